"""Pooled tree attention in Triton: :func:`pool_attention`, same contract as
``kernels.attention.reference.pool_attention``, safe inside CUDA graphs (every per-step value,
lengths, slots, masks, is read from tensors in the kernel; no host synchronisation).

Layout (flash-decoding, Dao et al. "Flash-Decoding for long-context inference", 2023; online
softmax of Milakov & Gimelshein 2018): a tree step runs one program per (batch row, kv head, node,
split of the key range), its query rows being the node's ``G`` query heads that share the kv head
(so they read each K/V tile once); a causal prefill chunk runs one program per (batch row, kv
head, block of node-major (node, head) rows, split). The key range is cut into chunks of
:data:`CHUNK` keys at fixed absolute positions (``splits`` of them, the last one taking the
rest); with one split the program normalises and writes the output, otherwise each split writes
its normalised partial output and log-sum-exp and :func:`_combine_kernel` merges them, so long
contexts at batch 1 still use many SMs.

Width invariance: a tree node reads its keys in *position* order: the committed rows ``[0, L)``,
then its ancestors by depth, the ancestor at depth ``e`` (the ``e``-th set bit of its ancestor
mask, as parents precede children) in the column of position ``L + e``, although its K/V sit at
scratch row ``L + index``. Tiles start at fixed absolute positions, so every score lands in the
tile column it has in the target-only step at the node's position, and the softmax sums and the
``P @ V`` accumulation run in the same order: a node verified in a tree of any width gets bit for
bit the result of the autoregressive step (speculative decoding stays token-identical to
target-only decoding in bf16; tests/test_kernels.py checks it on the GPU; Triton's CPU
interpreter sums position-independently, so there it checks only the mapping). Causal prefill
chunks use taller blocks (they are not compared with anything).

Several nodes per program (:func:`_pool_tree_nodes_kernel`): a tree step of at least
:data:`NODES_FROM` one-node programs (many sessions' trees) runs as many nodes per program as the
16-row tile holds; the committed context's key tiles (the same keys for every node) are read once
for them, a tile reaching past ``L`` runs once per node with the other nodes' rows masked (their
state is left bit for bit: ``alpha`` 1, ``p`` 0). Each row sees the same tiles in the same order
through the same tile shape and warps as with one node per program, so the bits are the same
(tests/test_kernels.py checks it on the GPU); 64 sessions of 8 nodes on an H200 54.9 -> 36.3 us
a layer (``benchmarks/gpu/attention/session15-nodes``). A sliding window keeps one node per program.

Sliding window (``window`` > 0, the drafter's sliding layers): a separately compiled variant
(``WINDOW``) masks key rows farther than ``window - 1`` from the query row ``L + i`` and starts
each split's loop at the first tile (at its fixed absolute start) that reaches the window, so
splits and tiles wholly below it cost nothing; skipping them is exact (an all ``-inf`` tile
leaves the online-softmax state unchanged). Without a window the kernel is the code it was.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention import CHUNK, default_splits  # noqa: F401 (re-exported)
from kernels.pdl import gdc_enter


@triton.jit
def _program(lengths_ptr, slots_ptr, HKV):
    """This program's place in the grid ``(batch row x kv head, row block, split)``: ``(pid_m,
    split, b, kvh, L, slot)``, with the batch row's committed length and pool slot."""
    pid_bh = tl.program_id(0)
    b = pid_bh // HKV
    return tl.program_id(1), tl.program_id(2), b, pid_bh % HKV, tl.load(lengths_ptr + b), tl.load(slots_ptr + b)


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, krow, col_ok, visible, d, skr, sm_scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key tile of the online softmax: the keys at pool rows ``krow`` ``[BLOCK_N]`` (of the
    slot and kv head ``k_ptr`` / ``v_ptr`` point at; columns not ``col_ok`` read as zeros), the
    scores of the query rows ``q`` ``[BLOCK_M, D]`` where ``visible`` ``[BLOCK_M, BLOCK_N]``, the
    rest ``-inf``; returns the updated ``(m_i, l_i, acc)``. A row that sees none of the tile keeps
    its state bit for bit (``alpha`` 1 and ``p`` 0, or all still ``-inf`` / zero)."""
    kt = tl.load(k_ptr + krow[None, :].to(tl.int64) * skr + d[:, None], mask=col_ok[None, :], other=0.0)
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = s * sm_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = tl.load(v_ptr + krow[:, None].to(tl.int64) * skr + d[None, :], mask=col_ok[:, None], other=0.0)
    if IEEE:
        pv = tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _ancestor_rows(cols, L, bit, rank, jw):
    """Pool rows of the key columns ``cols`` for a tree node with ancestor bits ``bit`` and their
    depths ``rank`` (``[64]`` each): a position below ``L`` is its own row; position ``P >= L``
    holds the ancestor of depth ``P - L``, at scratch row ``L + its index``."""
    e = cols - L
    hit = (bit[None, :] != 0) & (rank[None, :] == e[:, None])
    return tl.where(e < 0, cols, L + tl.sum(tl.where(hit, jw[None, :], 0), 1)).to(tl.int64)


@triton.jit
def _pool_attention_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, lengths_ptr, anc_ptr, out_ptr, part_ptr, lse_ptr,
    sm_scale, window,
    W, G, HKV, SPLITS, CHUNK,
    sqb, sqw, sqh,                 # q strides (last dim contiguous)
    sks, skr, skh,                 # pool strides (same for k and v)
    sob, sow, soh,                 # out strides
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    IEEE: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr = False,
):
    gdc_enter(PDL)   # (kernels.pdl)
    pid_m, split, b, kvh, L, slot = _program(lengths_ptr, slots_ptr, HKV)

    d = tl.arange(0, D)
    if CAUSAL:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < W * G
        w = rows // G
        head = kvh * G + rows % G
        w_first = (pid_m * BLOCK_M) // G
        w_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, W * G - 1) // G
        total = L + w_last + 1                     # keys any row of this block can see
    else:
        # one node per program (its G query heads): the node's ancestors are read in position
        # order, the ancestor at depth e standing at position L + e as in target-only decoding
        node = pid_m
        w_first = node
        r = tl.arange(0, BLOCK_M)
        row_ok = r < G
        w = tl.zeros([BLOCK_M], tl.int32) + node
        head = kvh * G + r
        jw = tl.arange(0, 64)
        anc = tl.load(anc_ptr + b * W + node)
        bit = ((anc >> jw.to(tl.int64)) & 1).to(tl.int32)
        rank = tl.cumsum(bit, 0) - 1               # depth of ancestor j (where bit j is set)
        total = L + tl.sum(bit, 0)                 # positions [0, L + depth + 1)
    q = tl.load(q_ptr + b * sqb + w[:, None] * sqw + head[:, None] * sqh + d[None, :], mask=row_ok[:, None], other=0.0)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, total)
    if split == SPLITS - 1:
        hi = total

    if WINDOW:
        # a sliding window: tiles of context rows below every query row's window are skipped
        # (they would add exact zeros: the online softmax state is unchanged by an all -inf
        # tile); tiles keep their absolute starts
        first = tl.minimum(L + w_first - (window - 1), L)
        lo = lo + (tl.maximum(first - lo, 0) // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    base = slot.to(tl.int64) * sks + kvh * skh
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        if CAUSAL:
            krow = cols
        elif start + BLOCK_N <= L:
            krow = cols.to(tl.int64)   # a block of the context alone: no ancestor lookup (the rows below give the same)
        else:
            krow = _ancestor_rows(cols, L, bit, rank, jw)
        if CAUSAL:
            j = cols - L
            visible = col_ok[None, :] & ((j[None, :] < 0) | (j[None, :] <= w[:, None]))
        else:
            visible = col_ok[None, :] & row_ok[:, None]
        if WINDOW:
            dist = (L + w)[:, None] - krow[None, :]     # query row L + w, key at pool row krow
            visible = visible & (dist <= window - 1) & (dist >= 1 - window)
        m_i, l_i, acc = _attend_tile(q, k_ptr + base, v_ptr + base, krow, col_ok, visible, d, skr, sm_scale,
                                     m_i, l_i, acc, IEEE)
    _store_rows(out_ptr, part_ptr, lse_ptr, acc, m_i, l_i, b, w, head, row_ok, d, split, SPLITS, W, HKV * G,
                sob, sow, soh, D)


@triton.jit
def _store_rows(out_ptr, part_ptr, lse_ptr, acc, m_i, l_i, b, w, head, row_ok, d, split, SPLITS, W, HQ, sob, sow, soh,
                D: tl.constexpr):
    """The rows' result: with one split the normalised output of each row (node ``w``, query
    head ``head``), else its split's normalised partial ``[B, W, Hq, SPLITS, D]`` and
    log-sum-exp ``[B, W, Hq, SPLITS]`` for :func:`_combine_kernel`."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + b * sob + w[:, None] * sow + head[:, None] * soh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        idx = ((b * W + w) * HQ + head) * SPLITS + split
        tl.store(part_ptr + idx[:, None].to(tl.int64) * D + d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + idx, lse, mask=row_ok)


@triton.jit
def _pool_tree_nodes_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, lengths_ptr, anc_ptr, out_ptr, part_ptr, lse_ptr,
    sm_scale, W, G, HKV, SPLITS, CHUNK,
    sqb, sqw, sqh, sks, skr, skh, sob, sow, soh,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NODES: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """:func:`_pool_attention_kernel`'s tree step (no window) with ``NODES`` tree nodes per program
    (their ``G`` query heads each, node-major rows of the same ``BLOCK_M`` tile): a key tile of
    the committed context (the same keys for every node) is read once for all of them; a tile
    reaching past ``L`` (each node's own ancestors) runs once per node with only that node's rows
    visible, the others keeping their state bit for bit (:func:`_attend_tile`). Every row sees
    the tiles the one-node kernel gives it, in the same order, through the same tile shape and
    warps: the same bits (``tests/test_kernels.py`` checks it on the GPU); ``NODES`` only changes
    how many programs share the reads."""
    gdc_enter(PDL)   # (kernels.pdl)
    pid_m, split, b, kvh, L, slot = _program(lengths_ptr, slots_ptr, HKV)
    d = tl.arange(0, D)
    r = tl.arange(0, BLOCK_M)
    rnode = r // G                                   # the row's node within the program
    w = pid_m * NODES + rnode
    row_ok = (r < NODES * G) & (w < W)
    head = kvh * G + r % G
    jw = tl.arange(0, 64)
    # each row's keys end at its node's L + depth + 1 (the split's end for the row: hi_r)
    anc_r = tl.load(anc_ptr + b * W + w, mask=row_ok, other=0)
    depth_r = tl.zeros([BLOCK_M], tl.int32)
    for j in tl.static_range(64):
        depth_r += ((anc_r >> j) & 1).to(tl.int32)
    total_r = L + depth_r
    lo = split * CHUNK
    if split == SPLITS - 1:
        hi_r = total_r
    else:
        hi_r = tl.minimum(lo + CHUNK, total_r)
    hi = tl.max(tl.where(row_ok, hi_r, 0), 0)
    q = tl.load(q_ptr + b * sqb + w[:, None] * sqw + head[:, None] * sqh + d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    base = slot.to(tl.int64) * sks + kvh * skh
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if start + BLOCK_N <= L:   # the committed context: every node's keys, read once
            col_ok = cols < hi
            visible = (cols[None, :] < hi_r[:, None]) & row_ok[:, None]
            m_i, l_i, acc = _attend_tile(q, k_ptr + base, v_ptr + base, cols.to(tl.int64), col_ok, visible, d, skr,
                                         sm_scale, m_i, l_i, acc, IEEE)
        else:
            for j in tl.static_range(NODES):
                node = pid_m * NODES + j
                if node < W:
                    anc = tl.load(anc_ptr + b * W + node)
                    bit = ((anc >> jw.to(tl.int64)) & 1).to(tl.int32)
                    rank = tl.cumsum(bit, 0) - 1
                    hi_j = tl.minimum(lo + CHUNK, L + tl.sum(bit, 0))
                    if split == SPLITS - 1:
                        hi_j = L + tl.sum(bit, 0)
                    col_ok = cols < hi_j
                    visible = col_ok[None, :] & (row_ok & (rnode == j))[:, None]
                    m_i, l_i, acc = _attend_tile(q, k_ptr + base, v_ptr + base, _ancestor_rows(cols, L, bit, rank, jw),
                                                 col_ok, visible, d, skr, sm_scale, m_i, l_i, acc, IEEE)
    _store_rows(out_ptr, part_ptr, lse_ptr, acc, m_i, l_i, b, w, head, row_ok, d, split, SPLITS, W, HKV * G,
                sob, sow, soh, D)


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, HQ, W, SPLITS, sob, sow, soh,
                    D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    pid = tl.program_id(0)                         # (b * W + w) * Hq + head
    head = pid % HQ
    bw = pid // HQ
    b = bw // W
    w = bw % W
    s = tl.arange(0, BLOCK_S)
    s_ok = s < SPLITS
    lse = tl.load(lse_ptr + pid * SPLITS + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    wt = tl.exp(lse - m)
    wt = wt / tl.sum(wt, 0)
    d = tl.arange(0, D)
    part = tl.load(part_ptr + (pid.to(tl.int64) * SPLITS + s[:, None]) * D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(part * wt[:, None], 0)
    tl.store(out_ptr + b * sob + w * sow + head * soh + d, out.to(out_ptr.dtype.element_ty))


#: The tree (non-causal) launch: ``num_stages`` 2 pipelines the key tiles' loads. Bit for bit the
#: results of Triton's default stages, and 5-14% faster on an H200 (``tools/attention_sweep.py``,
#: ``benchmarks/gpu/attention/session15``: a SmolLM2-shaped layer at one session and 200 keys
#: 10.2 -> 9.1 us, 64 sessions of 8-node trees 63.6 -> 54.7 us; a 9B full-attention layer 18.1 ->
#: 17.0 us). The other fields override the rule below for sweeps (None: the rule): ``block_n``
#: (keys per tile), ``num_warps`` and ``chunk`` (keys per split) change the order of a row's sums,
#: which stays width-invariant only when every step of a process uses the same values; the
#: causal (prefill) launch keeps Triton's default stages unless ``num_stages`` is set here.
TREE_LAUNCH: dict = {"block_n": None, "num_warps": 4, "num_stages": None, "chunk": None, "nodes": None}
#: a tree step of at least this many (batch row, kv head, node) programs runs several nodes per
#: program (:func:`_pool_tree_nodes_kernel`, as many as fit the 16-row tile); fewer keep one each
#: (more programs in flight for one session's few nodes). Either gives the same bits.
NODES_FROM = 512
#: stages of the tree launch when ``TREE_LAUNCH["num_stages"]`` is None
TREE_STAGES = 2


def _nodes_per_program(programs: int, fit: int) -> int:
    """Tree nodes per program for a tree step of ``programs`` one-node programs: ``fit`` (as many
    as the tile holds) from :data:`NODES_FROM` programs on, else 1; ``TREE_LAUNCH["nodes"]``
    overrides (for sweeps and tests). Never changes a row's bits (:func:`_pool_tree_nodes_kernel`)."""
    forced = TREE_LAUNCH.get("nodes")
    if forced:
        return max(1, min(int(forced), fit))
    return fit if programs >= NODES_FROM and fit > 1 else 1


def _stages(causal: bool) -> dict:
    """The launch's ``num_stages`` keyword: :data:`TREE_LAUNCH`'s, else :data:`TREE_STAGES` for a
    tree step, else none (Triton's default) for a causal prefill chunk."""
    stages = TREE_LAUNCH["num_stages"]
    if stages is None and not causal:
        stages = TREE_STAGES
    return {} if stages is None else {"num_stages": stages}


def _block_m(rows: int, causal: bool) -> int:
    return int(min(64, max(16, triton.next_power_of_2(rows)))) if causal else 16


def pool_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    ancestors: torch.Tensor | None,
    scale: float,
    causal: bool = False,
    splits: int = 1,
    window: int = 0,
    max_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of ``kernels.attention.reference.pool_attention`` (same arguments and
    result); ``splits``: key-range splits of :data:`CHUNK` keys (see :func:`default_splits`);
    ``max_splits``: the largest split count the caller uses (default ``splits``): the combine's
    block of splits is sized by it, so a step run with fewer splits, where every row's keys fit
    them, gets the same bits (:func:`kernels.attention.splits_for`). float32 inputs use IEEE
    float32 dots (no tf32), so they match the reference to float32 rounding. ``window`` (0: none)
    is the reference's sliding window; it compiles a separate kernel (``WINDOW``), so calls
    without one run exactly the code they ran before, and skips key tiles wholly below the
    window.

    Raises:
        ValueError: head counts do not divide, head_dim not a power of two >= 16, or a tree
            wider than 64 nodes (the ancestor bit mask holds 64).
    """
    bsz, w, hq, d = q.shape
    hkv = k_pool.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two >= 16")
    if not causal and w > 64:
        raise ValueError(f"tree of {w} nodes: at most 64 (ancestor bit mask)")
    g = hq // hkv
    assert q.stride(-1) == 1 and k_pool.stride(-1) == 1 and k_pool.stride() == v_pool.stride()
    out = torch.empty(bsz, w, hq, d, device=q.device, dtype=q.dtype)
    block_m = _block_m(w * g, causal) if causal else max(16, triton.next_power_of_2(g))
    block_n = TREE_LAUNCH["block_n"] or (64 if d <= 64 else (32 if d <= 128 else 16))
    if q.dtype == torch.float32:
        block_n = min(block_n, 32)
    chunk = TREE_LAUNCH.get("chunk") or CHUNK
    splits = max(1, int(splits))
    if splits > 1:
        part = torch.empty(bsz * w * hq * splits * d, device=q.device, dtype=torch.float32)
        lse = torch.empty(bsz * w * hq * splits, device=q.device, dtype=torch.float32)
    else:
        part = lse = out
    anc = ancestors if ancestors is not None else lengths
    slots, lengths, anc = slots.contiguous(), lengths.contiguous(), anc.contiguous()
    nodes = _nodes_per_program(bsz * hkv * w, block_m // g) if not causal and not window and ancestors is not None else 1
    args = (q, k_pool, v_pool, slots, lengths, anc, out, part, lse, float(scale))
    strides = (q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
               out.stride(0), out.stride(1), out.stride(2))
    shape = (w, g, hkv, splits, chunk if splits > 1 else 1 << 30)
    launch = dict(D=d, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
                  num_warps=TREE_LAUNCH["num_warps"], **_stages(causal))
    if nodes > 1:
        _pool_tree_nodes_kernel[(bsz * hkv, triton.cdiv(w, nodes), splits)](*args, *shape, *strides, NODES=nodes,
                                                                            **launch, **pdl.launch(q))
    else:
        grid = (bsz * hkv, triton.cdiv(w * g, block_m) if causal else w, splits)
        _pool_attention_kernel[grid](*args, max(0, int(window)), *shape, *strides, CAUSAL=bool(causal),
                                     WINDOW=int(window) > 0, **launch, **pdl.launch(q))
    if splits > 1:
        _combine_kernel[(bsz * w * hq,)](part, lse, out, hq, w, splits, out.stride(0), out.stride(1), out.stride(2),
                                         D=d, BLOCK_S=triton.next_power_of_2(max(splits, max_splits or 1)),
                                         **pdl.launch(q))
    return out

"""DDTree for a batch of top-K tables in one Triton launch: ``kernels.ddtree.reference``'s search
(the host's best-first search, ``draft_service.tree.build_tree``), the same trees node for node.

One program per batch row, one warp. The frontier (``S`` = the next power of two above ``N``
slots) lives in registers as four vectors: the order-preserving int64 key of the score, the
tie-break ``depth << 20 | push order`` (int32), the parent's score (float64) and ``parent node <<
16 | chain flag << 15 | rank``. A pop is one multi-operand ``tl.reduce`` (largest key, then
smallest tie-break: the host heap's order; under Triton's interpreter four plain reductions, see
:data:`TUPLE`), scalar loads from the row's table (the popped node's token and log-prob, its next
sibling's and its first child's log-probs) and elementwise updates; the row's tree is kept in two
register vectors and stored once. The pop loop runs as many rounds as the row's budget (a runtime
bound), so a tree of ``n`` nodes costs about ``n`` dependent reductions: 11.3 us for the default
15-node DDTree at one row in an eager drafter step under the profiler on an H200
(``benchmarks/gpu/step/run7/smollm2-135m-q4_1.json``, ``draft_propose.profile``), where the host's
``build_tree`` takes ~40 us per item on a 2-core VM (``python -m draft_service.tree``). Scores
are float64 additions in the host's order, so every comparison is the host's (``-0.0`` equals
``0.0`` through the key).

Safe inside CUDA graphs: every per-row value is read in the kernel; the launch depends only on
shapes and ``N``. Optionally the kernel also writes the step's top-K table into the engine's
packed output row (``table``: ``[b, D, K, 2]`` int32 view, the log-prob's bits and the token), so
the drafter's step needs no other kernel for its output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.ddtree.reference import DEPTH_SHIFT, INVALID
from kernels.pdl import gdc_enter

_INVALID = tl.constexpr(INVALID)
_SHIFT = tl.constexpr(DEPTH_SHIFT)


@triton.jit
def _key(s):
    """Order-preserving int64 key of float64 ``s`` (``-0.0`` -> the key of ``0.0``)."""
    bits = s.to(tl.int64, bitcast=True)
    key = bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)
    return tl.where(s == 0.0, 0, key)


@triton.jit
def _pick(k1, t1, p1, m1, k2, t2, p2, m2):
    """The entry popped first of two: larger key, then smaller tie-break (unique among entries)."""
    first = (k1 > k2) | ((k1 == k2) & (t1 < t2))
    return tl.where(first, k1, k2), tl.where(first, t1, t2), tl.where(first, p1, p2), tl.where(first, m1, m2)


@triton.jit
def _ddtree_kernel(lp_ptr, tok_ptr, roots_ptr, budget_ptr, topk_ptr, depth_ptr,
                   tokens_ptr, parents_ptr, count_ptr, table_ptr,
                   D, K, s_lp_b, s_lp_d, s_tok_b, s_tok_d, s_tokens, s_parents, s_count, s_table,
                   N: tl.constexpr, S: tl.constexpr, DP: tl.constexpr, KP: tl.constexpr, TABLE: tl.constexpr,
                   TUPLE: tl.constexpr = False, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    row = tl.program_id(0).to(tl.int64)
    budget = tl.load(budget_ptr + row).to(tl.int64)
    top_k = tl.load(topk_ptr + row).to(tl.int64)
    depth = tl.load(depth_ptr + row).to(tl.int64)
    root = tl.load(roots_ptr + row).to(tl.int32)
    lp_row = lp_ptr + row * s_lp_b
    tok_row = tok_ptr + row * s_tok_b
    if TABLE:   # the step's table into the packed output: [D, K, 2] int32 (log-prob bits, token)
        dd = tl.arange(0, DP)[:, None]
        kk = tl.arange(0, KP)[None, :]
        m = (dd < D) & (kk < K)
        v = tl.load(lp_row + dd * s_lp_d + kk, mask=m, other=0.0)
        t = tl.load(tok_row + dd * s_tok_d + kk, mask=m, other=0)
        to = table_ptr + row * s_table + (dd * K + kk) * 2
        tl.store(to, v.to(tl.int32, bitcast=True), mask=m)
        tl.store(to + 1, t.to(tl.int32), mask=m)
    # the row's parameters (kernels.ddtree.reference.row_params)
    n_depth = tl.minimum(tl.maximum(depth, 0), D)
    chain = (budget <= 0) | (top_k <= 1) | (n_depth == 0)
    n_chain = tl.where(budget <= 0, n_depth, tl.minimum(budget, n_depth)).to(tl.int32)
    k = tl.minimum(tl.minimum(top_k, budget), K).to(tl.int32)
    pops = tl.where(chain, 0, tl.minimum(budget, N)).to(tl.int32)
    nd = n_depth.to(tl.int32)

    place = tl.arange(0, S)
    out_tok = tl.where(place == 0, root, -1)
    out_par = tl.full([S], -1, tl.int32)
    # the frontier: slot 0 = the depth-1 chain node (push order 1, chain flag)
    lp0 = tl.load(lp_row, mask=pops > 0, other=0.0).to(tl.float64)
    f_key = tl.where(place == 0, _key(lp0), _INVALID)
    f_tb = tl.where(place == 0, 1, -1)
    f_ps = tl.zeros([S], tl.float64)
    f_meta = tl.where(place == 0, 1 << 15, 0)
    order = nd
    count = 1
    for i in range(1, pops + 1):
        if TUPLE:
            key_w, tb_w, ps_w, meta_w = tl.reduce((f_key, f_tb, f_ps, f_meta), 0, _pick)
        else:
            key_w = tl.max(f_key, 0)
            tb_w = tl.min(tl.where(f_key == key_w, f_tb, 0x7FFFFFFF), 0)
            sel = f_tb == tb_w
            ps_w = tl.sum(tl.where(sel, f_ps, 0.0), 0)
            meta_w = tl.max(tl.where(sel, f_meta, -1), 0)
        live = key_w != _INVALID
        d = tl.maximum(tb_w >> _SHIFT, 0)
        r = meta_w & 0x7FFF
        wc = (meta_w >> 15) & 1                     # 1: a chain node (its first child is the next chain node)
        pid = meta_w >> 16
        at = d * s_lp_d + r
        score = ps_w + tl.load(lp_row + at, mask=live, other=0.0).to(tl.float64)
        tk = tl.load(tok_row + d * s_tok_d + r, mask=live, other=-1).to(tl.int32)
        here = live & (place == count)
        out_tok = tl.where(here, tk, out_tok)
        out_par = tl.where(here, pid, out_par)
        node = count
        count += live.to(tl.int32)
        # next sibling, into the popped slot (or the slot empties)
        sib = live & (r + 1 < k)
        lp_s = tl.load(lp_row + at + 1, mask=sib, other=0.0).to(tl.float64)
        order += sib.to(tl.int32)
        popped = live & (f_tb == tb_w)
        f_key = tl.where(popped, tl.where(sib, _key(ps_w + lp_s), _INVALID), f_key)
        f_tb = tl.where(popped, tl.where(sib, (d << _SHIFT) | order, -1), f_tb)
        f_meta = tl.where(popped, (pid << 16) | (r + 1), f_meta)
        # first child, into slot i (a chain node's: the next chain node, its seed's push order)
        child = live & (d + 1 < nd)
        lp_c = tl.load(lp_row + (d + 1) * s_lp_d, mask=child, other=0.0).to(tl.float64)
        order += child.to(tl.int32) * (1 - wc)
        corder = tl.where(wc != 0, d + 2, order)
        new = child & (place == i)
        f_key = tl.where(new, _key(score + lp_c), f_key)
        f_tb = tl.where(new, ((d + 1) << _SHIFT) | corder, f_tb)
        f_ps = tl.where(new, score, f_ps)
        f_meta = tl.where(new, (node << 16) | (wc << 15), f_meta)
    # chains: node j = the top-1 token of depth j, under node j - 1
    on = chain & (place >= 1) & (place <= n_chain)
    ct = tl.load(tok_row + (place - 1) * s_tok_d, mask=on, other=-1).to(tl.int32)
    out_tok = tl.where(on, ct, out_tok)
    out_par = tl.where(on, place - 1, out_par)
    w = place <= N
    tl.store(tokens_ptr + row * s_tokens + place, out_tok, mask=w)
    tl.store(parents_ptr + row * s_parents + place, out_par, mask=w)
    tl.store(count_ptr + row * s_count, tl.where(chain, n_chain + 1, count))


#: Pop by one multi-operand reduction (compiled: 20% faster on an H200 than four plain ones) or by
#: four plain reductions (Triton's interpreter runs a custom combine element by element: 20x slower).
TUPLE = not isinstance(_ddtree_kernel, getattr(getattr(triton.runtime, "interpreter", None), "InterpretedFunction", ()))


def launch(lp: torch.Tensor, tok: torch.Tensor, roots: torch.Tensor, budget: torch.Tensor, top_k: torch.Tensor,
           depth: torch.Tensor, max_nodes: int, tokens: torch.Tensor, parents: torch.Tensor, count: torch.Tensor,
           table: torch.Tensor | None = None) -> None:
    """Run the kernel into the given outputs (any row strides; last dims contiguous).

    Args:
        lp, tok: ``[b, D, K]`` float32 / integer tables (last dim contiguous; ``1 <= D < 1024``,
            ``1 <= K < 32768``).
        roots, budget, top_k, depth: ``[b]`` integer.
        max_nodes: ``N``, ``D <= N < 32768`` (the frontier packs node indices in 15 bits).
        tokens, parents: ``[b, N + 1]`` int32; count: ``[b]`` int32.
        table: ``[b, D, K, 2]`` int32 (rows may be strided; each row's ``[D, K, 2]`` contiguous) or
            None.

    Raises:
        ValueError: sizes outside those bounds, or ``lp`` / ``tok`` not contiguous in ``K``.
    """
    b, D, K = lp.shape
    N = int(max_nodes)
    if N < D or N >= 1 << 15 or not (1 <= D < 1 << 10 and 1 <= K < 1 << 15):
        raise ValueError(f"max_nodes {N} must be in [D={D}, 32768), 1 <= D < 1024, 1 <= K={K} < 32768")
    if lp.stride(2) != 1 or tok.stride(2) != 1:
        raise ValueError("lp and tok must be contiguous in their last dimension")
    roots, budget, top_k, depth = (x.contiguous() for x in (roots, budget, top_k, depth))
    tab = table if table is not None else tokens
    s_table = table.stride(0) if table is not None else 0
    _ddtree_kernel[(b,)](lp, tok, roots, budget, top_k, depth, tokens, parents, count, tab,
                         D, K, lp.stride(0), lp.stride(1), tok.stride(0), tok.stride(1), tokens.stride(0),
                         parents.stride(0), count.stride(0), s_table, N=N, S=triton.next_power_of_2(N + 1),
                         DP=triton.next_power_of_2(D), KP=triton.next_power_of_2(K), TABLE=table is not None,
                         num_warps=1, TUPLE=TUPLE, **pdl.launch(lp))


def build_trees_batched(lp: torch.Tensor, tok: torch.Tensor, roots: torch.Tensor, budget: torch.Tensor,
                        top_k: torch.Tensor, depth: torch.Tensor | None = None,
                        max_nodes: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.ddtree.reference.build_trees_batched`` in one launch (same arguments, same
    results; ``max_nodes`` default ``max(D, budget.max())`` is a host read)."""
    b, D, K = lp.shape
    dev = lp.device
    N = max(D, int(budget.max()) if b else 0) if max_nodes is None else max(D, int(max_nodes))
    depth = torch.full((b,), D, dtype=torch.long, device=dev) if depth is None else depth
    tokens = torch.empty(b, N + 1, dtype=torch.int32, device=dev)
    parents = torch.empty(b, N + 1, dtype=torch.int32, device=dev)
    count = torch.empty(b, dtype=torch.int32, device=dev)
    if b:
        launch(lp.contiguous(), tok.contiguous(), roots.contiguous(), budget.contiguous(), top_k.contiguous(),
               depth.contiguous(), N, tokens, parents, count)
    return tokens, parents, count

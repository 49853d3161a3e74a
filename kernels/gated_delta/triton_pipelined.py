"""Software-pipelined Triton kernels for the Gated DeltaNet recurrence over pooled state:
:func:`pool_gdn_tree` and :func:`pool_gdn_commit`, the same signatures and contracts as
``kernels.gated_delta.reference`` (and as the shipped kernels of ``kernels/gated_delta/triton.py``,
which this module can replace: tools/gdn_swap.py runs any command with it swapped in), safe inside
CUDA graphs (slots, parents, path lengths are tensors; nothing is read back to the host).

Grid ``(B, HV, Dv / BV)``: one program per (batch row, value head, block of ``BV`` value columns)
holding its ``[Dk, BV]`` slice of the state in registers (float32). ``(BV, num_warps)`` is fixed per
head dims (:data:`GDN_CONFIGS`, :func:`default_config`, or ``config=`` for sweeps). The program is a
loop of node updates (:func:`_step`): a node's ``q`` and ``k`` L2-normalised (``q`` scaled), its
gates ``g = A * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` from the raw projections, then
decay, delta-rule correction, rank-1 update and the output ``S^T q``.

* Prefetch: before a step's math, the next step's node is chosen and its raw inputs (``q``, ``k``,
  this program's ``v`` columns, the gate projections ``a``, ``b``; for a commit the path entry one
  more step ahead) are loaded; they are widened to float32 only after the math, so the loads are
  in flight while the step computes and no step waits on memory. (The loop carries float32: a
  loop carrying the loaded bf16 values unpacks them where it closes, right after the loads are
  issued, and waits there: the load latency is back on every step.)
* A step's reductions (``S^T k``, ``S^T q``, ``|k|^2``, ``|q|^2``, ``k.q``) are all taken on the
  incoming state and raw vectors and run side by side; the output is ``S'^T q`` expanded
  (:func:`_step`), so no reduction waits on another.
* Trees (``commit=False``) are walked depth-first (:func:`_tree_plan`): a node continues from its
  parent's state in registers, or from a spare register tile holding a saved branch point, or
  from the committed state, replaying the ancestors in between. :func:`tree_walk` counts the
  steps: ``W`` for chains, stars and the bench's spine-with-siblings trees
  (``target_service.bench_gpu._tree_shape``: 592 steps at ``W = 64`` in index order, restarting
  every node whose parent is not the previous node, as the shipped kernel does), about 1.05 a
  node on DDTrees of 16 nodes and 1.15 at 64. No per-node state is ever written to memory, so a
  verify step keeps only the layer's raw inputs for the commit (docs/ARCHITECTURE.md, "State and
  rollback").
* Commits replay the accepted path the same way and write the state once; a committed chain
  (``commit=True``: a decode step, a prefill chunk) steps through ``0..W-1`` and writes the state
  at the end.

Layout: the state tile is handled as ``[Dk / VEC, VEC, CS, BV / CS]`` (``VEC`` = 16 bytes of the
input dtype, 8 for bf16; ``CS = 32 * num_warps * VEC / Dk`` column groups) and ``q``, ``k`` as
``[Dk / VEC, VEC, CS, 1]`` (each column group loads the same ``VEC`` elements). That shape leads
Triton to the layout the recurrence wants: a thread holds ``VEC`` consecutive ``Dk`` elements (one
16-byte load of ``k``; ``VEC`` terms of every ``Dk`` sum added in registers), 16 threads span
``Dk`` (4 shuffle rounds), and the remaining threads and the warps split the value columns, so no
reduction crosses a warp and no step converts a layout through shared memory but for the small
``v`` and ``o``. For ``Dk = 128`` bf16 a warp holds ``BV / num_warps`` columns, 2 a thread per 4.
(A plain ``[Dk, BV]`` tile spreads a warp over ``Dk`` with 4 elements a thread and shuffles every
column 5 rounds: about twice the instructions.)

Bit-exact width invariance: a node's output and the states after it are the same bits whether it
runs in a ``W = 1`` decode step, in a ``W = 16`` chain or tree verify (first time or replayed), or
in the commit's replay of the accepted path, so a verified token's logits are exactly the
autoregressive step's. Every update is the one :func:`_step` on the same tile with the same
``(BV, num_warps)`` (never chosen per ``W`` or ``B``), from the state its parent had (itself
computed the same way), and the mode (chain, tree, path) is a runtime argument of one kernel body:
``_tree_kernel`` and ``_commit_kernel`` are the same code under two names (their PTX is identical:
tests/test_gdn_kernels.py), compiled without specialising on ``W``, the mode or the pointers read
as scalars, so every call of a layer runs the same machine code (what is still specialised on, the
alignment of the conv output, pool and output and the head counts and row width, is the same for
all of them; tools/sweep_gdn.py checks the invariance on a GPU). The walk's choices (which node
next, where to restart from) change what is recomputed, never how. Against the reference the
results agree to float32 rounding (reductions in another order, scalings moved past them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta.triton import _layout


@triton.jit
def _bit(n):
    """``1 << n`` as int64 (``n`` clamped to 0..63: a wider shift is undefined)."""
    return tl.full([], 1, tl.int64) << tl.minimum(tl.maximum(n, 0), 63).to(tl.int64)


@triton.jit
def _ctz(x):
    """Index of the lowest set bit of the int64 ``x != 0``: the float32 exponent of the isolated
    bit (exact for every power of two)."""
    return (((x & -x).to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 255) - 127


@triton.jit
def _load_node(x_ptr, a_ptr, b_ptr, node, h, kh, C, sab, HKDK, dk, dv, DK: tl.constexpr):
    """A node's raw inputs in their storage dtype: ``q`` and ``k`` of key head ``kh`` (``dk``:
    ``[Dk / VEC, VEC, CS, 1]`` offsets), this program's ``v`` columns (``dv``: ``[1, 1, CS, BV /
    CS]``), and value head ``h``'s gate projections ``a``, ``b`` (module docstring, "Layout")."""
    node = node.to(tl.int64)
    row = x_ptr + node * C
    q = tl.load(row + kh * DK + dk)
    k = tl.load(row + HKDK + kh * DK + dk)
    v = tl.load(row + 2 * HKDK + dv)
    ga = tl.load(a_ptr + node * sab + h)
    gb = tl.load(b_ptr + node * sab + h)
    return q, k, v, ga, gb


@triton.jit
def _widen(q, k, v, ga, gb):
    """A node's inputs as float32 (exact)."""
    return q.to(tl.float32), k.to(tl.float32), v.to(tl.float32), ga.to(tl.float32), gb.to(tl.float32)


@triton.jit
def _red(x):
    """Sum over the first two axes (``Dk``) of a ``[Dk / VEC, VEC, CS, n]`` tile, as ``[1, 1, CS, n]``."""
    return tl.sum(tl.sum(x, 1), 0)[None, None, :, :]


@triton.jit
def _step(S, q, k, v, ga, gb, A, dtb, q_scale):
    """One node of the gated delta rule on a float32 state tile (``[Dk / VEC, VEC, CS, BV / CS]``,
    module docstring), from the node's inputs (:func:`_load_node`, widened to float32):
    ``g = A * softplus(a + dt_bias)`` (PyTorch's softplus: identity above 20), ``beta =
    sigmoid(b)``, ``k`` and ``q`` L2-normalised (``q`` also scaled), then decay, delta-rule
    correction, rank-1 update, and the output ``o = S'^T q`` of the updated state ``S' = g S + k
    u^T``. Returns ``(S', o)``, ``o`` as ``[1, 1, CS, BV / CS]``. The one update every step of
    every mode runs (module docstring, "Bit-exact width invariance").

    Every reduction is taken on the incoming state and raw vectors, so they all run side by side
    (a chain of warp shuffles each) instead of one after another: ``S^T k``, ``S^T q``, ``|k|^2``,
    ``|q|^2``, ``k.q``; the scalings come after (``u = beta (v - exp(g) rk S^T k)`` with ``rk =
    1/|k|``, and ``o = rq (exp(g) S^T q + u rk k.q)``, which is ``S'^T q`` expanded), and the gates
    are not waited for before the reductions. Same math as the reference; rounding differs at
    float32 epsilon.
    """
    xa = ga + dtb
    decay = tl.exp(A * tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(tl.minimum(xa, 20.0)))))
    beta = 1.0 / (1.0 + tl.exp(-gb))
    sk = _red(S * k)
    sq = _red(S * q)
    rk = tl.math.rsqrt(_red(k * k) + 1e-6)
    rq = tl.math.rsqrt(_red(q * q) + 1e-6) * q_scale
    kq = _red(k * q)
    u = (v - sk * (rk * decay)) * beta
    o = (sq * decay + u * (kq * rk)) * rq
    return S * decay + (k * rk) * u, o


@triton.jit
def _tree_plan(P, u, W, t, path, V, lane):
    """The next target of a tree walk in depth-first preorder, after target ``t`` (``path``: the
    ancestor bit mask of ``t``, itself included; ``V``: the visited nodes; ``lane``: the node whose
    state the spare tile holds, -1 for none). ``P``: the row's parents over ``u = 0..WB-1``.

    The next node is the highest-index unvisited child of the deepest node of ``t``'s path that
    has one (path nodes deepen with their index: the largest parent), else the highest-index
    unvisited root. Children go highest index first because in a DDTree the later children are
    the light side branches: they are done while their parent sits in the spare tile, and the
    heavy first child (the spine) comes last, so the walk rarely climbs back. The node's parent
    ``p`` is on ``t``'s path, so ``p``'s ancestors are ``path``'s bits up to ``p`` (the ancestor
    masks are never read). Its state is reached from ``t``'s (``p == t``), from the spare tile (its
    node is an ancestor of ``p``) or from the committed state, replaying the ancestors in between;
    ``p`` is saved to the spare tile on the way down when it has another unvisited child (the
    saved node is an ancestor of the walk's position or finished with, so the deeper one is kept).
    On DDTrees of 16 / 64 nodes (``draft_service.tree.build_tree``, random logits) this is about
    1.05 / 1.15 steps a node, against 2.4-2.8 / 3.3-5.4 for the index-order walk that restarts
    every node whose parent is not the previous node from the committed state (:func:`tree_walk`
    counts the steps).

    Returns ``(M, restore, save, lane, path, done)``: the bit mask of the nodes to apply in index
    order (replayed ancestors, then the node itself), where its first step starts from (0: the
    current state, 1: the committed state, 2: the spare tile), whether its last step saves the
    state before it (``p``'s) to the spare tile, the spare tile's node after that, the node's
    ancestor mask, and whether every node is done.
    """
    vis = ((V >> u.to(tl.int64)) & 1) != 0
    onpath = (((path >> tl.maximum(P, 0).to(tl.int64)) & 1) != 0) | (P == -1)
    cand = (u < W) & (P >= -1) & onpath & (vis == 0)
    k1 = tl.max(tl.where(cand, P * 64 + u, -4096), 0)          # deepest parent, then highest index
    k2 = tl.max(tl.where(cand, P * 64 + 63 - u, -4096), 0)     # deepest parent, then lowest index
    done = k1 < -64
    p = tl.maximum(k1 + 64, 0) // 64 - 1
    nt = k1 - p * 64
    more = 63 - (k2 - p * 64) != nt                            # p has another unvisited child
    anc_p = tl.where(p >= 0, path & (_bit(p + 1) - 1), 0)      # p and its ancestors
    cont = p == t
    hit = (lane >= 0) & (((anc_p >> tl.maximum(lane, 0).to(tl.int64)) & 1) != 0)
    base = tl.where(cont, t, tl.where(hit, lane, -1))          # the node the walk restarts after
    keep = tl.where(base >= 0, _bit(base + 1) - 1, 0)
    save = (p >= 0) & more & (lane != p)
    return ((anc_p & ~keep) | _bit(nt), tl.where(cont, 0, tl.where(hit, 2, 1)).to(tl.int32), save.to(tl.int32),
            tl.where(save, p, lane), anc_p | _bit(nt), done)


@triton.jit
def _walk(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, idx_ptr, n_ptr, o_ptr,
          W, HK, HV, C, sab, q_scale, mode,
          DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, WB: tl.constexpr,
          VEC: tl.constexpr, CS: tl.constexpr):
    """One program of :func:`_tree_kernel` / :func:`_commit_kernel`: batch row ``program_id(0)``,
    value head ``program_id(1)``, value columns ``program_id(2) * BV + [0, BV)``. Its ``[Dk, BV]``
    state tile (``[Dk / VEC, VEC, CS, BV / CS]``, module docstring) lives in registers (float32)
    and goes through a sequence of node updates, one :func:`_step` each, chosen by ``mode`` (a
    runtime value, so one binary serves every mode):
    0 the chain ``0..W-1``, outputs written, the state stored (``commit=True``); 1 the tree of
    ``parents`` (``idx_ptr``) in depth-first order with replays (:func:`_tree_plan`), outputs
    written, the pool untouched; 2 the nodes ``path[:n]`` (``idx_ptr``, ``n_ptr``), no outputs,
    the state stored.

    Software pipelined: before step ``s`` computes, step ``s + 1``'s node is chosen (scalar and
    ``[WB]``-vector work only) and its raw inputs (``q, k, v, a, b``) are loaded; they are widened
    to float32 only after step ``s``'s math, so they are in flight while it computes (a load
    blocks only where its value is first used) and no step waits on memory; mode 2 also loads
    step ``s + 2``'s path entry during step ``s``. The registers the loop carries are float32:
    carrying the loaded bf16 values would unpack them where the loop closes, right after the loads
    are issued, and wait for them there.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h % HK
    HKDK = HK * DK
    # the state tile as [Dk / VEC, VEC, CS, BV / CS] (module docstring, "Layout")
    dk = (tl.arange(0, DK // VEC)[:, None, None, None] * VEC
          + tl.arange(0, VEC)[None, :, None, None] + 0 * tl.arange(0, CS)[None, None, :, None])
    cols = vb * BV + (tl.arange(0, CS)[:, None] * (BV // CS) + tl.arange(0, BV // CS)[None, :])[None, None, :, :]
    dv = h * DV + cols
    A = tl.load(A_ptr + h)
    dtb = tl.load(dtb_ptr + h)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_off = (slot * HV + h) * DK * DV
    S0 = tl.load(state_ptr + s_off + (dk * DV + cols))
    S = S0
    # the spare tile (tree walks). Its own initial value, not S0: Triton finds a while loop's
    # carried variables by running the body once on the initial values, where `L = S` would look
    # like no change if L and S started as the same tensor, and L would silently not be carried.
    L = tl.zeros([DK // VEC, VEC, CS, BV // CS], tl.float32)
    row0 = b * W
    u = tl.arange(0, WB)
    P = tl.load(idx_ptr + row0 + u, mask=(u < W) & (mode == 1), other=-2).to(tl.int32)  # parents (trees)
    M = tl.full([], 0, tl.int64)                    # trees: the current target's nodes still to apply
    path = tl.full([], 0, tl.int64)                 # trees: the current target's ancestor mask
    V = tl.full([], 0, tl.int64)                    # trees: finished targets
    lane = tl.full([], -1, tl.int32)                # trees: the spare tile's node
    svp = tl.full([], 0, tl.int32)                  # trees: the current target saves its parent
    rst = tl.full([], 0, tl.int32)                  # this step starts from: 0 S, 1 S0, 2 L
    n = tl.full([], 0, tl.int32)                    # paths: length
    d = tl.full([], 0, tl.int32)                    # paths: this step's position
    nxt = tl.full([], 0, tl.int32)                  # paths: the next step's node
    j = tl.full([], 0, tl.int32)                    # this step's node
    go = tl.full([], 1, tl.int32)
    if mode == 1:
        M, rst, svp, lane, path, done = _tree_plan(P, u, W, -1, path, V, lane)
        go = (~done).to(tl.int32)
        j = _ctz(M)
        M = M & (M - 1)
    elif mode == 2:
        n = tl.load(n_ptr + b).to(tl.int32)
        go = (n > 0).to(tl.int32)
        j = tl.load(idx_ptr + row0).to(tl.int32)
        nxt = tl.load(idx_ptr + row0 + tl.minimum(1, W - 1)).to(tl.int32)
    sv = tl.where(M == 0, svp, 0)                   # this step saves the state it starts from
    emit = ((mode != 2) & (M == 0)).to(tl.int32)    # this step's output is written
    q, k, v, ga, gb = _load_node(x_ptr, a_ptr, b_ptr, row0 + tl.minimum(tl.maximum(j, 0), W - 1), h, kh, C, sab,
                                 HKDK, dk, dv, DK)
    q, k, v, ga, gb = _widen(q, k, v, ga, gb)
    while go != 0:
        if rst + sv != 0:                           # trees only: restart, save a branch point
            if rst == 1:
                S = S0
            elif rst == 2:
                S = L
            if sv != 0:
                L = S
        # the next step's node
        nrst = tl.full([], 0, tl.int32)
        if mode == 0:
            nj = j + 1
            ngo = (nj < W).to(tl.int32)
        elif mode == 2:
            d += 1
            nj = nxt
            ngo = (d < n).to(tl.int32)
            nxt = tl.load(idx_ptr + row0 + tl.minimum(d + 1, W - 1)).to(tl.int32)
        else:
            ngo = go
            if M == 0:                              # this step ends target j: plan the next one
                V = V | _bit(j)
                M, nrst, svp, lane, path, done = _tree_plan(P, u, W, j, path, V, lane)
                ngo = (~done).to(tl.int32)
            nj = _ctz(M)
            M = M & (M - 1)
        nsv = tl.where(M == 0, svp, 0)
        nemit = ((mode != 2) & (M == 0)).to(tl.int32)
        # its inputs, in flight while this step computes
        nq, nk, nv, nga, ngb = _load_node(x_ptr, a_ptr, b_ptr, row0 + tl.minimum(tl.maximum(nj, 0), W - 1), h, kh,
                                          C, sab, HKDK, dk, dv, DK)
        S, o = _step(S, q, k, v, ga, gb, A, dtb, q_scale)
        tl.store(o_ptr + ((row0 + j).to(tl.int64) * HV + h) * DV + cols, o, mask=(cols < DV) & (emit != 0))
        # widened only now, after this step's math: the loads have had the whole step to land
        q, k, v, ga, gb = _widen(nq, nk, nv, nga, ngb)
        j, rst, sv, emit, go = nj, nrst, nsv, nemit, ngo
    if mode != 1:
        tl.store(state_ptr + s_off + (dk * DV + cols), S)


# Two entry points with one body and one signature, so they compile to the same code (their names
# tell them apart in a profile): pool_gdn_tree launches _tree_kernel, pool_gdn_commit _commit_kernel.
# Nothing that may vary between a model's calls is specialised on: not W or the mode, not the
# alignment of the pointers read as scalars (gate projections: column slices of a projection or
# copies; slots: a view into a step buffer; parents / path / lengths; A, dt_bias).
_NO_SPEC = ["a_ptr", "b_ptr", "A_ptr", "dtb_ptr", "slots_ptr", "idx_ptr", "n_ptr", "W", "mode"]


@triton.jit(do_not_specialize=_NO_SPEC)
def _tree_kernel(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, idx_ptr, n_ptr, o_ptr,
                 W, HK, HV, C, sab, q_scale, mode,
                 DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, WB: tl.constexpr,
                 VEC: tl.constexpr, CS: tl.constexpr):
    _walk(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, idx_ptr, n_ptr, o_ptr,
          W, HK, HV, C, sab, q_scale, mode, DK, DV, BV, WB, VEC, CS)


@triton.jit(do_not_specialize=_NO_SPEC)
def _commit_kernel(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, idx_ptr, n_ptr, o_ptr,
                   W, HK, HV, C, sab, q_scale, mode,
                   DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, WB: tl.constexpr,
                   VEC: tl.constexpr, CS: tl.constexpr):
    _walk(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, idx_ptr, n_ptr, o_ptr,
          W, HK, HV, C, sab, q_scale, mode, DK, DV, BV, WB, VEC, CS)



_CHAIN, _TREE, _PATH = 0, 1, 2      # the kernels' modes
#: ``(BV, num_warps)`` of the recurrence kernels per ``(Dk, Dv)``; other head dims get
#: :func:`default_config`. Fixed per model (never per width or batch): a node's update must be the
#: same code in every call for the bit-exact width invariance (module docstring). Every warp holds
#: ``BV / num_warps`` value columns; fewer a warp is a shorter step (latency, ``B = 1``), more
#: columns a program fewer, wider programs (throughput and whole memory rows, large ``B``).
#: tools/sweep_gdn.py times the candidates and prints the entry to use. (128, 128): (16, 2), 8
#: columns a warp, 2 warps a program, is a middle guess, not measured yet: ptxas gives it 219
#: registers and no spills; (16, 1) and wider warps spill (3 tiles of 64 registers a thread).
GDN_CONFIGS: dict[tuple[int, int], tuple[int, int]] = {(128, 128): (16, 2)}
#: the widest tree (the ancestor masks and the planner's parent vector are 64 wide)
MAX_TREE = 64


def default_config(dk: int, dv: int) -> tuple[int, int]:
    """``(BV, num_warps)`` for head dims ``(Dk, Dv)``: :data:`GDN_CONFIGS`, else ``BV = min(8, Dv)``
    with one warp per 1024 state elements of a tile (at most 4): a thread's share of a tile is at
    most 32 registers (three tiles are live: the state, the committed state, the spare)."""
    if (dk, dv) in GDN_CONFIGS:
        return GDN_CONFIGS[(dk, dv)]
    bv = min(8, dv)
    return bv, max(1, min(4, dk * bv // 1024))


def _config(dk: int, dv: int, config: tuple[int, int] | None) -> tuple[int, int]:
    bv, nw = config if config is not None else default_config(dk, dv)
    bv = min(bv, dv)
    if bv & (bv - 1) or dv % bv or nw not in (1, 2, 4, 8):
        raise ValueError(f"bad config (BV={bv}, num_warps={nw}) for Dv={dv}")
    return bv, nw


def tree_walk(parents: list[int]) -> list[int]:
    """The nodes a tree step's programs apply, in order (plain Python, the same choices as
    :func:`_tree_plan`): each node once, in depth-first preorder, preceded by the replay of its
    ancestors above the state it restarts from. ``len(tree_walk(parents))`` is the step's number of
    recurrence steps (``W`` for a chain or a star; for benchmarks and tests)."""
    w, steps = len(parents), []
    visited = path = 0
    t, lane = -1, -1
    while True:
        cand = [i for i in range(w)
                if not visited >> i & 1 and (parents[i] == -1 or parents[i] >= 0 and path >> parents[i] & 1)]
        if not cand:
            return steps
        p = max(parents[i] for i in cand)
        nt = max(i for i in cand if parents[i] == p)
        anc_p = path & ((2 << p) - 1) if p >= 0 else 0
        base = t if p == t else lane if lane >= 0 and anc_p >> lane & 1 else -1
        todo = (anc_p & ~((2 << base) - 1 if base >= 0 else 0)) | 1 << nt
        steps += [i for i in range(w) if todo >> i & 1]
        if p >= 0 and lane != p and any(i != nt and parents[i] == p for i in cand):
            lane = p
        path, visited, t = anc_p | 1 << nt, visited | 1 << nt, nt


def _launch(kernel, conv_out, a, b, A, dt_bias, state_pool, slots, idx, n, out, mode, key_heads, config):
    bsz, w, c = conv_out.shape
    hv, dk, dv = state_pool.shape[1], state_pool.shape[2], state_pool.shape[3]
    bv, nw = _config(dk, dv, config)
    vec = min(dk, 16 // conv_out.element_size())            # module docstring, "Layout"
    cs = min(bv, max(1, 32 * nw * vec // dk))
    kernel[(bsz, hv, dv // bv)](conv_out, a, b, A, dt_bias, state_pool, slots, idx, n, out,
                                w, key_heads, hv, c, a.stride(1), dk ** -0.5, mode,
                                DK=dk, DV=dv, BV=bv, WB=MAX_TREE, VEC=vec, CS=cs, num_warps=nw)


def pool_gdn_tree(conv_out, a, b, A, dt_bias, state_pool: torch.Tensor, slots: torch.Tensor, parents: torch.Tensor,
                  ancestors: torch.Tensor | None, commit: bool, key_heads: int, head_k_dim: int, *,
                  config: tuple[int, int] | None = None) -> torch.Tensor:
    """Triton version of ``kernels.gated_delta.reference.pool_gdn_tree`` (same arguments and
    result). With ``commit`` the nodes are taken as the chain they must be (``parents`` unread);
    without, the tree walk reads only ``parents`` (``ancestors`` may be ``None``: the walk derives
    them). ``a`` and ``b`` may be column slices of one projection (same strides). ``config``:
    ``(BV, num_warps)`` instead of :func:`default_config` (for sweeps; give
    :func:`pool_gdn_commit` the same, or the bit-exact width invariance is lost).

    Raises:
        ValueError: a state pool that is not contiguous float32, head dims that are not powers of
            two, a tree wider than :data:`MAX_TREE`, a bad ``config``.
    """
    conv_out, a, b = _layout(conv_out, a, b, state_pool, head_k_dim)
    bsz, w, _ = conv_out.shape
    if not commit and w > MAX_TREE:
        raise ValueError(f"a tree of {w} nodes: at most {MAX_TREE}")
    out = torch.empty(bsz, w, state_pool.shape[1], state_pool.shape[3], device=conv_out.device, dtype=torch.float32)
    parents, slots = parents.contiguous(), slots.contiguous()
    _launch(_tree_kernel, conv_out, a, b, A, dt_bias, state_pool, slots, parents, slots, out,
            _CHAIN if commit else _TREE, key_heads, config)
    return out


def pool_gdn_commit(state_pool: torch.Tensor, slots: torch.Tensor, conv_out, a, b, A, dt_bias, path: torch.Tensor,
                    n_accept: torch.Tensor, key_heads: int, head_k_dim: int, *,
                    config: tuple[int, int] | None = None) -> None:
    """Triton version of ``kernels.gated_delta.reference.pool_gdn_commit`` (same arguments;
    ``config`` as :func:`pool_gdn_tree`)."""
    conv_out, a, b = _layout(conv_out, a, b, state_pool, head_k_dim)
    path, n_accept, slots = path.contiguous(), n_accept.contiguous(), slots.contiguous()
    _launch(_commit_kernel, conv_out, a, b, A, dt_bias, state_pool, slots, path, n_accept, state_pool, _PATH,
            key_heads, config)

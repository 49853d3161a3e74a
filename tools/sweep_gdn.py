"""Micro-benchmark of the Gated DeltaNet recurrence kernels on a GPU: every ``(BV, num_warps)``
candidate of the software-pipelined kernels (``kernels/gated_delta/triton_pipelined.py``) against
the shipped ones as of this tool's writing (``kernels/gated_delta/triton.py`` at cb4638a, copied
below as ``old``), with correctness checks on the same inputs.

Usage (on the GPU machine, from the repository root; well under 2 minutes on an H200 with a cold
Triton cache)::

    python tools/sweep_gdn.py --out gdn_sweep.json
    python tools/sweep_gdn.py --configs 4,1 8,1 --models 0.8b      # a subset
    python tools/sweep_gdn.py --smoke                              # tiny shapes, any device (CPU:
                                                                   # Triton's interpreter), timings meaningless

A micro-benchmark does not settle a kernel: judge it in the engine too
(``python tools/gdn_swap.py -m target_service.bench_gpu engine ...``, same command as
``tools/gpu_run.sh bench`` runs, with these kernels swapped in).

Cases, for the GDN layers of Qwen3.5 0.8B (``HV=16``) and 4B (``HV=32``), ``Hk=16``, ``Dk=Dv=128``,
bfloat16 inputs, float32 state; gate projections ``a``, ``b`` are column slices of one wide
projection, as the engine passes them:

* ``W=1`` decode (``commit=True``), ``B`` in {1, 16};
* ``W`` in {16, 64} verify steps, ``B`` in {1, 16}: a chain; a DDTree
  (``draft_service.tree.build_tree`` over ``W // 3`` peaked random distributions, ``W`` nodes, so
  depth about ``W / 3``); and the engine benchmark's tree (``target_service.bench_gpu._tree_shape``:
  a spine of ``W / 2`` nodes with one leaf under each, deep replays for an index-order walk). The
  tree call (``commit=False``) and the commit of a root-to-deepest-leaf path (the chain: all of it)
  are timed separately;
* a prefill chunk: ``B=1``, ``W=512``, ``commit=True``.

Method: each timed unit is a CUDA graph of ``C`` back-to-back calls cycling through ``C`` disjoint
sets of state slots spanning twice the L2 cache, so every call reads its states from HBM as a
layer of the real model does (the layer's inputs, written just before by the conv kernel, stay
hot); time per call = median over ``--reps`` replays of ``elapsed / C``. Columns: microseconds per
call, ``tree`` / ``commit``, and the speedup against ``old``. ``steps``: recurrence steps per row of
the pipelined kernels' tree walk (``triton_pipelined.tree_walk``), ``old``: the old kernel's (index
order, every node whose parent is not the previous node replayed from the committed state).

Checks, per config: the largest absolute error of outputs and committed states against
``kernels/gated_delta/reference.py`` over all cases (``B`` capped at 4 rows for the reference's
sake); and bit-exactness on the GPU, per model (``B=2``): a committed ``W=16`` chain equals its
nodes run one ``W=1`` call at a time (outputs and state), and a ``W=16`` chain / ``W=16`` tree /
``W=64`` tree / ``W=64`` bench tree verify plus the commit of a root-to-leaf path equals the
``W=1`` calls along the path (the path nodes' outputs and the state).

Output: the table, the per-config score (geometric mean over cases of time / best time of the case,
tree + commit; only configs that passed the bit-exact checks are suggested) and the suggested
``GDN_CONFIGS`` entry, and the JSON (``--out``): ``cases`` (every timing), ``errors``, ``bitexact``,
``scores``, ``suggested``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from draft_service.tree import build_tree  # noqa: E402
from kernels.gated_delta import reference as R  # noqa: E402
from kernels.gated_delta import triton_pipelined as T  # noqa: E402
from kernels.gated_delta.triton import _layout  # noqa: E402

CANDIDATES = ((4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4), (32, 8))
MODELS = {"0.8b": dict(hv=16, hk=16, dk=128), "4b": dict(hv=32, hk=16, dk=128)}
L2_BYTES = 50 * 2**20


# ------------------------------------------------------------------------------------------------
# The baseline: the kernels of kernels/gated_delta/triton.py at cb4638a, verbatim but for names. One
# program per (row, value head, 32 value columns), 4 warps; node loads and the math in sequence; a
# node whose parent is not the previous node restarts from the committed state.
@triton.jit
def _old_gates(a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, sab):
    xa = tl.load(a_ptr + node * sab + h).to(tl.float32) + tl.load(dtb_ptr + h)
    sp = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(tl.minimum(xa, 20.0))))
    xb = tl.load(b_ptr + node * sab + h).to(tl.float32)
    return tl.load(A_ptr + h) * sp, 1.0 / (1.0 + tl.exp(-xb))


@triton.jit
def _old_l2(x):
    return x * tl.math.rsqrt(tl.sum(x * x, 0) + 1e-6)


@triton.jit
def _old_update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, kh, C, sab, HKDK, dk, dv, DK: tl.constexpr):
    row = x_ptr + node * C
    kj = _old_l2(tl.load(row + HKDK + kh * DK + dk).to(tl.float32))
    vj = tl.load(row + 2 * HKDK + dv).to(tl.float32)
    gj, bj = _old_gates(a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, sab)
    S = S * tl.exp(gj)
    u = (vj - tl.sum(S * kj[:, None], 0)) * bj
    return S + kj[:, None] * u[None, :]


@triton.jit
def _old_tree_kernel(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, parents_ptr, anc_ptr, o_ptr,
                     W, HK, HV, C, sab, q_scale,
                     DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, COMMIT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h % HK
    HKDK = HK * DK
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    dv = h * DV + cols
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_off = (slot * HV + h) * DK * DV
    S0 = tl.load(state_ptr + s_off + dk[:, None] * DV + cols[None, :])
    S = S0
    for i in range(W):
        node = b * W + i
        p = tl.load(parents_ptr + node)
        if p != i - 1:
            S = S0
            if p >= 0:
                bits = tl.load(anc_ptr + b * W + p)
                for j in range(0, p + 1):
                    if ((bits >> j) & 1) != 0:
                        S = _old_update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, b * W + j, h, kh, C, sab, HKDK, dk, dv, DK)
        S = _old_update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, kh, C, sab, HKDK, dk, dv, DK)
        qi = _old_l2(tl.load(x_ptr + node * C + kh * DK + dk).to(tl.float32)) * q_scale
        tl.store(o_ptr + (node * HV + h) * DV + cols, tl.sum(S * qi[:, None], 0))
    if COMMIT:
        tl.store(state_ptr + s_off + dk[:, None] * DV + cols[None, :], S)


@triton.jit
def _old_commit_kernel(x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slots_ptr, path_ptr, n_ptr,
                       W, HK, HV, C, sab,
                       DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h % HK
    HKDK = HK * DK
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    dv = h * DV + cols
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_off = (slot * HV + h) * DK * DV
    S = tl.load(state_ptr + s_off + dk[:, None] * DV + cols[None, :])
    n = tl.load(n_ptr + b)
    for d in range(n):
        node = b * W + tl.load(path_ptr + b * W + d)
        S = _old_update(S, x_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, node, h, kh, C, sab, HKDK, dk, dv, DK)
    tl.store(state_ptr + s_off + dk[:, None] * DV + cols[None, :], S)


def old_tree(conv_out, a, b, A, dt_bias, state_pool, slots, parents, ancestors, commit, key_heads, head_k_dim, *,
             config=None):
    conv_out, a, b = _layout(conv_out, a, b, state_pool, head_k_dim)
    bsz, w, c = conv_out.shape
    hv, dk, dv = state_pool.shape[1], state_pool.shape[2], state_pool.shape[3]
    bv = min(32, triton.next_power_of_2(dv))
    out = torch.empty(bsz, w, hv, dv, device=conv_out.device, dtype=torch.float32)
    anc = ancestors.contiguous() if ancestors is not None else parents
    _old_tree_kernel[(bsz, hv, dv // bv)](conv_out, a, b, A, dt_bias, state_pool, slots, parents.contiguous(), anc, out,
                                          w, key_heads, hv, c, a.stride(1), dk ** -0.5,
                                          DK=dk, DV=dv, BV=bv, COMMIT=bool(commit), num_warps=4)
    return out


def old_commit(state_pool, slots, conv_out, a, b, A, dt_bias, path, n_accept, key_heads, head_k_dim, *, config=None):
    conv_out, a, b = _layout(conv_out, a, b, state_pool, head_k_dim)
    bsz, w, c = conv_out.shape
    hv, dk, dv = state_pool.shape[1], state_pool.shape[2], state_pool.shape[3]
    bv = min(32, triton.next_power_of_2(dv))
    _old_commit_kernel[(bsz, hv, dv // bv)](conv_out, a, b, A, dt_bias, state_pool, slots, path.contiguous(),
                                            n_accept.contiguous(), w, key_heads, hv, c, a.stride(1),
                                            DK=dk, DV=dv, BV=bv, num_warps=4)


# ------------------------------------------------------------------------------------------------
def masks(parents: list[int]) -> list[int]:
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append((1 << i) | (bits[p] if p >= 0 else 0))
    return [x - (1 << 64) if x >= 1 << 63 else x for x in bits]


def depths(parents: list[int]) -> list[int]:
    d: list[int] = []
    for p in parents:
        d.append(1 + (d[p] if p >= 0 else 0))
    return d


def old_steps(parents: list[int]) -> int:
    """The old kernel's recurrence steps for a tree (index order, restart from the committed state)."""
    anc = masks(parents)
    return sum(1 if p == i - 1 else bin(anc[i] % (1 << 64)).count("1") for i, p in enumerate(parents))


def ddtree(w: int, rng: random.Random) -> list[int]:
    """A DDTree of ``w`` nodes over ``max(2, w // 3)`` depths of peaked random distributions."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    d = max(2, w // 3)
    for temp in (8.0, 6.0, 4.0, 2.0):
        _, parents = build_tree(1, torch.randn(d, 512, generator=gen) * temp, w - 1, 8)
        if len(parents) == w:
            return parents
    raise RuntimeError("no tree of the requested size")


def bench_tree(w: int) -> list[int]:
    """``target_service.bench_gpu._tree_shape``: a spine of about ``w / 2`` nodes, a leaf under each."""
    chain = max(1, (w + 1) // 2)
    return ([-1] + list(range(chain - 1)) + [d % chain for d in range(w)])[:w]


def root_to_leaf(parents: list[int]) -> list[int]:
    """The path from the root to the deepest node (the first such), root first."""
    d = depths(parents)
    node, path = d.index(max(d)), []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


class Case:
    """One benchmark case: inputs for ``B`` rows of ``W`` nodes, trees / paths per row, a small pool
    for the checks and a large one (``copies`` disjoint slot sets) for timing."""

    def __init__(self, model: str, hv: int, hk: int, dk: int, b: int, w: int, kind: str, dev: str, seed: int,
                 copies: int | None = None):
        self.model, self.hv, self.hk, self.dk, self.b, self.w, self.kind = model, hv, hk, dk, b, w, kind
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        c = 2 * hk * dk + hv * dk
        self.x = torch.randn(b, w, c, generator=gen).to(dev, torch.bfloat16)
        # the engine's in_proj row [q|k|v pre-conv | z | b | a]: b and a are its last 2 HV columns
        proj = torch.randn(b, w, c + hv * dk + 2 * hv, generator=gen).to(dev, torch.bfloat16)
        self.bb, self.a = proj[..., c + hv * dk : c + hv * dk + hv], proj[..., c + hv * dk + hv :]
        self.A = -torch.exp(torch.randn(hv, generator=gen) * 0.5).to(dev)
        self.dtb = torch.randn(hv, generator=gen).to(dev)
        self.commit = kind in ("decode", "prefill")
        chain = [i - 1 for i in range(w)]
        self.trees = [ddtree(w, rng) if kind == "tree" else bench_tree(w) if kind == "bench" else chain for _ in range(b)]
        self.parents = torch.tensor(self.trees, device=dev)
        self.anc = torch.tensor([masks(t) for t in self.trees], device=dev) if w <= 64 else None
        paths = [root_to_leaf(t) for t in self.trees]
        self.path = torch.tensor([p + [0] * (w - len(p)) for p in paths], device=dev)
        self.n_acc = torch.tensor([len(p) for p in paths], device=dev)
        self.pool = (torch.randn(b + 1, hv, dk, dk, generator=gen) * 0.1).to(dev)
        self.slots = torch.arange(b, device=dev)
        per_copy = b * hv * dk * dk * 4
        self.copies = copies or max(2, min(256, math.ceil(2 * L2_BYTES / per_copy)))
        self.big = None
        self.dev = dev

    @property
    def name(self) -> str:
        return f"{self.model} B={self.b} W={self.w} {self.kind}"

    def big_pool(self) -> torch.Tensor:
        if self.big is None:
            self.big = torch.randn(self.b * self.copies, self.hv, self.dk, self.dk, device=self.dev) * 0.1
            self.big_slots = [torch.arange(self.b, device=self.dev) + r * self.b for r in range(self.copies)]
        return self.big

    def tree_call(self, tree_fn, pool, slots, config):
        return tree_fn(self.x, self.a, self.bb, self.A, self.dtb, pool, slots, self.parents, self.anc, self.commit,
                       self.hk, self.dk, config=config)

    def commit_call(self, commit_fn, pool, slots, config, n_acc=None):
        commit_fn(pool, slots, self.x, self.a, self.bb, self.A, self.dtb, self.path,
                  self.n_acc if n_acc is None else n_acc, self.hk, self.dk, config=config)


def time_calls(calls, reps: int, warmup: int = 2) -> float:
    """Microseconds per call: a CUDA graph of the calls back to back, median over ``reps`` replays
    (CPU: wall clock of the eager calls)."""
    for f in calls[:2]:
        f()                                              # compile outside the capture
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for f in calls:
            f()
        return (time.perf_counter() - t0) / len(calls) * 1e6
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls:                                  # warm the allocator on the side stream
            f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for f in calls:
            f()
    for _ in range(warmup):
        g.replay()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / len(calls))
    del g
    return statistics.median(times)


def reference(case: Case):
    """Reference outputs (first ``<= 4`` rows) and the state after the step's commit."""
    rb = min(case.b, 4)
    pool = case.pool.clone()
    sl = case.slots[:rb]
    args = (case.x[:rb], case.a[:rb], case.bb[:rb], case.A, case.dtb)
    anc = case.anc[:rb] if case.anc is not None else None
    out = R.pool_gdn_tree(*args, pool, sl, case.parents[:rb], anc, case.commit, case.hk, case.dk)
    if not case.commit:
        R.pool_gdn_commit(pool, sl, *args, case.path[:rb], case.n_acc[:rb], case.hk, case.dk)
    return out, pool[:rb]


def errors(case: Case, ref, tree_fn, commit_fn, config) -> tuple[float, float]:
    rb = min(case.b, 4)
    pool = case.pool.clone()
    out = case.tree_call(tree_fn, pool, case.slots, config)
    if not case.commit:
        case.commit_call(commit_fn, pool, case.slots, config)
    return (out[:rb] - ref[0]).abs().max().item(), (pool[:rb] - ref[1]).abs().max().item()


def bitexact(model: str, hv: int, hk: int, dk: int, tree_fn, commit_fn, config, dev: str, w16: int, w64: int) -> dict:
    """Width invariance on this device: one-node calls against a committed chain and against tree
    verifies + path commits (module docstring)."""
    res = {}

    def one_node_calls(case: Case, nodes: torch.Tensor):
        pool = case.pool.clone()
        rows = torch.arange(case.b, device=dev)
        root = torch.full((case.b, 1), -1, device=dev)
        outs = []
        for d in range(nodes.shape[1]):
            j = nodes[:, d]
            outs.append(tree_fn(case.x[rows, j][:, None], case.a[rows, j][:, None], case.bb[rows, j][:, None], case.A,
                                case.dtb, pool, case.slots, root, None, True, hk, dk, config=config)[:, 0])
        return torch.stack(outs, 1), pool

    case = Case(model, hv, hk, dk, 2, w16, "prefill", dev, seed=11, copies=2)   # a committed chain
    pool = case.pool.clone()
    out = case.tree_call(tree_fn, pool, case.slots, config)
    o1, p1 = one_node_calls(case, torch.arange(w16, device=dev).expand(2, w16))
    res[f"chain{w16} commit"] = bool(torch.equal(out, o1) and torch.equal(pool, p1))
    for kind, w in (("chain", w16), ("tree", w16), ("tree", w64), ("bench", w64)):
        case = Case(model, hv, hk, dk, 2, w, kind, dev, seed=12 + w, copies=2)
        n = int(case.n_acc.min())                       # both rows' paths cut to the shorter one
        pool = case.pool.clone()
        out = case.tree_call(tree_fn, pool, case.slots, config)       # the pool is not written
        case.commit_call(commit_fn, pool, case.slots, config, torch.full_like(case.n_acc, n))
        o1, p1 = one_node_calls(case, case.path[:, :n])
        got = out.gather(1, case.path[:, :n, None, None].expand(-1, -1, hv, dk))
        res[f"{kind}{w} verify+commit"] = bool(torch.equal(got, o1) and torch.equal(pool, p1))
    return res


def print_row(row: dict, names: list[str], header: bool) -> None:
    if header:
        print(f"\n{'case':<28}{'depth':>6}{'steps':>7}{'old':>6}  "
              + "".join(f"{n:>17}" for n in names) + "   (tree us / commit us; speedup vs old: tree+commit)")
    old = row["tree_us"].get("old", 0.0) + row["commit_us"].get("old", 0.0)
    cells = []
    for n in names:
        t, c = row["tree_us"][n], row["commit_us"].get(n)
        cell = f"{t:.1f}" + (f"/{c:.1f}" if c is not None else "")
        if old and n != "old":
            cell += f" x{old / (t + (c or 0.0)):.1f}"
        cells.append(f"{cell:>17}")
    print(f"{row['case']:<28}{row['depth']:>6}{row['steps']:>7.1f}{row['old_steps']:>6.0f}  " + "".join(cells),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--configs", nargs="*", default=[f"{a},{b}" for a, b in CANDIDATES], help="BV,num_warps ...")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--reps", type=int, default=10, help="timed graph replays per unit")
    ap.add_argument("--no-old", action="store_true", help="skip the baseline kernels")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any device (CPU: Triton's interpreter)")
    args = ap.parse_args()
    t_start = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    impls = {f"{bv},{nw}": (T.pool_gdn_tree, T.pool_gdn_commit, (bv, nw)) for bv, nw in configs}
    if not args.no_old:
        impls["old"] = (old_tree, old_commit, None)
    models = {m: MODELS[m] for m in args.models}
    batches, widths, prefill, w64, copies = (1, 16), (16, 64), 512, 64, None
    if args.smoke:
        models = {"tiny": dict(hv=2, hk=1, dk=16)}
        batches, widths, prefill, w64, copies = (1, 2), (4, 9), 12, 9, 2
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (interpreter)'}; "
          f"configs: {' '.join(impls)}", flush=True)

    cases: list[Case] = []
    for m, dims in models.items():
        for b in batches:
            cases.append(Case(m, **dims, b=b, w=1, kind="decode", dev=dev, seed=b, copies=copies))
            for w in widths:
                for kind in ("chain", "tree", "bench"):
                    cases.append(Case(m, **dims, b=b, w=w, kind=kind, dev=dev, seed=b * 1000 + w, copies=copies))
        cases.append(Case(m, **dims, b=1, w=prefill, kind="prefill", dev=dev, seed=7, copies=copies))

    rows, errs = [], {k: [0.0, 0.0] for k in impls}
    for case in cases:
        ref = reference(case)
        tree_like = case.kind in ("tree", "bench")
        row = {"case": case.name, "model": case.model, "B": case.b, "W": case.w, "kind": case.kind,
               "depth": max(max(depths(t)) for t in case.trees), "copies": case.copies,
               "steps": statistics.mean(len(T.tree_walk(t)) for t in case.trees) if tree_like else case.w,
               "old_steps": statistics.mean(old_steps(t) for t in case.trees) if tree_like else case.w,
               "tree_us": {}, "commit_us": {}, "err": {}}
        big = case.big_pool()
        for name, (tree_fn, commit_fn, cfg) in impls.items():
            e = errors(case, ref, tree_fn, commit_fn, cfg)
            row["err"][name] = e
            errs[name] = [max(errs[name][0], e[0]), max(errs[name][1], e[1])]
            calls = [lambda s=s: case.tree_call(tree_fn, big, s, cfg) for s in case.big_slots]
            row["tree_us"][name] = time_calls(calls, args.reps)
            if not case.commit:
                calls = [lambda s=s: case.commit_call(commit_fn, big, s, cfg) for s in case.big_slots]
                row["commit_us"][name] = time_calls(calls, args.reps)
        rows.append(row)
        print_row(row, list(impls), header=len(rows) == 1)
        case.big = None
        if dev == "cuda":
            torch.cuda.empty_cache()

    print("\nlargest |error| against the reference (outputs, states):")
    for name, (eo, es) in errs.items():
        print(f"  {name:>6}: {eo:.2e} {es:.2e}")
    print("\nbit-exact width invariance (one-node calls == one call of the chain / verify + commit):")
    bits = {}
    for name, (tree_fn, commit_fn, cfg) in impls.items():
        bits[name] = {}
        for m, dims in models.items():
            for k, ok in bitexact(m, **dims, tree_fn=tree_fn, commit_fn=commit_fn, config=cfg, dev=dev,
                                  w16=widths[0], w64=w64).items():
                bits[name][f"{m} {k}"] = ok
        print(f"  {name:>6}: {'ok' if all(bits[name].values()) else 'FAILED'}  "
              + " ".join(f"{k}={'ok' if v else 'NO'}" for k, v in bits[name].items()))

    # score: geometric mean over cases of (tree + commit) / best of the case; new configs only
    new = [k for k in impls if k != "old"]
    scores = {}
    for name in new:
        logs = []
        for row in rows:
            tot = {k: row["tree_us"][k] + row["commit_us"].get(k, 0.0) for k in new}
            logs.append(math.log(tot[name] / min(tot.values())))
        scores[name] = math.exp(sum(logs) / len(logs))
    ok = [k for k in new if all(bits[k].values()) and errs[k][0] < 1e-4 and errs[k][1] < 1e-4]
    print("\nscore (geometric mean of time / best config's time, tree + commit; 1.0 = best everywhere):")
    best = min(ok, key=scores.get) if ok else None
    for name in new:
        print(f"  {name:>6}: {scores[name]:.3f}{'  <- suggested' if name == best else ''}"
              f"{'' if name in ok else '  (failed a check)'}")
    dims = next(iter(models.values()))
    if best:
        bv, nw = best.split(",")
        print(f"\nsuggested: GDN_CONFIGS[({dims['dk']}, {dims['dk']})] = ({bv}, {nw})", end="")
    else:
        print("\nno config passed every check", end="")
    print(f"   ({time.time() - t_start:.0f} s in all)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "configs": list(impls),
                       "cases": rows, "errors": errs, "bitexact": bits, "scores": scores,
                       "suggested": [int(v) for v in best.split(",")] if best else None}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

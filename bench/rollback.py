"""Measure the GDN rollback strategies of ``target_service.models.qwen35``: time and bytes per step.

``python -m bench.rollback [--device cpu|cuda] [--heads 16] [--dk 128] [--dv 128]
[--out benchmarks/rollback.txt]``

One GDN layer at Qwen3.5 dimensions (defaults: 16 value heads, Dk = Dv = 128, as Qwen3.5-0.8B/2B),
one verify step over a tree of ``T`` nodes whose accepted path has ``n = k + 1`` nodes:

* ``gather``: the tree recurrence keeps all ``T`` node states; commit copies the path end's.
* ``recompute``: the tree recurrence keeps each node's ``(k, v, g, beta)``; commit re-runs the
  ``n`` path updates from the committed state.
* ``snapshot``: the first option of docs/ARCHITECTURE.md, "State and rollback", for reference:
  snapshot the committed state, let the tree recurrence overwrite it, restore the snapshot, then
  replay the path (``n`` updates).

Bytes are the state traffic a fused kernel would have to move per step and layer (a state is
``HV * Dk * Dv * 4`` bytes): gather writes ``T`` states in the forward and reads + writes one at
commit; recompute reads and writes one state at commit (plus ``n`` small ``(k, v, g, beta)``
rows); snapshot copies the state twice and replays like recompute. Times are the plain-PyTorch
reference on the given device (median of repeats, CUDA events on GPU), tree forward + commit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.gated_delta import gdn_update, l2norm, tree_gated_delta_rule


def _inputs(t: int, h: int, dk: int, dv: int, device: torch.device, gen: torch.Generator):
    def r(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = l2norm(r(t, h, dk)) / dk**0.5
    k = l2norm(r(t, h, dk))
    v = r(t, h, dv)
    g = -torch.rand(t, h, generator=gen).to(device)
    beta = torch.rand(t, h, generator=gen).to(device)
    return q, k, v, g, beta


def step(strategy: str, state: torch.Tensor, inputs, parents: list[int], path: list[int]) -> torch.Tensor:
    """One verify + commit of ``strategy``; returns the new committed state."""
    q, k, v, g, beta = inputs
    if strategy == "snapshot":
        snap = state.clone()
        _, states = tree_gated_delta_rule(q, k, v, g, beta, state, parents)
        state.copy_(states[-1])            # the forward "overwrote" the live state
        state.copy_(snap)                  # roll back
        s = state
        for i in path:
            s = gdn_update(s, k[i], v[i], g[i], beta[i])
        return s
    _, states = tree_gated_delta_rule(q, k, v, g, beta, state, parents)
    if strategy == "gather":
        return states[path[-1]].clone()
    del states
    idx = torch.tensor(path, device=state.device)
    kp, vp, gp, bp = (x.index_select(0, idx) for x in (k, v, g, beta))
    s = state
    for j in range(len(path)):
        s = gdn_update(s, kp[j], vp[j], gp[j], bp[j])
    return s


def bytes_moved(strategy: str, t: int, n: int, h: int, dk: int, dv: int) -> int:
    """State bytes per step and layer a fused kernel moves (module docstring)."""
    state = h * dk * dv * 4
    row = h * (dk + dv + 2) * 4
    if strategy == "gather":
        return t * state + 2 * state
    if strategy == "recompute":
        return 2 * state + n * row
    return 4 * state + n * row  # snapshot: copy out, copy back, then read + write during replay


def _time(fn, device: torch.device, repeats: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(args.heads, args.dk, args.dv, generator=gen).to(device) * 0.1
    lines = [
        f"GDN rollback, one layer: HV={args.heads} Dk={args.dk} Dv={args.dv} on {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f" ({torch.get_num_threads()} threads)"),
        "command: python -m bench.rollback " + " ".join(argv or []),
        f"{'T':>3} {'n':>3} {'strategy':>10} {'ms/step':>9} {'state MB moved':>15}",
    ]
    check = {}
    for t in (1, 4, 8, 16, 32):
        parents = [i - 1 for i in range(t)]  # a chain: the tree shape does not change the costs compared
        inputs = _inputs(t, args.heads, args.dk, args.dv, device, gen)
        for n in sorted({1, max(1, t // 2), t}):
            path = list(range(n))
            for strategy in ("gather", "recompute", "snapshot"):
                ms = _time(lambda: step(strategy, state.clone(), inputs, parents, path), device, args.repeats)
                mb = bytes_moved(strategy, t, n, args.heads, args.dk, args.dv) / 2**20
                lines.append(f"{t:>3} {n:>3} {strategy:>10} {ms:>9.3f} {mb:>15.2f}")
                check[strategy] = step(strategy, state.clone(), inputs, parents, path)
            ref = check["gather"]
            for s in ("recompute", "snapshot"):
                err = (check[s] - ref).abs().max().item()
                if err > 1e-4:
                    raise AssertionError(f"{s} state differs from gather by {err}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()

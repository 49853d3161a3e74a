"""Does the draft service's process slow the target's verify on the same GPU? (issue 18)

    python tools/gpu_contention.py [--steps 300] [--out contention.json]

End to end, both engines' batch calls take about 0.4 ms longer per step than the same calls in
isolation (``benchmarks/gpu/colocate``: the target's verify 1.65 ms against 1.22 in the engine
benchmark; the drafter's propose 0.90 against 0.48). This measures the same two calls (wall time
of ``BatchedEngine.verify_batch`` with a 16-node tree and of ``BatchedDrafter.propose_batch`` with
the default tree, one session each, CUDA graphs) in four layouts:

* ``alone``: each engine by itself in this process;
* ``one process``: verify and propose alternating on one thread of this process;
* ``two processes``: verify here, propose in a child process (its own CUDA context), strictly
  alternating through a pipe, as the services run (the pipe's round trip is not timed);
* ``two processes, idle peer``: the child holds its CUDA context and sleeps (no alternation).

Models: a llama with SmolLM2-135M's shapes (vocab 626, random weights, written here) and a random
drafter of the shipped drafter's shape (3 layers, block 16, 5 target layers): acceptance is
irrelevant, only the costs are measured. Prints medians and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path[:0] = [".", "proto"]

TREE = 15       # draft nodes of the default tree
TOPK = 4


def _paths(tmp: str) -> tuple[str, str]:
    from draft_service.init_random import write_random_drafter
    from fixtures.tiny_models import write_tiny_llama

    target = os.path.join(tmp, "llama-smollm2-shape.gguf")
    write_tiny_llama(target, vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, tied=True, std=0.02)
    drafter = os.path.join(tmp, "drafter.gguf")
    write_random_drafter(target, drafter, layers=3, block_size=16, num_target_layers=5)
    return target, drafter


class Target:
    def __init__(self, path: str, taps: list[int]):
        from runtime.sampling import Sampling
        from target_service.__main__ import build_engine
        from target_service.config import TargetConfig

        self.eng, _ = build_engine(path, TargetConfig(device="cuda", max_sessions=2, max_context=4096,
                                                      feature_layers=tuple(taps), gpu_memory_fraction=0.3))
        out = self.eng.prefill("s", list(range(1, 65)), Sampling(), taps)
        self.root = out.first_token

    def step(self) -> float:
        tokens = [self.root] + [(self.root + 1 + i) % 600 for i in range(TREE)]
        parents = [-1] + list(range(TREE))
        t0 = time.perf_counter()
        (out,) = self.eng.verify_batch([("s", tokens, parents)])
        dt = time.perf_counter() - t0
        self.root = out.bonus_token
        if out.committed_length > 3500:
            raise RuntimeError("context nearly full: fewer steps")
        return dt * 1e3


class Drafter:
    def __init__(self, target_path: str, drafter_path: str):
        import torch

        from draft_service.batched import BatchedDrafter
        from draft_service.gguf_io import load_drafter

        d = load_drafter(drafter_path, target_path, device="cuda", dtype=torch.bfloat16)
        self.eng = BatchedDrafter(d, max_sessions=2, max_context=4096)
        self.eng.capture()
        self.c = d.config
        self.L = 0
        self.gen = torch.Generator().manual_seed(0)
        self.torch = torch

    def step(self) -> float:
        from draft_service.batched import DraftItem

        n = 64 if self.L == 0 else 4
        feats = self.torch.randn(n, self.c.feature_size, generator=self.gen).to(self.torch.bfloat16)
        self.L += n
        item = DraftItem("d", feats, 1, self.L, budget=TREE, top_k=TOPK, max_depth=self.c.block_size - 1)
        t0 = time.perf_counter()
        (res,) = self.eng.propose_batch([item])
        dt = time.perf_counter() - t0
        if isinstance(res, BaseException):
            raise res
        return dt * 1e3


def _child(target_path: str, drafter_path: str, conn, idle: bool) -> None:
    d = Drafter(target_path, drafter_path)
    d.step()
    conn.send("ready")
    times = []
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if not idle:
            times.append(d.step())
        conn.send("done")
    conn.send(times)


def _median(xs: list[float]) -> dict:
    xs = xs[5:] if len(xs) > 10 else xs
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="contention-")
    target_path, drafter_path = _paths(tmp)
    from draft_service.gguf_io import read_drafter_config

    taps = list(read_drafter_config(drafter_path).target_layer_ids)
    res: dict = {}
    t = Target(target_path, taps)
    d = Drafter(target_path, drafter_path)
    for _ in range(10):
        t.step(), d.step()
    res["alone"] = {"verify_ms": _median([t.step() for _ in range(a.steps)]),
                    "propose_ms": _median([d.step() for _ in range(a.steps)])}
    v, q = [], []
    for _ in range(a.steps):
        v.append(t.step())
        q.append(d.step())
    res["one process"] = {"verify_ms": _median(v), "propose_ms": _median(q)}
    del d
    ctx = mp.get_context("spawn")
    for name, idle in (("two processes", False), ("two processes, idle peer", True)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(target_path, drafter_path, child, idle))
        proc.start()
        assert parent.recv() == "ready"
        v = []
        for _ in range(a.steps):
            v.append(t.step())
            parent.send("go")
            parent.recv()
        parent.send("stop")
        q = parent.recv()
        proc.join()
        res[name] = {"verify_ms": _median(v), "propose_ms": _median(q)}
    for name, r in res.items():
        print(f"{name:<26} verify {r['verify_ms'].get('median', float('nan')):.3f} ms   "
              f"propose {r['propose_ms'].get('median', float('nan')):.3f} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

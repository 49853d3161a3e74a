"""The target's per-item tree check on the host, before and after its shape memory (session 28).

    python benchmarks/cpu-host-per-item/run28-tree-shapes/bench.py

Times ``runtime.tree.analyze_tree`` (what ``BatchedEngine._check`` ran per item before) against
``BatchedEngine._analyze`` (a kept shape: its tokens checked only) on the default tree's shapes as a
64-stream tick sends them (8 nodes each: 512 verify nodes shared by 64 requests) and one stream's
(16 nodes), median of 7 repeats of 2,000 trees each, microseconds per tree, on this machine.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

sys.path[:0] = [".", "proto"]

from runtime.tree import analyze_tree  # noqa: E402
from target_service.batched_engine import BatchedEngine  # noqa: E402


def trees(n: int, count: int, shapes: int, vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    kinds = [[-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, n)] for _ in range(shapes)]
    return [([rng.randrange(vocab) for _ in range(n)], list(rng.choice(kinds))) for _ in range(count)]


def per_tree_us(fn, items) -> float:
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for tokens, parents in items:
            fn(tokens, parents)
        runs.append((time.perf_counter() - t0) / len(items) * 1e6)
    return statistics.median(runs)


def main() -> None:
    vocab = 49152
    eng = BatchedEngine.__new__(BatchedEngine)
    eng.cfg = type("Cfg", (), {"vocab_size": vocab})()
    eng.max_tree_width, eng.max_tree_depth, eng._shapes = 64, 32, {}
    print("nodes  analyze_tree us  _analyze us (kept shapes)")
    for n in (8, 16):
        items = trees(n, 2000, shapes=8, vocab=vocab)
        before = per_tree_us(lambda t, p: analyze_tree(t, p, vocab, 64, 32), items)
        after = per_tree_us(eng._analyze, items)
        print(f"{n:5d}  {before:15.2f}  {after:11.2f}")


if __name__ == "__main__":
    main()

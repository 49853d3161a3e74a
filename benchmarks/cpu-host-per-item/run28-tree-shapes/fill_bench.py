"""The target's step inputs written per row, with each session's sampling fields computed every
step (before: a float32 division and the seed's bits per row) and kept on the session (after:
``PoolSession.sampling_row``), session 28. Runner-shaped host views (``StepLayout.host_views``),
8-node trees, 1 / 8 / 64 rows; us per item, median of 7 repeats of 300 steps, on this machine.

    python benchmarks/cpu-host-per-item/run28-tree-shapes/fill_bench.py
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import numpy as np

sys.path[:0] = [".", "proto"]

from target_service.batched_engine import PoolSession  # noqa: E402
from target_service.engine import Sampling  # noqa: E402
from target_service.pooled import StepLayout  # noqa: E402


def before(v, group) -> None:
    """The per-row writes of 8685e65's ``_step`` (its ``_fill_sampling`` inlined)."""
    for r, (_, s, tokens, parents, depth, bits) in enumerate(group):
        n = len(tokens)
        v["tokens"][r, :n] = tokens
        v["parents"][r, :n] = parents
        v["depth"][r, :n] = depth
        v["ancestors"][r, :n] = bits
        v["n_nodes"][r], v["slots"][r], v["lengths"][r] = n, s.slot, s.length
        v["seeds"][r] = s.seed_bits
        v["top_k"][r] = s.sampling.top_k
        v["inv_temperature"][r] = s.inv_temperature
        v["top_p"][r] = s.sampling.top_p if s.sampling.temperature > 0 else 0.0


def after(v, group) -> None:
    """This tree's ``_step`` writes."""
    for r, (_, s, tokens, parents, depth, bits) in enumerate(group):
        n = len(tokens)
        v["tokens"][r, :n] = tokens
        v["parents"][r, :n] = parents
        v["depth"][r, :n] = depth
        v["ancestors"][r, :n] = bits
        v["n_nodes"][r], v["slots"][r], v["lengths"][r] = n, s.slot, s.length
        v["seeds"][r], v["top_k"][r], v["inv_temperature"][r], v["top_p"][r] = s.sampling_row


def main() -> None:
    rng = random.Random(0)
    depth, bits, parents = (0, 1, 2, 3, 1, 2, 2, 3), (1, 3, 7, 15, 17, 49, 67, 195), (-1, 0, 1, 2, 0, 4, 1, 6)
    print("rows  before us/item  after us/item")
    for b in (1, 8, 64):
        lay = StepLayout(b, 8)
        views = []
        for _ in range(2):
            buf = np.zeros(lay.size, dtype=np.int64)
            views.append(lay.host_views(buf))
        group = [(i, PoolSession(f"s{i}", i, Sampling(temperature=0.7, seed=i), [], length=100 + i),
                  [rng.randrange(1000) for _ in range(8)], list(parents), depth, bits) for i in range(b)]
        before(views[0], group)
        after(views[1], group)
        assert all(np.array_equal(views[0][k], views[1][k]) for k in views[0]), "the two fills differ"
        out = []
        for fn in (before, after):
            runs = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(300):
                    fn(views[0], group)
                runs.append((time.perf_counter() - t0) / 300 / b * 1e6)
            out.append(statistics.median(runs))
        print(f"{b:4d}  {out[0]:14.2f}  {out[1]:13.2f}")


if __name__ == "__main__":
    main()

"""The target's step inputs written per row, with each session's sampling fields computed every
step (before: a float32 division and the seed's bits per row) and kept on the session (after:
``PoolSession.sampling_row``, written by ``BatchedEngine._fill_rows``), session 28.
Runner-shaped host views (``StepLayout.host_views``), 8-node trees, 1 / 8 / 64 rows; us per item, median of 7 repeats of 300 steps, on this machine.

    python benchmarks/cpu-host-per-item/run28-tree-shapes/fill_bench.py
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import numpy as np

sys.path[:0] = [".", "proto"]

from target_service.batched_engine import BatchedEngine, PoolSession  # noqa: E402
from target_service.engine import Sampling  # noqa: E402
from target_service.pooled import StepLayout  # noqa: E402


class Uncached(PoolSession):
    """A session whose sampling fields are computed at every read, as 8685e65's ``_step`` did
    for every row of every step (its ``_fill_sampling``: ``seed_bits``, ``inv_temperature``)."""

    sampling_row = property(PoolSession.sampling_row.func)   # (the same body, not kept)


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
        trees = [([rng.randrange(1000) for _ in range(8)], list(parents), depth, bits) for _ in range(b)]
        groups = [[(i, kind(f"s{i}", i, Sampling(temperature=0.7, seed=i), [], length=100 + i), *trees[i])
                   for i in range(b)] for kind in (Uncached, PoolSession)]
        for v, group in zip(views, groups):
            BatchedEngine._fill_rows(v, group)
        assert all(np.array_equal(views[0][k], views[1][k]) for k in views[0]), "the two fills differ"
        out = []
        for group in groups:
            runs = []
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(300):
                    BatchedEngine._fill_rows(views[0], group)
                runs.append((time.perf_counter() - t0) / 300 / b * 1e6)
            out.append(statistics.median(runs))
        print(f"{b:4d}  {out[0]:14.2f}  {out[1]:13.2f}")


if __name__ == "__main__":
    main()

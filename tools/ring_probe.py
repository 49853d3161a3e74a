"""What the feature ring's host side costs a drafter step, on a GPU (issue 23; session 25).

    python tools/ring_probe.py [--rows 200] [--iters 300] [--out FILE]

py-spy put a third to a half of the drafter step's host samples in its ring read
(``benchmarks/gpu/step/run25-pyspy``), but replacing its per-step ``pin_memory()`` with
:class:`runtime.staging.IndexStaging` measured no gain end to end (``benchmarks/gpu/concurrency/
run25-staging``). This probe times the pieces alone, in a consumer process that maps a ring made by
this (producer) process, as the draft service maps the target's: per operation, the host
microseconds until the Python call returns (launch only) and until the device finished
(``torch.cuda.synchronize`` after it), medians over ``--iters`` after 20 of warm-up, each with the
GPU idle and with the producer keeping it busy (a loop of matmuls in this process, as the target's
prefills and verifies keep it busy under load).

Operations (``--rows`` ring rows each, SmolLM2's 5 x 576 bf16 feature width):

* ``pin+copy``: ``torch.from_numpy(idx).pin_memory().to(dev, non_blocking=True)`` (the old path);
* ``staging``: ``runtime.staging.IndexStaging.put(idx)`` (a persistent pinned buffer; only in the
  trees that had that module, before 220ce51 reverted it);
* ``gather ipc``: ``index_select`` from the mapped ring and ``index_copy_`` into a local buffer
  (the drafter's ``_features_in`` until session 25); ``gather local``: the same from a table of
  this process; ``gather kernel ipc``: a one-launch Triton row copy (in the tree that had it:
  slower on the host than the two ops, not kept);
* ``store reference`` / ``store kernel``: the target's store of a 64 x 16 verify step's rows (64
  items) into a local table, :mod:`kernels.ring.reference`'s ops against the one launch.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

sys.path[:0] = [".", "proto"]

WIDTH = 5 * 576


def _consumer(desc_bytes: bytes, rows: int, iters: int, busy, done, out) -> None:
    import numpy as np
    import torch

    from dflash_grpc.v1 import common_pb2
    from runtime.feature_ring import FeatureRing

    try:   # (session 25's trees until 220ce51 had it; reverted after this probe)
        from runtime.staging import IndexStaging
    except ImportError:
        IndexStaging = None

    dev = torch.device("cuda", 0)
    ring = FeatureRing.open(common_pb2.FeatureRing.FromString(desc_bytes), dev)
    local = torch.randn(ring.table.shape, device=dev).to(ring.table.dtype)
    dst = torch.empty(64 * 16, WIDTH, dtype=ring.table.dtype, device=dev)
    staging = IndexStaging(dev) if IndexStaging is not None else None
    rng = np.random.default_rng(0)

    def idx():
        return np.stack([rng.integers(0, ring.table.shape[0] - 1, rows), rng.integers(0, dst.shape[0], rows)])

    def pin_copy(a):
        return torch.from_numpy(a).pin_memory().to(dev, non_blocking=True)

    def gather(table, i):   # (the PyTorch reference's two ops)
        dst.index_copy_(0, i[1], table.index_select(0, i[0]))

    try:   # a one-launch row copy (kernels.ring.triton at 11a49e0, session 25; not kept)
        from kernels.ring.triton import copy_rows
    except ImportError:
        copy_rows = None
    try:   # the target's store as one launch (kernels.ring, session 25)
        from kernels.ring import reference as ring_ref
        from kernels.ring import triton as ring_tri
    except ImportError:
        ring_ref = None

    ops = {"pin+copy": lambda a: pin_copy(a)}
    if staging is not None:
        ops["staging"] = lambda a: staging.put(a)
    ops.update({"gather ipc": None, "gather local": None})
    if copy_rows is not None:
        ops["gather kernel ipc"] = None
    if ring_ref is not None:
        feats = torch.randn(64, 16, WIDTH, device=dev).to(local.dtype)
        counts = torch.randint(1, 17, (64,), device=dev)
        store_items = torch.stack([torch.arange(64), torch.arange(64), torch.randint(0, 256, (64,))]).to(dev)
        ops["store reference"] = lambda a: ring_ref.store_rows(local, feats, store_items, counts, 256, local.shape[0] - 1)
        ops["store kernel"] = lambda a: ring_tri.store_rows(local, feats, store_items, counts, 256, local.shape[0] - 1)
    result = {}
    for phase in ("idle", "busy"):
        if phase == "busy":
            busy.set()
            time.sleep(0.5)
        for name in ops:
            launch, full = [], []
            for k in range(iters + 20):
                a = idx()
                i = pin_copy(a) if name.startswith("gather") else None
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if name == "gather kernel ipc":
                    copy_rows(ring.table, i[0], dst, i[1])
                elif name == "gather ipc":
                    gather(ring.table, i)
                elif name == "gather local":
                    gather(local, i)
                else:
                    ops[name](a)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                if k >= 20:
                    launch.append((t1 - t0) * 1e6)
                    full.append((t2 - t0) * 1e6)
            result[f"{phase} {name}"] = {"launch_us": round(statistics.median(launch), 1),
                                         "to_done_us": round(statistics.median(full), 1)}
    done.set()
    out.put(result)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from runtime.feature_ring import FeatureRing

    ring = FeatureRing.create(64, 256, WIDTH, torch.bfloat16, "cuda:0")
    ctx = mp.get_context("spawn")
    busy, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_consumer, args=(ring.descriptor.SerializeToString(), args.rows, args.iters, busy, done, out))
    p.start()
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    while not done.is_set():   # the producer: idle until asked, then the GPU kept busy (as the target's work)
        if busy.is_set():
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
        else:
            time.sleep(0.01)
    result = out.get(timeout=60)
    p.join(30)
    lines = [f"# ring_probe: {args.rows} rows, width {WIDTH} bf16, {args.iters} iterations, {torch.cuda.get_device_name()}",
             "| GPU | operation | host us to return (launch) | host us to done |", "|---|---|---|---|"]
    for key, v in result.items():
        phase, name = key.split(" ", 1)
        lines.append(f"| {phase} | {name} | {v['launch_us']} | {v['to_done_us']} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n" + json.dumps(result) + "\n")
    ring.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

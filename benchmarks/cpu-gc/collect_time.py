"""How long one full garbage collection takes in a process that has imported what a service
imports (torch, triton, grpc, the three services' modules), before and after ``gc.freeze`` (session
29, ``dflash_grpc.serving.freeze_heap``). Run from the repo root:

    python benchmarks/cpu-gc/collect_time.py
"""

from __future__ import annotations

import gc
import importlib
import time


def collect_ms() -> float:
    t = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    for name in ("grpc", "torch", "triton", "draft_service.servicer", "orchestrator.scheduler", "target_service.__main__"):
        importlib.import_module(name)

    print(f"tracked objects after the imports: {len(gc.get_objects()):,}")
    for i in range(3):
        print(f"full collection {i + 1}: {collect_ms():.1f} ms")
    gc.freeze()
    print(f"after gc.freeze ({gc.get_freeze_count():,} objects frozen): {collect_ms():.3f} ms")


if __name__ == "__main__":
    main()

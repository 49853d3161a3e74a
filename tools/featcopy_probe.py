"""How much a target step's copy of its rows' tapped features costs: a 64 x 16 verify of a
SmolLM2-shaped llama (graphs captured, feature layers 1, 7, 14 tapped by the engine), its sessions
wanting feature rows or not (``_Runner.fetch_features`` copies them only when one does).

    python tools/featcopy_probe.py MODEL.gguf

Prints device ms (CUDA events around each step, ``runtime.device_time``) and wall ms per
``verify_batch``, median [min, max] of 30 steps after 5 of warm-up, for each case twice, alternating.
"""
import statistics
import sys
import time

import torch

from runtime.device_time import device_seconds
from target_service.batched_engine import BatchedEngine
from target_service.engine import Sampling
from target_service.models.llama import LlamaModel


def main(path: str) -> None:
    m = LlamaModel.from_gguf(path, device="cuda", dtype=torch.bfloat16)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    for want in ([], [1, 7, 14], [], [1, 7, 14]):
        eng = BatchedEngine(m, max_sessions=64, max_context=1024, max_tree_width=16, max_tree_depth=15,
                            batch_buckets=(64,), width_buckets=(16,), feature_layers=[1, 7, 14], cuda_graphs=True)
        roots = [eng.prefill(f"s{i}", [5, 6, 7, 8, 9], s, want).first_token for i in range(64)]

        def step():
            res = eng.verify_batch([(f"s{i}", [roots[i]] + [11] * 15, [-1] + list(range(15))) for i in range(64)])
            for i, r in enumerate(res):
                assert not isinstance(r, Exception), r
                roots[i] = r.bonus_token

        for _ in range(5):
            step()
        dev, wall = [], []
        for _ in range(30):
            d0, t0 = device_seconds(), time.perf_counter()
            step()
            wall.append((time.perf_counter() - t0) * 1e3)
            dev.append((device_seconds() - d0) * 1e3)
        print(f"features wanted={bool(want)}: device ms {statistics.median(dev):.3f} [{min(dev):.3f}, {max(dev):.3f}], "
              f"wall ms {statistics.median(wall):.3f} [{min(wall):.3f}, {max(wall):.3f}]", flush=True)
        eng = None   # (its pool freed before the next engine)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])

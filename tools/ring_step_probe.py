"""The target's verify step with its feature-ring store inside the captured step or launched after
it, timed on a GPU (issues 18 and 23; session 26).

    python tools/ring_step_probe.py MODEL [--batch 1,8,64] [--iters 200] [--rounds 2] [--out FILE]

In one machine session the end-to-end sweeps (``benchmarks/gpu/concurrency/run26-ring-in-step``)
showed the target's device time per speculative step 0.12-0.15 ms longer at one stream with the
store inside the step (``kernels.ring.store_rows_meta``) than with the host's launch after it
(``kernels.ring.store_rows``), while AR steps (no ring rows) did not change. This probe runs the
two alone, in child processes alternating ``DFLASH_RING_IN_STEP=1`` / ``0``: a
:class:`target_service.batched_engine.BatchedEngine` on MODEL with five tapped layers (SmolLM2's
5 x 576 feature width for the shipped drafter), ``B`` sessions prefilled and put on the ring,
then ``--iters`` verifies of a 16-node chain each (random guesses: about one accepted row per
item), after 20 of warm-up, while another process maps the ring (``PROBE_MAP=0``: none). Per mode and batch: the median device milliseconds of a step (CUDA
events of :meth:`runtime.graphs.StepGraph.run`), the median wall milliseconds of
``verify_batch``, and the device microseconds of the ring kernels (PyTorch's profiler over 20
replays). Prints a table; ``--out`` writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path[:0] = [".", "proto"]

LAYERS = [1, 8, 15, 22, 29]


def _child(model_path: str, batches: list[int], iters: int) -> dict:
    import random
    import time

    import torch

    from runtime.device_time import device_seconds
    from target_service.batched_engine import BatchedEngine
    from target_service.engine import Sampling
    from target_service.models.llama import LlamaModel

    model = LlamaModel.from_gguf(model_path, device="cuda", dtype=torch.bfloat16)
    layers = [i for i in LAYERS if i < model.cfg.num_layers]
    out = {}
    for b in batches:
        eng = BatchedEngine(model, max_sessions=max(batches), max_context=2048, max_tree_width=16, max_tree_depth=16,
                            feature_layers=layers, batch_buckets=tuple(sorted(set(batches))), ring_rows=64)
        s = Sampling.checked(0.0, 0, 0.0, 0)
        rng = random.Random(1)
        sids = [f"s{i}" for i in range(b)]
        roots = [eng.prefill(sid, [rng.randrange(min(1000, model.cfg.vocab_size)) for _ in range(20)], s, layers).first_token for sid in sids]
        assert eng.ring_features(sids) == b
        eng.capture()
        mapper = None
        if os.environ.get("PROBE_MAP", "1") == "1":   # another process maps the ring (as the draft service does)
            code = ("import sys; sys.path[:0] = ['.', 'proto']; import time, torch; "
                    "from dflash_grpc.v1 import common_pb2; from runtime.feature_ring import FeatureRing; "
                    "r = FeatureRing.open(common_pb2.FeatureRing.FromString(sys.stdin.buffer.read()), torch.device('cuda', 0)); "
                    "print('mapped', flush=True); time.sleep(600)")
            mapper = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            mapper.stdin.write(eng.ring.descriptor.SerializeToString())
            mapper.stdin.close()
            mapper.stdout.readline()

        def step():
            items = [(sid, [roots[i]] + [rng.randrange(min(1000, model.cfg.vocab_size)) for _ in range(15)], [-1] + list(range(15)))
                     for i, sid in enumerate(sids)]
            res = eng.verify_batch(items)
            for i, r in enumerate(res):
                roots[i] = r.bonus_token

        dev, wall = [], []
        for k in range(20 + iters):
            d0, t0 = device_seconds(), time.perf_counter()
            step()
            if k >= 20:
                wall.append((time.perf_counter() - t0) * 1e3)
                dev.append((device_seconds() - d0) * 1e3)
        kernels: dict[str, float] = {}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if "ring" in e.key or "store" in e.key or "gather" in e.key or "Memcpy" in e.key:
                kernels[e.key[:60]] = round(e.device_time_total / 20, 2) if hasattr(e, "device_time_total") else None
        out[b] = {"device_ms": statistics.median(dev), "wall_ms": statistics.median(wall),
                  "in_step_items": eng.ring_items_in_step, "kernels_us": kernels}
        if mapper is not None:
            mapper.kill()
            mapper.wait()
        eng.release(sids)
        del eng
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    batches = [int(x) for x in a.batch.split(",")]
    if a.child:
        print(json.dumps(_child(a.model, batches, a.iters)))
        return
    runs = []
    for r in range(a.rounds):
        for mode in ("1", "0") if r % 2 == 0 else ("0", "1"):
            env = dict(os.environ, DFLASH_RING_IN_STEP=mode)
            p = subprocess.run([sys.executable, __file__, a.model, "--batch", a.batch, "--iters", str(a.iters), "--child"],
                               env=env, capture_output=True, text=True, check=False)
            if p.returncode:
                print(p.stderr[-3000:], file=sys.stderr)
                raise SystemExit(p.returncode)
            res = json.loads(p.stdout.strip().splitlines()[-1])
            runs.append({"round": r, "in_step": mode == "1", "results": res})
            for b, v in res.items():
                print(f"round {r} in_step={mode} batch {b:>3}: device {v['device_ms']:.3f} ms, wall {v['wall_ms']:.3f} ms, "
                      f"in-step items {v['in_step_items']}, kernels {v['kernels_us']}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "batches": batches, "iters": a.iters, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()

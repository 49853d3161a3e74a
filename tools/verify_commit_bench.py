"""Device time of a target's verify step and of its commit, for an A/B of the step's kernels
(issue 18 goal 3: "commit inside the captured step <= 0.3 ms for 16 nodes on 9B; verify of a
16-node tree <= 1.2x a one-token forward").

    python tools/verify_commit_bench.py --model q35-9b-bf16.gguf [--reps 5] [--json OUT]

One engine (batch bucket 1, width buckets 1 and 16, CUDA graphs), then, ``--reps`` times in turn:
the one-token step (``W = 1``, the autoregressive step), a 16-node chain and a 16-node DDTree-like
tree (``bench.gpu._tree_shape``) verified at batch 1 after a 64-token prompt, CUDA events around
each replayed step (``bench.gpu._Timer``; 30 steps, the first 3 dropped), and the commit of a
16-node chain accepted whole on the spare slot, eager and captured alone as a CUDA graph
(``bench.gpu.commit_timing``). Prints per rep and the median [min, max] over reps; runs on older
checkouts too (copy this file into one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

sys.path[:0] = [".", "proto"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--json", default=None)
    ap.add_argument("--label", default="")
    args = ap.parse_args()

    import torch

    from bench.gpu import _Timer, _tree_shape, commit_timing
    from runtime.gguf_loader import open_gguf
    from target_service.batched_engine import BatchedEngine
    from target_service.engine import Sampling
    from target_service.models import load_model

    dev = torch.device("cuda")
    t0 = time.perf_counter()
    model = load_model(open_gguf(args.model), device=dev, dtype=torch.bfloat16, progress=False)
    engine = BatchedEngine(model, max_sessions=4, max_context=args.max_context, max_tree_width=16, max_tree_depth=15,
                           feature_layers=[], batch_buckets=(1,), width_buckets=(1, 16), max_step_tokens=1024)
    engine.capture(progress=False)
    print(f"loaded and captured in {time.perf_counter() - t0:.1f} s", flush=True)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def verify(parents: list[int], steps: int = 30) -> float:
        root = engine.prefill("v", rand(64), s, []).first_token
        with _Timer(engine) as tm:
            for _ in range(steps):
                res = engine.verify_batch([("v", [root] + rand(len(parents) - 1), parents)])
                root = res[0].bonus_token
        engine.release(["v"])
        return statistics.median(tm.times[3:])

    shapes = {"w1": [-1], "chain16": [-1] + list(range(15)), "tree16": _tree_shape(16)}
    rows: dict[str, list[float]] = {k: [] for k in [*shapes, "commit_eager", "commit_graph"]}
    for rep in range(args.reps):
        for k, parents in shapes.items():
            rows[k].append(verify(parents))
        rows["commit_eager"].append(commit_timing(engine)["median"])
        rows["commit_graph"].append(commit_timing(engine, graph=True)["median"])
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in rows.items()) + " ms", flush=True)
    summary = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} for k, v in rows.items()}
    w1 = summary["w1"]["median"]
    print(f"{args.label} device ms, median [min, max] of {args.reps}:")
    for k, v in summary.items():
        ratio = f"  ({v['median'] / w1:.3f}x W=1)" if k in ("chain16", "tree16") else ""
        print(f"  {k:13s} {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "model": args.model, "device": torch.cuda.get_device_name(),
                       "reps": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()

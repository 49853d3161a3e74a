"""What a prompt's prefill costs on the target's batched engine (GPU), cut as it is now (the last
chunk padded to one replay, ``BatchedEngine.pad_prefill``; with GDN layers, chunks of the finer
exact sizes of ``prefill_sizes``) or as before (chunks of exactly the powers of two, largest first).

    python tools/prefill_probe.py --model TARGET.gguf [--lengths 40,100,150,200,300,500]
                                  [--reps 10] [--out prefill.json]

One engine as the target service builds it (CUDA graphs of every prefill bucket and step shape
captured first), one session at a time: ``prefill`` of a prompt of each length (random tokens),
then ``release``; wall milliseconds per prompt (the engine's own host sync included), median
[min, max] of ``--reps`` after 2 of warm-up, both ways alternating per repetition, plus a
root-only verify step of one session for scale. In the JSON, ``exact_ms`` / ``exact_chunks`` are
"before" and ``padded_ms`` / ``padded_chunks`` "now" (the names of the first run's file). Without
``--model``: a llama of SmolLM2-135M's shapes with a 626-token vocabulary
(``fixtures.tiny_models``' tokenizer; random weights), whose LM head is smaller than SmolLM2's:
pass the real file for the real cost. The tapped layers are those a drafter of 5 target layers
reads (``draft_service.drafter.default_target_layer_ids``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path[:0] = [".", "proto"]

import torch  # noqa: E402


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="target GGUF (default: a SmolLM2-shaped random llama)")
    ap.add_argument("--lengths", default="40,100,150,200,300,500")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", help="JSON results")
    ap.add_argument("--device", default="cuda", help="(cpu: a smoke run of this tool; eager, nothing padded)")
    args = ap.parse_args(argv)
    from target_service.__main__ import build_engine
    from target_service.engine import Sampling

    path = args.model
    if not path:
        from fixtures.tiny_models import write_tiny_llama

        path = os.path.join(tempfile.mkdtemp(), "smollm2-shape.gguf")
        write_tiny_llama(path, vocab=626, hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, tied=True, std=0.02,
                         name="llama with SmolLM2-135M shapes, vocab 626")
    from runtime.gguf_loader import open_gguf

    from draft_service.drafter import default_target_layer_ids

    g = open_gguf(path)
    arch = g.get("general.architecture")
    n_layers = int(g.get(f"{arch}.block_count")) - int(g.get(f"{arch}.nextn_predict_layers", 0) or 0)   # (MTP blocks)
    taps = default_target_layer_ids(n_layers, min(5, n_layers))             # a drafter's 5 layers, as shipped
    eng, _ = build_engine(path, device=args.device, engine="batched", max_sessions=4, feature_layers=taps)
    layers = list(eng.taps)
    # "now": the engine's own chunking (the last chunk padded; with GDN layers, the finer exact
    # buckets); "before": chunks of exactly the powers of two (a subset of the buckets captured)
    now = (eng.pad_prefill, eng.prefill_buckets)
    before = (False, tuple(w for w in eng.prefill_buckets if w & (w - 1) == 0))
    s = Sampling.checked(0.0, 0, 0.0, 0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    vocab = eng.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
        times: dict[bool, list[float]] = {False: [], True: []}
        chunks: dict[bool, list[int]] = {}
        for rep in range(args.reps + 2):
            for pad in (False, True):
                eng.pad_prefill, eng.prefill_buckets = now if pad else before
                sync()
                t0 = time.perf_counter()
                out = eng.prefill("p", prompt, s, layers)
                dt = time.perf_counter() - t0
                eng.release(["p"])
                chunks[pad] = list(out.chunks)
                if rep >= 2:
                    times[pad].append(dt * 1e3)
        row = {"tokens": n, "exact_ms": _stats(times[False]), "padded_ms": _stats(times[True]),
               "exact_chunks": chunks[False], "padded_chunks": chunks[True]}
        rows.append(row)
        print(f"{n:5d} tokens: before {row['exact_ms']['median']:.3f} ms {chunks[False]}  "
              f"now {row['padded_ms']['median']:.3f} ms {chunks[True]}", flush=True)
    tok = eng.prefill("d", [5] * 64, s, layers).first_token
    step = []
    for i in range(args.reps + 2):
        sync()
        t0 = time.perf_counter()
        tok = eng.verify("d", [tok], [-1]).bonus_token
        if i >= 2:
            step.append((time.perf_counter() - t0) * 1e3)
    print(f"one root-only verify step: {statistics.median(step):.3f} ms", flush=True)
    out = {"model": path if args.model else "SmolLM2-shaped random llama", "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
           "rows": rows, "verify_1_ms": _stats(step)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

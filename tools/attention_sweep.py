"""Sweep of the pooled tree attention's launch (GPU; issues 18 and 23).

    python tools/attention_sweep.py [--out FILE.json] [--quick]

``tools/verify_profile.py`` found ``_pool_attention_kernel`` taking a third of a SmolLM2-shaped
verify step at one session (301 of 918 us, 10 us a layer for one query over 200 keys) and 62% at
64 sessions of 8-node trees (1.92 of 3.08 ms). This times :func:`kernels.attention.triton.pool_attention`
on random pools (bfloat16) for decode-like shapes (sessions ``B``, tree nodes ``W``, committed
keys ``L``; query / kv heads and head size of SmolLM2, and of a Qwen3.5-9B full-attention layer)
under each launch of a grid (:data:`kernels.attention.triton.TREE_LAUNCH`: ``BLOCK_N`` keys per
tile, warps, pipeline stages, and ``CHUNK``, the keys per split: more splits at one session are
more programs in flight), each with the splits the engine would use (``ceil((L + W) / CHUNK)``).
Microseconds per call (``tools/sweep_quant.Timer``: a CUDA graph of 20 calls, median of 10 replays). Also checks each
launch's output against the default launch's (max abs difference: the tile size reorders sums).
``s``d in a launch's name is the module's stages (:data:`kernels.attention.triton.TREE_STAGES` for
the tree launch since session 15, Triton's default before).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys

sys.path[:0] = [".", "proto", "tools"]

import torch  # noqa: E402

#: (label, B, W, L, query heads, kv heads, head size)
SHAPES = [("smol 1x1 L200", 1, 1, 200, 9, 3, 64), ("smol 1x16 L200", 1, 16, 200, 9, 3, 64),
          ("smol 1x1 L1000", 1, 1, 1000, 9, 3, 64), ("smol 64x1 L200", 64, 1, 200, 9, 3, 64),
          ("smol 64x8 L200", 64, 8, 200, 9, 3, 64), ("smol 16x16 L500", 16, 16, 500, 9, 3, 64),
          ("9b 1x1 L1000", 1, 1, 1000, 16, 4, 256), ("9b 1x16 L1000", 1, 16, 1000, 16, 4, 256)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer launches")
    ap.add_argument("--nodes-ab", action="store_true",
                    help="only the default launch, with one node per program against the automatic choice "
                         "(kernels.attention.triton.NODES_FROM) and every node count that fits")
    args = ap.parse_args(argv)
    from bench.gpu import _tree_shape
    from kernels.attention import CHUNK
    from kernels.attention import triton as tri
    from runtime.tree import analyze_tree
    from sweep_quant import Timer

    dev = torch.device("cuda")
    timed = Timer(dev, 20, 10)
    grid = {"block_n": (32, 64, 128), "num_warps": (1, 2, 4), "num_stages": (None, 1, 3), "chunk": (64, 128, CHUNK)}
    if args.quick:
        grid = {"block_n": (32, 64), "num_warps": (1, 4), "num_stages": (None,), "chunk": (64, CHUNK)}
    if args.nodes_ab:
        grid = {"nodes": (None, 1, 2, 4, 8)}
    default = dict(tri.TREE_LAUNCH)
    rows = []
    print(f"# {torch.cuda.get_device_name()}: pool_attention, bf16, us per call")
    for label, b, w, L, hq, hkv, d in SHAPES:
        gen = torch.Generator(device=dev).manual_seed(0)
        rows_pool = L + 64
        k = torch.randn(b + 1, rows_pool, hkv, d, generator=gen, device=dev).to(torch.bfloat16)
        v = torch.randn(b + 1, rows_pool, hkv, d, generator=gen, device=dev).to(torch.bfloat16)
        q = torch.randn(b, w, hq, d, generator=gen, device=dev).to(torch.bfloat16)
        parents = _tree_shape(w)
        _, bits = analyze_tree([0] * w, parents, 1, w)
        anc = torch.tensor([bits] * b, dtype=torch.long, device=dev)
        slots = torch.arange(b, device=dev)
        lengths = torch.full((b,), L, device=dev)
        scale = 1.0 / math.sqrt(d)
        results = {}
        ref = None
        base_launch = {"block_n": 64 if d <= 64 else 32, "num_warps": 4, "num_stages": None, "chunk": CHUNK, "nodes": 1}
        launches = [base_launch] + [{**base_launch, **dict(zip(grid, v))} for v in itertools.product(*grid.values())]
        for launch in launches:
            if d > 128 and launch["block_n"] > 32:
                continue
            tri.TREE_LAUNCH.update(launch)
            splits = max(1, math.ceil((L + w) / launch["chunk"]))
            try:
                fn = lambda: tri.pool_attention(q, k, v, slots, lengths, anc, scale, False, splits, 0, splits)  # noqa: E731
                us = timed(lambda i: fn())
                out = fn().float()
            except Exception as e:  # noqa: BLE001 - a launch the compiler refuses: noted
                print(f"#   {label} {launch}: {type(e).__name__}: {str(e)[:100]}")
                continue
            finally:
                tri.TREE_LAUNCH.clear()
                tri.TREE_LAUNCH.update(default)
            ref = out if ref is None else ref    # the default launch runs first
            key = (f"bn{launch['block_n']}-w{launch['num_warps']}-s{launch['num_stages'] or 'd'}-c{launch['chunk']}"
                   f"-n{launch['nodes'] or 'auto'}")
            results[key] = dict(us=us, splits=splits, diff=float((out - ref).abs().max()))
        base_key = f"bn{64 if d <= 64 else 32}-w4-sd-c{CHUNK}-n1"
        best = min(results, key=lambda k_: results[k_]["us"])
        base = results.get(base_key, {}).get("us")
        top = sorted(results, key=lambda k_: results[k_]["us"])[:4]
        print(f"{label}: default {base_key} {base:.1f} us; best {best} {results[best]['us']:.1f} us "
              f"({results[best]['us'] / base:.2f}x); next " + ", ".join(f"{t} {results[t]['us']:.1f}" for t in top[1:]),
              flush=True)
        rows.append(dict(shape=label, b=b, w=w, L=L, hq=hq, hkv=hkv, d=d, default=base_key, results=results))
    # launches good everywhere: the geometric mean of each launch's time over the default's
    common = set.intersection(*(set(r["results"]) for r in rows))
    score = {c: math.exp(statistics.mean(math.log(r["results"][c]["us"] / r["results"][r["default"]]["us"]) for r in rows))
             for c in common}
    print("# best launches over all shapes (geometric mean of time / default):")
    for c in sorted(score, key=score.get)[:8]:
        print(f"#   {c}: {score[c]:.2f}x  " + " ".join(f"{rows[i]['results'][c]['us']:.1f}" for i in range(len(rows))))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(shapes=rows, score=score), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

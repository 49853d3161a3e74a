"""Where a batched verify step's device time goes, by kernel family (GPU; issue 23).

    python tools/verify_profile.py --model TARGET.gguf [--shapes 64x1,64x8,16x16] [--context 200]
                                   [--tree] [--weights quantized] [--out FILE.json]

Under load the target's verify of every request's tree is the largest device part of a tick (an
H100 at 64 streams with the shipped SmolLM2 pair: 3.1 ms against 1.15 for a plain tick of the same
requests, ``benchmarks/gpu/concurrency/run14-ticks``). This tool builds the batched target engine
(:func:`target_service.__main__.build_engine`, eager: no CUDA graphs, so the profiler sees every
kernel), prefills ``B`` sessions with random prompts of ``--context`` tokens and, per shape ``BxW``
of ``--shapes``, runs one ``verify_batch`` of ``B`` trees of ``W`` nodes (chains; ``--tree``: the
DDTree-shaped tree of ``bench.gpu``) under the PyTorch profiler (:func:`bench.gpu.profile_kernels`:
kernels and device microseconds per family, the top kernels). The verify commits what it accepts,
so every call's trees start at the sessions' current bonus tokens.
"""

from __future__ import annotations

import argparse
import sys

sys.path[:0] = [".", "proto", "tools"]

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--shapes", default="64x1,64x8,16x16", help="BxW: sessions x tree nodes per verify")
    ap.add_argument("--context", type=int, default=200, help="prompt tokens of each session")
    ap.add_argument("--tree", action="store_true", help="DDTree-shaped trees (default chains)")
    ap.add_argument("--weights", choices=("auto", "bf16", "quantized"), default="auto",
                    help="the target's weights (TargetConfig.weights: quantized keeps GGUF blocks)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from bench.gpu import _tree_shape, profile_kernels
    from sweep_quant import write_rows
    from runtime.sampling import Sampling
    from target_service.__main__ import build_engine

    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    most = max(b for b, _ in shapes)
    engine, _ = build_engine(args.model, device="cuda", max_sessions=most + 1, cuda_graphs=False,
                             weights=args.weights)
    vocab = engine.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    greedy = Sampling.checked(0.0, 0, 0.0, 0)
    roots = {}
    for i in range(most):
        sid = f"s{i}"
        prompt = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
        roots[sid] = engine.prefill(sid, prompt, greedy, []).first_token

    rows = []
    print(f"# {torch.cuda.get_device_name()}: {args.model}, prompts of {args.context} tokens, "
          f"{'trees' if args.tree else 'chains'}, eager (no graphs)")
    for b, w in shapes:
        parents = _tree_shape(w) if args.tree else list(range(-1, w - 1))
        sids = [f"s{i}" for i in range(b)]

        def step():
            items = [(sid, [roots[sid]] + torch.randint(0, vocab, (w - 1,), generator=gen).tolist(), parents)
                     for sid in sids]
            for sid, out in zip(sids, engine.verify_batch(items)):
                if isinstance(out, BaseException):
                    raise out
                roots[sid] = out.bonus_token

        prof = profile_kernels(step)
        fams = ", ".join(f"{k} {v['count']}x {v['us']:.0f}" for k, v in prof["families"].items())
        print(f"{b}x{w}: {prof['kernels']} kernels, {prof['device_us']:.0f} us: {fams}")
        for t in prof["top"][:6]:
            print(f"    {t['us']:8.1f} us  {t['count']:4d}x  {t['name']}")
        rows.append(dict(batch=b, width=w, **prof))
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

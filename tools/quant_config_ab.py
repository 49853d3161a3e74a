"""Before / after of the quantized skinny path's code reads on a GPU (issue 19): per weight shape and
type, microseconds per call at ``M`` = 1 and 16 of the byte gathers (``WORD_LOADS`` off, the launch
rule of ``kernels.quant.triton.config_for``) against whole-word reads (``WORD_LOADS`` on, the same
rule, and a few other launch configs: ``VARIANTS``), beside the bf16 skinny kernel on a bf16 weight
of the same shape and a copy of the quantized bytes.

    python tools/quant_config_ab.py [--out FILE.json]        # on the GPU machine, ~3 min
    python tools/quant_config_ab.py --regs [--out FILE.json] # config_for's launch at each maxnreg of REGS

Timing as ``tools/sweep_quant.py`` (its ``Timer``: a CUDA graph of calls cycling through weight
copies spanning twice the L2 cache, so every call reads its weight from HBM; median of 10 replays).
"""

from __future__ import annotations

import argparse
import json
import sys

sys.path[:0] = [".", "proto", "tools"]

import torch  # noqa: E402

#: (type, N, K): a 9B-shaped Qwen3.5's projections (hidden 4096, FFN 12288) and SmolLM2-135M's
CASES = [("Q4_K", 4096, 4096), ("Q4_K", 12288, 4096), ("Q4_K", 4096, 12288), ("Q5_K", 4096, 4096),
         ("Q6_K", 4096, 4096), ("Q6_K", 4096, 12288), ("Q8_0", 4096, 4096), ("Q8_0", 12288, 4096),
         ("Q8_0", 4096, 12288), ("Q4_1", 960, 576), ("Q4_1", 576, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536),
         ("Q8_0", 49152, 576)]


#: the cases of ``--quick``
QUICK = [("Q4_K", 4096, 4096), ("Q4_K", 12288, 4096), ("Q4_K", 4096, 12288), ("Q6_K", 4096, 12288), ("Q8_0", 4096, 4096),
         ("Q4_1", 3072, 576), ("Q8_0", 49152, 576)]


def variants(n: int, k: int, qtype) -> dict:
    """Launch configs tried with word reads beside ``config_for``'s: ``BLOCK_N`` 16 and 64 with the
    same rule for splitting ``K`` (the fewest splits reaching ``TARGET_PROGRAMS``), 8 warps, 2 and 4
    stages (each only where it fits ``K``)."""
    import dataclasses

    from kernels.quant import triton as T

    from kernels.quant.weight import stride_for

    base = T.config_for(n, k, qtype, stride_for(qtype))   # (sweep_quant.cold_weights: the loader's stride)
    out = {}
    for bn in (16, 64, 128):
        out[f"bn{bn}"] = dataclasses.replace(base, block_n=bn, split_k=T.split_k_for(n, k, qtype, bn))
    out["w8"] = dataclasses.replace(base, num_warps=8)
    out["w2"] = dataclasses.replace(base, num_warps=2)
    out["bn64-w2"] = dataclasses.replace(out["bn64"], num_warps=2)
    out["st2"] = dataclasses.replace(base, num_stages=2)
    out["st4"] = dataclasses.replace(base, num_stages=4)
    return {name: c for name, c in out.items() if c.fits(k, qtype)}


def sweep_grid(n: int, k: int, qtype) -> dict:
    """``--sweep``: swapped-dot launch configs around ``config_for``'s: (``BLOCK_N``, warps) of
    (16, 1), (32, 1), (32, 2), (64, 2), (64, 4), ``maxnreg`` None or 128, ``unroll`` 1 or 2, and the
    split of ``K`` by the rule or twice it (each only where it fits ``K``)."""
    from kernels.quant import triton as T

    fits = T.split_candidates(k, qtype, 4 * T.MAX_SPLIT_K)
    out = {}
    for bn, w in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4)):
        rule = T.split_k_for(n, k, qtype, bn)
        for split in sorted({rule, min((s for s in fits if s >= 2 * rule), default=rule)}):
            for reg in (None, 128):
                for un in (1, 2):
                    c = T.Config(bn, w, 3, un, split, reg)
                    if c.fits(k, qtype):
                        out[f"bn{bn}-w{w}-s{split}-u{un}-r{reg or 0}"] = c
    return out


#: ``--regs``: registers per thread tried on ``config_for``'s launch (``None``: the compiler's choice;
#: ``tools/quant_sass.py`` offline: Q4_K 4096 x 4096 takes 103, 80 spills 48 B, 64 spills 216 B)
REGS = (None, 96, 88, 80, 72, 64)


def run_regs(timer, dev, sq, T, cases) -> list:
    """``--regs``: ``config_for``'s launch (the swapped dot, word reads: the defaults) with each
    ``maxnreg`` of :data:`REGS`, at M = 1, 4 and 16; prints us per call and the ratio to the
    compiler's choice."""
    import dataclasses

    rows = []
    for name, n, k in cases:
        w0, ws, calls = sq.cold_weights(name, n, k, dev)
        base = T.config_for(n, k, name, w0.block_stride)
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            got = {}
            for reg in REGS:
                c = dataclasses.replace(base, maxnreg=reg)
                try:
                    got[reg or 0] = timer(lambda i: T.linear(x, ws[i % len(ws)], config=c), calls)
                except Exception as e:  # a config the compiler refuses: noted, not fatal
                    print(f"# {name} {n}x{k} maxnreg {reg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            ref = got.get(0)
            print(f"| {name} | {n} x {k} | {m} | " + " | ".join(
                f"{got[r or 0]:.1f} ({got[r or 0] / ref:.2f}x)" if (r or 0) in got and ref else "-" for r in REGS) + " |",
                flush=True)
            rows.append(dict(type=name, n=n, k=k, m=m, config=str(base), us={str(r): v for r, v in got.items()}))
    return rows


def run_sweep(timer, dev, sq, T, cases) -> list:
    """Time :func:`sweep_grid` with the swapped dot at M = 1 and 16; print the five best per case."""
    rows = []
    for name, n, k in cases:
        w0, ws, calls = sq.cold_weights(name, n, k, dev)
        grid = sweep_grid(n, k, name)
        for m in (1, 16):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            got = {"default": timer(lambda i: T.linear(x, ws[i % len(ws)]), calls)}
            for label, c in grid.items():
                try:
                    got[label] = timer(lambda i: T.linear(x, ws[i % len(ws)], config=c), calls)
                except Exception as e:  # a config the compiler refuses: noted, not fatal
                    print(f"# {name} {n}x{k} {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            best = sorted(got, key=got.get)[:5]
            print(f"| {name} | {n} x {k} | {m} | {got['default']:.1f} | " + ", ".join(f"{b} {got[b]:.1f}" for b in best) + " |",
                  flush=True)
            rows.append(dict(type=name, n=n, k=k, m=m, us=got, configs={lb: str(c) for lb, c in grid.items()}))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="only the 9B-shaped Q4_K / Q6_K / Q8_0 cases and two SmolLM2 ones")
    p.add_argument("--sweep", action="store_true", help="time sweep_grid's swapped-dot configs on the --quick cases")
    p.add_argument("--regs", action="store_true", help="time config_for's launch with each maxnreg of REGS on the --quick cases")
    args = p.parse_args()
    import sweep_quant as sq

    from kernels.linear import triton as LT
    from kernels.quant import reference as R
    from kernels.quant import triton as T

    dev = torch.device("cuda")
    timer = sq.Timer(dev, 20, 10)
    rows = []
    if args.regs:
        print(f"# {torch.cuda.get_device_name(0)}: us per call (x the compiler's choice), config_for's launch, maxnreg =")
        print("| type | N x K | M | " + " | ".join(str(r or "default") for r in REGS) + " |")
        print("|---|---|---|" + "---|" * len(REGS))
        rows = run_regs(timer, dev, sq, T, QUICK)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if args.sweep:
        print(f"# {torch.cuda.get_device_name(0)}: us per call, swapped dot; the five best configs")
        print("| type | N x K | M | default us | best |")
        print("|---|---|---|---|---|")
        rows = run_sweep(timer, dev, sq, T, QUICK)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    print(f"# {torch.cuda.get_device_name(0)}: us per call (GB/s of the quantized bytes)")
    print("| type | N x K | M | MiB | copy us | bf16 us | bytes us | words us | words, swapped dot us | words / bytes | "
          "best variant | best us | best / bf16 | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, n, k in (QUICK if args.quick else CASES):
        w0, ws, calls = sq.cold_weights(name, n, k, dev)
        wb = [torch.randn(n, k, device=dev).to(torch.bfloat16) for _ in range(max(2, -(-2 * sq.L2_BYTES // (n * k * 2))))]
        src = [w.data for w in ws]
        dst = torch.empty_like(src[0])
        copy = timer(lambda i: dst.copy_(src[i % len(src)]), calls)
        cfg = T.config_for(n, k, name, ws[0].block_stride)
        for m in (1, 16):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            bf = timer(lambda i: LT.linear(x, wb[i % len(wb)]), calls)
            T.WORD_LOADS, T.SWAP_AB = False, False
            before = timer(lambda i: T.linear(x, ws[i % len(ws)], config=cfg), calls)
            T.WORD_LOADS = True
            after = timer(lambda i: T.linear(x, ws[i % len(ws)], config=cfg), calls)
            tried = {"default": after}
            for label, c in variants(n, k, name).items():
                tried[label] = timer(lambda i: T.linear(x, ws[i % len(ws)], config=c), calls)
            T.SWAP_AB = True
            swap = timer(lambda i: T.linear(x, ws[i % len(ws)], config=cfg), calls)
            tried["swap"] = swap
            for label, c in variants(n, k, name).items():
                tried["swap-" + label] = timer(lambda i: T.linear(x, ws[i % len(ws)], config=c), calls)
            T.SWAP_AB = False
            best = min(tried, key=tried.get)
            err = sq.rel(T.linear(x, w0, torch.float32), R.linear(x, w0, torch.float32))
            rows.append(dict(type=name, n=n, k=k, m=m, mib=w0.nbytes / 2**20, copy_us=copy, bf16_us=bf, bytes_us=before,
                             words_us=after, swap_us=swap, config=str(cfg), variants_us=tried,
                             variants={lb: str(c) for lb, c in variants(n, k, name).items()}, rel_err=err))
            print(f"| {name} | {n} x {k} | {m} | {w0.nbytes / 2**20:.2f} | {copy:.1f} | {bf:.1f} | {before:.1f} | "
                  f"{after:.1f} ({w0.nbytes / after / 1e3:.0f} GB/s) | {swap:.1f} | {after / before:.2f}x | {best} | "
                  f"{tried[best]:.1f} | {tried[best] / bf:.2f}x | {err:.1e} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

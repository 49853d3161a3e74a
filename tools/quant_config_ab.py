"""Before / after of the quantized skinny path's launch rule on a GPU (issue 19): per weight shape and
type, microseconds per call at ``M`` = 1 and 16 of the previous rule (``BLOCK_N`` 16, 2 stages, the
legacy types unrolled and split 2-3 ways only at SmolLM2's sizes, the group sums of ``x`` as a
reduction) against today's ``kernels.quant.triton.config_for`` with ``BIAS_DOT``, beside the bf16
skinny kernel on a bf16 weight of the same shape and a copy of the quantized bytes.

    python tools/quant_config_ab.py [--out FILE.json]        # on the GPU machine, ~2 min

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


def previous_rule(n: int, k: int, qtype):
    """The launch rule before this change (commit 2522c1a's ``config_for``)."""
    from gguf.constants import GGML_QUANT_SIZES

    from kernels.quant import triton as T
    from kernels.quant.weight import as_qtype

    qt = as_qtype(qtype)
    qk = GGML_QUANT_SIZES[qt][0]
    bn = 16 if n <= 4096 else (32 if n <= 16384 else 64)
    if qk != 32:
        return T.Config(bn, 4, 2, 1, 1)
    blocks = k // qk
    split = next((s for s in ((3, 2) if n <= 1024 else (2,) if n <= 3072 else ()) if blocks % s == 0 and blocks // s >= 4), 1)
    unroll = T._largest_divisor(blocks // split, T.MAX_UNROLLED // (bn * 32))
    return T.Config(bn, 4, 2, unroll, split)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import sweep_quant as sq

    from kernels.linear import triton as LT
    from kernels.quant import reference as R
    from kernels.quant import triton as T

    dev = torch.device("cuda")
    timer = sq.Timer(dev, 20, 10)
    rows = []
    print(f"# {torch.cuda.get_device_name(0)}: us per call (GB/s of the quantized bytes)")
    print("| type | N x K | M | MiB | copy us | bf16 us | previous us | now us | now / previous | now / bf16 | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, n, k in CASES:
        w0 = sq.random_weight(name, n, k, dev)
        ws = [sq.random_weight(name, n, k, dev, seed=i) for i in range(max(2, -(-2 * sq.L2_BYTES // w0.nbytes)))]
        wb = [torch.randn(n, k, device=dev).to(torch.bfloat16) for _ in range(max(2, -(-2 * sq.L2_BYTES // (n * k * 2))))]
        calls = max(20, len(ws))
        src = [w.data for w in ws]
        dst = torch.empty_like(src[0])
        copy = timer(lambda i: dst.copy_(src[i % len(src)]), calls)
        old, new = previous_rule(n, k, name), T.config_for(n, k, name)
        for m in (1, 16):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            bf = timer(lambda i: LT.linear(x, wb[i % len(wb)]), calls)
            T.BIAS_DOT = False
            before = timer(lambda i: T.linear(x, ws[i % len(ws)], config=old), calls)
            T.BIAS_DOT = True
            after = timer(lambda i: T.linear(x, ws[i % len(ws)], config=new), calls)
            err = sq.rel(T.linear(x, w0, torch.float32), R.linear(x, w0, torch.float32))
            rows.append(dict(type=name, n=n, k=k, m=m, mib=w0.nbytes / 2**20, copy_us=copy, bf16_us=bf, previous_us=before,
                             now_us=after, previous=str(old), now=str(new), rel_err=err))
            print(f"| {name} | {n} x {k} | {m} | {w0.nbytes / 2**20:.2f} | {copy:.1f} | {bf:.1f} | {before:.1f} | "
                  f"{after:.1f} ({w0.nbytes / after / 1e3:.0f} GB/s) | {after / before:.2f}x | {after / bf:.2f}x | {err:.1e} |",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

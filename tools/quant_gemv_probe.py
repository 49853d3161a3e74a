"""Probe (issue 19): how fast can a one-row Q4_K product be on the CUDA cores instead of the tensor cores?

    python tools/quant_gemv_probe.py [--out FILE.json]      # on the GPU machine, ~1-2 min
    python tools/quant_gemv_probe.py --smoke                # CPU self-test (TRITON_INTERPRET=1)

The skinny path (:mod:`kernels.quant.triton`) runs every group of 32 codes as a small tensor-core
dot padded to 16 rows of ``x``; Nsight Compute found it latency-bound (25% occupancy, 103
registers), 18 us for a Q4_K 4096 x 4096 product at one row, where a bf16 weight of 3.6x the
bytes takes 11 us. This probe times the other way at ``M`` = 1, a GEMV on the CUDA cores
(:func:`_q4k_gemv_kernel`): per program ``BLOCK_N`` weight rows over ``K / SPLIT_K``; per
super-block the 128 code bytes read as four ``[BLOCK_N, 8]`` tiles of 32-bit words (one per
pair of sub-blocks), each word's four codes of a sub-block multiplied by the four ``x`` values
they meet (float32 FMAs), summed per sub-block and scaled as gguf-py's formula factors it
(``(d * sc) * sum(q x) - (dmin * m) * sum(x)``). Nothing in the engine calls it: it is timed
beside the engine's kernel (:func:`kernels.quant.triton.linear`, its default launch) on the
same weight copies (``tools/sweep_quant.Timer``: a CUDA graph cycling through copies spanning twice
the L2, median of 10 replays) and checked against ``kernels.quant.reference.linear`` (relative
error, float32 output). If it is much faster, the next step is a version whose rows keep their
bits whatever ``M`` is (the engine's lossless rule: a 16-row verify gives each row the bits of a
one-row decode), which this one-row probe does not have to keep.
"""

from __future__ import annotations

import sys

sys.path[:0] = [".", "proto", "tools"]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.quant.triton import _f16w, _k_scale_min, _split_sum_kernel  # noqa: E402

#: bytes of a Q4_K super-block (256 elements)
Q4K_BS = 144


@triton.jit
def _q4k_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, swn, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """``y[n] = sum_k dequant(w)[n, k] * x[k]`` for one row ``x`` (bf16/f16/f32) and a Q4_K weight
    (uint8 ``[N, K / 256 * 144]``); with ``SPLIT_K`` > 1, ``y_ptr`` is the float32 scratch
    ``[SPLIT_K, N]`` of partial sums."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn
    i8 = tl.arange(0, 8)
    nb = K // 256 // SPLIT_K
    b0 = tl.program_id(1) * nb
    acc = tl.zeros([BLOCK_N], tl.float32)
    for b in range(b0, b0 + nb):
        blk = row + b * 144
        d = _f16w(blk)
        dm = _f16w(blk + 2)
        kb = b * 256
        for c in tl.static_range(4):
            words = tl.load((blk + 16 + 32 * c).to(tl.pointer_type(tl.int32))[:, None] + i8[None, :])   # [BLOCK_N, 8]
            for hi in tl.static_range(2):
                s = 2 * c + hi
                part = tl.zeros([BLOCK_N, 8], tl.float32)
                xsum = tl.zeros([8], tl.float32)
                for t in tl.static_range(4):
                    # byte t of word i holds element 4 i + t of sub-blocks 2c (low nibble) and 2c + 1 (high)
                    xv = tl.load(x_ptr + kb + 32 * s + 4 * i8 + t).to(tl.float32)
                    q = ((words >> (8 * t + 4 * hi)) & 15).to(tl.float32)
                    part += q * xv[None, :]
                    xsum += xv
                scale, bias = _k_scale_min(blk, s, d, dm)
                acc += scale * tl.sum(part, axis=1) + bias * tl.sum(xsum, axis=0)
    if SPLIT_K > 1:
        y_ptr += tl.program_id(1).to(tl.int64) * N
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


def q4k_gemv(x: torch.Tensor, w, block_n: int = 32, num_warps: int = 2, split_k: int = 1,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` ``[K]`` or ``[1, K]`` times a Q4_K :class:`~kernels.quant.weight.QuantizedWeight` ``[N, K]``
    -> ``[1, N]`` (``out_dtype``, default ``x``'s). Raises ValueError for another type or shape."""
    n, k = w.shape
    if w.qtype.name != "Q4_K" or x.numel() != k or k % (256 * split_k):
        raise ValueError("a Q4_K weight, one row of K values, K / 256 a multiple of split_k")
    x1 = x.reshape(-1).contiguous()
    y = torch.empty(1, n, device=x.device, dtype=out_dtype or x.dtype)
    grid = (triton.cdiv(n, block_n), split_k)
    data = w.data
    if split_k > 1:
        part = torch.empty(split_k, n, device=x.device, dtype=torch.float32)
        _q4k_gemv_kernel[grid](x1, data, part, n, k, data.stride(0), BLOCK_N=block_n, SPLIT_K=split_k, num_warps=num_warps)
        _split_sum_kernel[(triton.cdiv(n, 1024),)](part, y, n, SPLIT_K=split_k, BLOCK=1024, num_warps=4)
    else:
        _q4k_gemv_kernel[grid](x1, data, y, n, k, data.stride(0), BLOCK_N=block_n, SPLIT_K=1, num_warps=num_warps)
    return y


#: (N, K): the 9B-shaped projections of tools/quant_config_ab.py's --quick Q4_K cases
CASES = [(4096, 4096), (12288, 4096), (4096, 12288)]


def configs(n: int, k: int) -> dict:
    """``(BLOCK_N, warps, split_k)`` tried: BLOCK_N 8-64, 1-4 warps, K split to about 512-2048 programs."""
    import sweep_quant as sq

    return sq.probe_launches(n, k, (8, 16, 32, 64), (1, 2, 4), (512, 1024, 2048))


def main() -> int:
    import sweep_quant as sq

    a = sq.probe_args(__doc__)

    from kernels.quant import reference as R
    from kernels.quant import triton as T

    if a.smoke:
        sq.probe_smoke(q4k_gemv, torch.randn(1, 512), ((16, 1, 1), (32, 2, 2)), 1e-5)
        return 0
    dev = torch.device("cuda")
    timer = sq.Timer(dev, 20, 10)
    rows = []
    print(f"# {torch.cuda.get_device_name(0)}: Q4_K, one row of x (bf16), us per call")
    print("| N x K | MiB | copy us | engine skinny (tensor cores) us | GEMV best us | best config | GEMV / engine | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for n, k in CASES:
        w0, ws, calls = sq.cold_weights("Q4_K", n, k, dev)
        copy = sq.copy_us(ws, timer, calls)
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        engine = timer(lambda i: T.linear(x, ws[i % len(ws)]), calls)
        got = sq.time_launches(timer, calls, configs(n, k), lambda i, bn, nw, split: q4k_gemv(x, ws[i % len(ws)], bn, nw, split),
                               f"{n}x{k}")
        best = min(got, key=got.get)
        bn, nw, split = configs(n, k)[best]
        err = sq.rel(q4k_gemv(x, w0, bn, nw, split, torch.float32), R.linear(x, w0, torch.float32))
        print(f"| {n} x {k} | {w0.nbytes / 2**20:.2f} | {copy:.1f} | {engine:.1f} | {got[best]:.1f} | {best} | "
              f"{got[best] / engine:.2f}x | {err:.1e} |", flush=True)
        rows.append(dict(n=n, k=k, mib=w0.nbytes / 2**20, copy_us=copy, engine_us=engine, gemv_us=got, rel_err=err))
    sq.write_rows(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

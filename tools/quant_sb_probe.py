"""Probe (issue 19): a Q4_K skinny kernel with two deep tensor-core dots per super-block instead of one small dot per group.

    python tools/quant_sb_probe.py [--out FILE.json]      # on the GPU machine, ~1-2 min
    python tools/quant_sb_probe.py --smoke                # CPU self-test (TRITON_INTERPRET=1)

The engine's skinny path (:mod:`kernels.quant.triton`) runs each 32-element group of a Q4_K
super-block as its own small dot, then scales it (``d * sc``) and adds the min term (``dmin *
m * sum(x)``) into the accumulator: 8 dots, 8 min dots and 16 rescales of the accumulator per
super-block, a latency-bound chain at 25% occupancy (``benchmarks/gpu/quant/run6``, run7's README:
"the next attempt has to change the per-group structure itself"). Here
(:func:`_q4k_sb_kernel`) a super-block is two halves, its low nibbles (groups 0, 2, 4, 6) and its
high ones (1, 3, 5, 7), each one dot of depth 128 chained into the super-block's accumulator:

* the codes multiplied by their group's 6-bit scale, ``sc * q`` (integers 0..945), are exact in
  float16 (11 significant bits), and so is ``x`` converted from bfloat16 (8 significant bits)
  within float16's range: ``acc_s += dot(sc * q, x)`` has exact products and a float32 sum (each
  byte's scale comes from a dot of the scales with a one-hot chunk matrix: exact);
* the min term: the group sums of ``x`` (a dot of the one-hot matrix with ``x``), then
  ``acc_m += dot(m, sums)`` in float32;
* ``acc += d * acc_s - dmin * acc_m`` once per super-block (gguf-py's formula, ``w = d * sc * q -
  dmin * m``, factored).

The codes come as whole words (as the engine's ``WORD_LOADS``) and split into nibbles in registers,
in an order that keeps each word's bytes together; ``x`` is read in the same order. Its rows keep
their bits whatever ``M`` is (one launch configuration per shape, rows never mixed), which the
probe checks: a 16-row call's rows equal 1-row calls bit for bit. Not lossless-safe as it stands
for ``|x|`` over float16's 65504 (it would overflow to infinity): that is a known limit of this
probe, which the engine would have to handle before taking it.

Timed beside the engine's kernel (:func:`kernels.quant.triton.linear`, its default launch) on the
same weight copies (``tools/sweep_quant.Timer``: a CUDA graph cycling through copies spanning
twice the L2, median of 10 replays), at 1 and 16 rows of ``x``, and checked against
``kernels.quant.reference.linear`` (relative error, float32 output). Nothing in the engine calls it.
"""

from __future__ import annotations

import sys

sys.path[:0] = [".", "proto", "tools"]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.linear.triton import _tile  # noqa: E402
from kernels.quant.triton import _bytes_w, _f16w, _split_sum_kernel  # noqa: E402

#: bytes of a Q4_K super-block (256 elements)
Q4K_BS = 144
#: rows of ``x`` per program (the tensor-core tile), as the engine's skinny path
BLOCK_M = 16


@triton.jit
def _q4k_sb_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """``y = x @ dequant(w)^T`` for a Q4_K weight (uint8 ``[N, K / 256 * 144]``), one program per
    (``BLOCK_N`` features, ``BLOCK_M`` rows, ``K / SPLIT_K`` range); with ``SPLIT_K`` > 1 ``y_ptr``
    is the float32 scratch ``[SPLIT_K, M, N]``. Accumulator transposed, ``[BLOCK_N, BLOCK_M]``."""
    rn, rm, _, mm = _tile(M, N, BLOCK_M, BLOCK_N)
    row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * swn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    col = tl.arange(0, 16)                       # a group's column of the scale tiles (0..3 used)
    j = tl.arange(0, 128)                        # byte j of the 128 code bytes
    onehot = ((j // 32)[:, None] == col[None, :]).to(tl.float16)              # [128, 16]: byte j in chunk c
    used = col < 4
    nb = K // 256 // SPLIT_K
    b0 = tl.program_id(1) * nb
    for b in range(b0, b0 + nb):
        blk = row + b * 144
        d = _f16w(blk)
        dmin = _f16w(blk + 2)
        by = _bytes_w(blk + 16, 32)                                            # [BLOCK_N, 128] code bytes
        acc_s = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_m = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for h in tl.static_range(2):             # low nibbles: groups 0, 2, 4, 6; high: 1, 3, 5, 7
            gg = tl.where(used, 2 * col + h, 0)  # the group of column c
            low = gg < 4
            # get_scale_min_k4 of the 4 groups: bytes A, B, C of the 12 at byte 4
            a = tl.load(blk[:, None] + 4 + tl.where(low, gg, gg + 4)[None, :]).to(tl.int32)
            bb = tl.load(blk[:, None] + 4 + tl.where(low, gg + 4, gg - 4)[None, :]).to(tl.int32)
            c = tl.load(blk[:, None] + 4 + gg[None, :]).to(tl.int32)
            sc = tl.where(low[None, :], a & 63, (a & 15) | ((bb >> 6) << 4))   # [BLOCK_N, 16]
            mn = tl.where(low[None, :], bb & 63, (a >> 4) | ((c >> 6) << 4))
            sc = tl.where(used[None, :], sc, 0)
            mn = tl.where(used[None, :], mn, 0)
            # each byte's scale: a dot with the one-hot chunk matrix (small integers: exact)
            scp = tl.dot(sc.to(tl.float16), tl.trans(onehot), out_dtype=tl.float32)   # [BLOCK_N, 128]
            q = (by >> (4 * h)) & 15
            wq = (q.to(tl.float32) * scp).to(tl.float16)                      # sc * q <= 945: exact
            elem = (j // 32) * 64 + h * 32 + j % 32
            xt = tl.load(x_ptr + (b * 256 + elem)[:, None] + rm[None, :] * sxm, mask=mm[None, :], other=0.0)
            xh = xt.to(tl.float16)                                             # [128, BLOCK_M]
            acc_s = tl.dot(wq, xh, acc_s)
            xs = tl.dot(tl.trans(onehot), xh, out_dtype=tl.float32)            # [16, BLOCK_M] group sums of x
            acc_m += tl.dot(mn.to(tl.float32), xs, input_precision="ieee")
        acc += d[:, None] * acc_s - dmin[:, None] * acc_m
    if SPLIT_K > 1:
        y_ptr += tl.program_id(1).to(tl.int64) * M * sym
    tl.store(y_ptr + rm[None, :] * sym + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=mm[None, :] & (rn < N)[:, None])


def q4k_sb(x: torch.Tensor, w, block_n: int = 32, num_warps: int = 4, split_k: int = 1,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (``M`` <= 64) times a Q4_K :class:`~kernels.quant.weight.QuantizedWeight`
    ``[N, K]`` -> ``[M, N]`` (``out_dtype``, default ``x``'s). Raises ValueError for another type or
    shape."""
    n, k = w.shape
    if w.qtype.name != "Q4_K" or x.shape[-1] != k or k % (256 * split_k):
        raise ValueError("a Q4_K weight, rows of K values, K / 256 a multiple of split_k")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    grid = (triton.cdiv(n, block_n) * triton.cdiv(m, BLOCK_M), split_k)
    data = w.data
    if split_k > 1:
        part = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
        _q4k_sb_kernel[grid](x2, data, part, m, n, k, x2.stride(0), data.stride(0), n, BLOCK_M=BLOCK_M,
                             BLOCK_N=block_n, SPLIT_K=split_k, num_warps=num_warps)
        _split_sum_kernel[(triton.cdiv(m * n, 1024),)](part, y, m * n, SPLIT_K=split_k, BLOCK=1024, num_warps=4)
    else:
        _q4k_sb_kernel[grid](x2, data, y, m, n, k, x2.stride(0), data.stride(0), y.stride(0), BLOCK_M=BLOCK_M,
                             BLOCK_N=block_n, SPLIT_K=1, num_warps=num_warps)
    return y


#: (N, K): the 9B-shaped projections of tools/quant_config_ab.py's --quick Q4_K cases
CASES = [(4096, 4096), (12288, 4096), (4096, 12288)]


def configs(n: int, k: int) -> dict:
    """``(BLOCK_N, warps, split_k)`` tried: BLOCK_N 16-64, 2-8 warps, ``K`` split to about 512-1024 programs."""
    import sweep_quant as sq

    return sq.probe_launches(n, k, (16, 32, 64), (2, 4, 8), (512, 1024))


def main() -> int:
    import sweep_quant as sq

    a = sq.probe_args(__doc__)

    from kernels.quant import reference as R
    from kernels.quant import triton as T

    if a.smoke:
        sq.probe_smoke(q4k_sb, torch.randn(3, 512).to(torch.bfloat16), ((16, 4, 1), (32, 4, 2)), 1e-3)
        return 0
    dev = torch.device("cuda")
    timer = sq.Timer(dev, 20, 10)
    rows = []
    print(f"# {torch.cuda.get_device_name(0)}: Q4_K, x bf16, us per call (M = 1 / M = 16)")
    print("| N x K | MiB | copy us | engine M=1 | probe M=1 | best config | probe / engine M=1 | engine M=16 | probe M=16 "
          "| rel err | rows bit-equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, k in CASES:
        w0, ws, calls = sq.cold_weights("Q4_K", n, k, dev)
        copy = sq.copy_us(ws, timer, calls)
        x1 = torch.randn(1, k, device=dev).to(torch.bfloat16)
        x16 = torch.randn(16, k, device=dev).to(torch.bfloat16)
        engine1 = timer(lambda i: T.linear(x1, ws[i % len(ws)]), calls)
        engine16 = timer(lambda i: T.linear(x16, ws[i % len(ws)]), calls)
        got = sq.time_launches(timer, calls, configs(n, k), lambda i, bn, nw, split: q4k_sb(x1, ws[i % len(ws)], bn, nw, split),
                               f"{n}x{k}")
        if not got:
            print(f"| {n} x {k} | no config compiled |")
            continue
        best = min(got, key=got.get)
        bn, nw, split = configs(n, k)[best]
        p16 = timer(lambda i: q4k_sb(x16, ws[i % len(ws)], bn, nw, split), calls)
        err = sq.rel(q4k_sb(x16, w0, bn, nw, split, torch.float32), R.linear(x16.float(), w0, torch.float32))
        many = q4k_sb(x16, w0, bn, nw, split)
        ones = torch.cat([q4k_sb(x16[i:i + 1], w0, bn, nw, split) for i in range(16)])
        equal = bool(torch.equal(many, ones))
        print(f"| {n} x {k} | {w0.nbytes / 2**20:.2f} | {copy:.1f} | {engine1:.1f} | {got[best]:.1f} | {best} | "
              f"{got[best] / engine1:.2f}x | {engine16:.1f} | {p16:.1f} | {err:.1e} | {equal} |", flush=True)
        rows.append(dict(n=n, k=k, mib=w0.nbytes / 2**20, copy_us=copy, engine_us=engine1, engine16_us=engine16,
                         probe_us=got, probe16_us=p16, best=best, rel_err=err, rows_bit_equal=equal))
    sq.write_rows(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

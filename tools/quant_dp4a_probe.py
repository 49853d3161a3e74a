"""Probe (issue 19): products in exact integer arithmetic (:mod:`kernels.quant.intdot`: Q4_K, Q6_K,
Q4_0, Q4_1, Q8_0), timed beside the generic skinny kernel and (Q4_K) a float32 GEMV.

    python tools/quant_dp4a_probe.py [--out FILE.json]      # on the GPU machine, ~2-4 min
    python tools/quant_dp4a_probe.py --smoke                # CPU self-test (TRITON_INTERPRET=1)
    DP4A_QUICK=1 python tools/quant_dp4a_probe.py           # default launches only (no sweeps), ~1 min
    DP4A_TYPES=Q4_1,Q8_0 python tools/quant_dp4a_probe.py   # only those types' cases
    DP4A_MMA16=1 python tools/quant_dp4a_probe.py           # default launches, but every BLOCK_N x warps of the
                                                            # several-row kernel at M = 16 (the engine's split)

One row of ``x`` (bf16), per case of :data:`CASES`: the engine's generic skinny kernel
(:func:`kernels.quant.triton.linear` with ``INT_DOTS`` empty, its default launch), for Q4_K the float32
GEMV of ``tools/quant_gemv_probe.py`` (best of its launches), and the one-row ``dp4a`` kernel of :mod:`kernels.quant.intdot` (best of 36
launches, and its default launch), ``x``'s split timed apart (:func:`kernels.quant.intdot.split_x`).
Then several rows on the int8 tensor-core kernel (``M`` = 1, 4, 16, best of 12 launches) against
the generic kernel at 16 rows, each row checked bit for bit against one-row ``dp4a`` calls of the
same split. Weights from HBM (``tools/sweep_quant.Timer``: a CUDA graph of calls cycling through
copies spanning twice the L2, median of 10 replays), checked against
``kernels.quant.reference.linear`` (gguf-py's dequantization, float32) and
:func:`kernels.quant.intdot.reference` (the integer arithmetic in torch).
"""

from __future__ import annotations

import sys

sys.path[:0] = [".", "proto", "tools"]

import torch  # noqa: E402

from kernels.quant import intdot  # noqa: E402


def q4k_dp4a(x: torch.Tensor, w, block_n: int = intdot.DP4A_BLOCK_N, num_warps: int = 1, split_k: int | None = None,
             out_dtype: torch.dtype | None = None, planes=None) -> torch.Tensor:
    """One row ``x`` ``[1, K]`` times a Q4_K or Q6_K weight on the ``dp4a`` kernel with this launch -> ``[1, N]``.
    Raises ValueError for another type, shape or a split that does not divide ``K``'s blocks."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError("one row of x, [1, K]")
    y = torch.empty(1, w.shape[0], device=x.device, dtype=out_dtype or x.dtype)
    return intdot.linear(x, w, y, split_k, block_n, num_warps, planes, mma=False)


def q4k_mma(x: torch.Tensor, w, block_n: int = intdot.MMA_BLOCK_N, num_warps: int = 2, split_k: int | None = None,
            out_dtype: torch.dtype | None = None, planes=None) -> torch.Tensor:
    """``x`` ``[M, K]`` times a Q4_K or Q6_K weight on the int8 tensor-core kernel with this launch -> ``[M, N]``."""
    y = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=out_dtype or x.dtype)
    return intdot.linear(x, w, y, split_k, block_n, num_warps, planes, mma=True)


#: (type, N, K): the 9B-shaped projections of tools/quant_config_ab.py's --quick cases (a Q4_K_M file's
#: Q6_K tensors: ``attn_v`` and half the ``ffn_down``), a 9B-shaped Q8_0 one, and SmolLM2-135M's Q4_1
#: shapes (``qkv``, ``gate_up``, ``down``)
CASES = [("Q4_K", 4096, 4096), ("Q4_K", 12288, 4096), ("Q4_K", 4096, 12288), ("Q6_K", 4096, 12288), ("Q6_K", 4096, 4096),
         ("Q8_0", 4096, 4096), ("Q4_1", 960, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536)]


def configs(n: int, k: int) -> dict:
    """``(BLOCK_N, warps, split_k)`` tried at one row: BLOCK_N 8-64, 1-4 warps, K split to about 512-2048 programs."""
    import sweep_quant as sq

    return sq.probe_launches(n, k, (8, 16, 32, 64), (1, 2, 4), (512, 1024, 2048))


def smoke() -> None:
    """CPU (interpreter, ``dp4a`` emulated): both kernels against :func:`kernels.quant.intdot.reference`,
    the several-row kernel's rows equal to one-row calls."""
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    import sweep_quant as sq

    from kernels.quant import reference as R

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 512, generator=g) * torch.logspace(-3, 1, 512)
    for name in intdot.TYPES:
        w = sq.random_weight(name, 40, 512, torch.device("cpu"))
        oracle = intdot.reference(x, w)
        print(f"smoke {name} reference vs gguf-py: rel err {sq.rel(oracle, R.linear(x, w, torch.float32)):.1e}")
        for split in (1, 2):
            ones = torch.cat([q4k_dp4a(x[i : i + 1], w, 16, 1, split, torch.float32) for i in range(3)])
            many = q4k_mma(x, w, 16, 4, split, torch.float32)
            print(f"smoke {name} split {split}: dp4a {sq.rel(ones, oracle):.1e}, mma {sq.rel(many, oracle):.1e} vs "
                  f"reference; rows equal: {torch.equal(many, ones)}")
            assert sq.rel(ones, oracle) < 1e-6 and torch.equal(many, ones)


def main() -> int:
    import sweep_quant as sq

    a = sq.probe_args(__doc__)
    if a.smoke:
        smoke()
        return 0

    from kernels.quant import reference as R
    from kernels.quant import triton as T
    from quant_gemv_probe import configs as gemv_configs
    from quant_gemv_probe import q4k_gemv

    import os

    mma16 = os.environ.get("DP4A_MMA16") == "1"   # one row at its default; several rows: M = 16 only, default split
    quick = os.environ.get("DP4A_QUICK") == "1" or mma16
    T.INT_DOTS = ()         # the generic kernel as the baseline
    only = os.environ.get("DP4A_TYPES")   # e.g. "Q4_1,Q8_0": only those cases
    dev = torch.device("cuda")
    timer = sq.Timer(dev, 20, 10)
    rows = []
    print(f"# {torch.cuda.get_device_name(0)}: Q4_K, one row of x (bf16), us per call (weights from HBM)")
    print("| type | N x K | MiB | copy us | generic skinny us | float GEMV best us | dp4a default us (split) | dp4a best us | best config "
          "| dp4a default / generic | dp4a default / copy | x split us | rel err vs gguf-py | rel err vs reference |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    cases = [c for c in CASES if not only or c[0] in only.split(",")]
    for name, n, k in cases:
        w0, ws, calls = sq.cold_weights(name, n, k, dev)
        copy = sq.copy_us(ws, timer, calls)
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        planes = intdot.split_x(x)
        generic = timer(lambda i: T.linear(x, ws[i % len(ws)]), calls)
        gemv = {} if quick or name != "Q4_K" else sq.time_launches(timer, calls, gemv_configs(n, k),
                                                 lambda i, bn, nw, split: q4k_gemv(x, ws[i % len(ws)], bn, nw, split), f"gemv {n}x{k}")
        default = timer(lambda i: q4k_dp4a(x, ws[i % len(ws)], planes=planes), calls)
        got = {"default": default} if quick else sq.time_launches(timer, calls, configs(n, k),
                               lambda i, bn, nw, split: q4k_dp4a(x, ws[i % len(ws)], bn, nw, split, planes=planes),
                               f"dp4a {n}x{k}")
        split_us = timer(lambda i: intdot.split_x(x), calls)
        best = min(got, key=got.get)
        y = q4k_dp4a(x, w0, out_dtype=torch.float32)
        err = sq.rel(y, R.linear(x, w0, torch.float32))
        err_int = sq.rel(y.cpu(), intdot.reference(x.cpu(), w0, intdot.Planes(*(p.cpu() for p in intdot.split_x(x)))))
        gbest = min(gemv.values()) if gemv else float("nan")
        print(f"| {name} | {n} x {k} | {w0.nbytes / 2**20:.2f} | {copy:.1f} | {generic:.1f} | {gbest:.1f} | {default:.1f} "
              f"({intdot.split_k_for(n, k)}) | {got[best]:.1f} | {best} | {default / generic:.2f}x | {default / copy:.2f}x | "
              f"{split_us:.1f} | {err:.1e} | {err_int:.1e} |", flush=True)
        rows.append(dict(type=name, n=n, k=k, mib=w0.nbytes / 2**20, copy_us=copy, generic_us=generic, gemv_us=gemv, dp4a_us=got,
                         dp4a_default_us=default, split_us=split_us, rel_err=err, rel_err_reference=err_int))
    print()
    print("Several rows on the int8 tensor cores (the same integer sums and epilogue): us per call; rows compared "
          "bit for bit with one-row dp4a calls of the same split")
    print("| type | N x K | generic M=16 us | mma default M=4 us | mma default M=16 us | mma best M=1 / 4 / 16 us | best config at M=16 "
          "| default M=16 / default dp4a M=1 | rows bit-equal to dp4a | rel err M=16 vs gguf-py |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, n, k), r in zip(cases, rows):
        w0, ws, calls = sq.cold_weights(name, n, k, dev)
        launches = sq.probe_launches(n, k, (16, 32, 64), (2, 4), (512, 1024))
        if mma16:   # the engine's split (a row's bits depend on it; BLOCK_N and warps do not: DFLASH_QUANT_MMA_LAUNCH)
            split = intdot.split_k_for(n, k, intdot.block_elems(name))
            launches = {f"bn{bn}-w{w}-s{split}": (bn, w, split) for bn in (16, 32, 64) for w in (1, 2, 4)}
        best_m, default_m = {}, {}
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            planes = intdot.split_x(x)
            default_m[m] = timer(lambda i: q4k_mma(x, ws[i % len(ws)], planes=planes), calls)
            got = {"default": default_m[m]} if quick and not (mma16 and m == 16) else sq.time_launches(
                timer, calls, launches, lambda i, bn, nw, split: q4k_mma(x, ws[i % len(ws)], bn, nw, split, planes=planes),
                f"mma M={m} {n}x{k}")
            got.setdefault("default", default_m[m])
            best_m[m] = (min(got, key=got.get), got)
        x16 = torch.randn(16, k, device=dev).to(torch.bfloat16)
        generic16 = timer(lambda i: T.linear(x16, ws[i % len(ws)]), calls)
        many = q4k_mma(x16, w0, out_dtype=torch.float32)
        ones = torch.cat([q4k_dp4a(x16[i : i + 1], w0, out_dtype=torch.float32) for i in range(16)])
        equal = torch.equal(many, ones)
        err = sq.rel(many, R.linear(x16, w0, torch.float32))
        t = {m: best_m[m][1][best_m[m][0]] for m in best_m}
        print(f"| {name} | {n} x {k} | {generic16:.1f} | {default_m[4]:.1f} | {default_m[16]:.1f} | {t[1]:.1f} / {t[4]:.1f} / {t[16]:.1f} "
              f"| {best_m[16][0]} | {default_m[16] / r['dp4a_default_us']:.2f}x | {'yes' if equal else 'NO'} | {err:.1e} |",
              flush=True)
        r.update(mma_us={m: best_m[m][1] for m in best_m}, mma_default_us=default_m, generic16_us=generic16,
                 mma_rows_equal=equal, mma_rel_err=err)
    sq.write_rows(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

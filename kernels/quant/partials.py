"""The second pass of a split-``K`` launch (:mod:`kernels.quant.triton`, :mod:`kernels.quant.intdot`):
the float32 partial sums of ``SPLIT_K`` programs added in a fixed order, so a row's bits do not
depend on how the first pass was scheduled."""

import triton
import triton.language as tl


@triton.jit
def _split_sum_kernel(p_ptr, y_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """``y[i] = p[0, i] + p[1, i] + ... + p[SPLIT_K - 1, i]`` in that order (float32), rounded
    once to ``y``'s dtype: the partial sums ``[SPLIT_K, M * N]`` of a split-``K`` launch."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.load(p_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * MN + i, mask=mask, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=mask)

"""Linear projections: the skinny Triton kernel on CUDA for at most 64 rows (any number inside
:func:`batch_invariant`), PyTorch otherwise; GGUF block-quantized weights through :mod:`kernels.quant`."""

import contextlib
import threading

import torch

from kernels._select import impl


def linear(x, weight, out_dtype=None):
    """:func:`kernels.linear.reference.linear` (the Triton skinny kernel on CUDA for <= 64 rows).

    ``weight`` may also be a :class:`kernels.quant.QuantizedWeight` (:func:`kernels.quant.linear`:
    the fused dequantize-matmul) or a :class:`kernels.quant.PackedWeight` (each part's product,
    concatenated along the last dim)."""
    if not isinstance(weight, torch.Tensor):
        from kernels import quant

        if isinstance(weight, quant.PackedWeight):
            return torch.cat([linear(x, p, out_dtype) for p in weight.parts], dim=-1)
        return quant.linear(x, weight, out_dtype)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows <= 64:
        return impl("linear", x, weight).linear(x, weight, out_dtype)
    if _INVARIANT.depth:
        mod = impl("linear", x, weight)
        if mod.__name__.endswith(".triton"):
            return mod.linear(x, weight, out_dtype, wide=True)
    from kernels.linear import reference

    return reference.linear(x, weight, out_dtype)


class _Invariant(threading.local):
    depth = 0


_INVARIANT = _Invariant()


@contextlib.contextmanager
def batch_invariant():
    """Within it (on this thread), :func:`linear` keeps every row's bits independent of how many
    rows the call has: past 64 rows the Triton kernel runs in larger tiles with the same
    reduction order (``kernels.linear.triton.wide_config``) instead of cuBLAS, whose kernel choice
    depends on ``M``; quantized weights stay on their skinny path (:func:`kernels.quant.linear`).
    The batched engines' decode and verify steps run in it, so a request's tokens do not depend on
    what else is in its batch or on its tree's width (docs/ARCHITECTURE.md, "Width invariance");
    prefill chunks (cut the same way whatever the load) keep cuBLAS. Where the Triton kernels do
    not run (the CPU), it changes nothing."""
    _INVARIANT.depth += 1
    try:
        yield
    finally:
        _INVARIANT.depth -= 1


def invariant() -> bool:
    """Whether this thread is inside :func:`batch_invariant`."""
    return _INVARIANT.depth > 0


__all__ = ["batch_invariant", "invariant", "linear"]

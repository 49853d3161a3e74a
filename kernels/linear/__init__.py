"""Linear projections: the skinny Triton kernel on CUDA for at most 64 rows, PyTorch otherwise."""

from kernels._select import impl


def linear(x, weight, out_dtype=None, prologue=None):
    """:func:`kernels.linear.reference.linear` (the Triton skinny kernel on CUDA for <= 64 rows).

    ``prologue="swiglu"``: ``x`` is the ``[..., 2K]`` gate|up projection and the result is
    ``linear(kernels.activation.silu_mul(x), weight)``, bit for bit. Where the skinny kernel runs,
    the SwiGLU is fused into it (one launch, no ``[M, K]`` intermediate); elsewhere it is exactly
    that composition (``silu_mul`` picks its own implementation, then the reference projection).
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows <= 64:
        mod = impl("linear", x, weight)
        if prologue is None or mod.__name__ == "kernels.linear.triton":
            return mod.linear(x, weight, out_dtype, prologue)
    from kernels.linear import reference

    if prologue == "swiglu":
        from kernels.activation import silu_mul

        x = silu_mul(x)
    elif prologue is not None:
        raise ValueError(f"prologue {prologue!r}: expected None or 'swiglu'")
    return reference.linear(x, weight, out_dtype)


__all__ = ["linear"]

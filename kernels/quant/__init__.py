"""GGUF block-quantized weights kept as the file's bytes (:class:`QuantizedWeight`) and ``x @ w^T``
on them: the Triton kernels (dequantizing inside the matmul loop) on CUDA, the skinny path for
<= 64 rows and the tiled path for more (prefill), the float32 reference on the CPU."""

import torch

from kernels._select import impl, invariant
from kernels.quant.weight import QTYPES, PackedWeight, QuantizedWeight, as_qtype, block_geometry, pack_rows, weight_nbytes


def linear(x: torch.Tensor, weight: QuantizedWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ dequantize(weight)^T``, ``[..., K]`` -> ``[..., N]`` in ``out_dtype`` (default ``x``'s).

    Where :func:`kernels._select.impl` picks Triton (CUDA, or ``DFLASH_KERNELS=triton``): at most
    64 rows :func:`kernels.quant.triton.linear` (the skinny path: decode, verify, the LM head),
    more rows :func:`kernels.quant.triton.linear_tiled` (the tiled path: prefill), except inside
    :func:`kernels.linear.batch_invariant` (decode and verify steps), where any number of rows
    takes the skinny path, whose rows have the bits of a 1-row call. Elsewhere :func:`kernels.quant.reference.linear` (float32).

    Raises:
        ValueError / TypeError: as the implementations (``K`` mismatch, not a ``QuantizedWeight``).
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    mod = impl("quant", x)
    if rows <= 64 or not hasattr(mod, "linear_tiled"):
        return mod.linear(x, weight, out_dtype)
    if invariant():   # a decode / verify step of more than 64 rows: the skinny path's bits (kernels.linear.batch_invariant)
        return mod.linear(x, weight, out_dtype, wide=True)
    return mod.linear_tiled(x, weight, out_dtype)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`kernels.quant.reference.dequantize` (``[N, K]`` in ``dtype``, any device)."""
    from kernels.quant import reference

    return reference.dequantize(weight, dtype)


def embedding(weight: "torch.Tensor | QuantizedWeight", ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows ``ids`` of an embedding table ``[V, H]`` -> ``[*ids.shape, H]``.

    A float tensor: ``weight[ids]`` (cast to ``dtype`` when given). A :class:`QuantizedWeight`:
    only the looked-up rows' blocks are gathered (``index_select`` on the bytes) and dequantized
    (:func:`kernels.quant.reference.dequantize`, float32 equal to gguf-py's, then rounded once to
    ``dtype``, default float32): the values the loader's dequantize-at-load path gives those rows.
    Plain tensor ops on the device, no host read: safe inside a CUDA graph.

    Raises:
        TypeError: ``weight`` is neither.
    """
    if isinstance(weight, torch.Tensor):
        rows = weight[ids]
        return rows if dtype is None else rows.to(dtype)
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"an embedding must be a tensor or a QuantizedWeight, got {type(weight).__name__}")
    from kernels.quant import reference

    flat = ids.reshape(-1)
    rows = QuantizedWeight(weight.data.index_select(0, flat), weight.qtype, (flat.shape[0], weight.shape[1]))
    return reference.dequantize(rows, dtype or torch.float32).reshape(*ids.shape, weight.shape[1])


__all__ = ["QTYPES", "PackedWeight", "QuantizedWeight", "as_qtype", "block_geometry", "dequantize", "embedding", "linear",
           "pack_rows", "weight_nbytes"]

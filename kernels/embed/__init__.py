"""Embedding lookups of the engines' steps as one launch each (reference in ``reference.py``,
Triton in ``triton.py``, picked per call): :func:`embed_rows` (a step's tokens) and
:func:`embed_block` (a drafter block: each row's root token, then the mask token). A quantized
table (:class:`kernels.quant.QuantizedWeight`) goes through :func:`kernels.quant.embedding`
(its looked-up rows' blocks gathered and dequantized), the float kernels otherwise."""

import torch

from kernels._select import impl
from kernels.embed.reference import block_tokens
from kernels.quant import embedding


def embed_rows(weight, ids, dtype=None):
    """:func:`kernels.embed.reference.embed_rows` (Triton on CUDA); a ``QuantizedWeight``:
    :func:`kernels.quant.embedding`."""
    if not isinstance(weight, torch.Tensor):
        return embedding(weight, ids, dtype)
    return impl("embed", weight).embed_rows(weight, ids, dtype)


def embed_block(weight, roots, mask_id, block, dtype=None):
    """:func:`kernels.embed.reference.embed_block` (Triton on CUDA); a ``QuantizedWeight``:
    :func:`kernels.quant.embedding` of the blocks' tokens."""
    if not isinstance(weight, torch.Tensor):
        return embedding(weight, block_tokens(roots, mask_id, block).reshape(-1), dtype)
    return impl("embed", weight).embed_block(weight, roots, mask_id, block, dtype)


__all__ = ["embed_block", "embed_rows"]

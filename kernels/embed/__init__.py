"""Embedding lookups of the engines' steps as one launch each (reference in ``reference.py``,
Triton in ``triton.py``, picked per call): :func:`embed_rows` (a step's tokens) and
:func:`embed_block` (a drafter block: each row's root token, then the mask token). Float
tables only; a quantized table (:class:`kernels.quant.QuantizedWeight`) goes through
:func:`kernels.quant.embedding`."""

from kernels._select import impl


def embed_rows(weight, ids, dtype=None):
    """:func:`kernels.embed.reference.embed_rows` (Triton on CUDA)."""
    return impl("embed", weight).embed_rows(weight, ids, dtype)


def embed_block(weight, roots, mask_id, block, dtype=None):
    """:func:`kernels.embed.reference.embed_block` (Triton on CUDA)."""
    return impl("embed", weight).embed_block(weight, roots, mask_id, block, dtype)


__all__ = ["embed_block", "embed_rows"]

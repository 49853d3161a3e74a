"""Attention ops: ``tree_attention`` (one session, reference) and ``pool_attention`` (a batch of
trees over the GPU engine's pool: reference in ``reference.py``, Triton in ``triton.py``)."""

from kernels.attention import reference
from kernels.attention.reference import tree_attention
from kernels.dispatch import use_triton


def pool_attention(q, k_pool, v_pool, slots, lengths, ancestors, scale, causal=False, splits=1):
    """:func:`kernels.attention.reference.pool_attention`, run by its Triton version on CUDA
    (``splits``: key-range splits, used by the Triton version only)."""
    if use_triton(q):
        from kernels.attention import triton as tri

        return tri.pool_attention(q, k_pool, v_pool, slots, lengths, ancestors, scale, causal, splits)
    return reference.pool_attention(q, k_pool, v_pool, slots, lengths, ancestors, scale, causal)


__all__ = ["pool_attention", "tree_attention"]

"""Rotary embedding fused with the pool's K/V write (reference in ``reference.py``, Triton in
``triton.py``, picked per call)."""

from kernels._select import impl


def rope_store(q, k, v, cos, sin, k_pool, v_pool, slots, rows, positions=None, table=False):
    """:func:`kernels.rope.reference.rope_store` (Triton on CUDA)."""
    return impl("rope", q).rope_store(q, k, v, cos, sin, k_pool, v_pool, slots, rows, positions, table)


__all__ = ["rope_store"]

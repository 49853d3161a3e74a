"""Attention ops: ``tree_attention`` (one session, reference), ``pool_attention`` (a batch of
trees over the GPU engine's pool: reference in ``reference.py``, Triton in ``triton.py``) and
``pool_kv_commit`` (a verify step's accepted K/V rows moved into place: reference in
``reference.py``, Triton in ``kv_commit.py``)."""

import math

from kernels.attention import reference
from kernels.attention.reference import tree_attention
from kernels.dispatch import use_triton

#: keys per split of the key range in the Triton kernel (fixed absolute chunks, so a query's
#: result does not depend on the step's width; kernels/attention/triton.py)
CHUNK = 256


def default_splits(max_rows: int) -> int:
    """Key-range splits of an engine whose sessions hold at most ``max_rows`` pool rows
    (``max_context + max_width``): one per :data:`CHUNK` keys, the same for every step shape."""
    return max(1, math.ceil(max_rows / CHUNK))


def pool_attention(q, k_pool, v_pool, slots, lengths, ancestors, scale, causal=False, splits=1, window=0):
    """:func:`kernels.attention.reference.pool_attention`, run by its Triton version on CUDA
    (``splits``: key-range splits, used by the Triton version only; ``window``: the sliding
    window of a sliding drafter layer, 0 = none)."""
    if use_triton(q):
        from kernels.attention import triton as tri

        return tri.pool_attention(q, k_pool, v_pool, slots, lengths, ancestors, scale, causal, splits, window)
    return reference.pool_attention(q, k_pool, v_pool, slots, lengths, ancestors, scale, causal, window)


def pool_kv_commit(k_pool, v_pool, slots, lengths, path, n_accept):
    """:func:`kernels.attention.reference.pool_kv_commit` (all attention layers, K and V), run by
    its Triton version (one launch, ``kv_commit.py``) on CUDA."""
    if use_triton(k_pool):
        from kernels.attention import kv_commit

        return kv_commit.pool_kv_commit(k_pool, v_pool, slots, lengths, path, n_accept)
    return reference.pool_kv_commit(k_pool, v_pool, slots, lengths, path, n_accept)


__all__ = ["CHUNK", "default_splits", "pool_attention", "pool_kv_commit", "tree_attention"]

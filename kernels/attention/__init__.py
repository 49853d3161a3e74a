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


#: the fewer-split variants an engine also captures beside its full split count (a step whose
#: rows all see at most ``s * CHUNK`` keys runs with ``s`` splits: fewer programs, no combine for
#: one split, and the same bits as with every split; :func:`split_buckets`)
SPLIT_VARIANTS = (1, 4)


def default_splits(max_rows: int) -> int:
    """Key-range splits of an engine whose sessions hold at most ``max_rows`` pool rows
    (``max_context + max_width``): one per :data:`CHUNK` keys, the same for every step shape."""
    return max(1, math.ceil(max_rows / CHUNK))


def split_buckets(max_splits: int, variants: tuple[int, ...] = SPLIT_VARIANTS) -> tuple[int, ...]:
    """The split counts an engine of ``max_splits`` (:func:`default_splits`) runs steps with:
    the ``variants`` below it, then ``max_splits`` itself (ascending)."""
    return tuple(sorted({s for s in variants if 1 <= s < max_splits} | {max(1, int(max_splits))}))


def splits_for(keys: int, buckets: tuple[int, ...]) -> int:
    """The fewest splits of ``buckets`` whose :data:`CHUNK`-key chunks hold ``keys`` (the most
    keys any query row of the step sees: the longest context plus the width), else the largest.

    With ``s`` splits the last one takes every key from ``(s - 1) * CHUNK`` on, so when no row
    sees more than ``s * CHUNK`` keys each split covers exactly the keys it covers with more
    splits, the splits past a row's keys are empty, and the combine (its block of splits sized by
    the largest count, ``max_splits`` of :func:`pool_attention`) adds the same terms in the same
    order: the result keeps its bits (tests/test_kernels.py checks it on the GPU)."""
    for s in buckets:
        if keys <= s * CHUNK:
            return s
    return buckets[-1]


def pool_attention(q, k_pool, v_pool, slots, lengths, ancestors, scale, causal=False, splits=1, window=0,
                   max_splits=None):
    """:func:`kernels.attention.reference.pool_attention`, run by its Triton version on CUDA
    (``splits``: key-range splits, ``max_splits``: the engine's largest split count, which sizes
    the combine so that fewer splits give the same bits; both used by the Triton version only;
    ``window``: the sliding window of a sliding drafter layer, 0 = none)."""
    if use_triton(q):
        from kernels.attention import triton as tri

        return tri.pool_attention(q, k_pool, v_pool, slots, lengths, ancestors, scale, causal, splits, window,
                                  max_splits)
    return reference.pool_attention(q, k_pool, v_pool, slots, lengths, ancestors, scale, causal, window)


def pool_kv_commit(k_pool, v_pool, slots, lengths, path, n_accept):
    """:func:`kernels.attention.reference.pool_kv_commit` (all attention layers, K and V), run by
    its Triton version (one launch, ``kv_commit.py``) on CUDA."""
    if use_triton(k_pool):
        from kernels.attention import kv_commit

        return kv_commit.pool_kv_commit(k_pool, v_pool, slots, lengths, path, n_accept)
    return reference.pool_kv_commit(k_pool, v_pool, slots, lengths, path, n_accept)


__all__ = ["CHUNK", "SPLIT_VARIANTS", "default_splits", "pool_attention", "pool_kv_commit", "split_buckets", "splits_for",
           "tree_attention"]

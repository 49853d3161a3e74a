"""The feature ring's row copies (runtime.feature_ring; reference in ``reference.py``, Triton in
``triton.py``, picked per call): the target's store of a verify step's committed rows and the
drafter's gather of ring rows into its step's features. Each is one launch on CUDA where the
reference takes three to six PyTorch ops, whose own host work was most of the ring's cost per
step (``benchmarks/gpu/step/run25-ring-probe``: 65-97 us for an ``index_select`` and an
``index_copy_``). Copies only: the Triton path writes the reference's bits."""

from kernels._select import impl


def copy_rows(src, src_rows, dst, dst_rows):
    """:func:`kernels.ring.reference.copy_rows` (Triton on CUDA)."""
    return impl("ring", src, dst).copy_rows(src, src_rows, dst, dst_rows)


def store_rows(table, feats, items, counts, slot_rows, dump):
    """:func:`kernels.ring.reference.store_rows` (Triton on CUDA)."""
    return impl("ring", table, feats).store_rows(table, feats, items, counts, slot_rows, dump)


__all__ = ["copy_rows", "store_rows"]

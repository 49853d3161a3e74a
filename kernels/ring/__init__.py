"""The feature ring's store of a verify step's committed rows (runtime.feature_ring; reference in
``reference.py``, Triton in ``triton.py``, picked per call). One launch on CUDA where the
reference takes six PyTorch ops, whose own host work was most of the store's cost: on an H200,
62 against 334 us of host time per 64-item step, GPU idle (``benchmarks/gpu/step/run25-ring-probe``).
The drafter's gather stays two PyTorch ops (``index_select``, ``index_copy_``): their launches took
less host time there than one Triton launch of a row copy (43 against 95 us). A copy only: the
Triton path writes the reference's bits."""

from kernels._select import impl


def store_rows(table, feats, items, counts, slot_rows, dump):
    """:func:`kernels.ring.reference.store_rows` (Triton on CUDA)."""
    return impl("ring", table, feats).store_rows(table, feats, items, counts, slot_rows, dump)


__all__ = ["store_rows"]

"""The feature ring's device copies (runtime.feature_ring; reference in ``reference.py``, Triton in
``triton.py``, picked per call).

* :func:`store_rows`: the target's store of a verify step's committed rows. One launch on CUDA
  where the reference takes six PyTorch ops, whose own host work was most of the store's cost: on
  an H200, 62 against 334 us of host time per 64-item step, GPU idle
  (``benchmarks/gpu/step/run25-ring-probe``). :func:`store_rows_meta`: the same inside the
  target's captured step, its items and the ring's address in a meta buffer (:func:`store_meta`)
  the step copies in with its inputs: no launch and no index copy on the host.
* :func:`gather_rows`: the drafter's read of a step's ring rows into its features buffer, inside
  the drafter's captured step. The rows to copy and the ring's address come from a small int64
  buffer (:func:`gather_meta`) that the step copies in with its other inputs, so a graph captured
  before any ring was mapped reads whichever ring the step names, and the host launches nothing
  for it. Outside a graph, as two PyTorch ops (``index_select``, ``index_copy_``), the read took
  85-160 us of host time per step on an H200, the GPU idle meanwhile; one Triton launch of it,
  95 us (``run25-ring-probe``).

Copies only: the Triton paths write the references' bits."""

import os

from kernels._select import impl
from kernels.ring.reference import META_HEAD, STORE_HEAD, gather_meta, store_meta


def in_step(kind: str) -> bool:
    """Whether an engine of ``kind`` (``"draft"``: the drafter's gather, ``"target"``: the target's
    store) copies ring rows inside its captured steps (:func:`gather_rows`, :func:`store_rows_meta`;
    the default where the kernels run in Triton). ``DFLASH_RING_IN_STEP``: ``0`` gives both the
    launches from the host around the step instead, ``draft`` or ``target`` keeps only that one
    inside (A/B switches for benchmarks)."""
    return os.environ.get("DFLASH_RING_IN_STEP", "1") in ("1", kind)


def store_rows(table, feats, items, counts, slot_rows, dump):
    """:func:`kernels.ring.reference.store_rows` (Triton on CUDA)."""
    return impl("ring", table, feats).store_rows(table, feats, items, counts, slot_rows, dump)


def store_rows_meta(feats, meta, counts, table=None):
    """:func:`kernels.ring.reference.store_rows_meta` (Triton on CUDA: it writes the table at the
    address ``meta`` holds, of ``feats``' dtype, and ``table`` is not needed)."""
    mod = impl("ring", feats)
    if mod.__name__.endswith("triton"):
        return mod.store_rows_meta(feats, meta, counts)
    return mod.store_rows_meta(feats, meta, counts, table)


def gather_rows(dst, meta, table=None):
    """:func:`kernels.ring.reference.gather_rows` (Triton on CUDA: it reads the table at the
    address ``meta`` holds, which must be of ``dst``'s dtype, and ``table`` is not needed)."""
    mod = impl("ring", dst)
    if mod.__name__.endswith("triton"):
        return mod.gather_rows(dst, meta)
    return mod.gather_rows(dst, meta, table)


__all__ = ["META_HEAD", "STORE_HEAD", "gather_meta", "gather_rows", "in_step", "store_meta", "store_rows",
           "store_rows_meta"]

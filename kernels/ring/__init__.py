"""The feature ring's device copies (runtime.feature_ring; reference in ``reference.py``, Triton in
``triton.py``, picked per call).

* :func:`store_rows`: the target's store of a verify step's committed rows. One launch on CUDA
  where the reference takes six PyTorch ops, whose own host work was most of the store's cost: on
  an H200, 62 against 334 us of host time per 64-item step, GPU idle
  (``benchmarks/gpu/step/run25-ring-probe``). It stays a launch after the target's step: inside
  the step (the items and the ring's address from a meta buffer, as the gather below) it took
  the same device time alone, but through the three services the target's step was 0.13 ms
  longer on the device at one stream and 0.11 at eight (``benchmarks/gpu/concurrency/
  run26-ring-in-step``), for a host launch of about 50 us it saved.
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
from kernels.ring.reference import META_HEAD, gather_meta


def in_step() -> bool:
    """Whether the drafter gathers its ring rows inside its captured step (:func:`gather_rows`, its
    default where the kernels run in Triton); ``DFLASH_RING_IN_STEP=0`` gives the two PyTorch ops
    launched from the host before the step instead (an A/B switch for benchmarks)."""
    return os.environ.get("DFLASH_RING_IN_STEP", "1") != "0"


def gathers_in_step(dst) -> bool:
    """Whether :func:`gather_rows` into ``dst`` runs as the Triton kernel that reads the table's
    address from the meta buffer (so a captured step can hold it) and :func:`in_step` allows it:
    the drafter's runner asks this, so it holds a ring meta buffer exactly where its step's
    :func:`gather_rows` call takes the in-step path (the reference reads the meta on the host,
    which a captured step cannot do)."""
    return in_step() and impl("ring", dst).__name__.endswith("triton")


def store_rows(table, feats, items, counts, slot_rows, dump):
    """:func:`kernels.ring.reference.store_rows` (Triton on CUDA)."""
    return impl("ring", table, feats).store_rows(table, feats, items, counts, slot_rows, dump)


def gather_rows(dst, meta, table=None):
    """:func:`kernels.ring.reference.gather_rows` (Triton on CUDA: it reads the table at the
    address ``meta`` holds, which must be of ``dst``'s dtype, and ``table`` is not needed)."""
    return impl("ring", dst).gather_rows(dst, meta, table)


__all__ = ["META_HEAD", "gather_meta", "gather_rows", "gathers_in_step", "in_step", "store_rows"]

"""The feature ring: the target's feature rows handed to a drafter on the same host through shared
memory, not through the orchestrator (docs/ARCHITECTURE.md, "The feature ring").

Why: every speculative tick the target sends the drafter the features of the rows it committed
(``k + 1`` rows per item, ``len(taps) * hidden`` values each). Through the orchestrator they cross
two sockets and four protobuf (de)serialisations: at 64 streams of the shipped SmolLM2 pair about
1.5 MB a tick each way, 7-23 us of the orchestrator's host time per item and 5-11 of the drafter's
(``benchmarks/cpu-host-per-item/run13-features``). With a ring, the target writes them into a
table the drafter maps, and the messages carry a slot and a row count per item.

Layout: ``slots`` slots of ``slot_rows`` rows (``[slots * slot_rows + 1, width]``; the last row
takes the writes of padding rows). A session's target slot ``s`` is its ring slot, and its
committed position ``p`` has its row at ``s * slot_rows + p % slot_rows``: only that session's
verifies write there, so a client that knows which rows a drafter has not read yet (the
orchestrator: every row between its last Propose and the next) knows when a write would overwrite
them (more than ``slot_rows`` unread rows), without asking anyone.

Kinds: ``cuda-ipc`` (the table in GPU memory, mapped by the drafter's process with CUDA IPC:
:meth:`torch.UntypedStorage._share_cuda_`, the mechanism of :mod:`torch.multiprocessing`; only
for a drafter on the same GPU, matched by UUID) and ``shm`` (a file in a directory only this
user may enter, mapped by both: CPU services on one host). The descriptor
(``common_pb2.FeatureRing``) travels only over the same-host hop.

Ordering: the target writes a verify's rows before the step's host synchronisation, and its reply
leaves after it, so by the time a Propose names the rows they are in memory. A drafter's read and
a later write of the same row cannot overlap while the client keeps fewer than ``slot_rows``
unread rows per session (a write ``slot_rows`` positions later is the only one that lands there).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import tempfile
from typing import Sequence

import numpy as np
import torch

from dflash_grpc.v1 import common_pb2
from kernels import ring as ring_kernels

log = logging.getLogger(__name__)

CUDA_IPC, SHM = "cuda-ipc", "shm"

#: wire dtype of each table dtype
_WIRE = {torch.bfloat16: common_pb2.DTYPE_BF16, torch.float16: common_pb2.DTYPE_F16,
         torch.float32: common_pb2.DTYPE_F32}
_TORCH = {v: k for k, v in _WIRE.items()}


class RingUnavailable(RuntimeError):
    """A ring descriptor that cannot be mapped here (another GPU or host, an unknown kind, a
    missing file)."""


def device_uuid(device: torch.device) -> str:
    """The CUDA device's UUID as a string (what a peer compares to find the same GPU)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def slot_rows_for(slots: int, width: int, itemsize: int, want: int, max_bytes: int, least: int) -> int:
    """Rows per slot of a ring of ``slots`` slots of ``width`` values of ``itemsize`` bytes:
    ``want``, fewer where ``max_bytes`` holds fewer, 0 (no ring) below ``least``."""
    per_row = max(1, slots * width * itemsize)
    rows = min(int(want), int(max_bytes) // per_row)
    return rows if rows >= least else 0


def item_offsets(counts: np.ndarray) -> np.ndarray:
    """``0 .. counts[i] - 1`` for each item in turn (int64 ``[sum(counts)]``): a row's place in
    its item's run of rows (``counts`` int64)."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


class FeatureRing:
    """A mapped feature ring (module docstring): ``table`` ``[slots * slot_rows + 1, width]``.

    Make one with :meth:`create` (the target: owns the memory) or :meth:`open` (a drafter: maps a
    descriptor). ``descriptor`` is the wire message that :meth:`open` takes.
    """

    def __init__(self, table: torch.Tensor, slots: int, slot_rows: int, descriptor: common_pb2.FeatureRing,
                 directory: str | None = None):
        self.table = table
        self.slots, self.slot_rows = int(slots), int(slot_rows)
        self.width = int(table.shape[1])
        self.descriptor = descriptor
        self.id = descriptor.id
        self._dir = directory        # (the creator's shm directory: removed by close)
        #: the row padding writes go to
        self.dump = self.slots * self.slot_rows

    # ------------------------------------------------------------------ making one
    @classmethod
    def create(cls, slots: int, slot_rows: int, width: int, dtype: torch.dtype, device: torch.device | str) -> "FeatureRing":
        """A new zeroed ring on ``device`` (``cuda-ipc`` on CUDA, else ``shm`` in a new directory of
        mode 0700).

        Raises:
            ValueError: a size < 1 or a dtype the wire has no name for.
            torch.OutOfMemoryError: no room for it.
        """
        if slots < 1 or slot_rows < 1 or width < 1:
            raise ValueError(f"a ring needs slots, rows and width >= 1 (got {slots}, {slot_rows}, {width})")
        if dtype not in _WIRE:
            raise ValueError(f"no wire dtype for {dtype}")
        device = torch.device(device)
        n = slots * slot_rows + 1
        desc = common_pb2.FeatureRing(id=secrets.token_hex(12), slots=slots, slot_rows=slot_rows, width=width,
                                      dtype=_WIRE[dtype])
        if device.type == "cuda":
            table = torch.zeros(n, width, dtype=dtype, device=device)
            (_, handle, size, offset, ref_handle, ref_offset, event_handle,
             event_sync) = table.untyped_storage()._share_cuda_()
            desc.kind = CUDA_IPC
            desc.device_uuid = device_uuid(device)
            desc.handle, desc.storage_bytes, desc.storage_offset = handle, size, offset
            desc.ref_counter_handle, desc.ref_counter_offset = ref_handle, ref_offset
            desc.event_handle, desc.event_sync_required = event_handle or b"", bool(event_sync)
            return cls(table, slots, slot_rows, desc)
        directory = tempfile.mkdtemp(prefix="dflash-ring-")   # (mode 0700: this user only)
        atexit.register(shutil.rmtree, directory, True)       # (also when the owner never closes it)
        path = os.path.join(directory, "table")
        table = torch.from_file(path, shared=True, size=n * width, dtype=dtype).view(n, width)
        table.zero_()
        desc.kind, desc.path = SHM, path
        return cls(table, slots, slot_rows, desc, directory)

    @classmethod
    def open(cls, desc: common_pb2.FeatureRing, device: torch.device | str) -> "FeatureRing":
        """Map ``desc`` (made by :meth:`create` in another process) for a consumer on ``device``.

        Raises:
            RingUnavailable: ``device`` is not the ring's GPU (a ``cuda-ipc`` ring), or a CUDA
                device for an ``shm`` ring, the file is missing or short, or an unknown kind.
        """
        device = torch.device(device)
        dtype = _TORCH.get(desc.dtype)
        n = desc.slots * desc.slot_rows + 1
        if dtype is None or desc.slots < 1 or desc.slot_rows < 1 or desc.width < 1:
            raise RingUnavailable("a malformed feature ring descriptor")
        nbytes = n * desc.width * torch.empty(0, dtype=dtype).element_size()
        if desc.kind == CUDA_IPC:
            if device.type != "cuda":
                raise RingUnavailable("a GPU feature ring for a drafter off the GPU")
            index = device.index if device.index is not None else torch.cuda.current_device()
            if device_uuid(torch.device("cuda", index)) != desc.device_uuid:
                raise RingUnavailable("the feature ring is on another GPU")
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    index, desc.handle, desc.storage_bytes, desc.storage_offset, desc.ref_counter_handle,
                    desc.ref_counter_offset, desc.event_handle or None, desc.event_sync_required)
            except RuntimeError as e:   # (another host's handle, a process gone, ...)
                raise RingUnavailable(f"cannot map the feature ring: {e}") from None
            if storage.nbytes() < nbytes:
                raise RingUnavailable("the feature ring's memory is shorter than its shape")
            table = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
            table.set_(storage, 0, (n, desc.width))
            return cls(table, desc.slots, desc.slot_rows, desc)
        if desc.kind == SHM:
            if device.type != "cpu":
                raise RingUnavailable("a shared-file feature ring for a drafter on a GPU")
            try:
                if os.path.getsize(desc.path) < nbytes:
                    raise RingUnavailable("the feature ring's file is shorter than its shape")
            except OSError as e:
                raise RingUnavailable(f"cannot open the feature ring's file: {e}") from None
            table = torch.from_file(desc.path, shared=True, size=n * desc.width, dtype=dtype).view(n, desc.width)
            return cls(table, desc.slots, desc.slot_rows, desc)
        raise RingUnavailable(f"unknown feature ring kind {desc.kind!r}")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` dropped the table."""
        return self.table.dim() != 2

    def close(self) -> None:
        """Drop the table (the creator also removes its shm directory)."""
        self.table = torch.empty(0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ------------------------------------------------------------------ rows
    def rows_of(self, slots: Sequence[int], ends: Sequence[int], counts: Sequence[int]) -> np.ndarray:
        """The table rows of ``counts[i]`` positions ending before ``ends[i]`` (committed length)
        in slot ``slots[i]``, item after item: int64 ``[sum(counts)]``.

        Raises:
            ValueError: a slot outside the ring, a count over ``slot_rows`` or a negative start.
        """
        c = self.slot_rows
        s = np.asarray(slots, dtype=np.int64)
        e = np.asarray(ends, dtype=np.int64)
        k = np.asarray(counts, dtype=np.int64)
        if s.size and (s.min() < 0 or s.max() >= self.slots or k.min() < 0 or k.max() > c or (e - k).min() < 0):
            raise ValueError("ring rows outside the ring (a slot, count or position out of range)")
        item = np.repeat(np.arange(len(k)), k)
        pos = (e - k)[item] + item_offsets(k)
        return s[item] * c + pos % c

    def gather(self, rows: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The table rows ``rows`` (int64 ``[m]``): ``[m, width]`` on the table's device."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        if idx.device != self.table.device:
            idx = idx.to(self.table.device, non_blocking=True)
        return self.table.index_select(0, idx)

    def warm(self) -> None:
        """Run the store once into the dump row (one item, no accepted rows): on CUDA its kernel,
        which runs outside the captured steps, compiles now rather than in the first verify step
        that stores rows: on a fresh H200 the first speculative requests' target steps took 3.99
        ms a step against 1.25 for later ones, 1.51 with this (``benchmarks/gpu/step/run26-order``).
        Device work only; nothing a reader sees changes."""
        feats = torch.zeros(1, 1, self.width, dtype=self.table.dtype, device=self.table.device)
        self.store(feats, [0], [0], [0], torch.zeros(1, dtype=torch.long, device=self.table.device))

    def store(self, feats: torch.Tensor, batch_rows: Sequence[int], slots: Sequence[int], starts: Sequence[int],
              counts: torch.Tensor) -> None:
        """Write a verify step's committed rows (the target): for each ``i``, rows ``j <
        counts[batch_rows[i]]`` of ``feats[batch_rows[i]]`` at positions ``starts[i] + j`` of slot
        ``slots[i]``; the other rows go to the dump row. Device work only (``counts`` stays where it
        is: no host synchronisation).

        Args:
            feats: ``[B, W, width]`` the step's tapped features, path rows first (the table's
                device and dtype).
            batch_rows, slots, starts: per stored item (host ints).
            counts: ``[B]`` int64 accepted rows per batch row (``k + 1``), on the device.
        """
        if not len(batch_rows):
            return
        dev = self.table.device
        items = torch.tensor([list(batch_rows), list(slots), list(starts)], dtype=torch.long)
        if dev.type == "cuda":
            items = items.pin_memory().to(dev, non_blocking=True)
        ring_kernels.store_rows(self.table, feats, items, counts, self.slot_rows, self.dump)   # (one launch on CUDA)


__all__ = ["CUDA_IPC", "SHM", "FeatureRing", "RingUnavailable", "device_uuid", "item_offsets", "slot_rows_for"]

"""Index arrays from the host to the device without a new pinned allocation per step.

A step that needs a few hundred host-computed indices on the device (the feature ring's rows:
the target's scatter, the drafter's gather) used ``torch.from_numpy(a).pin_memory().to(dev,
non_blocking=True)``. Each ``pin_memory()`` is a page-locked allocation from PyTorch's caching host
allocator and a copy; under py-spy on an H200 the drafter's ring read (``_features_in`` and
``FeatureRing.gather``) was about a quarter of its step's host time at one stream and a third at
64 streams (benchmarks/gpu/concurrency/run25-prefill-hop, ``pyspy-*.md``), beside three small
kernel launches. :class:`IndexStaging` keeps one pinned host buffer and one device buffer instead,
grown (doubled) when a step needs more, and copies each step's indices through them with one
asynchronous copy; an event recorded after the copy guards the host buffer, so a later call never
overwrites indices that an earlier copy has not read yet (in the engines the step's own
synchronisation has passed it long before).
"""

from __future__ import annotations

import numpy as np
import torch


class IndexStaging:
    """int64 index arrays to ``device``, through persistent buffers (module docstring).

    Args:
        device: where the indices are used (off CUDA: no copy, the array is wrapped).
        capacity: values held before the first growth.
    """

    def __init__(self, device: torch.device | str, capacity: int = 1024):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._event = None
        self._alloc(max(1, int(capacity)))

    def _alloc(self, n: int) -> None:
        if not self.cuda:
            return
        if self._event is not None:
            self._event.synchronize()   # (the old host buffer may still be read by a copy)
        self._host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        self._dev = torch.empty(n, dtype=torch.int64, device=self.device)
        self._event = None

    def put(self, values: np.ndarray) -> torch.Tensor:
        """``values`` (int64-convertible, any shape) on the device: a view of the device buffer,
        valid until the next :meth:`put` (use it in work queued before then, on the current
        stream). Off CUDA the values themselves, as a tensor."""
        a = np.ascontiguousarray(values, dtype=np.int64)
        if not self.cuda:
            return torch.from_numpy(a)
        n = a.size
        if n > self._host.numel():
            self._alloc(1 << (n - 1).bit_length())
        if self._event is not None:
            self._event.synchronize()   # the last copy out of the host buffer is done
        host = self._host[:n]
        host.numpy()[:] = a.reshape(-1)
        dev = self._dev[:n]
        dev.copy_(host, non_blocking=True)
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()
        return dev.view(a.shape)


__all__ = ["IndexStaging"]

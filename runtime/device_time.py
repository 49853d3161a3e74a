"""Device seconds of the CUDA steps run in this process (no torch here: the step loop, which the
orchestrator's process may import, reads it).

:class:`runtime.graphs.StepGraph` adds the time between two CUDA events around each step it runs
(its input copies, the replayed graph or eager body, its output copies), read after the step's
host synchronisation; :class:`runtime.step_loop.StepLoop` reads :func:`device_seconds` before and
after a batch, so a reply can tell the device part of its ``compute_s`` (``device_s``: the step's
time on the GPU as this service saw it, time slices of other processes sharing the GPU included).
"""

from __future__ import annotations

_TOTAL = [0.0]


def device_seconds() -> float:
    """Device seconds of every CUDA step run in this process so far (0.0 off CUDA)."""
    return _TOTAL[0]


def add_device_seconds(seconds: float) -> None:
    """Add one step's device seconds (:meth:`runtime.graphs.StepGraph.run`)."""
    _TOTAL[0] += seconds


__all__ = ["add_device_seconds", "device_seconds"]

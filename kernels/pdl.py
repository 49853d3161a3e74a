"""Programmatic dependent launch (PDL) for the Triton kernels of a step (Hopper and later).

A decode step of a small model is a chain of a few hundred short kernels, each waiting for the
one before it; a kernel's launch (its grid set up, its programs placed on the SMs) is then a
large part of its time (SmolLM2's step on an H200: about 350 kernels, most of them 2-4 us;
benchmarks/gpu/RESULTS.md, "Kernel profile of one eager step"). With PDL a kernel is launched with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (Triton's ``launch_pdl``): it may start
as soon as every program of the kernel before it has executed ``griddepcontrol.launch_dependents``,
and it executes ``griddepcontrol.wait`` (which returns once that kernel has completed and its
memory writes are visible) before touching memory. CUDA graphs keep the launches' programmatic
edges. CUDA C Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA,
``griddepcontrol``; Triton's tutorial 11 and ``triton.language.extra.cuda.gdc``. The
integer-dot kernels of the quantized projections (``kernels/quant/intdot.py``) launch as before:
they have not run on a GPU with it yet.

The rule every kernel here follows (:func:`gdc_enter`, first thing in the kernel): wait, then
signal the dependents. So nothing of a kernel launched with PDL reads or writes memory before the
previous kernel has completed, whatever that kernel is and whether or not it signalled early (one
of ours, a PyTorch op, cuBLAS); a kernel launched without PDL (PyTorch's) starts after its
predecessor completes, as always; and a kernel that completes has waited for its predecessor, so
completion stays transitive along the stream. The next kernel's launch then overlaps this
kernel's work. The arithmetic is untouched: the same bits with or without PDL.

``DFLASH_PDL=0`` turns it off (the A/B of ``benchmarks/gpu/step/run22-pdl``); it is on by default
on devices of compute capability 9.0 and later, and never under Triton's interpreter. The choice
is made once per device, at its first launch (:func:`enabled` is on every launch's path; the
environment is read then, as Triton reads ``TRITON_INTERPRET`` once): :func:`refresh` makes it
again.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

#: Environment variable: ``0`` / ``off`` / ``false`` turn PDL off.
ENV = "DFLASH_PDL"


@functools.lru_cache(maxsize=1)
def triton_supports() -> bool:
    """Whether this Triton has PDL: the ``launch_pdl`` launch option and
    ``triton.language.extra.cuda.gdc_wait`` (Triton 3.6, which ``pyproject.toml`` pins on Linux
    x86_64, has both; an older one, e.g. beside another platform's PyTorch, launches without)."""
    try:
        import dataclasses

        import triton.language.extra.cuda as cuda
        from triton.backends.nvidia.compiler import CUDAOptions

        return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)} and hasattr(cuda, "gdc_wait")
    except Exception:   # (no NVIDIA backend, or a layout this check does not know: no PDL)
        return False


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET``, read as Triton reads
    it: ``triton.knobs.runtime.interpret``, which takes ``1``, ``true``, ``on``, ``yes``)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:   # (an older Triton without knobs)
        return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=16)
def _on(index: int) -> bool:
    """:func:`enabled` for CUDA device ``index``, decided at its first call (module docstring)."""
    if _interpreting() or not triton_supports():
        return False
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA device of compute capability >= 9.0,
    a Triton that has it (:func:`triton_supports`), not under Triton's interpreter, and
    :data:`ENV` not set to ``0`` / ``off`` / ``false`` (read at the device's first call; a cached
    answer after it)."""
    if device.type != "cuda":
        return False
    return _on(device.index if device.index is not None else torch.cuda.current_device())


def refresh() -> None:
    """Forget the choices :func:`enabled` made, so the next launch reads the environment again
    (tests, and A/B runs in one process; kernels already captured in a CUDA graph keep theirs)."""
    _on.cache_clear()


def options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch (or ``warmup``) on ``device``: ``PDL`` (the kernels'
    constexpr that adds :func:`gdc_enter`) and, when on, Triton's ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


def launch(t: torch.Tensor) -> dict:
    """:func:`options` for ``t``'s device."""
    return options(t.device)


@triton.jit
def gdc_enter(PDL: tl.constexpr):
    """A kernel's first statement: with ``PDL``, wait for the previous kernel to complete, then let
    the next one launch (module docstring); without, nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


__all__ = ["ENV", "enabled", "gdc_enter", "launch", "options", "refresh", "triton_supports"]

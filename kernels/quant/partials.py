"""The second pass of a split-``K`` launch (:mod:`kernels.quant.triton`, :mod:`kernels.quant.intdot`):
the float32 partial sums of ``SPLIT_K`` programs added in a fixed order, so a row's bits do not
depend on how the first pass was scheduled: a kernel of its own (:func:`_split_sum_kernel`), or
inside the first pass (:func:`_store_split`: the last program of an output tile to finish adds the
tile's partials, in the same order, so both give the same bits; one launch less per product)."""

import torch
import triton
import triton.language as tl

from kernels.pdl import gdc_enter

#: tile counters per device for :func:`_store_split`: int32, zero between launches
_COUNTERS: dict = {}
#: counters a buffer holds (tiles of one launch; a launch with more takes the separate sum kernel)
COUNTER_TILES = 1 << 17


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The zeroed int32 tile counters of :func:`_store_split` on ``device`` (allocated once, at
    the first launch outside graph capture: the engine warms every step up before capturing it),
    or None when ``tiles`` exceeds :data:`COUNTER_TILES` or the first allocation would fall inside
    a capture (the caller then launches :func:`_split_sum_kernel`). Each launch leaves its counters
    at zero, so launches in stream order share them, graphs captured later included.

    One buffer per device, not per stream: a graph is captured on PyTorch's capture stream and
    replayed on another, and PyTorch hands its pooled streams out again, so a stream's identity
    says nothing about where a captured launch will run. The rule this needs is the engine's: a
    process runs its products on one device in stream order (one compute stream; the warm-up's side
    stream is joined before and after), never two at once on two streams."""
    if tiles > COUNTER_TILES:
        return None
    key = device.type if device.type != "cuda" else (device.index if device.index is not None else torch.cuda.current_device())
    buf = _COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[key] = torch.zeros(COUNTER_TILES, dtype=torch.int32, device=device)
    return buf


@triton.jit
def _store_split(acc, y_ptr, part_ptr, cnt_ptr, offs, mask, tile, MN, SPLIT_K: tl.constexpr, FUSED: tl.constexpr):
    """A program's float32 results ``acc`` for the outputs at flat offsets ``offs`` of ``y``
    (``[M * N]``, ``mask`` the valid ones): stored into ``y`` with ``SPLIT_K`` 1; else stored as its
    partial ``part[k]`` (float32 ``[SPLIT_K, M * N]``, ``k = program_id(1)``), left for
    :func:`_split_sum_kernel` unless ``FUSED``; with ``FUSED`` then counted on its tile's counter (``cnt_ptr + tile``, an acquire-release atomic after a barrier of the program's
    threads). The tile's last program to count adds the ``SPLIT_K`` partials in order ``0, 1, ...``
    (:func:`_split_sum_kernel`'s order and bits; read through L2), stores the sum rounded once to
    ``y``'s dtype and sets the counter back to zero. The split-K semaphore of stream-K / split-K
    GEMMs (e.g. CUTLASS's serial split-K)."""
    if SPLIT_K == 1:
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * MN + offs, acc, mask=mask)
    if SPLIT_K > 1 and FUSED:
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            tot = _sum_partials(part_ptr + offs, mask, MN, SPLIT_K, True)
            tl.store(y_ptr + offs, tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(cnt_ptr + tile, 0)


@triton.jit
def _sum_partials(p, mask, MN, SPLIT_K: tl.constexpr, L2: tl.constexpr):
    """``p[0] + p[MN] + ... + p[(SPLIT_K - 1) * MN]`` in that order (float32; masked-off lanes 0):
    the one summation of the split's partials, so the separate kernel and the in-kernel sum give
    the same bits. ``L2``: loads through L2 only (``.cg``: partials other programs just wrote)."""
    if L2:
        tot = tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        tot = tl.load(p, mask=mask, other=0.0)
    for _ in tl.static_range(1, SPLIT_K):
        p += MN                               # (pointer steps: no int32 product s * MN to overflow)
        if L2:
            tot += tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            tot += tl.load(p, mask=mask, other=0.0)
    return tot


@triton.jit
def _split_sum_kernel(p_ptr, y_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``y[i] = p[0, i] + p[1, i] + ... + p[SPLIT_K - 1, i]`` in that order (float32), rounded
    once to ``y``'s dtype: the partial sums ``[SPLIT_K, M * N]`` of a split-``K`` launch."""
    gdc_enter(PDL)   # (kernels.pdl)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = _sum_partials(p_ptr + i, mask, MN, SPLIT_K, False)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=mask)

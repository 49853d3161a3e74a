"""The top-``k`` of the log-softmax of each row in two Triton launches: what
``torch.topk(torch.log_softmax(x, -1), k, -1)`` computes (``kernels.topk.reference``) without
torch's ~15 radix-select launches and its softmax kernel (issue 18, measured on an H200 for 15
rows x 49,152: 2 launches and 7.6 us here against torch's 23 and 65.1 us;
``benchmarks/gpu/step/run8/README.md``).

* ``_topk_lsm_partial_kernel``, grid ``(R, S)``: the row's ``ceil(V / BLOCK)`` chunks are split
  among ``S`` programs (``S = ceil(PROGRAMS / R)``, at most one per chunk: a few rows still fill
  the GPU, many rows loop). A program keeps, over its chunks, the running max ``m`` and
  ``sum(exp(x - m))`` (rescaled when ``m`` grows, as in flash softmax) and a running set of its
  ``k`` largest int64 keys ``(order-preserving key of the float32 value) << 32 | (2**32 - 1 -
  column)`` (the largest key is the largest value, the lowest column among equal values; keys are
  unique). Per chunk: while the chunk's largest key beats the set's smallest, it replaces it (one
  max reduction over the chunk per round, at most ``k`` rounds, none once the set is ahead of the
  chunk, which is most chunks after the first few on real logits).
* ``_topk_lsm_merge_kernel``, one program per row: the row's max ``M`` over its ``S`` parts, the
  sum ``sum_p s_p * exp(m_p - M)``, the ``k`` largest of the ``S * k`` part keys (``k`` max
  reductions), and the log-probs ``(x - M) - log(sum)`` (torch's epilogue, float32) with ``x``
  read back from the logits at the chosen columns.

Agreement with the reference: values to float32 rounding of the log-sum (the sums run in another
order; ~1e-6 absolute); indices are exactly a stable descending sort's first ``k`` of the logits
(``torch.sort(x, descending=True, stable=True)``): lower column first among equal logits, where
``torch.topk``'s order of ties is unspecified. ``-0.0`` and ``0.0`` are equal (lower column
first). Non-finite logits: NaN ranks above everything (as in ``torch.topk``) and any NaN makes the
row's values NaN, as ``log_softmax`` does; a row of all ``-inf`` gives NaN values and columns
``0..k-1``; ``+inf`` makes the row's values NaN (as torch). Nothing raises on values.

Safe inside CUDA graphs: the launches depend only on shapes and ``k``; no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import gdc_enter
from kernels.topk import reference as _reference

#: Columns per chunk of the partial kernel, and its warps.
BLOCK_V = 2048
PARTIAL_WARPS = 4
#: The partial kernel's grid aims at about this many programs: ``S = ceil(PROGRAMS / R)`` programs
#: per row (at most one per chunk), each looping over its share of the row's chunks.
PROGRAMS = 512
#: Largest ``k`` the kernels take; larger ``k`` runs the reference (torch's ops).
MAX_K = 64

_KEY_MIN = tl.constexpr(-(2**63))
_KEY_MAX = tl.constexpr(2**63 - 1)
_LOW = tl.constexpr(2**32 - 1)


@triton.jit
def _key(x, cols):
    """int64 key of float32 ``x`` at column ``cols``: larger value first, then lower column
    (``-0.0`` keyed as ``0.0``, NaN above ``+inf``)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    k = tl.where(x != x, 2147483647, k)
    return (k.to(tl.int64) << 32) | (_LOW - cols.to(tl.int64))


@triton.jit
def _top(keys, K, slots, KP: tl.constexpr):
    """The ``K`` largest of the unique int64 ``keys`` (descending, in ``[KP]``; ``_KEY_MIN`` past
    ``K`` or past the valid keys)."""
    top = tl.full([KP], _KEY_MIN, tl.int64)
    for j in range(K):
        c = tl.max(keys, 0)
        top = tl.where(slots == j, c, top)
        keys = tl.where(keys == c, _KEY_MIN, keys)
    return top


@triton.jit
def _topk_lsm_partial_kernel(x_ptr, m_ptr, s_ptr, key_ptr, V, sx, S, CPS, K,
                             KP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    slots = tl.arange(0, KP)
    live = slots < K
    # the running top-K as an unordered set of K unique keys; empty slots hold distinct keys below
    # every real key (_KEY_MIN + slot), padding slots one above them all (never the set's minimum)
    top = tl.where(live, _KEY_MIN + slots.to(tl.int64), _KEY_MAX)
    thr = tl.min(top, 0)                                  # the set's smallest key (a sentinel: _KEY_MIN)
    m = float("-inf")
    s = 0.0
    for i in range(CPS):
        cols = (part * CPS + i) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(x_ptr + row * sx + cols, mask=ok, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, 0))
        # -inf logits carry no mass, also where the max is -inf (exp(-inf - -inf) would be NaN);
        # a NaN logit makes s NaN (GPU max reductions skip NaN, so it must come through the sum)
        p = tl.where(x == float("-inf"), 0.0, tl.exp(x - new_m))
        s = tl.where(s == 0.0, 0.0, s * tl.exp(m - new_m)) + tl.sum(p, 0)
        m = new_m
        keys = tl.where(ok, _key(x, cols), _KEY_MIN)
        c = tl.max(keys, 0)
        while c > thr:                                    # at most K rounds; none once the chunk is below the set
            top = tl.where(top == thr, c, top)
            thr = tl.min(top, 0)
            keys = tl.where(keys == c, _KEY_MIN, keys)
            c = tl.max(keys, 0)
    out = row * S + part
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    tl.store(key_ptr + out * KP + slots, tl.where(live, top, _KEY_MIN))


@triton.jit
def _topk_lsm_merge_kernel(x_ptr, m_ptr, s_ptr, key_ptr, v_ptr, i_ptr, sx, S, K,
                           KP: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)   # (kernels.pdl)
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, SP)
    pok = parts < S
    m = tl.load(m_ptr + row * S + parts, mask=pok, other=float("-inf"))
    s = tl.load(s_ptr + row * S + parts, mask=pok, other=0.0)
    big = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - big), 0)               # all -inf parts: s = 0 (NaN only if the row is all -inf)
    lse = tl.log(total)
    flat = tl.arange(0, SP * KP)
    keys = tl.load(key_ptr + row * S * KP + flat, mask=flat < S * KP, other=_KEY_MIN)
    slots = tl.arange(0, KP)
    top = _top(keys, K, slots, KP)
    idx = _LOW - (top & _LOW)
    kk = slots < K
    x = tl.load(x_ptr + row * sx + idx, mask=kk, other=0.0).to(tl.float32)
    tl.store(v_ptr + row * K + slots, (x - big) - lse, mask=kk)
    tl.store(i_ptr + row * K + slots, idx, mask=kk)


def topk_log_softmax(logits: torch.Tensor, k: int, block: int | None = None,
                     splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``kernels.topk.reference.topk_log_softmax`` (module docstring: ties,
    non-finite values).

    Args:
        logits: ``[..., V]`` float32 (or float16 / bfloat16, read as float32), on the device the
            kernels run on (CUDA, or the CPU under ``TRITON_INTERPRET=1``).
        k: ``0 <= k <= V``; above :data:`MAX_K` the reference runs.
        block: columns per chunk, a power of two (default :data:`BLOCK_V`; cut to ``V``'s next
            power of two).
        splits: programs per row of the partial kernel (default ``ceil(PROGRAMS / R)``; cut to
            the row's chunk count).

    Returns:
        ``(values [..., k] float32, indices [..., k] int64)``, values descending.

    Raises:
        ValueError: ``k`` outside ``[0, V]``, ``block`` not a power of two, ``splits < 1``.
    """
    V = logits.shape[-1]
    k = int(k)
    if not 0 <= k <= V:
        raise ValueError(f"k={k} outside [0, {V}] (the row length)")
    if block is not None and (block < 1 or block & (block - 1)):
        raise ValueError(f"block={block} is not a power of two")
    if splits is not None and splits < 1:
        raise ValueError(f"splits={splits} < 1")
    if k > MAX_K:
        return _reference.topk_log_softmax(logits, k)
    lead = logits.shape[:-1]
    x = logits.reshape(-1, V)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R = x.shape[0]
    dev = logits.device
    values = torch.empty((R, k), device=dev, dtype=torch.float32)
    indices = torch.empty((R, k), device=dev, dtype=torch.int64)
    if R == 0 or k == 0:
        return values.reshape(*lead, k), indices.reshape(*lead, k)
    blk = min(block or BLOCK_V, triton.next_power_of_2(V))
    chunks = triton.cdiv(V, blk)
    cps = triton.cdiv(chunks, min(chunks, splits or triton.cdiv(PROGRAMS, R)))   # chunks per program
    S = triton.cdiv(chunks, cps)
    KP = triton.next_power_of_2(k)
    SP = triton.next_power_of_2(S)
    m = torch.empty((R, S), device=dev, dtype=torch.float32)
    s = torch.empty((R, S), device=dev, dtype=torch.float32)
    keys = torch.empty((R, S, KP), device=dev, dtype=torch.int64)
    _topk_lsm_partial_kernel[(R, S)](x, m, s, keys, V, x.stride(0), S, cps, k, KP=KP, BLOCK=blk,
                                     num_warps=PARTIAL_WARPS, **pdl.launch(x))
    _topk_lsm_merge_kernel[(R,)](x, m, s, keys, values, indices, x.stride(0), S, k, KP=KP, SP=SP,
                                 num_warps=min(8, max(1, SP * KP // 256)), **pdl.launch(x))
    return values.reshape(*lead, k), indices.reshape(*lead, k)

"""A GGUF block-quantized weight kept as the file's raw bytes: :class:`QuantizedWeight`.

GGUF stores a quantized ``[N, K]`` matrix (GGUF shape ``[ne0 = K, ne1 = N]``, ``K`` fastest) row
by row; each row is ``K / QK`` blocks of ``BS`` bytes, each block coding ``QK`` consecutive
elements (``QK``, ``BS`` = ``gguf.constants.GGML_QUANT_SIZES[qtype]``). :class:`QuantizedWeight`
holds those bytes unchanged as a ``uint8`` tensor ``[N, K / QK * BS]`` plus the type and the
logical shape; the kernels of this package read the blocks directly.

The block layouts (ggml's ``ggml-common.h`` ``block_*`` structs; the Python port is gguf-py's
``gguf/quants.py``, whose ``dequantize`` is the oracle of the tests). All fields little-endian;
``d``, ``m``, ``dmin`` are IEEE float16; element ``j`` of a block is ``w[b * QK + j]``.

=====  ====  ===  =============================================================================
type   QK    BS   block (byte offsets) and element value
=====  ====  ===  =============================================================================
Q4_0   32    18   ``d`` @0, ``qs[16]`` @2. ``q_j`` = low nibble of ``qs[j]`` (j < 16), high
                  nibble of ``qs[j - 16]`` (j >= 16); ``w = d * (q - 8)``
Q4_1   32    20   ``d`` @0, ``m`` @2, ``qs[16]`` @4 (nibbles as Q4_0); ``w = d * q + m``
Q5_0   32    22   ``d`` @0, ``qh`` @2 (uint32: bit ``j`` = bit 4 of ``q_j``), ``qs[16]`` @6
                  (low 4 bits as Q4_0); ``w = d * (q - 16)``
Q5_1   32    24   ``d`` @0, ``m`` @2, ``qh`` @4, ``qs[16]`` @8; ``w = d * q + m``
Q8_0   32    34   ``d`` @0, ``qs[32]`` int8 @2; ``w = d * q``
Q4_K   256   144  ``d`` @0, ``dmin`` @2, ``scales[12]`` @4, ``qs[128]`` @16. Eight sub-blocks of
                  32 with 6-bit scale ``sc_s`` and min ``m_s`` packed in ``scales`` (s < 4:
                  ``sc = scales[s] & 63``, ``m = scales[s + 4] & 63``; s >= 4: ``sc =
                  (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4``, ``m = (scales[s + 4] >> 4)
                  | (scales[s] >> 6) << 4``). Sub-block ``s``, element ``l``: ``q`` = nibble
                  ``s % 2`` of ``qs[32 * (s // 2) + l]``; ``w = (d * sc_s) * q - dmin * m_s``
Q5_K   256   176  ``d`` @0, ``dmin`` @2, ``scales[12]`` @4 (as Q4_K), ``qh[32]`` @16,
                  ``qs[128]`` @48; ``q`` = Q4_K's nibble ``| ((qh[l] >> s) & 1) << 4``;
                  ``w = (d * sc_s) * q - dmin * m_s``
Q6_K   256   210  ``ql[128]`` @0, ``qh[64]`` @128, ``scales[16]`` int8 @192, ``d`` @208. Element
                  ``e = 128 * h + r``: low 4 bits = nibble ``r // 64`` of ``ql[64 * h + r % 64]``,
                  high 2 bits = bits ``2 * (r // 32)`` of ``qh[32 * h + r % 32]``;
                  ``w = (d * scales[e // 16]) * (q - 32)``
=====  ====  ===  =============================================================================

Other GGUF types (Q2_K, Q3_K, the IQ types, ...) are not handled here; F32 / F16 / BF16 weights
stay plain tensors.

**Padded blocks.** A weight may hold each block in ``S >= BS`` bytes (its *block stride*): the
block's ``BS`` bytes unchanged, then ``S - BS`` zero bytes. Only Q6_K takes it
(:data:`PADDED_STRIDES`): its 210-byte super-blocks start only on 2-byte boundaries in the file,
so every kernel read them as 16-bit halves; padded to 224 bytes every super-block and each of
its fields (``ql`` @0, ``qh`` @128, ``scales`` @192) starts on a 16-byte boundary: the integer
kernels read whole words (128-bit loads in the one-row kernel) and the compiler merges the generic
kernel's 16-bit reads into 8-byte loads. The stride is the data's own shape (``data.shape[1] / (K /
QK)``), so a view, a row gather or a concatenation of padded weights stays padded. The loader
pads at load (:func:`stride_for`, ``DFLASH_QUANT_Q6K_STRIDE``); :meth:`QuantizedWeight.with_stride`
converts either way. The values are the same: every reader takes the first ``BS`` bytes of each
stored block.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

#: The types of this package, by GGUF name.
QTYPES: dict[str, GGMLQuantizationType] = {
    n: GGMLQuantizationType[n] for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
}


log = logging.getLogger(__name__)

#: The block strides a weight may hold besides the GGUF block size, per type (module docstring,
#: "Padded blocks"): Q6_K's 210-byte super-blocks padded to a 4-, 8- or 16-byte boundary.
PADDED_STRIDES: dict[str, tuple[int, ...]] = {"Q6_K": (212, 216, 224)}


def int_setting(name: str, value: str | None, default: "int | None", allowed) -> "int | None":
    """An integer speed setting from an environment variable's ``value``: unset or empty gives
    ``default``; an integer for which ``allowed(v)`` holds gives it; anything else (not an
    integer, out of range) is logged as a warning naming ``name`` and gives ``default``, so a bad
    value never stops a service from starting."""
    v = (value or "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is not None and allowed(n):
        return n
    log.warning("%s=%r is not a valid value: left at %s", name, v, default, extra={"setting": name, "value": v})
    return default


def _stride_setting(value: str | None) -> int:
    """:data:`Q6K_STRIDE` from the value of ``DFLASH_QUANT_Q6K_STRIDE``: unset or empty the
    default 224; ``210`` (the file's layout) or one of ``PADDED_STRIDES["Q6_K"]``; anything else
    is logged and the default kept (:func:`int_setting`)."""
    return int_setting("DFLASH_QUANT_Q6K_STRIDE", value, 224, lambda v: v in (210,) + PADDED_STRIDES["Q6_K"])


#: Bytes per Q6_K super-block as the loader holds them on the device (:func:`stride_for`): 224, the
#: 210 GGUF bytes then 14 zero bytes, so every super-block starts on a 16-byte boundary (6.7% more
#: bytes for the Q6_K tensors: the synthetic 9B Q4_K_M holds 1.5% more, 4.25 GiB against 4.18). Read once at import from
#: ``DFLASH_QUANT_Q6K_STRIDE`` (``210``: the file's layout, for A/B runs; or 212, 216).
Q6K_STRIDE = _stride_setting(os.environ.get("DFLASH_QUANT_Q6K_STRIDE"))


def stride_for(qtype: "GGMLQuantizationType | str | int") -> int:
    """The block stride the loader gives a weight of ``qtype``: :data:`Q6K_STRIDE` for Q6_K, else
    the GGUF block size (``GGML_QUANT_SIZES``)."""
    qt = as_qtype(qtype)
    return Q6K_STRIDE if qt.name == "Q6_K" else GGML_QUANT_SIZES[qt][1]


def as_qtype(qtype: "GGMLQuantizationType | str | int") -> GGMLQuantizationType:
    """``qtype`` (a ``GGMLQuantizationType``, its name such as ``"Q4_K"``, or its GGUF number) as a
    ``GGMLQuantizationType`` of :data:`QTYPES`.

    Raises:
        ValueError: an unknown name or number, or a type this package does not handle.
    """
    try:
        t = GGMLQuantizationType[qtype] if isinstance(qtype, str) else GGMLQuantizationType(int(qtype))
    except (KeyError, ValueError) as e:
        raise ValueError(f"unknown GGUF tensor type {qtype!r}") from e
    if t.name not in QTYPES:
        raise ValueError(f"GGUF type {t.name} is not a supported quantized type (supported: {', '.join(QTYPES)})")
    return t


def block_geometry(qtype: "GGMLQuantizationType | str | int") -> tuple[int, int]:
    """``(elements per block, bytes per block)`` of ``qtype`` (``GGML_QUANT_SIZES``)."""
    return GGML_QUANT_SIZES[as_qtype(qtype)]


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A ``[N, K]`` weight (``N`` output features, ``K`` input features: the layout of
    ``F.linear``) in GGUF block-quantized form.

    Attributes:
        data: ``torch.uint8`` ``[N, K // QK * S]``, contiguous: the GGUF file's bytes of the
            tensor (a copy with zeros after each block when padded), row ``n`` = the blocks of output feature ``n`` (module docstring), each block in
            ``S`` bytes: ``S = BS`` (the file's layout) or, for a type of :data:`PADDED_STRIDES`, a
            padded stride (the block's ``BS`` bytes first). Any device.
        qtype: the ``GGMLQuantizationType`` (construct with a name or number: it is normalised).
        shape: the logical shape ``(N, K)`` in elements; ``K`` is a multiple of the block size.

    Equality is identity (the bytes are a tensor).

    Raises:
        ValueError: unsupported type, ``K`` not a multiple of the block size, or ``data`` not a
            contiguous 2-D uint8 tensor of ``[N, K // QK * S]`` bytes with ``S`` the block size or
            one of the type's :data:`PADDED_STRIDES`.
    """

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    def __post_init__(self):
        qt = as_qtype(self.qtype)
        object.__setattr__(self, "qtype", qt)
        n, k = (int(v) for v in self.shape)
        object.__setattr__(self, "shape", (n, k))
        qk, bs = GGML_QUANT_SIZES[qt]
        if k % qk:
            raise ValueError(f"{qt.name} weight [{n}, {k}]: K must be a multiple of {qk}")
        d = self.data
        nb = k // qk
        ok = isinstance(d, torch.Tensor) and d.dtype == torch.uint8 and d.dim() == 2 and d.shape[0] == n
        if ok and d.shape[1] != nb * bs:   # a padded stride (module docstring)
            ok = nb > 0 and d.shape[1] % nb == 0 and d.shape[1] // nb in PADDED_STRIDES.get(qt.name, ())
        if not ok:
            got = tuple(d.shape) if isinstance(d, torch.Tensor) else type(d).__name__
            pads = "".join(f" or [{n}, {nb * p}]" for p in PADDED_STRIDES.get(qt.name, ()))
            raise ValueError(f"{qt.name} weight [{n}, {k}] needs uint8 data [{n}, {nb * bs}]{pads}, got {got}"
                             f"{'' if not isinstance(d, torch.Tensor) else ' ' + str(d.dtype)}")
        if not d.is_contiguous():
            raise ValueError(f"{qt.name} weight data must be contiguous")

    @property
    def block_elems(self) -> int:
        """Elements per block (``QK``: 32 for the legacy types, 256 for the k-quants)."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        """Bytes per block (``BS``)."""
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def block_stride(self) -> int:
        """Bytes each block takes in :attr:`data` (``S``: :attr:`block_bytes`, or a padded stride)."""
        nb = self.shape[1] // self.block_elems
        return self.data.shape[1] // nb if nb else self.block_bytes

    @property
    def nbytes(self) -> int:
        """Bytes held: ``N * K / QK * S``."""
        return self.data.numel()

    def with_stride(self, stride: int) -> "QuantizedWeight":
        """The same weight with each block in ``stride`` bytes (module docstring, "Padded
        blocks"): itself when it already is, else a new tensor on the same device (each block's
        ``BS`` bytes, then zeros up to ``stride``).

        Raises:
            ValueError: ``stride`` neither :attr:`block_bytes` nor one of the type's
                :data:`PADDED_STRIDES`.
        """
        bs = self.block_bytes
        if stride != bs and stride not in PADDED_STRIDES.get(self.qtype.name, ()):
            raise ValueError(f"{self.qtype.name} blocks take {bs} bytes or one of {PADDED_STRIDES.get(self.qtype.name, ())}, "
                             f"not {stride}")
        if stride == self.block_stride:
            return self
        n, k = self.shape
        nb = k // self.block_elems
        out = torch.zeros(n, nb, stride, dtype=torch.uint8, device=self.device)
        out[..., :bs] = self.blocks()
        return QuantizedWeight(out.reshape(n, nb * stride), self.qtype, self.shape)

    def blocks(self) -> torch.Tensor:
        """The blocks without their padding: uint8 ``[N, K / QK, BS]`` (a view when unpadded)."""
        n, k = self.shape
        return self.data.reshape(n, k // self.block_elems, self.block_stride)[..., : self.block_bytes]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: "torch.device | str") -> "QuantizedWeight":
        """The same weight with its bytes on ``device``."""
        return QuantizedWeight(self.data.to(device), self.qtype, self.shape)

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """Output features ``[start, stop)`` (a view of the bytes; rows are whole blocks)."""
        d = self.data[start:stop]
        return QuantizedWeight(d, self.qtype, (d.shape[0], self.shape[1]))

    @classmethod
    def from_bytes(cls, data: "np.ndarray | torch.Tensor", qtype: "GGMLQuantizationType | str | int",
                   shape: tuple[int, int]) -> "QuantizedWeight":
        """From a GGUF tensor's bytes (numpy or torch, any shape holding ``N * K / QK * BS``
        uint8 values in file order: the file's layout, :meth:`with_stride` pads), copied into a new
        contiguous CPU tensor if numpy.

        Raises:
            ValueError: ``K`` not a multiple of the block size, or not ``N * K / QK * BS`` bytes.
        """
        qt = as_qtype(qtype)
        n, k = (int(v) for v in shape)
        qk, bs = GGML_QUANT_SIZES[qt]
        if isinstance(data, np.ndarray):
            data = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
        if k % qk:
            raise ValueError(f"{qt.name} weight [{n}, {k}]: K must be a multiple of {qk}")
        if data.numel() != n * (k // qk) * bs:
            raise ValueError(f"{qt.name} weight [{n}, {k}] needs {n * (k // qk) * bs} bytes (the file's layout), "
                             f"got {data.numel()}")
        return cls(data.reshape(n, k // qk * bs).contiguous(), qt, (n, k))

    @classmethod
    def quantize(cls, w: torch.Tensor, qtype: "GGMLQuantizationType | str | int") -> "QuantizedWeight":
        """Quantize a float ``[N, K]`` tensor with ``gguf.quants.quantize`` (CPU; gguf-py
        quantizes the legacy types only, so the k-quants raise ``NotImplementedError``)."""
        import gguf.quants

        qt = as_qtype(qtype)
        arr = w.detach().float().cpu().numpy()
        return cls.from_bytes(gguf.quants.quantize(np.ascontiguousarray(arr), qt), qt, tuple(arr.shape)).to(w.device)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedWeight:
    """Weights stacked along their output features that cannot share one storage: a ``[sum N_i,
    K]`` weight made of parts of different types (a ``Q4_K_M`` file's ``attn_q`` / ``attn_k`` in
    Q4_K beside an ``attn_v`` in Q6_K, or a quantized part beside a float one). ``x @ w^T`` is
    each part's product concatenated along the last dim (``kernels.linear.linear``). Made by
    :func:`pack_rows`, which joins parts of one type into one tensor or :class:`QuantizedWeight`
    instead (block quants run along ``K``, so stacking rows of one type is a byte concatenation).

    Attributes:
        parts: two or more :class:`QuantizedWeight` / 2-D float tensors, all with ``K`` columns,
            adjacent parts of different kinds (as :func:`pack_rows` leaves them).

    Raises:
        ValueError: fewer than two parts, a part that is neither, or ``K`` mismatch.
    """

    parts: tuple

    def __post_init__(self):
        parts = tuple(self.parts)
        object.__setattr__(self, "parts", parts)
        if len(parts) < 2 or not all(isinstance(p, QuantizedWeight) or (isinstance(p, torch.Tensor) and p.dim() == 2)
                                     for p in parts):
            raise ValueError("a PackedWeight holds two or more QuantizedWeight / 2-D tensor parts")
        if len({int(p.shape[1]) for p in parts}) != 1:
            raise ValueError(f"packed parts have different K: {[tuple(p.shape) for p in parts]}")

    @property
    def shape(self) -> tuple[int, int]:
        """``(sum of the parts' N, K)``."""
        return sum(int(p.shape[0]) for p in self.parts), int(self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by all parts."""
        return sum(weight_nbytes(p) for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def to(self, device: "torch.device | str") -> "PackedWeight":
        """The same weight with every part on ``device``."""
        return PackedWeight(tuple(p.to(device) for p in self.parts))


def weight_nbytes(w: "torch.Tensor | QuantizedWeight | PackedWeight") -> int:
    """Bytes a weight holds: a tensor's ``numel * element_size``, a quantized or packed weight's
    :attr:`~QuantizedWeight.nbytes`."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return int(w.nbytes)


def pack_rows(parts) -> "torch.Tensor | QuantizedWeight | PackedWeight":
    """Stack weights along output features (``torch.cat(parts)`` for any mix of storage).

    Adjacent parts of one kind are joined: float tensors with ``torch.cat`` (they must share a
    dtype and device, as the loader makes them), :class:`QuantizedWeight` parts of one type by
    concatenating their bytes row-wise (a new contiguous tensor). One group left: that tensor or
    weight; several: a :class:`PackedWeight` of the groups.

    Raises:
        ValueError: no parts, ``K`` mismatch, or a part that is neither kind.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("nothing to pack")
    flat = []
    for p in parts:
        flat.extend(p.parts if isinstance(p, PackedWeight) else [p])
    def kind(w):   # parts of one type and block stride join into one byte tensor
        return (w.qtype, w.block_stride) if isinstance(w, QuantizedWeight) else None

    groups: list[list] = []
    for p in flat:
        if not isinstance(p, (torch.Tensor, QuantizedWeight)):
            raise ValueError(f"cannot pack a {type(p).__name__}")
        if groups and kind(groups[-1][0]) == kind(p):
            groups[-1].append(p)
        else:
            groups.append([p])
    if len({int(p.shape[1]) for p in flat}) != 1:
        raise ValueError(f"packed parts have different K: {[tuple(p.shape) for p in flat]}")
    joined = []
    for g in groups:
        if isinstance(g[0], QuantizedWeight):
            data = torch.cat([p.data for p in g]) if len(g) > 1 else g[0].data
            joined.append(QuantizedWeight(data.contiguous(), g[0].qtype, (data.shape[0], g[0].shape[1])))
        else:
            joined.append(torch.cat(g).contiguous() if len(g) > 1 else g[0].contiguous())
    return joined[0] if len(joined) == 1 else PackedWeight(tuple(joined))

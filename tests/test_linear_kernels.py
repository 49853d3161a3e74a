"""The skinny Triton linear kernel (``kernels/linear/triton.py``): bit-exactness across the number of
rows, accuracy against the reference, and the config table / ``DFLASH_LINEAR_CONFIG`` override.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``),
small shapes only; float16 and float32 (the interpreter's bfloat16 ``dot`` is broken, as
tests/test_kernels.py notes). Bit-exactness across ``M`` is a property of the compiled kernel: it is
asserted bit for bit on a GPU only (under the interpreter the dot runs on the host BLAS, and the
rows agree to a stated tolerance there); ``tools/sweep_linear.py`` re-checks its chosen configs on
the GPU.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.linear import reference as R  # noqa: E402
from kernels.linear import triton as T  # noqa: E402
from tests.conftest import assert_bits_on_gpu  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.float16]
#: A non-default config, to check the properties hold for more than one tiling.
ALT = T.Config(32, 64, 2, 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rand(gen: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEV, dtype)


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(T.CONFIG_ENV, raising=False)
    T.load_config_file.cache_clear()
    yield
    T.load_config_file.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, ALT], ids=["default", "alt"])
def test_rows_bit_identical_across_m(dtype, config):
    """Row i of a 1-, 16-, 37- and 64-row call: the same bits on a GPU. Under the interpreter the
    dot is numpy's matmul on the host BLAS, whose blocking (and so the float32 summation order of a
    row) depends on the CPU and on where the row sits in the tile: there the rows agree to
    :data:`TOL` (``assert_bits_on_gpu``)."""
    gen = torch.Generator().manual_seed(1)
    n, k = 40, 96
    w = rand(gen, n, k, dtype=dtype)
    x = rand(gen, 64, k, dtype=dtype)
    y = T.linear(x, w, config=config)
    for m in (16, 37):
        assert_bits_on_gpu(T.linear(x[:m], w, config=config), y[:m], TOL[dtype], m)
    for i in (0, 1, 15, 16, 17, 40, 63):
        assert_bits_on_gpu(T.linear(x[i:i + 1], w, config=config)[0], y[i], TOL[dtype], i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_rows_bit_identical_to_one_row(dtype):
    """``wide=True`` (the batch-invariant steps): past 64 rows the kernel runs 64 x 64 tiles
    (``wide_config``: the config's ``BLOCK_K``, 4 warps) and each row still gets the bits of a
    1-row call (on a GPU; within :data:`TOL` under the interpreter), and ``F.linear``'s value
    within :data:`TOL`; without ``wide`` more than 64 rows is refused."""
    gen = torch.Generator().manual_seed(4)
    n, k = 80, 96
    w = rand(gen, n, k, dtype=dtype)
    x = rand(gen, 130, k, dtype=dtype)
    bm, wide = T.wide_config(T.config_for(n, k, dtype), dtype)
    assert bm == 64 and wide.block_n >= 64 and wide.block_k == T.config_for(n, k, dtype).block_k
    y = T.linear(x, w, wide=True)
    assert rel(y, R.linear(x, w)) < TOL[dtype]
    for i in (0, 63, 64, 100, 129):
        assert_bits_on_gpu(T.linear(x[i:i + 1], w)[0], y[i], TOL[dtype], i)
    with pytest.raises(ValueError, match="at most 64"):
        T.linear(x, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, ALT], ids=["default", "alt"])
def test_linear_swiglu(dtype, config):
    """The gate-up projection with SwiGLU in one launch: on a GPU bit for bit the skinny
    projection (the same config) followed by ``silu_mul`` (within :data:`TOL` under the interpreter
    and against the reference), its rows the bits of a 1-row call at 16, 37 and 64 rows and, with
    ``wide``, past 64 (on a GPU)."""
    from kernels.activation import triton as A

    gen = torch.Generator().manual_seed(9)
    f, k = 40, 96
    w = rand(gen, 2 * f, k, dtype=dtype)
    x = rand(gen, 130, k, dtype=dtype)
    y = T.linear_swiglu(x[:64], w, config=config)
    assert y.shape == (64, f) and y.dtype == dtype
    assert_bits_on_gpu(y, A.silu_mul(T.linear(x[:64], w, config=config)), TOL[dtype])
    assert rel(y, R.linear_swiglu(x[:64], w)) < TOL[dtype]
    for m in (16, 37):
        assert_bits_on_gpu(T.linear_swiglu(x[:m], w, config=config), y[:m], TOL[dtype], m)
    for i in (0, 15, 16, 63):
        assert_bits_on_gpu(T.linear_swiglu(x[i:i + 1], w, config=config)[0], y[i], TOL[dtype], i)
    if config is None:
        yw = T.linear_swiglu(x, w, wide=True)
        assert_bits_on_gpu(yw, A.silu_mul(T.linear(x, w, wide=True)), TOL[dtype])
        for i in (0, 64, 129):
            assert_bits_on_gpu(T.linear_swiglu(x[i:i + 1], w)[0], yw[i], TOL[dtype], i)
    with pytest.raises(ValueError):
        T.linear_swiglu(x[:2], w[:-1])                                     # odd rows
    with pytest.raises(ValueError, match="at most 64"):
        T.linear_swiglu(x, w)


def test_batch_invariant_dispatch(monkeypatch):
    """``kernels.linear.linear`` past 64 rows: the reference (cuBLAS on a GPU) outside
    ``batch_invariant``, the Triton kernel's wide tiles inside it (nested, per thread)."""
    import kernels.linear as L

    monkeypatch.setenv("DFLASH_KERNELS", "triton")
    gen = torch.Generator().manual_seed(5)
    w = rand(gen, 40, 32, dtype=torch.float16)
    x = rand(gen, 70, 32, dtype=torch.float16)
    assert not L.invariant()
    assert torch.equal(L.linear(x, w), R.linear(x, w))
    with L.batch_invariant():
        with L.batch_invariant():
            assert L.invariant()
        assert L.invariant() and torch.equal(L.linear(x, w), T.linear(x, w, wide=True))
    assert not L.invariant()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (16, 33, 512), (64, 48, 200)])
def test_against_reference(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x = rand(gen, m, k, dtype=dtype)
    w = rand(gen, n, k, dtype=dtype)
    assert rel(T.linear(x, w), R.linear(x, w)) < TOL[dtype]
    assert rel(T.linear(x, w, config=ALT), R.linear(x, w)) < TOL[dtype]
    assert rel(T.linear(x, w, torch.float32), R.linear(x, w, torch.float32)) < TOL[dtype]


def test_bad_arguments():
    w = torch.zeros(8, 16, device=DEV)
    with pytest.raises(ValueError):
        T.linear(torch.zeros(2, 32, device=DEV), w)                         # K mismatch
    with pytest.raises(ValueError):
        T.linear(torch.zeros(65, 16, device=DEV), w)
    with pytest.raises(ValueError):
        T.Config(24, 64)
    assert T.linear(torch.zeros(0, 16, device=DEV), w).shape == (0, 8)


def test_dispatch_and_mlp_then_norm(monkeypatch):
    """``kernels.linear.linear``: on the CPU the reference (``F.linear``); with the Triton kernels
    (``DFLASH_KERNELS=triton``: the interpreter) the skinny kernel up to 64 rows, the reference
    above; ``mlp_then_norm`` is the gate-up projection and ``silu_mul`` (``linear_swiglu``: fused
    where the skinny kernel runs, the same bits), the down projection, then ``add_rms_norm``."""
    import kernels.linear as L
    from kernels.activation import silu_mul
    from kernels.norm import add_rms_norm
    from target_service.models.layers import mlp_then_norm

    gen = torch.Generator().manual_seed(3)
    hdim, f = 32, 48
    lw = {"gate_up": rand(gen, 2 * f, hdim, dtype=torch.float16), "down": rand(gen, hdim, f, dtype=torch.float16)}
    norm = rand(gen, hdim, dtype=torch.float16)
    for mode in ("", "triton"):
        monkeypatch.setenv("DFLASH_KERNELS", mode)
        for rows in (3, 70):
            x, h = rand(gen, rows, hdim, dtype=torch.float16), rand(gen, rows, hdim, dtype=torch.float16)
            gu = L.linear(h, lw["gate_up"])
            want = L.linear(silu_mul(gu), lw["down"])
            tri = rows <= 64 and (mode == "triton" or DEV == "cuda")
            assert torch.equal(want, (T if tri else R).linear(silu_mul(gu), lw["down"])), (mode, rows)
            assert torch.equal(L.linear_swiglu(h, lw["gate_up"]), silu_mul(gu)), (mode, rows)
            xo, ho = mlp_then_norm(x, h, lw, norm, 1e-6)
            xw, hw = add_rms_norm(x, want, norm, 1e-6)
            assert torch.equal(xo, xw) and torch.equal(ho, hw)


def test_config_table_and_override(monkeypatch, tmp_path):
    bf = torch.bfloat16
    assert T.default_config(2560, 9216, bf) == T.Config(16, 256, 4, 3)
    assert T.config_for(2560, 9216, bf) == T.CONFIGS[(2560, 9216)]          # the tuned table
    assert T.config_for(2560, 9217, bf) == T.default_config(2560, 9217, bf)  # absent: the rule
    assert T.config_for(8192, 1024, bf).block_n == 32 and T.config_for(248320, 1024, bf).block_n == 64
    assert T.config_for(1024, 1024, torch.float32) == T.Config(16, 128, 4, 3)

    monkeypatch.setitem(T.CONFIGS, (2560, 9216), T.Config(16, 512, 8, 4))
    assert T.config_for(2560, 9216, bf) == T.Config(16, 512, 8, 4)
    assert T.config_for(2560, 9216, torch.float16) == T.Config(16, 512, 8, 4)
    assert T.config_for(2560, 9216, torch.float32) == T.default_config(2560, 9216, torch.float32)

    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"device": "x", "configs": [
        {"N": 2560, "K": 9216, "dtype": "bfloat16", "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 2, "num_stages": 5, "uses": ["a"]},
        {"N": 40, "K": 96, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2, "num_stages": 2},
    ]}))
    monkeypatch.setenv(T.CONFIG_ENV, str(path))
    assert T.config_for(2560, 9216, bf) == T.Config(32, 128, 2, 5)          # the file beats the table
    assert T.config_for(2560, 4096, bf) == T.CONFIGS[(2560, 4096)]          # absent from the file: the table

    seen = []
    real = T._launch
    monkeypatch.setattr(T, "_launch", lambda *a: (seen.append(a[6]), real(*a))[1])
    gen = torch.Generator().manual_seed(0)
    x, w = rand(gen, 2, 96, dtype=torch.float16), rand(gen, 40, 96, dtype=torch.float16)
    T.linear(x, w)
    assert seen == [T.Config(16, 64, 2, 2)]                                  # the kernel runs it

    lst = tmp_path / "list.json"                                             # a bare list works too
    lst.write_text(json.dumps([{"N": 1, "K": 2, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1}]))
    assert T.load_config_file(str(lst)) == {(1, 2): T.Config(16, 16, 1, 1)}
    for bad in ("{", json.dumps({"configs": [{"N": 1, "K": 2}]}), json.dumps({"configs": [
            {"N": 1, "K": 2, "BLOCK_N": 48, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}]}), json.dumps({"configs": [
            {"N": 1, "K": 2, "dtype": "float32", "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}]})):
        p = tmp_path / "bad.json"
        p.write_text(bad)
        T.load_config_file.cache_clear()
        monkeypatch.setenv(T.CONFIG_ENV, str(p))
        with pytest.raises(ValueError):
            T.config_for(1, 2, bf)
    monkeypatch.setenv(T.CONFIG_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError):
        T.config_for(1, 2, bf)


def test_sweep_rule_and_candidates():
    """tools/sweep_linear.py's pure parts: the choice rule and the candidate pruning."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import sweep_linear as S

    times = {"a": {1: 10.0, 16: 12.0}, "b": {1: 9.0, 16: 14.0}, "d": {1: 10.1, 16: 12.1}}
    win, score = S.choose(times, {1: 1.0, 16: 1.0}, "d", 0.03)
    assert win == "d" and min(score, key=score.get) == "a"      # within 3% of the best: keep the default
    assert S.choose(times, {1: 1.0, 16: 1.0}, "d", 0.0)[0] == "a"
    for n, k in ((2560, 9216), (248320, 4096), (576, 576)):
        cs = S.candidates(n, k, S.H200_SMS, S.H200_SMEM)
        assert T.default_config(n, k, torch.bfloat16) in cs and len(set(cs)) == len(cs)
        assert all(S.smem_bytes(c.block_n, c.block_k, c.num_stages) <= S.H200_SMEM for c in cs)
        assert all(c.block_n == 16 or -(-n // c.block_n) >= S.H200_SMS for c in cs)
    uses = S.model_uses(["0.8b"])
    assert sum(u.count for u in uses) == 97                      # the profile's 97 projections
    assert {(u.name, u.n, u.k) for u in uses} >= {("down", 1024, 3584), ("gate_up", 7168, 1024), ("lm_head", 248320, 1024)}

"""The skinny Triton linear kernel (``kernels/linear/triton.py``): bit-exactness across the number of
rows, the fused SwiGLU prologue against ``silu_mul`` + the kernel, accuracy against the reference,
and the config table / ``DFLASH_LINEAR_CONFIG`` override.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``),
small shapes only; float16 and float32 (the interpreter's bfloat16 ``dot`` is broken, as
tests/test_kernels.py notes). The interpreter shows the kernel's *logic* is row-independent and
that the fused prologue feeds the dot the very tile ``silu_mul`` stores; the same tests on a GPU
exercise the compiled kernels (and ``tools/sweep_linear.py`` re-checks its chosen configs there).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.activation import reference as AR  # noqa: E402
from kernels.activation import triton as AT  # noqa: E402
from kernels.linear import reference as R  # noqa: E402
from kernels.linear import triton as T  # noqa: E402

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
    """Row i of a 1-, 16-, 37- and 64-row call: the same bits (plain and SwiGLU prologue)."""
    gen = torch.Generator().manual_seed(1)
    n, k = 40, 96
    w = rand(gen, n, k, dtype=dtype)
    x = rand(gen, 64, k, dtype=dtype)
    y = T.linear(x, w, config=config)
    for m in (16, 37):
        assert torch.equal(T.linear(x[:m], w, config=config), y[:m])
    for i in (0, 1, 15, 16, 17, 40, 63):
        assert torch.equal(T.linear(x[i:i + 1], w, config=config)[0], y[i]), i
    gu = rand(gen, 64, 2 * k, dtype=dtype)
    yg = T.linear(gu, w, prologue="swiglu", config=config)
    assert torch.equal(T.linear(gu[:16], w, prologue="swiglu", config=config), yg[:16])
    for i in (0, 15, 16, 63):
        assert torch.equal(T.linear(gu[i:i + 1], w, prologue="swiglu", config=config)[0], yg[i]), i


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 16, 37])
def test_fused_swiglu_bit_identical(dtype, m):
    """``linear(gu, w, prologue="swiglu")`` == ``linear(silu_mul(gu), w)`` bit for bit (Triton
    silu_mul, same config), for both output dtypes, with a K that is not a multiple of BLOCK_K and
    a strided input."""
    gen = torch.Generator().manual_seed(m)
    n, k = 33, 80
    w = rand(gen, n, k, dtype=dtype)
    gu = rand(gen, m, 2 * k, dtype=dtype) * 3
    for config in (None, ALT):
        for out in (None, torch.float32):
            fused = T.linear(gu, w, out, prologue="swiglu", config=config)
            assert torch.equal(fused, T.linear(AT.silu_mul(gu), w, out, config=config))
    wide = rand(gen, m, 2 * k + 8, dtype=dtype)[:, 8:]          # row stride != 2K
    assert torch.equal(T.linear(wide, w, prologue="swiglu"), T.linear(AT.silu_mul(wide.contiguous()), w))
    g3 = gu.reshape(1, m, 2 * k)                                  # leading dims kept
    assert T.linear(g3, w, prologue="swiglu").shape == (1, m, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (16, 33, 512), (64, 48, 200)])
def test_against_reference(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x = rand(gen, m, k, dtype=dtype)
    w = rand(gen, n, k, dtype=dtype)
    assert rel(T.linear(x, w), R.linear(x, w)) < TOL[dtype]
    assert rel(T.linear(x, w, config=ALT), R.linear(x, w)) < TOL[dtype]
    assert rel(T.linear(x, w, torch.float32), R.linear(x, w, torch.float32)) < TOL[dtype]
    gu = rand(gen, m, 2 * k, dtype=dtype)
    assert rel(T.linear(gu, w, prologue="swiglu"), R.linear(gu, w, prologue="swiglu")) < TOL[dtype]
    assert torch.equal(R.linear(gu, w, prologue="swiglu"), R.linear(AR.silu_mul(gu), w))


def test_bad_arguments():
    w = torch.zeros(8, 16, device=DEV)
    with pytest.raises(ValueError):
        T.linear(torch.zeros(2, 16, device=DEV), w, prologue="gelu")
    with pytest.raises(ValueError):
        T.linear(torch.zeros(2, 16, device=DEV), w, prologue="swiglu")      # needs [.., 32]
    with pytest.raises(ValueError):
        T.linear(torch.zeros(65, 16, device=DEV), w)
    with pytest.raises(ValueError):
        T.Config(24, 64)
    assert T.linear(torch.zeros(0, 16, device=DEV), w).shape == (0, 8)


def test_dispatch_and_mlp_then_norm(monkeypatch):
    """``kernels.linear.linear(.., prologue="swiglu")``: on the CPU (reference) exactly
    ``silu_mul`` then ``F.linear``, as ``mlp_then_norm`` computed before; with the Triton kernels
    (``DFLASH_KERNELS=triton``: the interpreter) the fused kernel, equal to Triton ``silu_mul`` +
    kernel; above 64 rows ``silu_mul`` + reference."""
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
            assert torch.equal(L.linear(gu, lw["down"], prologue="swiglu"), want), (mode, rows)
            xo, ho = mlp_then_norm(x, h, lw, norm, 1e-6)
            xw, hw = add_rms_norm(x, want, norm, 1e-6)
            assert torch.equal(xo, xw) and torch.equal(ho, hw)
            if mode == "" and DEV == "cpu":
                assert torch.equal(want, R.linear(AR.silu_mul(gu), lw["down"]))


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


def test_swiglu_falls_back_when_prologue_does_not_fit(monkeypatch):
    """A config whose SwiGLU kernel runs out of shared memory: ``silu_mul`` + the plain kernel with
    the same config (the same bits), remembered for the next call."""
    from triton.runtime.errors import OutOfResources

    real = T._launch
    calls = []

    def launch(x2, weight, y, m, n, k, cfg, swiglu):
        calls.append(swiglu)
        if swiglu:
            raise OutOfResources(300000, 232448, "shared memory")
        real(x2, weight, y, m, n, k, cfg, swiglu)

    monkeypatch.setattr(T, "_launch", launch)
    monkeypatch.setattr(T, "_UNFUSABLE", set())
    gen = torch.Generator().manual_seed(5)
    gu, w = rand(gen, 4, 64, dtype=torch.float16), rand(gen, 24, 32, dtype=torch.float16)
    want = T.linear(AT.silu_mul(gu), w)
    assert torch.equal(T.linear(gu, w, prologue="swiglu"), want)
    assert torch.equal(T.linear(gu, w, prologue="swiglu"), want)
    assert calls == [False, True, False, False]


def test_sweep_rule_and_candidates():
    """tools/sweep_linear.py's pure parts: the choice rule and the candidate pruning."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import sweep_linear as S

    times = {"a": {1: 10.0, 16: 12.0}, "b": {1: 9.0, 16: 14.0}, "d": {1: 10.1, 16: 12.1}}
    win, score = S.choose(times, {1: 1.0, 16: 1.0}, "d", 0.03)
    assert win == "d" and min(score, key=score.get) == "a"      # within 3% of the best: keep the default
    assert S.choose(times, {1: 1.0, 16: 1.0}, "d", 0.0)[0] == "a"
    for n, k, sw in ((2560, 9216, True), (248320, 4096, False), (576, 576, False)):
        cs = S.candidates(n, k, S.H200_SMS, S.H200_SMEM, sw)
        assert T.default_config(n, k, torch.bfloat16) in cs and len(set(cs)) == len(cs)
        assert all(S.smem_bytes(c.block_n, c.block_k, c.num_stages, sw) <= S.H200_SMEM for c in cs)
        assert all(c.block_n == 16 or -(-n // c.block_n) >= S.H200_SMS for c in cs)
    uses = S.model_uses(["0.8b"])
    assert sum(u.count for u in uses) == 97                      # the profile's 97 projections
    assert {(u.name, u.n, u.k) for u in uses} >= {("down", 1024, 3584), ("gate_up", 7168, 1024), ("lm_head", 248320, 1024)}

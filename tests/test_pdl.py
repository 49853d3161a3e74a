"""Programmatic dependent launch (``kernels.pdl``): when it is on, and, on a GPU of compute
capability 9.0 or later, the same bits with and without it, eagerly and in a CUDA graph whose
kernels launch early and wait for the one before them (a chain where every kernel reads what the
previous one wrote, so a kernel that read before its wait would read stale values)."""

from __future__ import annotations

import pytest
import torch

from kernels import pdl

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9


def test_enabled_rules(monkeypatch):
    """Off for CPU tensors and under Triton's interpreter; ``DFLASH_PDL=0`` turns it off; on a
    CUDA device it follows the compute capability."""
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch(torch.zeros(1)) == {"PDL": False}
    if CUDA:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        dev = torch.device("cuda")
        assert pdl.enabled(dev) == HOPPER
        for off in ("0", "off", "false"):
            monkeypatch.setenv(pdl.ENV, off)
            assert not pdl.enabled(dev)
        monkeypatch.setenv(pdl.ENV, "1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not pdl.enabled(dev)


def _chain(x, w, g, n: int):
    """``n`` rounds of norm -> projection -> SwiGLU-free residual add, each kernel reading the
    previous kernel's output (kernels.norm, kernels.linear)."""
    from kernels.linear import linear
    from kernels.norm import add_rms_norm, rms_norm

    h = rms_norm(x, g, 1e-6)
    for _ in range(n):
        d = linear(h, w)
        x, h = add_rms_norm(x, d, g, 1e-6)
    return x, h


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a CUDA device of compute capability >= 9.0")
def test_same_bits_with_and_without_pdl(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator(device="cuda").manual_seed(3)
    k = 576
    x = torch.randn(5, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(k, k, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    g = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(pdl.ENV, mode)
        eager = _chain(x, w, g, 40)
        xs = x.clone()
        _chain(xs, w, g, 2)                      # warm-up (compiles) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _chain(xs, w, g, 40)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        out[mode] = (eager, captured)
    for a, b in zip(out["0"][0] + out["0"][1], out["1"][0] + out["1"][1]):
        assert torch.equal(a, b)
    assert torch.equal(out["1"][0][1], out["1"][1][1])

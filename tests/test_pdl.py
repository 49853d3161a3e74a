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


@pytest.fixture(autouse=True)
def _fresh_choice():
    """Each test reads the environment anew, and leaves no choice it made behind."""
    pdl.refresh()
    yield
    pdl.refresh()


def test_choice_made_once_per_device(monkeypatch):
    """``enabled`` is on every launch's path, so it decides once per device and answers from its
    cache after; ``refresh`` makes it read the environment again (a CUDA device faked on the CPU:
    compute capability 9.0, not under the interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(pdl, "triton_supports", lambda: True)
    monkeypatch.delenv(pdl.ENV, raising=False)
    dev = torch.device("cuda", 0)
    assert pdl.enabled(dev) and pdl.options(dev) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.enabled(dev)                        # (the choice made at the first call)
    pdl.refresh()
    assert not pdl.enabled(dev) and pdl.options(dev) == {"PDL": False}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.delenv(pdl.ENV)
    pdl.refresh()
    assert not pdl.enabled(dev)                    # (an A100)


def test_enabled_rules(monkeypatch):
    """Off for CPU tensors, under Triton's interpreter and with a Triton without PDL;
    ``DFLASH_PDL=0`` turns it off; on a CUDA device it follows the compute capability."""
    monkeypatch.delenv(pdl.ENV, raising=False)
    import triton

    if triton.__version__ == "3.6.0":            # (the version pyproject.toml pins has it)
        assert pdl.triton_supports()
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch(torch.zeros(1)) == {"PDL": False}
    if CUDA:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        dev = torch.device("cuda")
        assert pdl.enabled(dev) == HOPPER
        for off in ("0", "off", "false"):
            monkeypatch.setenv(pdl.ENV, off)
            pdl.refresh()
            assert not pdl.enabled(dev)
        monkeypatch.setenv(pdl.ENV, "1")
        monkeypatch.setattr(pdl, "triton_supports", lambda: False)
        pdl.refresh()
        assert not pdl.enabled(dev)                # (an older Triton: launched as before)
        monkeypatch.undo()
        for on in ("1", "true"):                   # (as Triton reads it)
            monkeypatch.setenv("TRITON_INTERPRET", on)
            pdl.refresh()
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
        pdl.refresh()
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


def test_every_pdl_launch_waits_first():
    """A kernel launched with ``**pdl.launch(...)`` may start before the kernel ahead of it has
    finished, so it must wait before it touches memory: every such kernel (in ``kernels/``) takes
    the ``PDL`` constexpr and its first statement (after the docstring) is ``gdc_enter(PDL)``; and
    every kernel with that statement is launched so somewhere (else it would never overlap; a
    launch without PDL stays safe: ``PDL=False`` compiles the wait out). Read from the
    source with ``ast``: a kernel added later without the wait fails here, on any machine."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "kernels"
    defs, launched = {}, {}
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                body = node.body[1:] if (isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                                         and isinstance(node.body[0].value.value, str)) else node.body
                first = body[0] if body else None
                enters = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                          and getattr(first.value.func, "id", None) == "gdc_enter"
                          and [ast.unparse(a) for a in first.value.args] == ["PDL"])
                params = {a.arg for a in node.args.args + node.args.kwonlyargs}
                defs[node.name] = (enters and "PDL" in params, f"{path.name}:{node.lineno}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name)):
                pdl_kw = any(k.arg is None and isinstance(k.value, ast.Call)
                             and ast.unparse(k.value.func) == "pdl.launch" for k in node.keywords)
                launched.setdefault(node.func.value.id, set()).add(pdl_kw)
    with_pdl = {name for name, kinds in launched.items() if True in kinds}
    assert len(with_pdl) >= 20
    for name in with_pdl:
        assert name in defs and defs[name][0], f"{name} is launched with PDL but does not wait first ({defs.get(name)})"
    entering = {name for name, (ok, _) in defs.items() if ok and name != "gdc_enter"}
    for name in entering:
        assert True in launched.get(name, set()), f"{name} waits for PDL but is never launched with it"

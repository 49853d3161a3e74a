"""On a GPU: the CUDA path of the qwen35 target (fla chunked prefill, reference tree verify)
matches the CPU float32 reference. Skipped without CUDA (CI); run with ``pytest -m gpu``.

Tolerances (relative, ``||a - b|| / ||b||``): fla's Triton kernels compute their dots in tf32
(10-bit mantissa), so the fla kernel alone is held to 5e-3 against a float64 recurrence; a whole
model prefilled through fla (8 layers, errors compound) to 2e-2 on a model with real-scale
weights (std 0.02); the reference tree verify on CUDA (float32, no tf32) from the same
committed state to 1e-4.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("fla")
    from target_service.models.qwen35 import Qwen35Model
    from fixtures.synth import PRESETS, write_qwen35
    from fixtures.tiny_models import write_tiny_llama

    d = tmp_path_factory.mktemp("gpu")
    tok = str(d / "tok.gguf")
    write_tiny_llama(tok)  # a small real BPE tokenizer to copy (the default model is not on GPU hosts)
    path = str(d / "q35.gguf")
    write_qwen35(path, PRESETS["tiny"], seed=4, tokenizer_from=tok, std=0.02)
    return Qwen35Model.from_gguf(path), Qwen35Model.from_gguf(path, device="cuda")


def test_fla_is_used_on_cuda(models):
    from kernels.gated_delta import fla

    assert fla.available(torch.device("cuda"))


@pytest.mark.parametrize("n,heads,dim", [(1, 4, 16), (63, 4, 16), (64, 4, 16), (65, 16, 128), (200, 16, 128)])
def test_fla_kernel_matches_reference(n, heads, dim):
    from kernels.gated_delta import fla, l2norm, recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(n)
    q = l2norm(torch.randn(n, heads, dim, generator=gen, dtype=torch.float64)) / dim**0.5
    k = l2norm(torch.randn(n, heads, dim, generator=gen, dtype=torch.float64))
    v = torch.randn(n, heads, dim, generator=gen, dtype=torch.float64)
    g = -torch.rand(n, heads, generator=gen, dtype=torch.float64)
    beta = torch.rand(n, heads, generator=gen, dtype=torch.float64)
    s0 = torch.randn(heads, dim, dim, generator=gen, dtype=torch.float64) * 0.1
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o, s1 = fla.chunk_gated_delta_rule(*(x.float().cuda() for x in (q, k, v, g, beta, s0)))
    assert rel(o, o_ref) < 5e-3
    assert rel(s1, s_ref) < 5e-3


@pytest.mark.parametrize("n", [1, 64, 65, 200])
def test_cuda_prefill_matches_cpu(models, n):
    from runtime.tree import chain

    cpu, gpu = models
    ids = torch.randint(0, cpu.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    outs = []
    for m in (cpu, gpu):
        cache = m.new_cache(512)
        tr = chain(ids.tolist(), m.device)
        out = m.forward(tr.tokens, torch.arange(n, device=m.device), tr.ancestors, cache)
        m.commit(cache, out, torch.arange(n, device=m.device))
        outs.append((out.logits, cache))
    (lc, cc), (lg, cg) = outs
    assert rel(lg, lc) < 2e-2
    for i in cc.recurrent:
        assert rel(cg.recurrent[i], cc.recurrent[i]) < 2e-2
        assert rel(cg.conv[i], cc.conv[i]) < 2e-2


def _copy_state(src, dst):
    dst.ensure(src.length)
    for i in src.k:
        dst.k[i][:, : src.length] = src.k[i][:, : src.length].to(dst.device)
        dst.v[i][:, : src.length] = src.v[i][:, : src.length].to(dst.device)
    for i in src.recurrent:
        dst.recurrent[i].copy_(src.recurrent[i])
        dst.conv[i].copy_(src.conv[i])
    dst.length = src.length


def test_cuda_tree_verify_and_commit_match_cpu(models):
    """From the same committed state: tree logits and the committed state after a partial path."""
    from runtime.tree import chain, tree_tensors

    cpu, gpu = models
    rng = random.Random(0)
    prompt = [rng.randrange(cpu.cfg.vocab_size) for _ in range(100)]
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 0, 8]
    tokens = [rng.randrange(cpu.cfg.vocab_size) for _ in parents]
    base = cpu.new_cache(256)
    tr = chain(prompt)
    cpu.commit(base, cpu.forward(tr.tokens, torch.arange(100), tr.ancestors, base), torch.arange(100))
    res = []
    for m in (cpu, gpu):
        cache = m.new_cache(256)
        _copy_state(base, cache)
        tree = tree_tensors(tokens, parents, m.device)
        out = m.forward(tree.tokens, 100 + tree.depth, tree.ancestors, cache, parents=parents)
        m.commit(cache, out, torch.tensor([0, 1, 3, 6], device=m.device))
        res.append((out.logits, cache))
    (lc, cc), (lg, cg) = res
    assert cg.length == cc.length == 104
    assert rel(lg, lc) < 1e-4
    for i in cc.recurrent:
        assert rel(cg.recurrent[i], cc.recurrent[i]) < 1e-4
        assert rel(cg.conv[i], cc.conv[i]) < 1e-4
    for i in cc.k:
        assert rel(cg.k[i][:, :104], cc.k[i][:, :104]) < 1e-4


def test_cuda_engine_lossless(models):
    from target_service.engine import Sampling, TargetEngine

    _, gpu = models
    engine = TargetEngine(gpu, max_sessions=2, max_context=256, max_tree_width=32)
    s = Sampling.checked(0.0, 0, 0.0, 0)
    prompt = list(range(10, 40))
    ref = [engine.prefill("ar", prompt, s, []).first_token]
    while len(ref) < 30:
        ref.append(engine.verify("ar", [ref[-1]], [-1]).bonus_token)
    engine.release(["ar"])
    got = [engine.prefill("sp", prompt, s, []).first_token]
    while len(got) < 30:
        draft = ref[len(got) : len(got) + 6]
        v = engine.verify("sp", [got[-1], *draft], list(range(-1, len(draft))))
        got += v.accepted_tokens + [v.bonus_token]
    assert got[:30] == ref

"""Sampling is lossless: the emitted token's distribution equals the target's softmax.

Chi-square goodness-of-fit tests on a tiny llama target (fixtures/tiny_models.py), several thousand
samples each. Seeds are fixed, so each test is deterministic; the threshold p > 1e-3 is the
test's significance level.
"""

from __future__ import annotations

import pytest
import torch

from kernels.sampling import filter_thresholds, filtered_logprobs, sample_tokens, select_tokens
from kernels.sampling.reference import sampling_tensors
from target_service.engine import Sampling, TargetEngine
from target_service.models.llama import LlamaModel
from runtime.tree import chain

N_SAMPLES = 3000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (cells with
    expected count < 5 pooled into one, as usual)."""
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if exp[-1] == 0:
        assert obs[-1] == 0, "a token of probability 0 was sampled"
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(1 - torch.distributions.Chi2(torch.tensor(float(df), dtype=torch.float64)).cdf(stat))


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    assert tiny_llama.vocab == 300                     # the shared tiny target (tests/conftest.py)
    model = LlamaModel.from_gguf(str(tiny_llama.path))
    return TargetEngine(model, max_sessions=2, max_context=64, max_tree_width=16)


def _next_logits(engine: TargetEngine, prefix: list[int]) -> torch.Tensor:
    cache = engine.model.new_cache(64)
    tr = chain(prefix)
    return engine.model.forward(tr.tokens, torch.arange(len(prefix)), tr.ancestors, cache).logits[-1]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.0), (0.7, 20, 0.9)])
def test_sampler_matches_softmax(tiny_engine, temperature, top_k, top_p):
    logits = _next_logits(tiny_engine, [5, 17, 42]).unsqueeze(0)
    probs = filtered_logprobs(logits, temperature, top_k, top_p)[0].exp()
    # N_SAMPLES seeds in one call of the kernels that select_tokens runs (row r: seed r, position
    # 3; rows are independent), ...
    rows = logits.expand(N_SAMPLES, -1)
    inv_t, k, p, _ = sampling_tensors(N_SAMPLES, logits.device, temperature, top_k, top_p, 0)
    tokens = sample_tokens(rows, inv_t, filter_thresholds(rows, inv_t, k, p), torch.arange(N_SAMPLES),
                           torch.full((N_SAMPLES,), 3))
    # ... the tokens select_tokens gives one seed at a time
    for seed in range(0, N_SAMPLES, 97):
        assert int(select_tokens(logits, [3], temperature, top_k, top_p, seed)[0]) == int(tokens[seed]), seed
    counts = torch.bincount(tokens, minlength=probs.numel()).to(probs.dtype)
    assert chi_square_p(counts, probs) > 1e-3
    assert counts[probs == 0].sum() == 0


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.0), (0.8, 0, 0.9)])
def test_tree_verify_emits_target_distribution(tiny_engine, monkeypatch, temperature, top_k, top_p):
    """Verify a tree whose root has the target's favourite token, decoys and a deeper chain as
    children: the first emitted token (accepted child or bonus) ~ the target's softmax."""
    prompt, root = [5, 17, 42], 7
    logits = _next_logits(tiny_engine, prompt + [root])
    probs = filtered_logprobs(logits.unsqueeze(0), temperature, top_k, top_p)[0].exp()
    favourite = int(probs.argmax())
    children = [favourite, 11, 200, 299]
    tokens = [root, *children, 3, 4]
    parents = [-1, 0, 0, 0, 0, 1, 5]
    counts = torch.zeros_like(probs)
    accepted = 0
    # One prefill, then one verify per seed from the same state (white-box): the cache rows after
    # the prompt are identical for every seed and the prefill's own sample is overwritten by the
    # fixed root, so each iteration rewinds the session to just after the prompt (rows past
    # cache.length are never read) and swaps in the seed. Each verify sees exactly what a fresh
    # prefill + verify with that seed would (same cache, positions and Philox counters), and so
    # its tree forward (same tokens over the same cache rows) is the same every time: it runs
    # once and is reused (the commit copies rows out of it, never writes it). What depends on the
    # seed, the engine's sampling, acceptance walk and commit, runs for every seed.
    sid = "s"
    tiny_engine.prefill(sid, prompt, Sampling(temperature, top_k, top_p, 0), [])
    session = tiny_engine.sessions[sid]
    committed = session.length
    forward, memo = tiny_engine.model.forward, []

    def forward_once(tree_tokens, positions, mask, cache, *args, **kw):
        assert cache is session.cache and cache.length == committed and tree_tokens.tolist() == tokens
        if not memo:
            memo.append(forward(tree_tokens, positions, mask, cache, *args, **kw))
        return memo[0]

    monkeypatch.setattr(tiny_engine.model, "forward", forward_once)
    try:
        for seed in range(N_SAMPLES):
            session.cache.length = committed
            session.sampling = Sampling(temperature, top_k, top_p, seed)
            session.root = root  # fix the prefix: the root is not sampled here
            out = tiny_engine.verify(sid, tokens, parents)
            assert out.committed_length == committed + 1 + len(out.accepted_tokens)
            first = (out.accepted_tokens + [out.bonus_token])[0]
            accepted += bool(out.accepted_tokens)
            counts[first] += 1
    finally:
        monkeypatch.undo()
        tiny_engine.release([sid])
    assert 0 < accepted < N_SAMPLES, "both accepted and rejected paths must occur"
    assert chi_square_p(counts, probs) > 1e-3
    # The test has power: the same counts are far from a distribution that favours the drafts.
    biased = probs.clone()
    biased[children] += 0.05
    assert chi_square_p(counts, biased / biased.sum()) < 1e-6

"""End to end through the three services with a synthetic qwen35 (hybrid) target and a drafter
for it: speculative output equals target-only output."""

from __future__ import annotations

import time

import pytest

import client as sdk
from client.launcher import ServiceGroup, dflash_services, free_ports

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen35_services(tmp_path_factory):
    from draft_service.init_random import write_random_drafter
    from fixtures.synth import PRESETS, write_qwen35

    d = tmp_path_factory.mktemp("q35e2e")
    target = str(d / "qwen35-tiny.gguf")
    drafter = str(d / "qwen35-tiny-drafter.gguf")
    write_qwen35(target, PRESETS["tiny"], seed=1)
    write_random_drafter(target, drafter, layers=1, seed=1)
    ports = free_ports(3)
    # No Propose deadline (the step timeout still holds): these tests assert that drafting happens,
    # and the tiny drafter's ~50 ms round trips give a ~200 ms deadline that a busy 2-core runner
    # misses, which turns drafting off for the request (tests/test_draft_deadline.py covers that).
    services = dflash_services(target, drafter, ports=ports, orchestrator_args=["--draft-deadline-factor", "0"])
    with ServiceGroup(services, grace=5.0) as group:
        group.wait_healthy(timeout=300)
        with sdk.Client(f"127.0.0.1:{ports[2]}", timeout=300) as c:
            yield c


def test_info_is_qwen35(qwen35_services):
    # the orchestrator finds the drafter with its probes (backing off while the drafter starts):
    # on a busy runner its health may come before the probe that sees it
    deadline = time.monotonic() + 60
    while not (info := qwen35_services.info()).drafter.available and time.monotonic() < deadline:
        time.sleep(0.25)
    assert info.target.architecture == "qwen35"
    assert info.drafter.available and info.drafter.compatible


@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "The capital of France is", "Once upon a time", "1, 2, 3, 4,"])
def test_speculative_equals_target_only(qwen35_services, prompt):
    spec = qwen35_services.generate(prompt, max_tokens=24, ignore_eos=True)
    ar = qwen35_services.generate(prompt, max_tokens=24, ignore_eos=True, speculative=False)
    assert len(spec.token_ids) == 24
    assert spec.token_ids == ar.token_ids
    assert spec.stats.drafts > 0 and ar.stats.drafts == 0


def test_trees_equal_target_only(qwen35_services):
    for prompt in ["def fibonacci(n):", "1, 2, 3, 4,"]:
        tree = qwen35_services.generate(prompt, max_tokens=24, ignore_eos=True, tree_budget=20, top_k_draft=3)
        ar = qwen35_services.generate(prompt, max_tokens=24, ignore_eos=True, speculative=False)
        assert tree.token_ids == ar.token_ids
        assert tree.stats.draft_tokens > tree.stats.drafts * 15


def test_seeded_sampling_equals_target_only(qwen35_services):
    # top_k 20 then top_p 0.9: the random target's logits are nearly flat, so top_p alone keeps
    # ~90% of the 49152 tokens and the sampler draws Philox noise for all of them at every tree
    # node (on a busy 2-core CPU: 4 s per 16-node verify, 38 s for this request; 7 s with top_k)
    kw = dict(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=5, ignore_eos=True)
    spec = qwen35_services.generate("Hello", **kw)
    assert spec.token_ids == qwen35_services.generate("Hello", speculative=False, **kw).token_ids
    assert spec.stats.drafts > 0

"""The feature ring through the services as processes (runtime.feature_ring; docs/ARCHITECTURE.md,
"The feature ring"): with the batched target engine on the CPU (a shared-file ring), the three
services on one host, and the target in the orchestrator's process, the drafter reads the verified
rows from the ring (the scheduler counts them), and speculative output equals target-only output,
greedy and seeded. With the ring off, no row goes through it and the output is the same."""

from __future__ import annotations

import time

import pytest

import client as sdk
from client.launcher import ServiceGroup, dflash_services, free_ports

pytestmark = pytest.mark.slow


def _decode(api):
    deadline = time.monotonic() + 60
    while not (info := api.info()).drafter.available and time.monotonic() < deadline:
        time.sleep(0.25)
    assert info.drafter.available and info.drafter.compatible
    out = []
    for ids in ([5, 6, 7, 8], [9, 10, 11]):
        spec = api.generate(tokens=ids, max_tokens=24, ignore_eos=True)
        ar = api.generate(tokens=ids, max_tokens=24, ignore_eos=True, speculative=False)
        assert spec.token_ids == ar.token_ids and len(ar.token_ids) == 24
        assert spec.stats.drafts > 0 and ar.stats.drafts == 0
        out.append(spec.token_ids)
    kw = dict(tokens=[3, 4, 5], max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    assert api.generate(**kw).token_ids == api.generate(speculative=False, **kw).token_ids
    return out, api.info().scheduler.ring_rows


@pytest.mark.parametrize("layout", ["three", "colocated", "ring-off", "drafter-refuses"])
def test_services_read_rows_from_the_ring_losslessly(tiny_llama, tiny_drafter, layout):
    """``drafter-refuses``: the draft service reads no ring (``--no-feature-ring``), as one on
    another GPU: the first items naming ring rows are refused, the orchestrator stops asking and
    sends the rows, the sessions are re-created from recomputed rows and speculation goes on."""
    ports = free_ports(3)
    services = dflash_services(str(tiny_llama.path), tiny_drafter, ports=ports, colocate=layout == "colocated",
                               target_args=["--max-sessions", "2", "--engine", "batched", "--max-context", "256"],
                               orchestrator_args=["--no-feature-ring"] if layout == "ring-off" else (),
                               draft_args=["--no-feature-ring"] if layout == "drafter-refuses" else ())
    with ServiceGroup(services, grace=5.0) as group:
        group.wait_healthy(timeout=300)
        with sdk.Client(services[-1].address, timeout=120) as api:
            _, ring_rows = _decode(api)
            fallbacks = api.info().scheduler.draft_fallbacks
    if layout == "ring-off":
        assert ring_rows == 0
    elif layout == "drafter-refuses":
        assert 0 < ring_rows <= 2 * 24 and fallbacks >= 1, (ring_rows, fallbacks)   # named once, refused, then bytes
    else:
        assert ring_rows > 0, "the drafter read no row from the feature ring"
        assert fallbacks == 0
    _RING_ROWS[layout] = ring_rows


#: rows the Proposes named in the ring, per layout run above (the same requests, greedy: the same
#: rows wherever the target runs)
_RING_ROWS: dict[str, int] = {}


def test_three_processes_put_the_prompts_on_the_ring_as_the_colocated_target_does():
    """With three processes the orchestrator's Prefill goes over the target's same-host hop, where
    the target honours ``feature_ring``: the prompts' rows reach the drafter through the ring, as
    with the target in the orchestrator's process, so both name the same rows (before, the
    prompts went as bytes with three processes: 55 rows against 61)."""
    if "three" not in _RING_ROWS or "colocated" not in _RING_ROWS:
        pytest.skip("needs both layouts of the test above in this run")
    assert _RING_ROWS["three"] == _RING_ROWS["colocated"], _RING_ROWS

"""Prometheus metrics of the orchestrator (served on ``--metrics-port`` when given)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter("dflash_requests_total", "Generate requests by outcome (OK or a gRPC status name)", ["outcome"])
GENERATED = Counter("dflash_generated_tokens_total", "Tokens emitted to clients")
PROMPT = Counter("dflash_prompt_tokens_total", "Prompt tokens prefilled")
DRAFT_TOKENS = Counter("dflash_draft_tokens_total", "Draft tokens sent to verify")
ACCEPTED = Counter("dflash_accepted_tokens_total", "Draft tokens accepted")
FORWARDS = Counter("dflash_target_forwards_total", "Target verify forwards")
FALLBACKS = Counter("dflash_draft_fallbacks_total", "Requests that went on without the drafter after it failed")
TAU = Histogram("dflash_acceptance_length", "Tokens emitted per verify forward (tau)", buckets=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32])


def observe_request(s) -> None:
    """Add one finished request's :class:`orchestrator.stats.AcceptanceStats`."""
    REQUESTS.labels(outcome="OK").inc()
    GENERATED.inc(s.generated_tokens)
    PROMPT.inc(s.prompt_tokens)
    DRAFT_TOKENS.inc(s.draft_tokens)
    ACCEPTED.inc(s.accepted_tokens)
    FORWARDS.inc(s.target_forwards)
    FALLBACKS.inc(s.draft_fallbacks)
    for tau, count in enumerate(s.acceptance_length_histogram):
        for _ in range(count):
            TAU.observe(tau)

"""Prometheus metrics of the orchestrator (served on ``--metrics-port`` when given).

Three kinds of call feed them:

* :func:`observe_request`, once per finished request: requests, prompt and generated tokens,
  request wall time;
* :func:`observe_verify`, once per item of every verify step: the speculative-decoding counters
  (named like vLLM's ``spec_decode_*`` metrics), acceptance length, forwards, autoregressive steps;
* :func:`observe_tick`, :func:`set_queue_depth`, :func:`set_active_sessions`,
  :func:`observe_fallback`, :func:`observe_admission`: the batching scheduler, per tick or event;
* :func:`set_draft_deadline`, :func:`observe_deadline_miss`, :func:`set_draft_circuit`: the
  drafter's Propose deadline and circuit breaker (docs/ARCHITECTURE.md, "Drafter deadlines and
  circuit breaker").

The per-step functions run on the scheduler thread every tick, so they only bump pre-resolved
metric children (a label lookup happens once per label value, then is cached here). The
scheduler's per-tick calls (:func:`observe_verify_batch`, :func:`observe_tick`) go further: they
only note the tick (a list append) and the notes are added to the series in bulk by
:func:`flush`, which runs before every collection of the default registry (a scrape, or
``REGISTRY.get_sample_value``: readers never see stale values), at least every
:data:`FLUSH_INTERVAL_S` seconds from the scheduler thread (bounded memory without scrapes), and
when the scheduler goes idle. (A scrape restricted to some names, ``?name[]=...``, may collect
before the flush: its values may then lag by up to :data:`FLUSH_INTERVAL_S`.)
Every Prometheus update costs about 1-3 us on a CPU core; per item and per tick they were tens
of microseconds of every step (tools/hop_overhead.py).

Useful queries::

    rate(dflash_generated_tokens_total[1m])                                   # tokens/s
    rate(dflash_spec_decode_num_accepted_tokens_total[1m])
      / rate(dflash_spec_decode_num_draft_tokens_total[1m])                   # acceptance rate
    rate(dflash_spec_decode_num_accepted_tokens_per_pos_total[5m])
      / rate(dflash_spec_decode_num_drafted_per_pos_total[5m])                # by position
    rate(dflash_acceptance_length_sum[1m]) / rate(dflash_acceptance_length_count[1m])  # tau
    histogram_quantile(0.99, rate(dflash_scheduler_step_seconds_bucket{part="verify"}[1m]))
    dflash_draft_circuit{state="open"}                                       # 1 while no Propose is sent
"""

from __future__ import annotations

import bisect
import threading
import time

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from orchestrator.stats import bump, positions_of_ends

#: most seconds the scheduler's per-tick notes wait for :func:`flush` when nobody scrapes
FLUSH_INTERVAL_S = 0.25


class _Pending(Collector):
    """The per-tick notes not yet added to the series; as a collector of the default registry
    (registered before the series, so collected first) it flushes them before every
    collection and yields nothing itself."""

    def __init__(self):
        self.lock = threading.Lock()
        self.verify: list = []      # step lists of observe_verify_batch
        self.ticks: list = []       # (batch, draft_s, verify_s, overhead_s) of observe_tick
        self.next_flush = 0.0       # time.monotonic() of the next flush from the hot path

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        flush()
        return []


_PENDING = _Pending()
REGISTRY.register(_PENDING)

# ------------------------------------------------------------------------------ per request
REQUESTS = Counter("dflash_requests_total", "Generate requests by outcome (OK or a gRPC status name)", ["outcome"])
GENERATED = Counter("dflash_generated_tokens_total", "Tokens emitted to clients")
PROMPT = Counter("dflash_prompt_tokens_total", "Prompt tokens prefilled")
REQUEST_SECONDS = Histogram(
    "dflash_request_duration_seconds", "Wall time of a finished Generate request, seconds",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600),
)

# ------------------------------------------------------------------------------ per verify item
NUM_DRAFTS = Counter("dflash_spec_decode_num_drafts_total", "Verify items that carried a draft tree (draft_nodes > 0)")
NUM_DRAFT_TOKENS = Counter("dflash_spec_decode_num_draft_tokens_total", "Draft tokens (non-root tree nodes) sent to verify")
NUM_ACCEPTED = Counter("dflash_spec_decode_num_accepted_tokens_total", "Draft tokens accepted by verify")
ACCEPTED_PER_POS = Counter("dflash_spec_decode_num_accepted_tokens_per_pos_total",
                           "Draft tokens accepted at tree depth position+1 (position 0 = first draft token)", ["position"])
DRAFTED_PER_POS = Counter("dflash_spec_decode_num_drafted_per_pos_total",
                          "Drafts whose tree reached depth position+1 (denominator of the per-position acceptance)", ["position"])
TAU = Histogram("dflash_acceptance_length", "Tokens emitted per verify forward of one session (tau = accepted + 1)",
                buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32))
FORWARDS = Counter("dflash_target_forwards_total", "Verify items run by the target (one session's share of a forward)")
AR_STEPS = Counter("dflash_autoregressive_steps_total", "Verify items without a draft (plain autoregressive steps)")

# ------------------------------------------------------------------------------ scheduler
BATCH = Histogram("dflash_scheduler_batch_size", "Verify items per scheduler tick",
                  buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256))
STEP_SECONDS = Histogram(
    "dflash_scheduler_step_seconds", "Seconds of one scheduler tick, split by part (draft, verify, overhead)", ["part"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
QUEUE_DEPTH = Gauge("dflash_queue_depth", "Requests admitted and waiting for a session")
ACTIVE_SESSIONS = Gauge("dflash_active_sessions", "Requests decoding now (one target session each)")
FALLBACKS = Counter("dflash_draft_fallbacks_total", "Times the drafter failed and sessions went on without it, by reason", ["reason"])
ADMISSIONS = Counter("dflash_admissions_total", "Admission decisions on new requests (admitted, queued, rejected)", ["outcome"])
DEADLINE_MISSES = Counter("dflash_draft_deadline_misses_total", "Propose calls the drafter did not answer within their deadline")
DRAFT_DEADLINE = Gauge("dflash_draft_deadline_seconds", "Deadline of the latest Propose call, seconds")
CIRCUIT = Gauge("dflash_draft_circuit", "The drafter's circuit breaker: 1 for its current state (closed, half_open, open), 0 for the others",
                ["state"])
_CIRCUIT_STATES = ("closed", "half_open", "open")

_STEP_DRAFT = STEP_SECONDS.labels(part="draft")
_STEP_VERIFY = STEP_SECONDS.labels(part="verify")
_STEP_OVERHEAD = STEP_SECONDS.labels(part="overhead")
#: cached children of the per-position counters, index = position
_ACC_POS: list = []
_DRAFTED_POS: list = []
_GROW = threading.Lock()
_FALLBACK: dict = {}
_LAST: dict = {}   # the values last set by set_active_sessions / set_draft_deadline
_ADMISSION: dict = {}


def _positions(cache: list, counter: Counter, n: int) -> list:
    """``cache`` grown to at least ``n`` children of ``counter`` (label ``position`` = index)."""
    if len(cache) < n:
        with _GROW:
            while len(cache) < n:
                cache.append(counter.labels(position=str(len(cache))))
    return cache


def observe_request(s) -> None:
    """Count one finished request (an :class:`orchestrator.stats.AcceptanceStats`): one OK request,
    its prompt tokens, its generated tokens and its wall time (``wall_time_s``, seconds).

    Draft and acceptance counters are not touched here: :func:`observe_verify` counts them per step.
    """
    REQUESTS.labels(outcome="OK").inc()
    GENERATED.inc(s.generated_tokens)
    PROMPT.inc(s.prompt_tokens)
    REQUEST_SECONDS.observe(s.wall_time_s)


def observe_verify(draft_nodes: int, tree_depth: int, accepted: int) -> None:
    """Count one session's item of a verify step.

    Args:
        draft_nodes: non-root nodes of the tree sent (draft tokens); 0 is an autoregressive step.
        tree_depth: depth of the deepest node (positions ``0..tree_depth-1`` were drafted).
        accepted: draft tokens accepted (positions ``0..accepted-1``); tokens emitted = ``accepted + 1``.
    """
    observe_verify_batch(((draft_nodes, tree_depth, accepted),))


def observe_verify_batch(steps) -> None:
    """Count the items of one verify step: ``steps`` holds one ``(draft_nodes, tree_depth,
    accepted)`` per item (as :func:`observe_verify` takes them). The same series move as with
    one :func:`observe_verify` per item, in bulk at the next :func:`flush` (before any
    collection of the default registry): the scheduler calls this every tick."""
    pending = _PENDING
    with pending.lock:
        pending.verify.append(steps)
    _maybe_flush()


def _maybe_flush() -> None:
    if time.monotonic() >= _PENDING.next_flush:
        flush()


def flush() -> None:
    """Add the noted ticks (:func:`observe_verify_batch`, :func:`observe_tick`) to the series
    now; thread-safe (each note is added once). Runs by itself before every collection of the
    default registry and at least every :data:`FLUSH_INTERVAL_S` from the scheduler's calls."""
    pending = _PENDING
    with pending.lock:
        verify, ticks = pending.verify, pending.ticks
        pending.verify, pending.ticks = [], []
        pending.next_flush = time.monotonic() + FLUSH_INTERVAL_S
    if verify:
        _count_verify([step for steps in verify for step in steps])
    if ticks:
        batches: dict[int, int] = {}
        for t in ticks:
            batches[t[0]] = batches.get(t[0], 0) + 1
        for b, n in batches.items():
            _observe_n(BATCH, b, n)
        for child, i in ((_STEP_DRAFT, 1), (_STEP_VERIFY, 2), (_STEP_OVERHEAD, 3)):
            _observe_all(child, [t[i] for t in ticks])


def _count_verify(steps) -> None:
    """Bump the per-item series for ``steps`` (``(draft_nodes, tree_depth, accepted)`` each),
    each counter once by the total."""
    forwards = ar = drafts = draft_tokens = accepted_tokens = 0
    acc_ends: list[int] = []      # index = accepted draft tokens / tree depth: drafting items
    drafted_ends: list[int] = []
    taus: dict[int, int] = {}     # tau -> items
    for draft_nodes, tree_depth, accepted in steps:
        forwards += 1
        taus[accepted + 1] = taus.get(accepted + 1, 0) + 1
        if draft_nodes <= 0:
            ar += 1
            continue
        drafts += 1
        draft_tokens += draft_nodes
        accepted_tokens += accepted
        if len(acc_ends) > accepted:
            acc_ends[accepted] += 1
        else:
            bump(acc_ends, accepted)
        if len(drafted_ends) > tree_depth:
            drafted_ends[tree_depth] += 1
        else:
            bump(drafted_ends, tree_depth)
    acc_pos, drafted_pos = positions_of_ends(acc_ends), positions_of_ends(drafted_ends)
    if not forwards:
        return
    FORWARDS.inc(forwards)
    for tau, n in taus.items():
        _observe_n(TAU, tau, n)
    if ar:
        AR_STEPS.inc(ar)
    if drafts:
        NUM_DRAFTS.inc(drafts)
        NUM_DRAFT_TOKENS.inc(draft_tokens)
    if accepted_tokens:
        NUM_ACCEPTED.inc(accepted_tokens)
    for c, n in zip(_positions(_ACC_POS, ACCEPTED_PER_POS, len(acc_pos)), acc_pos):
        c.inc(n)
    for c, n in zip(_positions(_DRAFTED_POS, DRAFTED_PER_POS, len(drafted_pos)), drafted_pos):
        c.inc(n)


def _observe_all(hist: Histogram, values: list[float]) -> None:
    """``hist.observe(v)`` for every ``v`` of ``values``, as one update of its sum and of each
    bucket hit where prometheus_client's histogram is as known (:func:`_observe_n`)."""
    buckets, bounds, total = getattr(hist, "_buckets", None), getattr(hist, "_upper_bounds", None), getattr(hist, "_sum", None)
    if buckets is None or bounds is None or total is None or len(buckets) != len(bounds) or len(values) < 2:
        for v in values:
            hist.observe(v)
        return
    counts = [0] * len(bounds)
    for v in values:
        i = bisect.bisect_left(bounds, v)   # the first bound >= v, as observe's scan finds it
        if i < len(counts) and v == v:      # (NaN: no bucket, as observe)
            counts[i] += 1
    total.inc(sum(values))
    for b, n in zip(buckets, counts):
        if n:
            b.inc(n)


def _observe_n(hist: Histogram, value: float, n: int) -> None:
    """``hist.observe(value)`` ``n`` times (:func:`_observe_all`)."""
    _observe_all(hist, [value] * n)


def observe_tick(batch: int, draft_s: float, verify_s: float, overhead_s: float) -> None:
    """Count one scheduler tick that ran ``batch`` verify items; its time split into the Propose
    round trip (``draft_s``), the Verify round trip (``verify_s``) and the rest (``overhead_s``),
    all in seconds (``dflash_scheduler_step_seconds{part=...}``). Added to the series at the
    next :func:`flush` (before any collection of the default registry)."""
    pending = _PENDING
    with pending.lock:
        pending.ticks.append((batch, draft_s, verify_s, overhead_s))
    _maybe_flush()


def set_queue_depth(n: int) -> None:
    """Requests admitted and waiting for a session now (a count)."""
    QUEUE_DEPTH.set(n)


def set_active_sessions(n: int) -> None:
    """Requests decoding now (a count). (Called every scheduler loop: the gauge is set only when
    the value changed.)"""
    if _LAST.get("active") != n:
        _LAST["active"] = n
        ACTIVE_SESSIONS.set(n)


def observe_fallback(reason: str) -> None:
    """Count one draft fallback (the drafter failed; sessions went on autoregressively), by
    ``reason`` (a short fixed word, e.g. a gRPC status name: it becomes a label value)."""
    c = _FALLBACK.get(reason)
    if c is None:
        c = _FALLBACK[reason] = FALLBACKS.labels(reason=reason)
    c.inc()


def observe_admission(outcome: str) -> None:
    """Count one admission decision on a new request: ``admitted`` (a session at once),
    ``queued`` (waits for one) or ``rejected`` (queue full: RESOURCE_EXHAUSTED)."""
    c = _ADMISSION.get(outcome)
    if c is None:
        c = _ADMISSION[outcome] = ADMISSIONS.labels(outcome=outcome)
    c.inc()


def observe_deadline_miss() -> None:
    """Count one Propose call the drafter did not answer within its deadline (it also counts as a
    fallback, :func:`observe_fallback` with reason ``draft_deadline``)."""
    DEADLINE_MISSES.inc()


def set_draft_deadline(seconds: float) -> None:
    """The deadline of the Propose call being sent, seconds. (Called every tick: the gauge is set
    only when the value changed.)"""
    if _LAST.get("deadline") != seconds:
        _LAST["deadline"] = seconds
        DRAFT_DEADLINE.set(seconds)


def set_draft_circuit(state: str) -> None:
    """The drafter's circuit breaker is now in ``state`` (``closed``, ``half_open`` or ``open``)."""
    for s in _CIRCUIT_STATES:
        CIRCUIT.labels(state=s).set(1 if s == state else 0)

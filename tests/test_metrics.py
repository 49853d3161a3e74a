"""Monitoring: the orchestrator's Prometheus series, the services' step-loop collector, the
``stats --watch`` frame, the bench's concurrency sweep and PNG report (all CPU, no models)."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading

import pytest
from dflash_grpc.service_metrics import StepLoopCollector, pool_usage
from dflash_grpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from prometheus_client import REGISTRY, CollectorRegistry

from client import AcceptanceStats, Client, SchedulerStatus, ServiceInfo
from bench.serving import format_concurrency, parse_levels, run_concurrency, write_png
from client.cli import main
from client.watch import render_frame, tokens_per_second
from orchestrator import metrics
from orchestrator.stats import AcceptanceStats as ServerStats
from tests.test_client import serve_fake_generation


def _value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class _Delta:
    """Sample values of the global registry before a block, to assert on the change."""

    def __init__(self, *series: tuple):
        self.series = series

    def __enter__(self):
        self.before = {s: _value(s[0], **dict(s[1:])) for s in self.series}
        return self

    def __exit__(self, *exc):
        self.change = {s: _value(s[0], **dict(s[1:])) - v for s, v in self.before.items()}

    def __getitem__(self, name_and_labels) -> float:
        key = name_and_labels if isinstance(name_and_labels, tuple) else (name_and_labels,)
        return self.change[key]


# --------------------------------------------------------------------------------------------
# orchestrator/metrics.py


def test_observe_verify_counts_spec_decode_series():
    pos = "dflash_spec_decode_num_accepted_tokens_per_pos_total"
    dpos = "dflash_spec_decode_num_drafted_per_pos_total"
    series = [("dflash_spec_decode_num_drafts_total",), ("dflash_spec_decode_num_draft_tokens_total",),
              ("dflash_spec_decode_num_accepted_tokens_total",), ("dflash_target_forwards_total",),
              ("dflash_autoregressive_steps_total",), ("dflash_acceptance_length_count",), ("dflash_acceptance_length_sum",),
              ("dflash_acceptance_length_bucket", ("le", "1.0")), ("dflash_acceptance_length_bucket", ("le", "3.0"))]
    series += [(pos, ("position", str(p))) for p in range(4)] + [(dpos, ("position", str(p))) for p in range(4)]
    with _Delta(*series) as d:
        metrics.observe_verify(draft_nodes=12, tree_depth=3, accepted=2)  # tau 3
        metrics.observe_verify(draft_nodes=5, tree_depth=2, accepted=0)   # tau 1
        metrics.observe_verify(draft_nodes=0, tree_depth=0, accepted=0)   # autoregressive, tau 1
    assert d["dflash_spec_decode_num_drafts_total"] == 2
    assert d["dflash_spec_decode_num_draft_tokens_total"] == 17
    assert d["dflash_spec_decode_num_accepted_tokens_total"] == 2
    assert d["dflash_target_forwards_total"] == 3 and d["dflash_autoregressive_steps_total"] == 1
    assert d["dflash_acceptance_length_count"] == 3 and d["dflash_acceptance_length_sum"] == 5
    assert d[("dflash_acceptance_length_bucket", ("le", "1.0"))] == 2
    assert d[("dflash_acceptance_length_bucket", ("le", "3.0"))] == 3
    assert [d[(pos, ("position", str(p)))] for p in range(4)] == [1, 1, 0, 0]
    assert [d[(dpos, ("position", str(p)))] for p in range(4)] == [2, 2, 1, 0]


def test_observe_verify_batch_moves_the_series_as_one_call_per_item():
    """The scheduler counts a tick's items at once: every series moves as with one
    observe_verify per item (taus of several buckets, repeated values, deep and shallow trees)."""
    steps = [(12, 3, 2), (5, 2, 0), (0, 0, 0), (4, 4, 4), (12, 3, 2), (30, 11, 9), (0, 0, 0), (1, 1, 1)]
    names = ["dflash_spec_decode_num_drafts_total", "dflash_spec_decode_num_draft_tokens_total",
             "dflash_spec_decode_num_accepted_tokens_total", "dflash_target_forwards_total", "dflash_autoregressive_steps_total",
             "dflash_acceptance_length_count", "dflash_acceptance_length_sum"]
    series = [(n,) for n in names] + [("dflash_acceptance_length_bucket", ("le", b)) for b in ("1.0", "2.0", "3.0", "5.0", "10.0", "+Inf")]
    series += [(f"dflash_spec_decode_num_{k}_per_pos_total", ("position", str(p)))
               for k in ("accepted_tokens", "drafted") for p in range(12)]
    with _Delta(*series) as one_by_one:
        for s in steps:
            metrics.observe_verify(*s)
    with _Delta(*series) as batched:
        metrics.observe_verify_batch(steps)
    assert batched.change == one_by_one.change
    assert batched["dflash_acceptance_length_count"] == 8 and batched["dflash_acceptance_length_sum"] == 26
    with _Delta(*series) as empty:
        metrics.observe_verify_batch([])
    assert not any(empty.change.values())


def test_bulk_histogram_updates_equal_single_observations():
    """The flush adds many observations at once (its sum and each bucket once): the samples equal
    those of one observe() per value, boundaries, +Inf and repeats included."""
    from prometheus_client import Histogram

    values = [0.0, 0.0001, 0.00011, 0.00025, 0.003, 0.003, 1, 9.99, 10, 11, 1e9, 0.0002]
    buckets = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 1, 10)

    def samples(fill) -> dict:
        reg = CollectorRegistry()
        h = Histogram("h", "h", buckets=buckets, registry=reg)
        fill(h)
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in reg.collect() for s in m.samples
                if not s.name.endswith("_created")}

    want = samples(lambda h: [h.observe(v) for v in values])
    assert samples(lambda h: metrics._observe_all(h, values)) == want
    assert samples(lambda h: [metrics._observe_n(h, v, 1) for v in values]) == want
    assert samples(lambda h: metrics._observe_n(h, 10, 5)) == samples(lambda h: [h.observe(10) for _ in range(5)])


def test_scheduler_notes_are_flushed_before_every_read():
    """observe_tick / observe_verify_batch only note the tick; any read of the default registry
    sees it (the pending notes are flushed first), and a flush adds each note once."""
    series = [("dflash_scheduler_batch_size_count",), ("dflash_target_forwards_total",)]
    with _Delta(*series) as d:
        metrics.observe_tick(3, 0.001, 0.002, 0.0001)
        metrics.observe_verify_batch([(4, 4, 2)] * 3)
        metrics.flush()
        metrics.flush()
    assert d["dflash_scheduler_batch_size_count"] == 1 and d["dflash_target_forwards_total"] == 3


def test_observe_request_counts_request_level_only():
    s = ServerStats(requests=1, prompt_tokens=7, generated_tokens=11, wall_time_s=0.3)
    s.record_step(tree_depth=3, draft_nodes=4, accepted=2)
    series = [("dflash_requests_total", ("outcome", "OK")), ("dflash_prompt_tokens_total",), ("dflash_generated_tokens_total",),
              ("dflash_request_duration_seconds_count",), ("dflash_request_duration_seconds_sum",),
              ("dflash_spec_decode_num_draft_tokens_total",), ("dflash_target_forwards_total",), ("dflash_acceptance_length_count",)]
    with _Delta(*series) as d:
        metrics.observe_request(s)
    assert d[("dflash_requests_total", ("outcome", "OK"))] == 1
    assert d["dflash_prompt_tokens_total"] == 7 and d["dflash_generated_tokens_total"] == 11
    assert d["dflash_request_duration_seconds_count"] == 1
    assert d["dflash_request_duration_seconds_sum"] == pytest.approx(0.3)
    # per-step series move only with observe_verify
    assert d["dflash_spec_decode_num_draft_tokens_total"] == 0
    assert d["dflash_target_forwards_total"] == 0 and d["dflash_acceptance_length_count"] == 0


def test_scheduler_series():
    series = [("dflash_scheduler_batch_size_count",), ("dflash_scheduler_batch_size_sum",),
              ("dflash_scheduler_batch_size_bucket", ("le", "4.0"))]
    series += [("dflash_scheduler_step_seconds_sum", ("part", p)) for p in ("draft", "verify", "overhead")]
    series += [("dflash_scheduler_step_seconds_bucket", ("le", "0.0001"), ("part", "overhead")),
               ("dflash_scheduler_step_seconds_bucket", ("le", "10.0"), ("part", "verify")),
               ("dflash_draft_fallbacks_total", ("reason", "UNAVAILABLE")), ("dflash_draft_fallbacks_total", ("reason", "mismatch")),
               ("dflash_admissions_total", ("outcome", "admitted")), ("dflash_admissions_total", ("outcome", "rejected"))]
    with _Delta(*series) as d:
        metrics.observe_tick(4, 0.002, 0.010, 0.00005)
        metrics.observe_tick(9, 0.003, 0.020, 0.0002)
        metrics.observe_fallback("UNAVAILABLE")
        metrics.observe_fallback("UNAVAILABLE")
        metrics.observe_fallback("mismatch")
        metrics.observe_admission("admitted")
        metrics.observe_admission("rejected")
        metrics.set_queue_depth(5)
        metrics.set_active_sessions(3)
    assert d["dflash_scheduler_batch_size_count"] == 2 and d["dflash_scheduler_batch_size_sum"] == 13
    assert d[("dflash_scheduler_batch_size_bucket", ("le", "4.0"))] == 1
    assert d[("dflash_scheduler_step_seconds_sum", ("part", "draft"))] == pytest.approx(0.005)
    assert d[("dflash_scheduler_step_seconds_sum", ("part", "verify"))] == pytest.approx(0.030)
    assert d[("dflash_scheduler_step_seconds_sum", ("part", "overhead"))] == pytest.approx(0.00025)
    assert d[("dflash_scheduler_step_seconds_bucket", ("le", "0.0001"), ("part", "overhead"))] == 1
    assert d[("dflash_scheduler_step_seconds_bucket", ("le", "10.0"), ("part", "verify"))] == 2
    assert d[("dflash_draft_fallbacks_total", ("reason", "UNAVAILABLE"))] == 2
    assert d[("dflash_draft_fallbacks_total", ("reason", "mismatch"))] == 1
    assert d[("dflash_admissions_total", ("outcome", "admitted"))] == 1
    assert d[("dflash_admissions_total", ("outcome", "rejected"))] == 1
    assert _value("dflash_queue_depth") == 5 and _value("dflash_active_sessions") == 3
    metrics.set_queue_depth(0)
    metrics.set_active_sessions(0)
    assert _value("dflash_queue_depth") == 0


def test_observe_verify_positions_from_threads():
    """Per-position children grow correctly when several threads reach new depths at once."""
    name = "dflash_spec_decode_num_drafted_per_pos_total"
    before = [_value(name, position=str(p)) for p in range(40)]
    threads = [threading.Thread(target=metrics.observe_verify, args=(40, 40, 0)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [_value(name, position=str(p)) - before[p] for p in range(40)] == [8] * 40


# --------------------------------------------------------------------------------------------
# dflash_grpc/service_metrics.py


class _FakePool:
    def __init__(self, slots, free, nbytes):
        self.slots, self.free, self.nbytes = slots, free, nbytes


@dataclasses.dataclass
class _FakeLoop:
    engine: object
    ticks: int = 0
    items: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0


def _collect(loop, service) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(StepLoopCollector(loop, service))
    return reg


def test_collector_reads_loop_and_pool_at_scrape_time():
    engine = type("Engine", (), {"pool": _FakePool(16, 16, 1 << 20), "max_sessions": 16})()
    loop = _FakeLoop(engine)
    reg = _collect(loop, "target")
    lab = {"service": "target"}
    assert reg.get_sample_value("dflash_engine_ticks_total", lab) == 0
    assert reg.get_sample_value("dflash_engine_mean_batch", lab) == 0
    loop.ticks, loop.items, loop.busy_s, loop.prefill_tokens = 4, 10, 0.25, 300
    engine.pool.free = 11
    assert reg.get_sample_value("dflash_engine_ticks_total", lab) == 4
    assert reg.get_sample_value("dflash_engine_items_total", lab) == 10
    assert reg.get_sample_value("dflash_engine_busy_seconds_total", lab) == 0.25
    assert reg.get_sample_value("dflash_engine_prefill_tokens_total", lab) == 300
    assert reg.get_sample_value("dflash_engine_mean_batch", lab) == 2.5
    assert reg.get_sample_value("dflash_engine_pool_slots", lab) == 16
    assert reg.get_sample_value("dflash_engine_pool_free_slots", lab) == 11
    assert reg.get_sample_value("dflash_engine_pool_bytes", lab) == 1 << 20


def test_collector_reference_engine_and_real_step_loop():
    from runtime.step_loop import StepLoop

    class Engine:  # the reference engines' shape: max_sessions + a sessions dict, no pool
        max_sessions = 8

        def __init__(self):
            self.sessions = {"a": 1, "b": 2, "c": 3}

        def verify_batch(self, items):
            return [x * 2 for x in items]

        def release(self, ids):
            return sum(self.sessions.pop(i, None) is not None for i in ids)

    engine = Engine()
    assert pool_usage(engine) == (8, 5, None)
    loop = StepLoop(engine, name="test-metrics")
    try:
        assert loop.batch([1, 2, 3]).results == [2, 4, 6]
        loop.batch([4])
        reg = _collect(loop, "draft")
        lab = {"service": "draft"}
        assert reg.get_sample_value("dflash_engine_ticks_total", lab) == 2
        assert reg.get_sample_value("dflash_engine_items_total", lab) == 4
        assert reg.get_sample_value("dflash_engine_mean_batch", lab) == 2
        assert reg.get_sample_value("dflash_engine_busy_seconds_total", lab) >= 0
        assert reg.get_sample_value("dflash_engine_pool_free_slots", lab) == 5
        assert reg.get_sample_value("dflash_engine_pool_bytes", lab) is None
        loop.release(["a"])
        assert reg.get_sample_value("dflash_engine_pool_free_slots", lab) == 6
    finally:
        loop.stop()


def test_metrics_port_flags():
    import draft_service.__main__ as draft_main
    import target_service.__main__ as target_main

    for mod in (target_main, draft_main):
        src = open(mod.__file__).read()
        assert "--metrics-port" in mod.build_parser().format_help() and "serve_metrics(cfg.metrics_port, cfg.host" in src


# --------------------------------------------------------------------------------------------
# stats --watch


def _stats(**kw) -> AcceptanceStats:
    return AcceptanceStats(**kw)


def test_render_frame():
    prev = _stats(requests=3, generated_tokens=100)
    now = _stats(requests=5, generated_tokens=150, prompt_tokens=40, drafts=10, draft_tokens=40, accepted_tokens=12,
                 accepted_per_position=[3, 1], drafted_per_position=[4, 4, 2], mean_acceptance_length=2.2,
                 target_forwards=11, autoregressive_steps=1, draft_fallbacks=1)
    sched = SchedulerStatus(active_sessions=3, queued_requests=2, max_sessions=8, max_queue=64, ticks=120, mean_batch=2.5,
                            tree_budget_now=16, drafting=True, draft_fallbacks=2)
    assert tokens_per_second(now, prev, 2.0) == 25.0 and tokens_per_second(now, None, 2.0) is None
    frame = render_frame(now, sched, prev, 2.0, address="h:1", interval_s=2.0, clock="12:00:00")
    for needle in ["dflash-grpc stats @ h:1", "12:00:00", "25.0 tok/s", "+50 tokens, +2 requests in 2.0 s", "tau          2.200",
                   "acceptance rate 0.300", "active 3/8", "queued 2/64", "mean batch 2.50", "tree budget 16", "drafting yes",
                   "fallbacks    2", "0.750", "3/4", "1/4", "0/2"]:
        assert needle in frame, (needle, frame)
    first = render_frame(now, None, None, 0.0, error="UNAVAILABLE: down")
    assert "-- tok/s" in first and "error: UNAVAILABLE: down" in first and "not reported" in first
    assert "nothing drafted yet" in render_frame(AcceptanceStats())


class _FakeGeneration(generation_pb2_grpc.GenerationServiceServicer):
    """Generates 5 tokens per request; GetStats grows by 10 tokens per call; Info has a scheduler
    whose ``refeatures`` and ``admitted_plain`` counters grow by 1 and 2 per Info call (and its
    ``tick_seconds`` by 0.5: a server that reports its counters)."""

    def __init__(self):
        self.calls = 0
        self.infos = 0
        self.lock = threading.Lock()
        self.requests: list[generation_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        with self.lock:
            self.requests.append(request)
        yield generation_pb2.GenerateResponse(text="abc", token_ids=[1, 2, 3], prompt_tokens=2)
        yield generation_pb2.GenerateResponse(text="de", token_ids=[4, 5])
        spec = request.speculative.enabled   # 5 tokens: 2 forwards of tau 2.5 drafting, else 5 of 1
        yield generation_pb2.GenerateResponse(finished=True, finish_reason=generation_pb2.FINISH_REASON_LENGTH,
                                              stats=generation_pb2.AcceptanceStats(
                                                  requests=1, generated_tokens=5, target_forwards=2 if spec else 5,
                                                  mean_acceptance_length=2.5 if spec else 1.0, decode_time_s=0.02,
                                                  draft_time_s=0.006 if spec else 0.0, verify_time_s=0.01,
                                                  draft_compute_s=0.004 if spec else 0.0, verify_compute_s=0.008,
                                                  draft_device_s=0.002 if spec else 0.0, verify_device_s=0.005))

    def GetStats(self, request, context):
        with self.lock:
            self.calls += 1
            n = self.calls
        return generation_pb2.AcceptanceStats(requests=n, generated_tokens=10 * n, drafted_per_position=[4, 2],
                                              accepted_per_position=[3, 1], mean_acceptance_length=1.8)

    def Info(self, request, context):
        with self.lock:
            self.infos += 1
            n = self.infos
        return generation_pb2.ServiceInfo(
            target=common_pb2.ModelInfo(model_name="smol"), version="1",
            scheduler=generation_pb2.SchedulerStatus(active_sessions=2, queued_requests=1, max_sessions=4, max_queue=8,
                                                     ticks=9, mean_batch=1.5, tree_budget_now=8, drafting=True,
                                                     refeatures=n, admitted_plain=2 * n, tick_seconds=0.5 * n))


@pytest.fixture(scope="module")
def fake():
    yield from serve_fake_generation(_FakeGeneration())


def test_info_scheduler(fake):
    with Client(fake.address) as c:
        info = c.info()
    n = info.scheduler.refeatures
    assert n >= 1 and info.scheduler == SchedulerStatus(
        active_sessions=2, queued_requests=1, max_sessions=4, max_queue=8, ticks=9, mean_batch=1.5, tree_budget_now=8,
        drafting=True, draft_fallbacks=0, refeatures=n, admitted_plain=2 * n, tick_seconds=0.5 * n)
    assert "scheduler: 2/4 sessions, 1/8 queued" in info.format()
    # the counters since start that are not 0, on a line of their own
    assert f"since start: {n} drafter sessions recomputed, {2 * n} requests started plainly" in info.format()
    assert "since start" not in ServiceInfo(target=info.target, drafter=info.drafter).format()
    json.dumps(info.to_dict())


def test_cli_stats_watch(fake, capsys):
    assert main(["stats", "--address", fake.address, "--watch", "--interval", "0.05", "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("dflash-grpc stats @") == 2  # piped: frames one after the other
    assert "-- tok/s" in out and "tok/s   (+10 tokens, +1 requests" in out and "active 2/4" in out and "0.750" in out
    assert main(["stats", "--address", fake.address, "--watch", "--json", "--interval", "0.05", "--count", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and rows[0]["tokens_per_second"] is None and rows[1]["tokens_per_second"] > 0
    assert rows[1]["scheduler"]["max_sessions"] == 4 and rows[1]["acceptance_per_position"] == [0.75, 0.5]
    assert main(["stats", "--address", fake.address, "--watch", "--interval", "0"]) == 1


# --------------------------------------------------------------------------------------------
# bench: concurrency sweep and PNG


def test_run_concurrency(fake, monkeypatch):
    import bench.serving as serving_bench

    assert parse_levels("1, 4,16") == [1, 4, 16]
    for bad in ("0", "a", ""):
        with pytest.raises(ValueError):
            parse_levels(bad)
    fake.requests.clear()
    first = {}
    with Client(fake.address) as c:
        for p in ("p0", "p1"):
            first[p] = c.generate(p, max_tokens=5).token_ids
    fake.requests.clear()
    # the fake's tokens do not depend on the request: a reference with one wrong prompt is 1 mismatch per request of it
    wrong = {"p0": first["p0"], "p1": [t + 1 for t in first["p1"]]}
    res = run_concurrency(fake.address, ["p0", "p1"], [1, 3], max_tokens=5, requests_per_stream=2, reference=wrong)
    assert list(res["modes"]) == ["ar", "spec"] and res["levels"] == [1, 3]
    for rows in res["modes"].values():
        assert [r["concurrency"] for r in rows] == [1, 3]
        assert [r["generated_tokens"] for r in rows] == [10, 30] and all(r["errors"] == 0 for r in rows)
        assert all(r["aggregate_tokens_per_second"] > 0 and len(r["per_stream_tokens_per_second"]) == r["concurrency"] for r in rows)
        assert [r["mismatches"] for r in rows] == [1, 3]   # stream j's requests: prompts 2j, 2j+1 (mod 2): one p1 each
        assert all(r["itl_p50_ms"] is None or r["itl_p99_ms"] >= r["itl_p50_ms"] >= 0 for r in rows)
        # every request streamed tokens, so each level has a time to first token
        assert all(r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 for r in rows)
    # tau from the requests' final statistics (tokens per verify forward over the level)
    assert [r["tau"] for r in res["modes"]["spec"]] == [pytest.approx(2.5)] * 2
    assert [r["tau"] for r in res["modes"]["ar"]] == [pytest.approx(1.0)] * 2
    # where a tick went: each request's seconds over its forwards (ms per forward), the orchestrator the rest
    t = res["modes"]["spec"][1]["tick_ms"]   # 2 forwards per request: 20 ms / 2 per tick
    assert t["tick"] == pytest.approx(10.0) and t["draft_exchange"] == pytest.approx(3.0)
    assert t["verify_exchange"] == pytest.approx(5.0) and t["orchestrator"] == pytest.approx(2.0)
    assert t["verify_device"] == pytest.approx(2.5) and t["draft_compute"] == pytest.approx(2.0)
    assert res["modes"]["ar"][0]["tick_ms"]["tick"] == pytest.approx(4.0)   # 5 forwards
    assert len(fake.requests) == 2 * (2 + 6)
    spec = [r for r in fake.requests if r.speculative.enabled]
    assert len(spec) == 8 and {r.prompt for r in fake.requests} == {"p0", "p1"}
    json.dumps(res)
    # the scheduler's counters over each level: its Info before and after (one call each)
    for rows in res["modes"].values():
        for r in rows:
            assert r["scheduler"]["refeatures"] == 1 and r["scheduler"]["admitted_plain"] == 2
            assert r["scheduler"]["ticks"] == 0 and set(r["scheduler"]) == set(SchedulerStatus.COUNTERS)
    # nothing is made of readings that say nothing: one failed, a server that does not report the
    # counters (it ticked, no tick seconds: zeros by proto3's defaults), a restart in between
    from bench.serving import _counted

    now = {k: 0.0 for k in SchedulerStatus.COUNTERS}
    later = dict(now, ticks=40, tick_seconds=0.2, refeatures=3)
    assert _counted(now, later) == dict(now, ticks=40, tick_seconds=0.2, refeatures=3)
    assert _counted(None, later) is None and _counted(now, None) is None
    assert _counted(now, dict(later, tick_seconds=0.0)) is None
    assert _counted(later, dict(later, ticks=5, tick_seconds=0.01)) is None
    table = format_concurrency(res)
    assert "spec" in table and "streams" in table and "TTFT p50" in table
    # more streams than a client process runs: spread over client processes, the same accounting
    monkeypatch.setattr(serving_bench, "STREAMS_PER_PROCESS", 2)
    fake.requests.clear()
    res = run_concurrency(fake.address, ["p0", "p1"], [3], max_tokens=5, requests_per_stream=2, reference=wrong,
                          modes={"ar": {"speculative": False}})
    (row,) = res["modes"]["ar"]
    assert row["generated_tokens"] == 30 and row["errors"] == 0 and row["mismatches"] == 3
    assert len(row["per_stream_tokens_per_second"]) == 3 and len(fake.requests) == 6


RESULT = {
    "prompts": 2, "max_tokens": 8,
    "configs": {"ar": {"tau": 1.0, "acceptance_per_depth": []},
                "chain": {"tau": 2.1, "acceptance_per_depth": [0.8, 0.5, 0.3, 0.1]},
                "tree:16:4": {"tau": 2.6, "acceptance_per_depth": [0.9, 0.6, 0.4, 0.2, 0.1]}},
}
SWEEP = {"levels": [1, 4, 16], "modes": {
    "ar": [{"concurrency": n, "aggregate_tokens_per_second": t} for n, t in ((1, 10.0), (4, 35.0), (16, 90.0))],
    "spec": [{"concurrency": n, "aggregate_tokens_per_second": t} for n, t in ((1, 20.0), (4, 60.0), (16, 120.0))],
}}


def test_write_png(tmp_path):
    pytest.importorskip("matplotlib")
    for name, sweep in (("full.png", SWEEP), ("no-sweep.png", None)):
        path = tmp_path / name
        write_png(RESULT, str(path), sweep)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_png_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(ImportError, match="needs matplotlib"):
        write_png(RESULT, str(tmp_path / "x.png"), SWEEP)
    assert main(["bench", "--png", str(tmp_path / "x.png")]) == 1  # before any service starts
    assert "--png needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()

"""When to draft (orchestrator.policy.DraftPolicy and the scheduler's use of it): the faster mode
per batch bucket, measured; the slower one re-measured now and then; lossless whatever it picks."""

from __future__ import annotations

import random
import threading
import time

import pytest

from orchestrator.policy import BARE, DRAFT, PLAIN, DraftPolicy, batch_bucket


def test_batch_bucket_is_the_power_of_two_at_or_above():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def _drive(policy: DraftPolicy, cost, batch: int, ticks: int, rng: random.Random) -> list[str]:
    """Run ``ticks`` ticks of ``batch`` requests (ids ``r0``...) as the scheduler does:
    ``cost(mode, batch) -> (tokens, seconds)`` with +-10% noise on the seconds, a drafting tick's
    tokens noted per request; the modes chosen."""
    chosen = []
    ids = [f"r{i}" for i in range(batch)]
    for _ in range(ticks):
        mode = policy.choose(batch, ids)
        tokens, seconds = cost(mode, batch)
        if mode == DRAFT:
            for r in ids:
                policy.note(r, tokens / batch)
        policy.observe(batch, mode, tokens, seconds * rng.uniform(0.9, 1.1))
        chosen.append(mode)
    return chosen


def _gpu_like(mode: str, batch: int) -> tuple[int, float]:
    """A plain tick costs 1.4 ms for one token per request; a drafting tick emits 3.7 per request
    and costs 3 ms + 1.2 ms per request (a drafter and host work that grow with the batch)."""
    if mode == PLAIN:
        return batch, 1.4e-3 + 0.05e-3 * batch
    return round(3.7 * batch), 3.0e-3 + 1.2e-3 * batch


def test_picks_the_faster_mode_per_batch_size_and_keeps_measuring_the_other():
    policy, rng = DraftPolicy(refresh=48), random.Random(0)   # (refresh 48 here: the counts below)
    one = _drive(policy, _gpu_like, 1, 500, rng)       # drafting: 3.7 / 4.2 ms; plain 1 / 1.45 ms
    eight = _drive(policy, _gpu_like, 8, 500, rng)     # drafting: 30 / 12.6 ms; plain 8 / 1.8 ms
    assert one[-400:].count(DRAFT) >= 0.95 * 400
    assert eight[-400:].count(PLAIN) >= 0.95 * 400
    # the mode not chosen is measured again, less and less often while it stays slower: the
    # interval doubles from 48 per confirming re-measurement (48, 96, 192, ... ticks)
    assert 1 <= one[-400:].count(PLAIN) <= 3
    assert policy.interval(1) >= 4 * 48 and policy.interval(8) >= 4 * 48
    rates = policy.rates()
    assert rates[1][DRAFT] > rates[1][PLAIN] and rates[8][PLAIN] > rates[8][DRAFT]


def test_follows_a_change_within_a_refresh_window():
    """The drafter's acceptance drops (a different text): drafting stops paying, and the policy
    moves to plain within about one refresh window."""
    policy, rng = DraftPolicy(refresh=32, alpha=0.5), random.Random(1)
    good = lambda mode, b: (4, 3e-3) if mode == DRAFT else (1, 1.5e-3)   # noqa: E731 - 1333 vs 667 tok/s
    bad = lambda mode, b: (1, 3e-3) if mode == DRAFT else (1, 1.5e-3)    # noqa: E731 - 333 vs 667 tok/s
    assert _drive(policy, good, 1, 200, rng)[-100:].count(DRAFT) >= 95
    after = _drive(policy, bad, 1, 200, rng)
    switched = next(i for i in range(len(after)) if after[i:].count(DRAFT) <= len(after[i:]) // 20)
    assert switched <= 2 * 32


def test_warmup_alternates_the_modes_and_skips_each_ones_first_tick():
    policy = DraftPolicy(warmup=2)
    modes = []
    for _ in range(6):
        m = policy.choose(1)
        modes.append(m)
        # the first tick of each mode is slow (a prompt's features): it must not count
        policy.observe(1, m, 1, 1.0 if modes.count(m) == 1 else 1e-3)
    assert modes == [DRAFT, PLAIN, DRAFT, PLAIN, DRAFT, PLAIN]
    assert policy.rates()[1] == {DRAFT: pytest.approx(1000.0), PLAIN: pytest.approx(1000.0)}
    with pytest.raises(ValueError):
        DraftPolicy(alpha=0.0)



def test_admits_requests_plain_where_plain_ticks_are_faster_with_a_probe_per_refresh():
    """A request starting where plain ticks measured faster is decoded plainly for life, except
    one in ``refresh`` (it drafts, so drafting stays measured there); unmeasured or
    drafting-faster buckets start requests drafting."""
    policy, rng = DraftPolicy(refresh=8), random.Random(2)
    assert policy.faster(8) is None and policy.admit(8) == DRAFT        # not measured yet
    _drive(policy, _gpu_like, 1, 60, rng)
    _drive(policy, _gpu_like, 8, 60, rng)
    assert policy.faster(1) == DRAFT and policy.faster(5) == PLAIN      # 5 joins bucket 8
    assert [policy.admit(1) for _ in range(20)] == [DRAFT] * 20
    every = policy.interval(7)                                          # 8, or more once re-measurements confirmed plain
    assert every >= 8
    got = [policy.admit(7) for _ in range(3 * every)]
    assert got == ([PLAIN] * (every - 1) + [DRAFT]) * 3                 # one probe per interval
    assert policy.admissions == {DRAFT: 24, PLAIN: 3 * (every - 1)}

def test_admission_compares_drafting_with_bare_ticks_where_measured():
    """Plain ticks of requests that may draft still pay drafting's per-tick costs; once ticks of
    requests that may not (BARE) are measured at a batch size, a request starting there is judged
    against those: here drafting (3.3 tokens per request in 11.7 ms at 16 requests) beats the
    dearer plain ticks (6 ms) but not bare ones (2.9 ms, the measured shape of
    benchmarks/gpu/concurrency/run12-long). Bare ticks are a cost only: they change no choice
    between drafting and plain ticks."""
    policy, rng = DraftPolicy(refresh=16), random.Random(3)

    def cost(mode, batch):
        return (round(3.3 * batch), 11.7e-3) if mode == DRAFT else (batch, 6.0e-3)

    chosen = _drive(policy, cost, 16, 200, rng)
    assert chosen[-100:].count(DRAFT) >= 95                       # drafting beats the dear plain ticks
    assert policy.expected(16) == DRAFT and policy.admit(16) == DRAFT
    for _ in range(policy.warmup + 2):
        policy.observe(16, BARE, 16, 2.9e-3 * rng.uniform(0.9, 1.1))
    assert policy.choose(16, [f"r{i}" for i in range(16)]) == DRAFT    # the tick choice is unchanged
    assert policy.expected(16) == PLAIN
    every = policy.interval(16)
    modes = [policy.admit(16) for _ in range(2 * every)]
    assert modes.count(DRAFT) == 2 and modes.count(PLAIN) == 2 * every - 2   # plain, a drafting probe per interval
    # a bucket without bare ticks keeps judging by the plain ticks of drafting requests
    _drive(policy, cost, 4, 100, rng)
    assert policy.expected(4) == DRAFT


def test_demotes_only_where_its_own_bucket_found_plain_faster():
    """Requests that started drafting are demoted (plain for the rest of their lives) only by
    their own bucket's measurements: not while it is cold, not on a smaller bucket's verdict
    (which only decides how a new request starts), not where drafting is faster; against bare
    ticks where those are measured there, as admission judges."""
    policy, rng = DraftPolicy(refresh=8), random.Random(5)
    assert not policy.demote(1) and not policy.demote(16)               # nothing measured
    _drive(policy, _gpu_like, 1, 60, rng)
    assert policy.faster(1) == DRAFT and not policy.demote(1)            # drafting pays at 1
    _drive(policy, _gpu_like, 8, 60, rng)
    assert policy.faster(8) == PLAIN and policy.demote(8) and policy.demote(5)   # bucket 8 holds 5..8
    assert policy.expected(16) == PLAIN and not policy.demote(16)       # inferred for admission only
    # drafting beats the dear plain ticks of drafting requests, not bare ones: demoted once bare
    # ticks are measured at that bucket
    def dear(mode, batch):
        return (round(3.3 * batch), 11.7e-3) if mode == DRAFT else (batch, 6.0e-3)

    _drive(policy, dear, 32, 60, rng)
    assert policy.faster(32) == DRAFT and not policy.demote(32)
    for _ in range(policy.warmup + 2):
        policy.observe(32, BARE, 32, 2.9e-3 * rng.uniform(0.9, 1.1))
    assert policy.demote(32)


def _tokens(req) -> list[int]:
    """Every token a submitted request streams, in order, until its finish (a failure fails the test)."""
    from orchestrator.scheduler import Failure

    out = []
    while True:
        ev = req.events.get(timeout=60)
        assert not isinstance(ev, Failure), ev
        out += list(ev.tokens)
        if ev.finish:
            return out


def test_scheduler_stops_drafting_where_it_does_not_pay_and_stays_lossless(tiny_llama, tiny_drafter):
    """A random drafter (it accepts next to nothing) makes every drafting tick slower than a plain
    one: with the measured policy the scheduler decodes mostly plainly, and the text equals the
    target's alone. A request that started drafting (nothing measured yet) decodes plainly for the
    rest of its life once its batch size is measured faster plainly (demoted: its drafter session
    released, no more feature rows from the target, its ticks bare)."""
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Request
    from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

    def run(sched, speculative: bool, n: int) -> list[int]:
        req = Request(session_id=f"p-{speculative}-{threading.get_ident()}", prompt=[5, 6, 7, 8], max_tokens=n,
                      sampling=common_pb2.SamplingParams(), tree=draft_pb2.TreeParams(budget=6, top_k=2),
                      speculative=speculative)
        sched.submit(req)
        return _tokens(req)

    with target_in_process(tiny_llama.path, max_sessions=4, max_context=512) as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=4, max_context=512) as (_, dport), \
            orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=4, draft_policy="measured") as (servicer, _):
        sched = servicer.scheduler
        deadline = time.monotonic() + 30
        while sched.draft.state() is None:   # the drafter reached before the first tick
            assert time.monotonic() < deadline
            time.sleep(0.05)
        plain = run(sched, False, 60)
        # a request that may not draft: its ticks are bare, a cost measured, never a choice
        bare = sched.policy._count.get((1, BARE), 0)
        assert bare >= 50 and sched.policy.choices == {DRAFT: 0, PLAIN: 0}
        spec = run(sched, True, 60)
        assert spec == plain
        choices = sched.policy.choices
        # it drafted and ran plain ticks until bucket 1 was warm (warmup + 1 counted ticks of each
        # mode), then it was demoted (that tick is not measured): the rest of its ticks were bare
        # (this machine's timing may keep it drafting a few ticks longer, never to its end)
        assert sched.policy.warmup + 1 <= choices[DRAFT] <= 20 and choices[PLAIN] >= sched.policy.warmup, choices
        assert sched.demoted == 1
        assert sched.policy._count[(1, BARE)] > bare
        # plain ticks measured faster at one request (made certain here: the few ticks measured on
        # this busy machine are noisy): a new one starts plain for life (no feature rows from the
        # target, no drafter session), and its text is the same
        for _ in range(8):
            sched.policy.observe(1, DRAFT, 1, 20e-3)
            sched.policy.observe(1, PLAIN, 1, 1e-3)
            sched.policy.observe(1, BARE, 1, 1e-3)
        assert sched.policy.faster(1) == PLAIN and sched.policy.expected(1) == PLAIN
        before = dict(sched.policy.admissions)
        drafted = dict(sched.policy.choices)
        assert run(sched, True, 60) == plain
        assert sched.policy.admissions[PLAIN] == before[PLAIN] + 1
        assert sched.policy.choices[DRAFT] == drafted[DRAFT]   # no tick had a request that may draft
        assert sched.demoted == 1                              # (nor one to demote)


def test_demotion_releases_the_drafter_session_stops_the_rows_and_spares_probes(tiny_llama, tiny_drafter, monkeypatch):
    """Two requests start drafting (nothing measured); once their batch size is measured faster
    plainly, the one that is not a probe is demoted on the next plain tick: its drafter session
    is released, its history dropped, and the tick's Verify names it in ``stop_features`` (the
    target changed that one session). The probe keeps drafting. Both texts are the target's."""
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Request
    from runtime.step_loop import StepLoop
    from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

    stopped: list[tuple[list[str], int]] = []
    real_stop = StepLoop.stop_features

    def spy(self, ids, owner=None):
        n = real_stop(self, ids, owner)
        stopped.append((list(ids), n))
        return n

    monkeypatch.setattr(StepLoop, "stop_features", spy)

    def request(name: str, speculative: bool = True) -> Request:
        return Request(session_id=name, prompt=[5, 6, 7, 8], max_tokens=120, sampling=common_pb2.SamplingParams(),
                       tree=draft_pb2.TreeParams(budget=6, top_k=2), speculative=speculative)

    with target_in_process(tiny_llama.path, max_sessions=4, max_context=512) as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=4, max_context=512) as (_, dport), \
            orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=4, draft_policy="measured") as (servicer, _):
        sched = servicer.scheduler
        policy = sched.policy
        deadline = time.monotonic() + 30
        while sched.draft.state() is None:   # the drafter reached before the first tick
            assert time.monotonic() < deadline
            time.sleep(0.05)
        plain = request("ref", speculative=False)
        sched.submit(plain)
        want = _tokens(plain)
        released: list[str] = []
        real_release = sched._release
        monkeypatch.setattr(sched, "_release", lambda on_t, on_d: (released.extend(r.session_id for r in on_d),
                                                                   real_release(on_t, on_d))[1])
        a, b = request("a"), request("b")
        sched.submit(a)
        sched.submit(b)
        first = [a.events.get(timeout=60), b.events.get(timeout=60)]   # both decoding, admitted drafting
        assert a.speculative and b.speculative and not a.probe and not b.probe
        b.probe = True
        for _ in range(policy.warmup + 3):   # drafting measured slower than bare ticks at 2 requests
            policy.observe(2, DRAFT, 2, 30e-3)
            policy.observe(2, PLAIN, 2, 1e-3)
            policy.observe(2, BARE, 2, 1e-3)
        outs = [list(first[0].tokens) + _tokens(a), list(first[1].tokens) + _tokens(b)]
        assert outs == [want, want]
        assert sched.demoted == 1 and not a.speculative and b.speculative
        assert a.history == [] and not a.keeping
        assert released.count("a") == 1 and released.index("a") < released.index("b")   # released when demoted
        assert (["a"], 1) in stopped and all("b" not in ids for ids, _ in stopped)   # the target changed it alone


def test_an_unmeasured_bucket_starts_requests_plain_where_a_smaller_one_found_plain_faster():
    """A burst larger than any batch measured so far: where the nearest smaller measured bucket
    found plain ticks faster, requests start plain (drafting only loses more as batches grow);
    where it found drafting faster, the bucket is unknown and requests start drafting."""
    policy, rng = DraftPolicy(refresh=8), random.Random(3)
    assert policy.expected(64) is None and policy.admit(64) == DRAFT    # nothing measured
    _drive(policy, _gpu_like, 1, 60, rng)
    assert policy.expected(64) is None                                   # drafting faster below: unknown
    _drive(policy, _gpu_like, 8, 60, rng)
    assert policy.faster(64) is None and policy.expected(64) == PLAIN    # 8 found plain faster
    assert policy.expected(2) is None and policy.expected(1) == DRAFT    # 2: only bucket 1 below, drafting
    every = policy.interval(40)
    assert [policy.admit(40) for _ in range(every)] == [PLAIN] * (every - 1) + [DRAFT]  # a probe per interval


def test_a_burst_is_judged_as_the_batch_it_makes(tiny_llama, tiny_drafter):
    """Requests queued together are admitted by the batch they will make, not one by one: with
    plain measured faster at 2-4 requests and drafting at 1, a burst of 3 starts plain for life
    (the first of them counts the two queued behind it), and each text is the target's."""
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Request
    from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

    with target_in_process(tiny_llama.path, max_sessions=4, max_context=512) as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=4, max_context=512) as (_, dport), \
            orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=4, draft_policy="measured") as (servicer, _):
        sched = servicer.scheduler
        policy = sched.policy
        # 3 tokens per drafted item; a drafting tick costs 2, 8 and 20 ms at 1, 2 and 4 requests,
        # a plain one 1 ms: drafting pays at 1 (1500 against 1000 tokens/s), not at 2 or 4
        for batch, draft_s in ((1, 2e-3), (2, 8e-3), (4, 20e-3)):
            for _ in range(policy.warmup + 2):
                policy.observe(batch, DRAFT, 3 * batch, draft_s)
                policy.observe(batch, PLAIN, batch, 1e-3)
        assert [policy.faster(b) for b in (1, 2, 4)] == [DRAFT, PLAIN, PLAIN]
        sched._slot_wait_until = time.monotonic() + 0.5   # hold admissions: the burst queues whole
        reqs = [Request(session_id=f"burst-{i}", prompt=[5, 6, 7, 8], max_tokens=12, sampling=common_pb2.SamplingParams(),
                        tree=draft_pb2.TreeParams(budget=6, top_k=2), speculative=True) for i in range(3)]
        for r in reqs:
            sched.submit(r)
        outs = [_tokens(r) for r in reqs]
        assert policy.admissions == {DRAFT: 0, PLAIN: 3}
        assert sched.admitted_plain == 3 == sched.status().admitted_plain   # (counted as the always policy's are)
        assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 12


def test_re_measurements_back_off_and_a_flip_resets_them():
    """While plain stays faster its re-measurements of drafting come less often (the interval
    doubles up to max_refresh); when drafting turns faster (the text became predictable) the first
    re-measurement after it flips the choice and sets the interval back to refresh."""
    policy, rng = DraftPolicy(refresh=4, max_refresh=64, alpha=0.5), random.Random(4)
    slow = lambda mode, b: (2, 4e-3) if mode == DRAFT else (1, 1.4e-3)   # noqa: E731 - 500 vs 714 tok/s
    fast = lambda mode, b: (5, 3e-3) if mode == DRAFT else (1, 1.4e-3)   # noqa: E731 - 1667 vs 714 tok/s
    first = _drive(policy, slow, 1, 400, rng)
    assert policy.interval(1) == 64 and first[-200:].count(DRAFT) <= 200 // 64 + 1
    after = _drive(policy, fast, 1, 200, rng)
    flip = next(i for i, m in enumerate(after) if m == DRAFT)
    assert flip <= 64 and after[flip + 4:].count(DRAFT) >= 0.95 * len(after[flip + 4:])
    assert policy.faster(1) == DRAFT


def test_each_request_drafts_by_its_own_text_pulled_towards_all_requests():
    """The tick's cost is the bucket's; the tokens are each request's: a text the drafter reads
    well keeps drafting, one it does not goes plain once measured, and a new request starts at
    the prior of all requests, its first few items weighed against it (one stream on an H200, a
    text's drafting ticks emitted 1-6 tokens tick to tick: benchmarks/gpu/policy/session13)."""
    policy = DraftPolicy(warmup=2)
    for _ in range(4):                       # a drafting tick costs 3 ms, a plain one 1.5 ms: 2 tokens break even
        policy.note("a", 4)
        policy.observe(1, DRAFT, 4, 3e-3)
        policy.observe(1, PLAIN, 1, 1.5e-3)
    assert policy.choose(1, ["a"]) == DRAFT and policy.tokens("a") == pytest.approx(4.0)
    assert policy.choose(1, ["b"]) == DRAFT and policy.tokens("b") == pytest.approx(policy.prior())
    for _ in range(3):
        policy.note("c", 1)                  # three items of a text the drafter reads badly ...
    assert policy.tokens("c") > 2 and policy.choose(1, ["c"]) == DRAFT   # ... against the prior: not yet judged
    for _ in range(12):
        policy.note("c", 1)
    assert policy.tokens("c") < 2 and policy.choose(1, ["c"]) == PLAIN
    policy.forget("c")
    assert policy.tokens("c") == pytest.approx(policy.prior())
    with pytest.raises(ValueError):
        DraftPolicy(alpha_tokens=0.0)


@pytest.mark.parametrize("server_kind", ["threads", "aio"])
def test_a_request_its_client_cancels_is_forgotten_by_the_policy(server_kind, tiny_llama, tiny_drafter):
    """``--draft-policy measured`` keeps an estimate per drafting request until the request ends. A
    client that cancels mid-stream ends it either way: on the thread server its context callback
    closes the request with a failure event, on the asyncio server the cancelled coroutine closes
    it without one; the estimate is forgotten in both (the scheduler drops closed requests)."""
    import uuid

    import grpc

    from dflash_grpc.transport import GRPC_OPTIONS
    from dflash_grpc.v1 import generation_pb2, generation_pb2_grpc
    from runtime.owners import EPOCH_KEY, OWNER_KEY
    from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

    with target_in_process(tiny_llama.path, max_sessions=4, max_context=256, max_workers=8,
                           name=f"forget-{server_kind}") as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=4, max_context=256, max_workers=8) as (_, dport):
        md = [(OWNER_KEY, f"forget-{server_kind}"), (EPOCH_KEY, uuid.uuid4().hex)]
        with orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=4, metadata=md, max_workers=8,
                                     server_kind=server_kind, draft_policy="measured") as (servicer, oport), \
                grpc.insecure_channel(f"127.0.0.1:{oport}", options=GRPC_OPTIONS) as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            sched = servicer.scheduler
            for i in range(6):
                req = generation_pb2.GenerateRequest(prompt_tokens=generation_pb2.PromptTokens(ids=[5, 17, 40 + i]),
                                                     max_tokens=150, ignore_eos=True)
                req.speculative.enabled = True
                call = stub.Generate(req, timeout=30)
                for k, _ in enumerate(call):
                    if k == 3:
                        call.cancel()
                        break
            deadline = time.monotonic() + 15
            while (sched.status().active_sessions or sched.policy._req) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sched.status().active_sessions == 0
            assert not sched.policy._req, f"{len(sched.policy._req)} cancelled requests never forgotten"


def test_drafting_ticks_of_a_few_probes_do_not_make_drafting_look_cheap_for_all():
    """Where only a few requests draft (the probes of a bucket where plain is faster), a drafting
    tick costs little more than a plain one. Admission asks what a tick costs when every request
    drafts: the drafting cost is scaled by the number of requests that draft
    (``DraftPolicy.draft_seconds``), so 2 drafters of 32 in 3.0 ms against plain ticks of 2.4 ms
    predict 12 ms for 32 drafters, and a request starting there is decoded plainly (the unscaled
    3.0 ms would have admitted it to draft, and a later tick demoted it)."""
    policy, rng = DraftPolicy(refresh=16), random.Random(5)
    probes = ["p0", "p1"]
    for _ in range(12):
        for mode in (DRAFT, PLAIN):
            if mode == DRAFT:
                for r in probes:
                    policy.note(r, 3.5)
                policy.observe(32, DRAFT, 30 + 7, 3.0e-3 * rng.uniform(0.98, 1.02), drafted=2)
            else:
                policy.observe(32, PLAIN, 32, 2.4e-3 * rng.uniform(0.98, 1.02))
    assert policy.draft_seconds(32, 2) == pytest.approx(3.0e-3, rel=0.05)
    assert policy.draft_seconds(32, 32) == pytest.approx(2.4e-3 + 0.6e-3 * 16, rel=0.1)
    assert policy.faster(32) == PLAIN and policy.expected(32) == PLAIN and policy.admit(32) == PLAIN
    # (unscaled, 32 x 3.5 tokens in 3.0 ms would have beaten 32 in 2.4 ms)
    assert 32 * policy.prior() / 3.0e-3 > 32 / 2.4e-3
    # ticks where every request drafts are judged by their own cost, as before
    full = DraftPolicy()
    for _ in range(12):
        full.observe(8, DRAFT, 28, 4.0e-3)
        full.observe(8, PLAIN, 8, 1.6e-3)
    assert full.draft_seconds(8, 8) == pytest.approx(4.0e-3) and full.faster(8) == DRAFT


def test_a_request_joining_where_no_tree_fits_starts_plain_for_life(tiny_llama, tiny_drafter):
    """With the default ``always`` policy, a request that joins a batch at which its tree gets no
    node of the tick's share of ``step_nodes`` (here 4 nodes: a burst of 3 leaves each one node,
    a tree needs two draft nodes and its root) starts plainly for its life: no feature rows, no
    drafter session, never a tree. A request alone fits one (4 nodes) and drafts. Every text is
    the target's own (a plain request's tokens)."""
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Request
    from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

    def request(name, speculative=True):
        return Request(session_id=name, prompt=[5, 6, 7, 8], max_tokens=12, sampling=common_pb2.SamplingParams(),
                       tree=draft_pb2.TreeParams(budget=6, top_k=2), speculative=speculative)

    with target_in_process(tiny_llama.path, max_sessions=4, max_context=512) as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=4, max_context=512) as (_, dport), \
            orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=4, step_nodes=4) as (servicer, _):
        sched = servicer.scheduler
        assert sched.policy is None and sched.step_nodes == 4
        plain = request("plain", speculative=False)
        sched.submit(plain)
        reference = _tokens(plain)
        alone = request("alone")
        sched.submit(alone)
        assert _tokens(alone) == reference
        assert alone.speculative and alone.stats.drafts > 0 and sched.admitted_plain == 0
        sched._slot_wait_until = time.monotonic() + 0.5   # hold admissions: the burst queues whole
        burst = [request(f"burst-{i}") for i in range(3)]
        for r in burst:
            sched.submit(r)
        assert [_tokens(r) for r in burst] == [reference] * 3
        assert sched.admitted_plain == 3 == sched.status().admitted_plain
        assert all(not r.speculative and r.stats.drafts == 0 and not r.on_drafter for r in burst)
        assert sched.status().no_drafter_slot == 0


def test_requests_beyond_the_drafters_slots_decode_plainly_that_tick_and_are_counted(tiny_llama, tiny_drafter):
    """A drafter of one session under an orchestrator of three: in a tick of three drafting
    requests two get no drafter slot and decode plainly that tick (``no_drafter_slot`` counts
    each such item, as ``SchedulerStatus`` reports); the one that holds the slot drafts. Every
    text is the target's own."""
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Request
    from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

    def request(name, speculative=True):
        return Request(session_id=name, prompt=[5, 6, 7, 8], max_tokens=12, sampling=common_pb2.SamplingParams(),
                       tree=draft_pb2.TreeParams(budget=6, top_k=2), speculative=speculative)

    with target_in_process(tiny_llama.path, max_sessions=3, max_context=512) as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=1, max_context=512) as (_, dport), \
            orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=3) as (servicer, _):
        sched = servicer.scheduler
        plain = request("plain", speculative=False)
        sched.submit(plain)
        reference = _tokens(plain)
        assert sched.no_drafter_slot == 0
        sched._slot_wait_until = time.monotonic() + 0.5   # hold admissions: the three start together
        burst = [request(f"burst-{i}") for i in range(3)]
        for r in burst:
            sched.submit(r)
        assert [_tokens(r) for r in burst] == [reference] * 3
        drafted = [r.stats.drafts > 0 for r in burst]
        assert any(drafted) and not all(drafted)
        assert sched.no_drafter_slot > 0 and sched.status().no_drafter_slot == sched.no_drafter_slot
        # the scheduler's own part of its ticks: its loop's seconds hold the exchanges' (read once
        # the last tick's accounting is done: the loop idles)
        deadline = time.monotonic() + 5
        while (st := sched.status()).tick_seconds < st.exchange_seconds and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.tick_seconds >= st.exchange_seconds > 0 and st.tick_cpu_seconds >= st.exchange_cpu_seconds > 0
        # the replies' queue seconds, summed: some, and within the exchanges that carried them
        assert 0 < st.verify_queue_seconds + st.propose_queue_seconds < st.exchange_seconds


def test_no_tree_fits_counts_the_sessions_that_decode_at_once_and_gates_chains(tiny_llama, tiny_drafter):
    """The batch a request joins is at most the orchestrator's --max-sessions: with one session at
    a time a burst of 3 drafts (each runs alone: 4 nodes fit a tree), however long the queue. A
    chain joining a batch where no tick drafts (3 requests sharing 4 nodes) starts plain too; alone
    it drafts. Every text is the target's own."""
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Request
    from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

    def request(name, tree, speculative=True):
        return Request(session_id=name, prompt=[5, 6, 7, 8], max_tokens=12, sampling=common_pb2.SamplingParams(),
                       tree=tree, speculative=speculative)

    tree, chain = draft_pb2.TreeParams(budget=6, top_k=2), draft_pb2.TreeParams(budget=0, max_depth=3)
    with target_in_process(tiny_llama.path, max_sessions=4, max_context=512) as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=4, max_context=512) as (_, dport):
        with orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=1, step_nodes=4) as (servicer, _):
            sched = servicer.scheduler
            plain = request("plain", tree, speculative=False)
            sched.submit(plain)
            reference = _tokens(plain)
            sched._slot_wait_until = time.monotonic() + 0.5   # the burst queues whole
            burst = [request(f"one-{i}", tree) for i in range(3)]
            for r in burst:
                sched.submit(r)
            assert [_tokens(r) for r in burst] == [reference] * 3
            assert sched.admitted_plain == 0 and all(r.speculative and r.stats.drafts > 0 for r in burst)
        with orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=4, step_nodes=4) as (servicer, _):
            sched = servicer.scheduler
            alone = request("chain-alone", chain)
            sched.submit(alone)
            assert _tokens(alone) == reference and alone.speculative and alone.stats.drafts > 0
            sched._slot_wait_until = time.monotonic() + 0.5
            burst = [request(f"chain-{i}", chain) for i in range(3)]
            for r in burst:
                sched.submit(r)
            assert [_tokens(r) for r in burst] == [reference] * 3
            assert sched.admitted_plain == 3 and not any(r.speculative for r in burst)

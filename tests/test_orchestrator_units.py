"""Orchestrator pieces without processes: text streaming with stop strings, statistics, tree trim."""

from __future__ import annotations

import time

import grpc
import pytest

from orchestrator.detok import TextStream
from orchestrator.scheduler import trim_tree
from orchestrator.stats import AcceptanceStats


def test_text_stream_deltas_concatenate_to_decode(smollm_tokenizer):
    text = "Grüße, 世界! 😀 def f(x):\n    return x ** 2  # done"
    ids = smollm_tokenizer.encode(text)
    stream = TextStream(smollm_tokenizer.decode)
    out = "".join(stream.push([i]) for i in ids) + stream.finish()
    assert out == text
    assert "\ufffd" not in "".join(TextStream(smollm_tokenizer.decode).push([i]) for i in ids)


@pytest.mark.parametrize("stop", [["\n"], ["return"], ["zz", " x **"], ["2  #"]])
def test_text_stream_stops_before_the_stop_string(smollm_tokenizer, stop):
    text = "def f(x):\n    return x ** 2  # done"
    ids = smollm_tokenizer.encode(text)
    stream = TextStream(smollm_tokenizer.decode, stop)
    out = ""
    for i in ids:
        out += stream.push([i])
        if stream.stopped:
            break
    out += stream.finish()
    cut = min(text.find(s) for s in stop if s in text)
    assert stream.stopped and out == text[:cut]


@pytest.mark.parametrize("stop", [[], ["\n"], ["界!", "x **"], ["2  #", "2"]])
def test_text_stream_incremental_equals_decoding_everything(smollm_tokenizer, stop):
    """Decoding only the new ids (the default) gives exactly the deltas of decoding every id at
    every push, also where a character's bytes are split across tokens and pushes."""
    import random

    text = "Grüße, 世界! 😀 def f(x):\n    return x ** 2  # done 🎉🎉 ünïcödé"
    ids = smollm_tokenizer.encode(text)
    ids += [b for ch in "€😀" for b in smollm_tokenizer.encode(ch)] + ids   # byte tokens too
    rng = random.Random(0)
    for _ in range(20):
        a, b = TextStream(smollm_tokenizer.decode, stop), TextStream(smollm_tokenizer.decode, stop, incremental=False)
        i = 0
        while i < len(ids) and not b.stopped:
            n = rng.randint(1, 4)
            assert a.push(ids[i:i + n]) == b.push(ids[i:i + n])
            assert a.stopped == b.stopped
            i += n
        assert a.finish() == b.finish()


def test_text_stream_without_stops_gives_the_same_text_however_ids_are_grouped(smollm_tokenizer):
    """Without stop strings Generate pushes a message's queued events at once (one decode): the
    text streamed is the same whether ids come one push per event or grouped, split characters
    included."""
    import random

    text = "Grüße, 世界! 😀 def f(x):\n    return x ** 2  # done 🎉🎉 ünïcödé"
    ids = smollm_tokenizer.encode(text)
    ids += [b for ch in "€😀" for b in smollm_tokenizer.encode(ch)] + ids
    rng = random.Random(1)
    for _ in range(20):
        one, grouped = TextStream(smollm_tokenizer.decode), TextStream(smollm_tokenizer.decode)
        assert not one.has_stops and TextStream(smollm_tokenizer.decode, ["", "x"]).has_stops
        i, a, b = 0, "", ""
        while i < len(ids):
            events = []
            for _ in range(rng.randint(1, 4)):   # a message's queued events (some without tokens)
                n = rng.randint(0, 3)
                events.append(ids[i:i + n])
                i += n
            a += "".join(one.push(e) for e in events)
            b += grouped.push([t for e in events for t in e])
            assert a == b
        assert a + one.finish() == b + grouped.finish()


def test_text_stream_holds_back_a_possible_stop_prefix():
    pieces = {1: "ab", 2: "c<", 3: "/s", 4: "x"}
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), ["</s>"])
    assert stream.push([1]) == "ab"
    assert stream.push([2]) == "c"      # "<" might start "</s>"
    assert stream.push([3]) == ""       # "</s" too
    assert stream.push([4]) == "</sx"   # not a stop after all
    assert not stream.stopped


def test_stats_accounting_and_merge():
    s = AcceptanceStats()
    s.record_step(tree_depth=3, draft_nodes=3, accepted=2)
    s.record_step(tree_depth=3, draft_nodes=5, accepted=0)
    s.record_step(tree_depth=0, draft_nodes=0, accepted=0)
    assert (s.drafts, s.draft_tokens, s.accepted_tokens, s.target_forwards, s.autoregressive_steps) == (2, 8, 2, 3, 1)
    assert s.accepted_per_position == [1, 1]
    assert s.drafted_per_position == [2, 2, 2]
    assert s.acceptance_length_histogram == [0, 2, 0, 1]
    assert s.mean_acceptance_length == pytest.approx(5 / 3)
    t = AcceptanceStats()
    t.record_step(tree_depth=4, draft_nodes=4, accepted=4)
    s.merge(t)
    assert s.accepted_per_position == [2, 2, 1, 1]
    assert s.acceptance_length_histogram == [0, 2, 0, 1, 0, 1]
    p = s.to_proto()
    assert p.mean_acceptance_length == pytest.approx(10 / 4)
    assert list(p.accepted_per_position) == [2, 2, 1, 1]


def test_stats_per_position_counts_equal_counting_each_position():
    """record_step keeps one count per verify (the depth reached, the tokens accepted); the
    per-position lists read from them equal counting every position of every draft, also merged,
    and in the proto (the metrics' series: tests/test_metrics.py)."""
    import random

    rng = random.Random(5)
    for _ in range(200):
        steps = [(rng.randrange(0, 7), rng.choice((0, 0, 3, 9)), rng.randrange(0, 7)) for _ in range(rng.randrange(0, 12))]
        s, acc, drafted = AcceptanceStats(), [], []
        for depth, nodes, k in steps:
            s.record_step(tree_depth=depth, draft_nodes=nodes, accepted=k)
            if nodes:
                for hist, n in ((drafted, depth), (acc, k)):
                    hist.extend([0] * (n - len(hist)))
                    for d in range(n):
                        hist[d] += 1
        assert (s.accepted_per_position, s.drafted_per_position) == (acc, drafted)
        merged = AcceptanceStats()
        merged.merge(s)
        merged.merge(s)
        assert merged.drafted_per_position == [2 * n for n in drafted]
        p = merged.to_proto()
        assert (list(p.accepted_per_position), list(p.drafted_per_position)) == ([2 * n for n in acc], [2 * n for n in drafted])


def test_trim_tree_drops_deep_nodes_and_reindexes():
    tokens = [10, 11, 12, 13, 14, 15]
    parents = [-1, 0, 1, 0, 3, 4]   # depths 0 1 2 1 2 3
    assert trim_tree(tokens, parents, 1) == ([10, 11, 13], [-1, 0, 0])
    assert trim_tree(tokens, parents, 2) == ([10, 11, 12, 13, 14], [-1, 0, 1, 0, 3])
    assert trim_tree(tokens, parents, 0) == ([10], [-1])


def test_fit_tree_trims_caps_and_gives_the_depth():
    from orchestrator.scheduler import fit_tree
    from runtime.tree import TreeError

    tokens = [10, 11, 12, 13, 14, 15]
    parents = [-1, 0, 1, 0, 3, 4]   # depths 0 1 2 1 2 3
    assert fit_tree(tokens, parents, 8, 64) == (tokens, parents, 3)        # fits: as sent
    assert fit_tree(tokens, parents, 2, 64) == ([10, 11, 12, 13, 14], [-1, 0, 1, 0, 3], 2)
    assert fit_tree(tokens, parents, 8, 3) == ([10, 11, 12], [-1, 0, 1], 2)   # a prefix, its own depth
    assert fit_tree(tokens, parents, 1, 2) == ([10, 11], [-1, 0], 1)
    assert fit_tree([10, 11, 12], [-1, 0], 8, 64) == ([10, 11], [-1, 0], 1)   # unequal lists: paired up
    assert fit_tree([10], [-1, 0, 1], 8, 64) == ([10], [-1], 0)
    assert fit_tree([], [-1], 8, 64) == ([], [], 0)   # no root token: no tree (the caller drops it)
    for bad in ([], [0], [-1, 1], [-1, 0, 5]):
        with pytest.raises(TreeError):
            fit_tree([1] * len(bad), bad, 8, 64)


def test_adaptive_budget_shares_the_tick_in_width_buckets():
    from orchestrator.scheduler import adaptive_budget

    # one request: its own budget while it fits the share
    assert adaptive_budget(1, 512, want=16) == 16
    assert adaptive_budget(1, 512, want=31) == 31
    # the tick's 512 nodes shared in power-of-two widths: 64 requests get 8-node trees, 32 get 16
    assert adaptive_budget(64, 512, want=16) == 7
    assert adaptive_budget(32, 512, want=16) == 15
    assert adaptive_budget(20, 512, want=31) == 15
    # below two draft nodes per request the tick does not draft
    assert adaptive_budget(200, 512, want=16) == 0
    assert adaptive_budget(64, 64, want=16) == 0


def test_tokens_reach_the_handler_once_handed_over_and_before_any_end():
    """Scheduler._emit defers a tick's tokens to _flush_events (the next exchange's on_sent):
    nothing reaches the handler before, everything in order after; a request's final tokens
    mark it ended at once; a failure event (_end) hands the pending tokens over first."""
    import queue

    import grpc

    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Failure, Request, Scheduler, Tokens

    class Target:
        def info(self):
            return common_pb2.ModelInfo(device="cpu", max_sessions=4)

    class NoDraft:
        address = None

    sched = Scheduler(Target(), NoDraft(), max_sessions=2)
    try:
        def request(n):
            return Request(session_id=f"r{n}", prompt=[1], sampling=common_pb2.SamplingParams(), max_tokens=5,
                           tree=draft_pb2.TreeParams())

        a, b = request(1), request(2)
        sched._emit(a, [10, 11])
        sched._emit(b, [20])
        sched._emit(a, [12, 13, 14, 15])       # past max_tokens: the last of a, cut to 3 tokens
        assert a.ended and a.closed and not b.ended
        assert a.events.empty() and b.events.empty()   # nothing handed over yet
        sched._flush_events()
        got = [a.events.get_nowait(), a.events.get_nowait()]
        assert [(e.tokens, e.finish) for e in got] == [([10, 11], None), ([12, 13, 14], "length")]
        assert b.events.get_nowait().tokens == [20]
        sched._emit(b, [21])
        sched._end(b, Failure(grpc.StatusCode.UNAVAILABLE, "gone", "TARGET_UNAVAILABLE"))
        first, second = b.events.get_nowait(), b.events.get_nowait()
        assert isinstance(first, Tokens) and first.tokens == [21] and isinstance(second, Failure)
        with pytest.raises(queue.Empty):
            b.events.get_nowait()
    finally:
        sched.stop(timeout=1.0, release_timeout=0.1)


def test_kept_rows_are_exactly_those_the_drafter_lacks():
    """Scheduler._keep holds the rows of committed positions [rows_from, L) that the drafter
    session lacks, as views of the reply that brought them for at most KEEP_VIEWS ticks, then as
    bytes of their own (_compact); a Propose that carried them (_sent) leaves none; a lost
    session (_lose_rows) keeps its rows only while they start at 0 (a new session's), else none
    until the target recomputes them; past history_bytes of rows piled up over ticks (more than
    one entry) the session is given up, whatever its rows start at."""
    import random

    from dflash_grpc.columns import Rows
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import KEEP_VIEWS, Request, Scheduler

    class Target:
        def info(self):
            return common_pb2.ModelInfo(device="cpu", max_sessions=4)

    class NoDraft:
        address = None

    rng = random.Random(7)
    sched = Scheduler(Target(), NoDraft(), max_sessions=2)
    gave_up_total = 0
    try:
        for limit, lost_p, sent_p in ((1 << 30, 0.0, 0.6), (1 << 30, 0.1, 0.6), (40, 0.0, 0.15)):
            sched.history_bytes = limit
            req = Request(session_id="r", prompt=[1, 2, 3], sampling=common_pb2.SamplingParams(), max_tokens=5,
                          tree=draft_pb2.TreeParams())
            req.length = 3
            sched._keep(req, Rows(1, 2, 3, bytes(12)))   # a prefill's rows: bytes, [0, 3)
            lacks = bytes(12)                             # what the drafter lacks, None: nothing kept
            gave_up = 0
            for tick in range(80):
                u = rng.random()
                if u < lost_p:                            # the drafter lost it
                    kept_from_0 = req.rows_from == 0 and req.keeping
                    sched._lose_rows(req)
                    lacks = lacks if kept_from_0 else None
                elif u < lost_p + sent_p and req.keeping and (req.draft_synced or req.rows_from == 0):   # a Propose carried them
                    req.on_drafter = True
                    sched._sent(req)
                    lacks = b""
                n = rng.randrange(0, 3)
                reply = bytes(rng.randrange(256) for _ in range(4 * (n + 2)))
                req.length += n
                kept = req.keeping
                sched._keep(req, Rows(1, 2, n, memoryview(reply)[4:4 + 4 * n]) if n else None)
                if kept and not req.keeping:              # past history_bytes: given up, recomputed later
                    assert len(lacks) + 4 * n > limit     # (only rows piled up past the bound)
                    gave_up += 1
                    lacks = None
                elif lacks is not None and n:
                    lacks += reply[4:4 + 4 * n]
                if lacks is None:
                    assert not req.keeping and req.history == [] and req.rows_from == req.length
                    assert not req.draft_synced
                    req.keeping, req.rows_from, lacks = True, 0, bytes(4 * req.length)   # recomputed by the target
                    req.history, req.history_bytes, req.loose = [Rows(1, 2, req.length, lacks)], len(lacks), 1
                    continue
                assert b"".join(bytes(h.data) for h in req.history) == lacks
                assert req.rows_from + sum(h.rows for h in req.history) == req.length
                assert req.history_bytes == len(lacks)
                views = [i for i, h in enumerate(req.history) if not isinstance(h.data, bytes)]
                assert len(views) <= KEEP_VIEWS and all(i >= req.loose for i in views)
                if limit < 1 << 20 and req.rows_from:
                    assert req.history_bytes <= limit
            assert (gave_up > 0) == (limit < 1 << 20)
            gave_up_total += gave_up
            # counted as given up (SchedulerStatus); a loss on the drafter's side is not a give-up
            assert sched.given_up == gave_up_total == sched.status().drafter_sessions_given_up
    finally:
        sched.stop(timeout=1.0, release_timeout=0.1)


def test_ring_rows_are_counted_named_and_given_up_before_a_write_could_land_on_them():
    """Rows in the target's feature ring (RingRows) are counted after the rows kept as bytes and
    named in the next Propose (_sent clears them); once a request's unread ring rows and the rows
    its tree may commit could pass a ring slot (before the Verify: _ring_guard), or its rows move
    slot, or bytes follow ring rows, its drafter session is given up (recomputed later), never
    overwritten in place."""
    from dflash_grpc.columns import Rows
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.messages import ProposeItems, RingRows
    from orchestrator.scheduler import Request, Scheduler

    class Target:
        def info(self):
            return common_pb2.ModelInfo(device="cpu", max_sessions=4, max_tree_width=8)

    class NoDraft:
        address = None

    sched = Scheduler(Target(), NoDraft(), max_sessions=2)
    sched._ring_slot_rows = 32
    try:
        def fresh():
            req = Request(session_id="r", prompt=[1, 2, 3], sampling=common_pb2.SamplingParams(), max_tokens=500,
                          tree=draft_pb2.TreeParams())
            req.length = 3
            sched._keep(req, Rows(1, 2, 3, bytes(12)))   # the prompt's rows, as bytes
            return req

        req = fresh()
        for n in (2, 4, 1):   # verified rows in slot 5
            req.length += n
            sched._keep(req, RingRows(5, n))
        assert req.keeping and req.ring_slot == 5 and req.ring_rows == 7 and req.history[0].rows == 3
        items = ProposeItems()
        items.ring = common_pb2.FeatureRing(id="x", slots=8, slot_rows=32, width=2)
        items.add("r", 9, req.length, 4, 2, 3, req.history[0], RingRows(req.ring_slot, req.ring_rows))
        cols = items.request(True).columns
        assert cols.features.ring_rows == (7).to_bytes(4, "little") and cols.features.ring_slots == (5).to_bytes(4, "little")
        per_item = items.request(False)
        assert per_item.ring.id == "x" and per_item.items[0].ring_rows == 7 and per_item.items[0].features.shape == [3, 2]
        req.on_drafter = True
        sched._sent(req)
        assert req.ring_rows == 0 and req.history == [] and req.rows_from == req.length
        # unread rows pile up: given up before a Verify whose tree's rows could pass the slot's 32
        for _ in range(23):
            req.length += 1
            sched._keep(req, RingRows(5, 1))
        sched._ring_guard([req], [8])
        assert req.keeping and req.ring_rows == 23
        req.length += 1
        sched._keep(req, RingRows(5, 1))
        sched._ring_guard([req], [0])               # a root-only tree: 1 row more still fits
        assert req.keeping and req.ring_rows == 24
        sched._ring_guard([req], [8])               # 8 draft nodes: 24 + 9 > 32
        assert not req.keeping and req.ring_rows == 0 and req.rows_from == req.length
        # more unread rows than a slot holds (the oldest overwritten): given up when counted
        req = fresh()
        req.length += 33
        sched._keep(req, RingRows(5, 33))
        assert not req.keeping and req.ring_rows == 0
        # rows that move slot, and bytes after ring rows: given up too
        for second in (RingRows(6, 1), Rows(1, 2, 1, bytes(4))):
            req = fresh()
            req.length += 1
            sched._keep(req, RingRows(5, 1))
            req.length += 1
            sched._keep(req, second)
            assert not req.keeping and req.ring_rows == 0 and req.history == []
    finally:
        sched.stop(timeout=1.0, release_timeout=0.1)


def test_a_lost_drafter_session_is_recomputed_by_the_target_in_a_free_slot_before_admission():
    """A request whose drafter session is lost keeps no rows; the target recomputes rows [0, L)
    of its committed tokens (prompt and emitted, ``seq[:L]``) in a scratch session, which needs a
    free target slot: none while the target is full, the first freed one before a queued request
    is admitted (one recompute at a time while requests are queued; none while ticks do not draft).
    The rows committed meanwhile are kept from L, joined after the recomputed ones, and the scratch
    session is released. A recompute the target fails as when busy is tried again after a backoff;
    one it refuses otherwise leaves the request plain to its end, its feature rows stopped."""
    import concurrent.futures

    from dflash_grpc.columns import Rows
    from dflash_grpc.v1 import common_pb2, draft_pb2, target_pb2
    from orchestrator.scheduler import Request, Scheduler

    calls = []

    class PrefillCall:
        def future(self, request, timeout=None):
            fut = concurrent.futures.Future()
            calls.append((request, fut))
            return fut

    class ReleaseCall:
        released = []

        def future(self, request, timeout=None):
            self.released += list(request.session_ids)
            fut = concurrent.futures.Future()
            fut.set_result(common_pb2.ReleaseResponse())
            return fut

    class Stub:
        Prefill = PrefillCall()
        Release = ReleaseCall()

    class Target:
        stub = Stub()

        def info(self):
            return common_pb2.ModelInfo(device="cpu", max_sessions=2)

    class Draft:
        address = "x"
        stub = None

        def layers(self):
            return [1, 2]

    def request(name):
        r = Request(session_id=name, prompt=[1, 2, 3], sampling=common_pb2.SamplingParams(), max_tokens=100,
                    tree=draft_pb2.TreeParams())
        r.on_target, r.on_drafter, r.root, r.length = True, True, 9, 6
        r.seq = [1, 2, 3, 7, 8, 5, 9]
        r.rows_from, r.draft_synced = 6, True    # the drafter holds [0, 6)
        return r

    sched = Scheduler(Target(), Draft(), max_sessions=2)
    sched._stop.set()
    sched._thread.join(5)     # (driven by hand here)
    sched._drafter = lambda: object()
    sched.drafting = True                        # (ticks draft: recomputes may start)
    a, b = request("a"), request("b")
    sched._active = [a, b]
    sched._new_draft_session(a)                  # e.g. the drafter refused its item
    assert not a.keeping and a.history == [] and a.draft_id == "a~1" and sched._refeature_wanted
    a.length, a.seq = 8, a.seq + [4, 6]          # a tick committed 2 rows (length, then rows: as _tick)
    sched._keep(a, Rows(1, 2, 2, bytes(8)))      # committed while lost: not kept
    assert a.history == [] and a.rows_from == 8
    sched._start_refeatures()
    assert calls == [] and sched._refeature_wanted   # the target is full
    b.closed = True
    sched._queue.append(request("queued"))
    sched._drop_closed()                         # b's slot is free
    sched._start_refeatures()
    sched._admit()
    assert len(calls) == 1 and len(sched._prefilling) == 0   # the recompute took the slot, not the queued request
    item = calls[0][0].items[0]
    assert item.session_id.startswith("a#f") and list(item.prompt_tokens) == [1, 2, 3, 7, 8, 5, 9, 4]
    assert list(item.feature_layer_ids) == [1, 2]
    assert a.keeping and a.rows_from == 8
    a.length = 11
    sched._keep(a, Rows(1, 2, 3, bytes(range(12))))   # committed while it runs: kept from 8
    feats = common_pb2.Tensor(dtype=1, shape=[8, 2], data=bytes(range(100, 132)))
    calls[0][1].set_result(target_pb2.PrefillResponse(results=[target_pb2.PrefillResult(
        session_id=item.session_id, first_token=0, committed_length=8, features=feats)]))
    sched._collect_refeatures()
    assert item.session_id in Target.stub.Release.released and sched._refeaturing == []
    assert a.rows_from == 0 and b"".join(bytes(h.data) for h in a.history) == bytes(range(100, 132)) + bytes(range(12))
    assert sum(h.rows for h in a.history) == a.length and sched.refeatures == 1
    def failed(code):
        return type("Failed", (grpc.RpcError,), {"code": lambda self: code, "trailing_metadata": lambda self: ()})()

    # a target busy or restarting: tried again after a backoff, still a drafting request
    c = request("c")
    sched._active = [c]
    sched._lose_rows(c)
    sched._start_refeatures()
    assert len(calls) == 2
    calls[1][1].set_exception(failed(grpc.StatusCode.UNAVAILABLE))
    sched._collect_refeatures()
    assert c.speculative and not c.keeping and c.refeat_after > time.monotonic() + 0.5 and sched._refeature_wanted
    sched._start_refeatures()
    assert len(calls) == 2                       # (not before its backoff)
    c.refeat_after = 0.0
    sched._start_refeatures()
    assert len(calls) == 3
    # refused (not for a slot, nor as a target may when busy): plain to its end, its rows stopped
    calls[2][1].set_exception(failed(grpc.StatusCode.INVALID_ARGUMENT))
    sched._collect_refeatures()
    sched._start_refeatures()
    assert len(calls) == 3 and not c.keeping and not c.speculative and not sched._refeature_wanted
    assert sched._stop_features == ["c"]         # (the next Verify's stop_features)
    # while requests are queued, one recompute at a time; none while ticks do not draft
    sched._stop_features = []
    d, e = request("d"), request("e")
    sched._active, sched.max_sessions = [d, e], 8
    sched._queue.append(request("waiting"))
    sched._lose_rows(d)
    sched._lose_rows(e)
    sched.drafting = False
    sched._start_refeatures()
    assert len(calls) == 3 and sched._refeature_wanted
    sched.drafting = True
    sched._start_refeatures()
    assert len(calls) == 4 and len(sched._refeaturing) == 1
    sched._active, sched._refeaturing = [], []
    sched._queue.clear()


# ------------------------------------------------------------------------------------------------
# streaming: events coalesced into messages (issue 23)


class _Peer:
    address = None
    stub = None

    def info(self):
        from dflash_grpc.v1 import common_pb2

        return common_pb2.ModelInfo(vocab_size=300, max_context=64, max_sessions=4, tokenizer_fingerprint="fp",
                                    model_fingerprint="m", device="cpu")

    def state(self):
        return None


class _ScriptedScheduler:
    """Stands in for the scheduler: every submitted request finds ``events`` already queued."""

    def __init__(self, events):
        self.events = events

    def submit(self, req):
        for e in self.events:
            req.events.put(e)

    def close(self, req, why=None):
        pass


def _servicer(events):
    from fixtures.fakes import FakeTokenizer
    from orchestrator.servicer import GenerationServicer

    return GenerationServicer(_Peer(), _Peer(), FakeTokenizer(), 16, None, _ScriptedScheduler(events))


def test_generate_sends_the_events_queued_together_as_one_message():
    from dflash_grpc.localhop import LocalContext
    from dflash_grpc.v1 import generation_pb2
    from orchestrator.scheduler import Tokens

    svc = _servicer([Tokens([1]), Tokens([2, 3]), Tokens([4], "length")])
    msgs = list(svc.Generate(generation_pb2.GenerateRequest(prompt="a", max_tokens=4), LocalContext()))
    assert [list(m.token_ids) for m in msgs] == [[1, 2, 3, 4], []]
    assert msgs[0].text == "xxxx" and msgs[0].prompt_tokens == 3
    assert msgs[-1].finished and msgs[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].stats.generated_tokens == 4


def test_generate_coalescing_keeps_each_push_and_stops_at_a_stop_string():
    """Each event still goes through the text stream on its own: a stop string found in one
    event ends the message there, later events' tokens are not sent."""
    from dflash_grpc.localhop import LocalContext
    from dflash_grpc.v1 import generation_pb2
    from orchestrator.scheduler import Tokens

    svc = _servicer([Tokens([1]), Tokens([2, 3]), Tokens([4, 5])])
    svc.tokenizer.decode = lambda ids: "".join("ab<c"[i % 4] for i in ids)   # 1 2 3 -> "b<c", 4 5 -> "ab"
    msgs = list(svc.Generate(generation_pb2.GenerateRequest(prompt="a", max_tokens=9, stop=["<c"]), LocalContext()))
    assert [list(m.token_ids) for m in msgs] == [[1, 2, 3], []]
    assert msgs[0].text == "b" and msgs[-1].finish_reason == generation_pb2.FINISH_REASON_STOP


def test_generate_sends_the_tokens_before_a_failure_then_fails():
    import grpc

    from dflash_grpc.localhop import HopAborted, LocalContext
    from dflash_grpc.v1 import generation_pb2
    from orchestrator.scheduler import Failure, Tokens

    svc = _servicer([Tokens([1]), Tokens([2]), Failure(grpc.StatusCode.UNAVAILABLE, "gone", "TARGET_UNAVAILABLE")])
    gen = svc.Generate(generation_pb2.GenerateRequest(prompt="a", max_tokens=9), LocalContext())
    assert list(next(gen).token_ids) == [1, 2]
    with pytest.raises(HopAborted) as e:
        next(gen)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.reason == "TARGET_UNAVAILABLE"


def _idle_scheduler(interval_ms):
    """A scheduler whose thread is stopped, to drive its event hand-over by hand."""
    from orchestrator.scheduler import Scheduler

    sched = Scheduler(_Peer(), _Peer(), max_sessions=4, step_nodes=64, stream_interval_ms=interval_ms)
    sched._stop.set()
    sched._wake.set()
    sched._thread.join()
    return sched


def _request(sid="r"):
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Request

    return Request(session_id=sid, prompt=[1], sampling=common_pb2.SamplingParams(), max_tokens=100,
                   tree=draft_pb2.TreeParams(), speculative=False)


def _drain(req):
    out = []
    while not req.events.empty():
        out.append(req.events.get())
    return out


def test_stream_interval_holds_tokens_but_never_the_first_or_the_end():
    import grpc

    from orchestrator.scheduler import Failure, Tokens

    sched = _idle_scheduler(60_000)   # a minute: nothing becomes due by time alone here
    a, b = _request("a"), _request("b")
    sched._pending.extend([(a, Tokens([1])), (b, Tokens([7]))])
    sched._flush_events()
    assert [e.tokens for e in _drain(a)] == [[1]] and [e.tokens for e in _drain(b)] == [[7]]   # first: at once
    sched._pending.extend([(a, Tokens([2])), (b, Tokens([8])), (a, Tokens([3]))])
    sched._flush_events()
    assert _drain(a) == [] and _drain(b) == []                                                  # held
    sched._pending.append((a, Tokens([4])))
    sched._end(a, Failure(grpc.StatusCode.UNAVAILABLE, "gone"))                                  # an end: all, in order
    got = _drain(a)
    assert [e.tokens for e in got[:3]] == [[2], [3], [4]] and isinstance(got[3], Failure)
    assert _drain(b) == []
    b.flush_at = sched._next_due = 0.0                                                           # as if b's interval passed
    sched._pending.append((b, Tokens([9])))
    sched._flush_events()
    assert [e.tokens for e in _drain(b)] == [[8], [9]]
    sched._pending.append((b, Tokens([10], "length")))                                           # a finish: _emit ends it
    sched._end(b, Tokens([11], "length"), hand_over=False)
    sched._flush_events()
    assert [e.tokens for e in _drain(b)] == [[10], [11]]


def test_stream_interval_zero_hands_every_event_over_and_force_flushes():
    from orchestrator.scheduler import Tokens

    sched = _idle_scheduler(0)
    a = _request()
    for t in ([1], [2]):
        sched._pending.append((a, Tokens(t)))
        sched._flush_events()
        assert [e.tokens for e in _drain(a)] == [t]
    held = _idle_scheduler(60_000)
    held._pending.append((a, Tokens([1])))
    held._flush_events()
    assert [e.tokens for e in _drain(a)] == [[1]]
    held._pending.append((a, Tokens([2])))
    held._flush_events()
    assert _drain(a) == []
    held._flush_events(force=True)   # the loop idles, or stops
    assert [e.tokens for e in _drain(a)] == [[2]]


def test_adaptive_hold_coalesces_only_where_messages_would_take_the_host():
    """Scheduler._adapt_hold: with several requests per tick, tokens are held for batch x the
    measured cost of a message / stream_host_share (capped by stream_hold_max_ms): never for a
    single request, for ticks slower than twice that, or when turned off. Held events then go
    out as with stream_interval_ms, and once the hold is gone they still leave in order."""
    from orchestrator.scheduler import Scheduler, Tokens

    sched = _idle_scheduler(0)   # the defaults: at most 50 ms, a quarter of a core
    assert (sched.hold_max, sched.stream_share) == (0.05, 0.25)
    for _ in range(300):
        sched.note_message(200e-6)
    assert sched.message_s == pytest.approx(200e-6, rel=0.01)
    for batch, tick_s, want in ((1, 0.001, 0.0), (16, 0.002, 16 * 200e-6 / 0.25), (64, 0.002, 0.05), (16, 0.03, 0.0)):
        sched._adapt_hold(batch, tick_s)
        assert sched.hold == pytest.approx(want, rel=0.01), (batch, tick_s)
    off = Scheduler(_Peer(), _Peer(), max_sessions=4, step_nodes=64, stream_hold_max_ms=0)
    try:
        off.message_s = 200e-6
        off._adapt_hold(64, 0.002)
        assert off.hold == 0.0
    finally:
        off.stop(timeout=1.0, release_timeout=0.1)

    a = _request()
    sched._adapt_hold(16, 0.002)
    sched._pending.append((a, Tokens([1])))
    sched._flush_events()
    assert [e.tokens for e in _drain(a)] == [[1]]                    # the first at once
    sched._pending.append((a, Tokens([2])))
    sched._flush_events()
    assert _drain(a) == []                                           # held
    sched._adapt_hold(1, 0.002)                                      # one request left: no hold
    assert sched.hold == 0.0
    sched._pending.append((a, Tokens([3])))
    sched._flush_events()
    a.flush_at = sched._next_due = 0.0                               # (as if the old hold passed)
    sched._flush_events()
    assert [e.tokens for e in _drain(a)] == [[2], [3]]
    sched._pending.append((a, Tokens([4])))
    sched._flush_events()                                            # nothing held: at once again
    assert [e.tokens for e in _drain(a)] == [[4]]


def test_generate_tells_the_scheduler_each_message_cost():
    """Each Generate message's CPU time (its thread's, the send included) reaches the scheduler
    (note_message), once per message with tokens: what the adaptive hold is measured on."""
    from dflash_grpc.localhop import LocalContext
    from dflash_grpc.v1 import generation_pb2
    from orchestrator.scheduler import Tokens

    class Noting(_ScriptedScheduler):
        noted: list = []

        def note_message(self, cpu_s):
            self.noted.append(cpu_s)

    from fixtures.fakes import FakeTokenizer
    from orchestrator.servicer import GenerationServicer

    sched = Noting([Tokens([1]), Tokens([2], "length")])
    svc = GenerationServicer(_Peer(), _Peer(), FakeTokenizer(), 16, None, sched)
    msgs = list(svc.Generate(generation_pb2.GenerateRequest(prompt="a", max_tokens=2), LocalContext()))
    assert len(msgs) == 2 and len(sched.noted) == 1 and sched.noted[0] >= 0.0


def test_propose_asks_each_request_for_the_depth_its_limits_leave():
    """Each Propose item's max_depth is min(block - 1, the target's depth cap, the depth asked,
    the context left, the tokens left) - 1 for the last two - and a request with no depth left
    does not draft; a chain (budget 0) asks for its node share as its length. Requests far from
    their ends take the short path (the last two bounds not read): checked here against the
    formula, near and far from each end."""
    from dflash_grpc.columns import COLUMNAR, unpack_i32
    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.scheduler import Request, Scheduler, adaptive_budget

    block, cap, context = 16, 12, 200
    info = common_pb2.ModelInfo(vocab_size=300, max_context=context, max_tree_width=64, max_tree_depth=cap,
                                max_sessions=64, model_fingerprint="m", device="cpu", features=[COLUMNAR])
    drafter = draft_pb2.DrafterInfo(model=common_pb2.ModelInfo(vocab_size=300, block_size=block, max_sessions=1024,
                                                               features=[COLUMNAR]), target_fingerprint="m")
    sent = []

    class Stream:
        broken = False

        def exchange(self, request, timeout=None, on_sent=None):
            sent.append(request)
            return draft_pb2.ProposeResponse()   # no trees: every request decodes plainly this tick

    class Target(_Peer):
        def info(self):
            return info

    class Draft(_Peer):
        address = "x"

        def state(self):
            return drafter

        def layers(self):
            return [1]

        def mark_ok(self):
            pass

        def propose_stream(self, timeout):
            return Stream()

    sched = Scheduler(Target(), Draft(), max_sessions=1024, step_nodes=1024)
    sched._stop.set()
    sched._wake.set()
    sched._thread.join()
    cases = []   # (length, emitted, max_tokens, budget, asked depth)
    for length in (20, context - 14, context - 13, context - 12, context - 3, context - 2, context - 1):
        for left in (1, 2, 3, 12, 13, 14, 500):
            for budget, asked in ((15, 0), (15, 5), (0, 0), (0, 7)):
                cases.append((length, 10, 10 + left, budget, asked))
    batch = []
    for i, (length, emitted, max_tokens, budget, asked) in enumerate(cases):
        r = Request(session_id=f"s{i}", prompt=[1], sampling=common_pb2.SamplingParams(), max_tokens=max_tokens,
                    tree=draft_pb2.TreeParams(budget=budget, top_k=4, max_depth=asked), speculative=True)
        r.on_target, r.root, r.length, r.emitted = True, 5, length, emitted
        sched._keep(r, common_pb2.Tensor(dtype=common_pb2.DTYPE_BF16, shape=[length, 2], data=bytes(4 * length)))
        batch.append(r)
    sched._propose_trees(batch, drafter, columnar=True)
    cols = sent[0].columns
    asked_ids = list(cols.session_ids)
    depths = dict(zip(asked_ids, unpack_i32(cols.max_depths)))
    budgets = dict(zip(asked_ids, unpack_i32(cols.budgets)))
    for i, (length, emitted, max_tokens, budget, asked) in enumerate(cases):
        want = min(block - 1, cap, asked or 10**9, context - length - 1, max_tokens - emitted - 1)
        nodes = adaptive_budget(len(batch), 1024, want=budget or want, min_nodes=2 if budget else 1) if want > 0 else 0
        if not nodes:
            assert f"s{i}" not in depths, cases[i]
            continue
        assert depths[f"s{i}"] == (want if budget else nodes), cases[i]
        assert budgets[f"s{i}"] == (nodes if budget else 0), cases[i]
    sched.stop(timeout=1.0, release_timeout=0.1)


def test_tick_hands_each_request_its_tokens_cut_at_eos_and_max_tokens():
    """A tick's tokens per request (accepted + bonus) go to its handler as one event: whole
    while tokens are left and no EOS is among them (the tick's inline path), cut at the first
    EOS (finish eos) or at max_tokens (finish length, exactly at the limit too) otherwise."""
    from dflash_grpc.v1 import common_pb2, draft_pb2, target_pb2
    from orchestrator.scheduler import Request, Scheduler

    class Stream:
        broken = False

        def exchange(self, request, timeout=None, on_sent=None):
            if on_sent is not None:
                on_sent()
            return target_pb2.VerifyResponse(results=[
                target_pb2.VerifyResult(session_id=it.session_id, accepted_tokens=[7, 2, 8] if it.session_id == "eos" else [7, 8],
                                        bonus_token=9, committed_length=30) for it in request.items])

    class Target(_Peer):
        def verify_stream(self, timeout):
            return Stream()

    sched = Scheduler(Target(), _Peer(), max_sessions=8, stream_hold_max_ms=0)
    sched._stop.set()
    sched._wake.set()
    sched._thread.join()
    batch = []
    for sid, left in (("exact", 3), ("over", 2), ("eos", 10), ("free", 10), ("one-more", 4)):
        r = Request(session_id=sid, prompt=[1], sampling=common_pb2.SamplingParams(), max_tokens=5 + left,
                    tree=draft_pb2.TreeParams(), speculative=False, eos=frozenset({2}))
        r.on_target, r.root, r.length, r.emitted = True, 5, 20, 5
        batch.append(r)
    sched._active = list(batch)
    sched._tick(batch)
    sched._flush_events(force=True)
    got = {r.session_id: [(e.tokens, e.finish) for e in _drain(r)] for r in batch}
    assert got == {"exact": [([7, 8, 9], "length")], "over": [([7, 8], "length")], "eos": [([7], "eos")],
                   "free": [([7, 8, 9], None)], "one-more": [([7, 8, 9], None)]}
    assert [r.emitted for r in batch] == [8, 7, 6, 8, 8] and [r.closed for r in batch] == [True, True, True, False, False]
    assert all(r.length == 30 and r.root == 9 for r in batch)


def test_verify_asks_the_ring_but_for_requests_whose_drafter_session_lacks_rows():
    """With the drafter on the same-host hop, a Verify asks for the feature ring, naming in
    ``ring_off`` each request whose drafter session lacks rows [0, rows_from) (lost; its rows
    recomputed or to be): its rows come as bytes meanwhile. Without the hop, or once the drafter
    refused the ring, no Verify asks for it."""
    from dflash_grpc.v1 import common_pb2, draft_pb2, target_pb2
    from orchestrator.peers import LocalHopCall
    from orchestrator.scheduler import Request, Scheduler

    sent = []

    class Stream:
        spin_s, broken = 0.0, False

        def exchange(self, request, timeout=None, on_sent=None):
            sent.append(request)
            return target_pb2.VerifyResponse(results=[target_pb2.VerifyResult(
                session_id=it.session_id, accepted_nodes=[0], bonus_token=5, committed_length=7) for it in request.items])

    class Target:
        def info(self):
            return common_pb2.ModelInfo(device="cpu", max_sessions=4)

    class NoDraft:
        address = None

    sched = Scheduler(Target(), NoDraft(), max_sessions=4)
    sched._stop.set()
    sched._thread.join(5)     # (driven by hand here)
    try:
        sched._verify = Stream()
        sched._drafter = lambda: None   # (plain ticks: no Propose)

        def request(name, synced):
            r = Request(session_id=name, prompt=[1, 2, 3], sampling=common_pb2.SamplingParams(), max_tokens=100,
                        tree=draft_pb2.TreeParams())
            r.on_target, r.root, r.length, r.seq = True, 9, 6, [1, 2, 3, 7, 8, 5, 9]
            r.rows_from, r.draft_synced = 6, synced
            return r

        batch = [request("synced", True), request("lost", False)]
        sched._propose = None                       # the drafter not on the hop: no ring
        sched._tick(batch)
        assert not sent[-1].feature_ring and not sent[-1].ring_off
        sched._propose = LocalHopCall.__new__(LocalHopCall)
        sched._tick(batch)
        assert sent[-1].feature_ring and list(sent[-1].ring_off) == ["lost"]
        sched.ring_refused = True
        sched._tick(batch)
        assert not sent[-1].feature_ring
    finally:
        sched._propose = None
        sched.stop(timeout=1.0, release_timeout=0.1)


def test_a_hop_prefill_the_scheduler_stops_waiting_for_is_cancelled_and_released():
    """A Prefill over the same-host hop (``TargetPeer.prefill_future`` -> ``HopFuture``) that has
    not answered when the scheduler stops: ``stop`` cancels it (its connection is shut down, so
    the target's call ends and releases what it opened) and releases the session anyway; the
    future's result is CANCELLED, a ``grpc.RpcError`` as gRPC's futures give."""
    import threading

    from dflash_grpc.v1 import common_pb2, draft_pb2
    from orchestrator.peers import HopFuture, StreamError
    from orchestrator.scheduler import Request, Scheduler

    interrupted = threading.Event()
    futures = []

    class FakeCall:   # what hop_unary hands on_open: the open connection
        def interrupt(self):
            interrupted.set()

    def call(deadline, on_open):
        on_open(FakeCall())
        interrupted.wait(30)
        raise StreamError(grpc.StatusCode.UNAVAILABLE, "the local hop connection was lost")

    class ReleaseCall:
        released = []

        def __call__(self, request, timeout=None):
            self.released += list(request.session_ids)
            return common_pb2.ReleaseResponse(released=len(request.session_ids))

    class Target:
        stub = type("Stub", (), {"Release": ReleaseCall()})()

        def info(self):
            return common_pb2.ModelInfo(device="cpu", max_sessions=2)

        def prefill_future(self, request, timeout):
            fut = HopFuture(call, lambda deadline: None, timeout)
            futures.append(fut)
            return fut

    class Draft:
        address = None
        stub = None

        def layers(self):
            return None

        def state(self):
            return None

    sched = Scheduler(Target(), Draft(), max_sessions=2)
    req = Request(session_id="s1", prompt=[1, 2, 3], sampling=common_pb2.SamplingParams(), max_tokens=4,
                  tree=draft_pb2.TreeParams(), speculative=False)
    sched.submit(req)
    deadline = time.monotonic() + 10
    while not futures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert futures, "the scheduler sent no Prefill"
    sched.stop(timeout=5.0, release_timeout=1.5)
    assert interrupted.is_set(), "the hop Prefill was not cancelled"
    with pytest.raises(grpc.RpcError) as e:
        futures[0].result(5)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert "s1" in Target.stub.Release.released


def test_exchange_seconds_leave_out_the_hand_over_and_count_a_failed_exchange():
    """Scheduler._exchange counts an exchange's wall and CPU seconds (SchedulerStatus
    exchange_seconds ...) without the hand-over of tokens it runs once the request is sent
    (_flush_events: the orchestrator's own work), and counts an exchange that raised too."""
    from dflash_grpc.v1 import common_pb2
    from orchestrator.scheduler import Scheduler

    class Target:
        def info(self):
            return common_pb2.ModelInfo(device="cpu", max_sessions=4)

    class NoDraft:
        address = None

    class Call:
        def __init__(self, fail):
            self.fail = fail

        def exchange(self, request, timeout, on_sent):
            on_sent()
            time.sleep(0.05)   # (the peer's answer)
            if self.fail:
                raise RuntimeError("stream broke")
            return "reply"

    sched = Scheduler(Target(), NoDraft(), max_sessions=2)
    try:
        # a long hand-over on this thread (the scheduler's own idle loop forces flushes: left quick)
        sched._flush_events = lambda force=False: None if force else time.sleep(0.2)
        assert sched._exchange(Call(False), None, 1.0) == "reply"
        first = sched.exchange_s
        assert 0.05 <= first < 0.2   # the answer's wait, not the hand-over's
        with pytest.raises(RuntimeError):
            sched._exchange(Call(True), None, 1.0)
        assert 0.1 <= sched.exchange_s < 0.4 and sched.exchange_s - first >= 0.05
        assert sched.status().exchange_seconds == sched.exchange_s
    finally:
        sched.stop(timeout=1.0, release_timeout=0.1)

"""Orchestrator pieces without processes: text streaming with stop strings, statistics, tree trim."""

from __future__ import annotations

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

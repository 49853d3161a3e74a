"""Draft service over gRPC (in-process server on 127.0.0.1:0, tiny synthetic target): Info,
Propose for interleaved sessions against the drafter called directly, per-item errors that leave
the session untouched, Release, session and context limits, and ``python -m draft_service``."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from dflash_grpc.wire import GRPC_OPTIONS, tensor_from_proto, tensor_to_proto
from draft_service.drafter import DFlashDrafter
from draft_service.gguf_io import load_drafter
from draft_service.servicer import file_sha256
from draft_service.tree import build_chain, build_tree
from runtime.fingerprint import model_fingerprint, tokenizer_fingerprint
from runtime.gguf_loader import GGUFFile
from tests.conftest import draft_in_process

OK = grpc.StatusCode.OK.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]

MAX_SESSIONS = 3
MAX_CONTEXT = 40


@pytest.fixture(scope="module")
def files(tiny_llama, tiny_drafter):
    """The shared tiny target and its random drafter (tests/conftest.py)."""
    return tiny_llama, tiny_drafter


@pytest.fixture(scope="module")
def reference(files):
    tiny, drafter = files
    return load_drafter(drafter, tiny.path)


@pytest.fixture()
def served(files):
    """A fresh servicer behind a real gRPC server; yields ``(servicer, stub)``."""
    tiny, drafter = files
    with draft_in_process(drafter, tiny.path, max_sessions=MAX_SESSIONS, max_context=MAX_CONTEXT) as (servicer, port):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
        try:
            yield servicer, draft_pb2_grpc.DraftServiceStub(channel)
        finally:
            channel.close()


class Stream:
    """One open Propose stream: send a request, read its response."""

    def __init__(self, stub):
        self._q: queue.Queue = queue.Queue()
        self._responses = stub.Propose(iter(self._q.get, None), timeout=30)

    def __call__(self, *items: draft_pb2.ProposeItem) -> list[draft_pb2.ProposeResult]:
        self._q.put(draft_pb2.ProposeRequest(items=list(items)))
        return list(next(self._responses).results)

    def close(self):
        self._q.put(None)
        assert list(self._responses) == []


def feats(rows: int, width: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def item(sid: str, features: torch.Tensor | None, root: int, committed: int, **tree) -> draft_pb2.ProposeItem:
    msg = draft_pb2.ProposeItem(session_id=sid, root_token=root, committed_length=committed, tree=draft_pb2.TreeParams(**tree))
    if features is not None:
        msg.features.CopyFrom(tensor_to_proto(features))
    return msg


class Mirror:
    """The drafter called directly, fed the same rows as a session (as decoded off the wire)."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.ctx = drafter.new_context()

    def step(self, features: torch.Tensor, root: int, depth: int | None = None) -> tuple[list[int], list[int]]:
        self.drafter.append_context(self.ctx, tensor_from_proto(tensor_to_proto(features)))
        logits = self.drafter.block_logits(self.ctx, root)
        return build_chain(root, logits if depth is None else logits[:depth])


def tree_of(result: draft_pb2.ProposeResult) -> tuple[list[int], list[int]]:
    return list(result.tree.tokens), list(result.tree.parents)


# ------------------------------------------------------------------------------------------------


def test_info(served, files):
    servicer, stub = served
    tiny, drafter = files
    info = stub.Info(draft_pb2.DrafterInfoRequest())
    m = info.model
    assert m.architecture == "qwen3" and m.block_size == 8 and m.vocab_size == tiny.vocab
    assert m.hidden_size == 64 and m.num_layers == 2 and m.max_sessions == MAX_SESSIONS
    assert m.max_context == MAX_CONTEXT and m.device == "cpu" and list(m.features) == ["chain", "tree", "columnar"]
    assert m.model_name == "dflash-random-llama" and m.model_fingerprint == file_sha256(drafter)
    target = GGUFFile(tiny.path)
    assert m.tokenizer_fingerprint == tokenizer_fingerprint(target)
    assert info.target_fingerprint == model_fingerprint(target)
    assert list(info.target_layer_ids) == [0, 2, 3]
    assert info.mask_token_id == servicer.config.mask_token_id == 0


def test_propose_interleaved_sessions_match_the_drafter(served, reference):
    servicer, stub = served
    W = reference.config.feature_size
    a, b = Mirror(reference), Mirror(reference)
    stream = Stream(stub)

    fa, fb = feats(7, W, 1), feats(5, W, 2)
    res = stream(item("A", fa, 10, 7), item("B", fb, 20, 5))
    assert [r.session_id for r in res] == ["A", "B"] and [r.status.code for r in res] == [OK, OK]
    assert tree_of(res[0]) == a.step(fa, 10) and tree_of(res[1]) == b.step(fb, 20)
    assert len(res[0].tree.tokens) == 8 and list(res[0].tree.parents) == [-1, 0, 1, 2, 3, 4, 5, 6]

    # B first this time; A sends f16 features, B f32; then A again, with a single row
    fa2, fb2 = feats(3, W, 3, torch.float16), feats(1, W, 4, torch.float32)
    res = stream(item("B", fb2, 21, 6), item("A", fa2, 11, 10))
    assert [r.status.code for r in res] == [OK, OK]
    assert tree_of(res[0]) == b.step(fb2, 21) and tree_of(res[1]) == a.step(fa2, 11)
    fa3 = feats(1, W, 5)
    (r,) = stream(item("A", fa3, 12, 11))
    assert tree_of(r) == a.step(fa3, 12)
    assert servicer.session_length("A") == 11 and servicer.session_length("B") == 6
    stream.close()

    # the chains are not degenerate (the test would be weak if every token were the same)
    assert len(set(r.tree.tokens[1:])) > 1 or len(set(res[1].tree.tokens[1:])) > 1


def test_same_session_twice_in_one_request_and_empty_features(served, reference):
    _, stub = served
    W = reference.config.feature_size
    m = Mirror(reference)
    f1, f2 = feats(4, W, 6), feats(2, W, 7)
    stream = Stream(stub)
    res = stream(item("S", f1, 1, 4), item("S", f2, 2, 6), item("S", None, 3, 6))
    assert [r.status.code for r in res] == [OK, OK, OK]
    assert tree_of(res[0]) == m.step(f1, 1)
    assert tree_of(res[1]) == m.step(f2, 2)
    assert tree_of(res[2]) == m.step(f2[:0], 3)  # no new rows: same context, new root
    stream.close()


def test_tree_params(served, reference):
    _, stub = served
    W = reference.config.feature_size
    f = feats(3, W, 8)
    stream = Stream(stub)
    full = stream(item("T", f, 5, 3))[0]
    assert len(full.tree.tokens) == 8
    for tree, nodes in (({"max_depth": 3}, 4), ({"max_depth": 7}, 8), ({"budget": 4, "top_k": 1}, 5),
                        ({"budget": 1, "top_k": 8}, 2), ({"top_k": 1}, 8), ({"budget": 0, "top_k": 8}, 8)):  # fmt: skip
        (r,) = stream(item("T", None, 5, 3, **tree))
        assert r.status.code == OK and list(r.tree.tokens) == list(full.tree.tokens)[:nodes], tree
        assert list(r.tree.parents) == [i - 1 for i in range(nodes)]
    # budget > 1 and top_k > 1: the DDTree of the same block distributions
    mirror = Mirror(reference)
    mirror.drafter.append_context(mirror.ctx, tensor_from_proto(tensor_to_proto(f)))
    logits = mirror.drafter.block_logits(mirror.ctx, 5)
    for budget, top_k, depth in ((4, 4, 0), (12, 3, 0), (9, 2, 3)):
        (r,) = stream(item("T", None, 5, 3, budget=budget, top_k=top_k, max_depth=depth))
        assert r.status.code == OK
        expected = build_tree(5, logits[: depth or None], budget, top_k)
        assert tree_of(r) == expected and len(r.tree.tokens) == budget + 1
    stream.close()


def test_tree_params_over_the_service_bounds_are_refused_at_once(served, reference):
    """budget, top_k and max_depth are bounded by the service's capacity (MAX_TREE_BUDGET nodes,
    the vocabulary, block_size - 1): larger ones are refused with INVALID_ARGUMENT before any work,
    naming the bound, and a valid item of the same message still gets its tree."""
    from draft_service.batched import MAX_TREE_BUDGET

    _, stub = served
    c = reference.config
    f = feats(3, c.feature_size, 11)
    stream = Stream(stub)
    assert stream(item("V", f, 5, 3))[0].status.code == OK
    over = [({"budget": 5_000_000, "top_k": 8}, str(MAX_TREE_BUDGET)), ({"budget": MAX_TREE_BUDGET + 1, "top_k": 2}, str(MAX_TREE_BUDGET)),
            ({"budget": 8, "top_k": 2**31 - 1}, str(c.vocab_size)), ({"budget": 2**31 - 1, "top_k": 2**31 - 1}, "budget"),
            ({"max_depth": c.block_size}, str(c.block_size - 1)), ({"max_depth": 2**31 - 1}, "max_depth")]  # fmt: skip
    t0 = time.monotonic()
    res = stream(*(item("B", f, 5, 3, **tree) for tree, _ in over), item("V", None, 5, 3, budget=6, top_k=3))
    assert time.monotonic() - t0 < 5.0
    assert [r.status.code for r in res] == [INVALID_ARGUMENT] * len(over) + [OK]
    for r, (_, bound) in zip(res, over):
        assert bound in r.status.message and r.status.reason == "INVALID_ARGUMENT" and not r.tree.tokens, r.status.message
    assert len(res[-1].tree.tokens) == 7                       # the valid item got its 6-node tree
    assert stream(item("B", f, 5, 3, budget=MAX_TREE_BUDGET, top_k=c.vocab_size))[0].status.code == OK   # the bounds pass
    stream.close()


def test_item_errors_leave_the_session_unchanged(served, reference):
    servicer, stub = served
    W = reference.config.feature_size
    V = reference.config.vocab_size
    f1, f2 = feats(4, W, 9), feats(3, W, 10)
    stream = Stream(stub)
    assert stream(item("S", f1, 7, 4))[0].status.code == OK

    nan = f2.clone()
    nan[1, 5] = float("nan")
    wrong_bytes = tensor_to_proto(f2)
    wrong_bytes.data = wrong_bytes.data[:-2]
    bad = [
        (item("S", feats(3, W + 1, 0), 8, 7), INVALID_ARGUMENT),  # bad width
        (item("S", feats(3, W, 0).reshape(-1), 8, 7), INVALID_ARGUMENT),  # 1-D
        (item("S", f2, 8, 8), FAILED_PRECONDITION),  # committed_length: 4 held + 3 sent != 8
        (item("S", f2, 8, 4), FAILED_PRECONDITION),
        (item("S", f2, V, 7), INVALID_ARGUMENT),  # root out of vocabulary
        (item("S", f2, -1, 7), INVALID_ARGUMENT),
        (item("S", nan, 8, 7), INVALID_ARGUMENT),
        (draft_pb2.ProposeItem(session_id="S", features=wrong_bytes, root_token=8, committed_length=7), INVALID_ARGUMENT),
        (item("S", f2, 8, 7, budget=-1), INVALID_ARGUMENT),
        (item("", f2, 8, 7), INVALID_ARGUMENT),
        (item("new", f2, 8, 99), FAILED_PRECONDITION),  # a new session with a bad first item
    ]
    res = stream(*(b for b, _ in bad), item("other", f1, 3, 4))
    assert [r.status.code for r in res] == [code for _, code in bad] + [OK]
    assert all(r.status.message for r in res[:-1]) and not any(r.tree.tokens for r in res[:-1])
    assert servicer.session_length("S") == 4 and servicer.session_length("new") is None

    # S continues as if the bad items had never been sent: same tree as a session that never saw them
    (after,) = stream(item("S", f2, 8, 7))
    stream.close()
    clean = Mirror(reference)
    clean.step(f1, 7)
    assert after.status.code == OK and tree_of(after) == clean.step(f2, 8)
    assert servicer.session_length("S") == 7


def test_release_and_session_limit(served, reference):
    servicer, stub = served
    W = reference.config.feature_size
    f = feats(2, W, 11)
    stream = Stream(stub)
    for sid in ("s1", "s2", "s3"):
        assert stream(item(sid, f, 1, 2))[0].status.code == OK
    (full,) = stream(item("s4", f, 1, 2))
    assert full.status.code == RESOURCE_EXHAUSTED and servicer.num_sessions == MAX_SESSIONS
    assert stream(item("s2", None, 1, 2))[0].status.code == OK  # existing sessions still work

    assert stub.Release(common_pb2.ReleaseRequest(session_ids=["s2", "nope", "s2"])).released == 1
    assert stub.Release(common_pb2.ReleaseRequest(session_ids=["s2"])).released == 0
    assert servicer.session_length("s2") is None
    assert stream(item("s4", f, 1, 2))[0].status.code == OK
    # a released session starts again from position 0
    (again,) = stream(item("s2", f, 1, 4))
    assert again.status.code == RESOURCE_EXHAUSTED  # full again (s1, s3, s4)
    stub.Release(common_pb2.ReleaseRequest(session_ids=["s1"]))
    (again,) = stream(item("s2", f, 1, 4))
    assert again.status.code == FAILED_PRECONDITION
    (again,) = stream(item("s2", f, 1, 2))
    assert again.status.code == OK and tree_of(again) == Mirror(reference).step(f, 1)
    stream.close()


def test_context_limit(served, reference):
    servicer, stub = served
    W = reference.config.feature_size
    stream = Stream(stub)
    assert stream(item("c", feats(MAX_CONTEXT - 1, W, 12), 1, MAX_CONTEXT - 1))[0].status.code == OK
    (r,) = stream(item("c", feats(2, W, 13), 1, MAX_CONTEXT + 1))
    assert r.status.code == RESOURCE_EXHAUSTED and servicer.session_length("c") == MAX_CONTEXT - 1
    assert stream(item("c", feats(1, W, 13), 1, MAX_CONTEXT))[0].status.code == OK
    stream.close()


def test_concurrent_streams(served, reference):
    """Several streams at once give the same trees as one at a time (the model is shared)."""
    _, stub = served
    W = reference.config.feature_size
    steps = [(feats(3, W, 20 + i), 30 + i) for i in range(4)]
    expected = {}
    for sid in ("x", "y", "z"):
        m = Mirror(reference)
        expected[sid] = [m.step(f, r) for f, r in steps]
    got: dict[str, list] = {}

    def run(sid):
        stream = Stream(stub)
        got[sid] = [tree_of(stream(item(sid, f, r, 3 * (i + 1)))[0]) for i, (f, r) in enumerate(steps)]
        stream.close()

    threads = [threading.Thread(target=run, args=(sid,)) for sid in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == expected


def test_module_main_serves(files, tmp_path):
    """``python -m draft_service`` without --drafter: uses (and creates) the cached default drafter."""
    tiny, _ = files
    env = {**os.environ, "DFLASH_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "draft_service", "--target", tiny.path, "--port", "0", "--max-sessions", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY draft port="), (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(line.strip().split("=")[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            info = draft_pb2_grpc.DraftServiceStub(ch).Info(draft_pb2.DrafterInfoRequest(), timeout=10)
        assert info.model.max_sessions == 5 and info.model.block_size == 16
        assert info.target_fingerprint == model_fingerprint(GGUFFile(tiny.path))
        assert os.listdir(tmp_path / "cache" / "drafters")
    finally:
        proc.terminate()
        proc.wait(15)
    assert "untrained" in proc.stderr.read()

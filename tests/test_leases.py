"""Session owners and leases (runtime/owners.py; docs/ARCHITECTURE.md, "Owners, leases and
shutdown"), over gRPC against in-process target and draft services on the tiny model.

* An owner (``dflash-owner`` / ``dflash-owner-epoch`` call metadata) cannot Verify, Propose or
  Release another owner's session (PERMISSION_DENIED, reason NOT_OWNER, per item), and that
  session keeps decoding exactly as an untouched twin.
* An owner whose stream dropped and that makes no call loses its sessions after ``lease_s``;
  an open stream holds the lease however long it is idle; another owner's sessions stay.
* A new epoch of a known name frees the older epochs' sessions at once (the very call that
  carries it sees the freed slots); a superseded epoch never frees the newer one's.
"""

from __future__ import annotations

import contextlib
import queue
import time

import grpc
import pytest
import torch

from dflash_grpc.serving import make_server
from dflash_grpc.transport import GRPC_OPTIONS
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from dflash_grpc.wire import tensor_to_proto
from runtime.errors import Reason
from runtime.owners import ANONYMOUS, EPOCH_KEY, OWNER_KEY, Owner, Owners, owner_from_metadata
from tests.conftest import draft_in_process

PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
SLOTS = 4
CONTEXT = 64
PROMPT = [5, 17, 42, 9, 100, 7]


def md(name: str, epoch: str = "e1") -> tuple[tuple[str, str], ...]:
    return ((OWNER_KEY, name), (EPOCH_KEY, epoch))


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# --------------------------------------------------------------------------------------------
# the bookkeeping alone


def test_owners_bookkeeping():
    clock = Clock()
    o = Owners(lease_s=5, clock=clock)
    a1, a2, b = Owner("a", "1"), Owner("a", "2"), Owner("b", "1")
    assert owner_from_metadata(md("a", "1")) == a1 and owner_from_metadata(None) == ANONYMOUS
    assert o.call_started(a1) == [] and o.call_started(b) == [] and o.call_started(ANONYMOUS) == []
    for sid, who in (("x", a1), ("y", a1), ("z", b), ("anon", ANONYMOUS)):
        o.record(sid, who)
    assert o.may_touch("x", a1) and not o.may_touch("x", b) and not o.may_touch("x", ANONYMOUS)
    assert o.may_touch("anon", ANONYMOUS) and not o.may_touch("anon", a1) and o.may_touch("new", b)
    assert o.may_touch("x", None)                                 # in-process callers are trusted
    for who in (a1, b, ANONYMOUS):
        o.call_ended(who)
    clock.t += 5
    assert o.expired() == []                                      # not past the lease yet
    o.call_started(b)                                             # b has a call in flight
    clock.t += 0.5
    assert o.expired() == [(a1, ["x", "y"])] and o.owner_of("x") is None
    # epochs: a new one frees the older's sessions; a superseded one never frees the newer's
    o.record("p", a1)
    assert o.call_started(a2) == ["p"] and o.owner_of("p") is None
    o.record("q", a2)
    assert o.call_started(a1) == [] and o.owner_of("q") == a2
    o.call_ended(a1)
    o.call_ended(a2)
    clock.t += 100
    assert o.expired() == [(a2, ["q"])]
    assert o.owner_of("z") == b and o.owner_of("anon") == ANONYMOUS   # a call in flight; anonymous: no lease
    clock.t += 100
    assert o.expired() == [] and "a" not in o._epoch   # noqa: SLF001 - quiet owners holding nothing are forgotten


# --------------------------------------------------------------------------------------------
# services


@contextlib.contextmanager
def target_service(model_path: str, lease_s: float, serve: bool = False):
    """The target in this process (reference engine) with leases of ``lease_s`` seconds; yields
    ``(loop, port)``, with ``serve`` ``(loop, port, server, health_servicer)``."""
    from runtime.step_loop import StepLoop
    from target_service.__main__ import build_engine
    from target_service.servicer import TargetServicer

    engine, info = build_engine(model_path, max_sessions=SLOTS, max_context=CONTEXT)
    loop = StepLoop(engine, name="lease-target", owners=Owners(lease_s=lease_s))
    servicer = TargetServicer(loop, info)

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.TargetService"]

    server, health, port = make_server(add, "127.0.0.1:0", max_workers=8)
    try:
        yield (loop, port, server, health) if serve else (loop, port)
    finally:
        server.stop(None)
        loop.stop()


@pytest.fixture()
def target(tiny_llama):
    """``(stub, loop)`` of a fresh target without leases (tests set ``loop.owners.lease_s``)."""
    with target_service(tiny_llama.path, 0.0) as (loop, port):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
        try:
            yield target_pb2_grpc.TargetServiceStub(channel), loop
        finally:
            channel.close()


@pytest.fixture()
def draft(tiny_llama, tiny_drafter):
    """``(stub, servicer)`` of a fresh draft service."""
    with draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=SLOTS, max_context=CONTEXT, max_workers=8) as (s, port):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
        try:
            yield draft_pb2_grpc.DraftServiceStub(channel), s
        finally:
            channel.close()


class Stream:
    """One open Verify or Propose stream of one owner: ``stream(items)`` -> the reply's results."""

    def __init__(self, method, request_type, metadata=()):
        self._q: queue.Queue = queue.Queue()
        self._type = request_type
        self.responses = method(iter(self._q.get, None), metadata=metadata, timeout=60)

    def __call__(self, *items):
        self._q.put(self._type(items=list(items)))
        return list(next(self.responses).results)

    def cancel(self):
        self.responses.cancel()


def prefill(stub, sid: str, metadata=(), prompt=PROMPT) -> target_pb2.PrefillResult:
    item = target_pb2.PrefillItem(session_id=sid, prompt_tokens=prompt)
    return stub.Prefill(target_pb2.PrefillRequest(items=[item]), metadata=metadata, timeout=30).results[0]


def vitem(sid: str, root: int) -> target_pb2.VerifyItem:
    return target_pb2.VerifyItem(session_id=sid, tree=common_pb2.TokenTree(tokens=[root], parents=[-1]))


def free_slots(stub, metadata=()) -> int:
    return stub.Info(target_pb2.TargetInfoRequest(), metadata=metadata, timeout=10).free_slots


def release(stub, ids, metadata=()) -> int:
    return stub.Release(common_pb2.ReleaseRequest(session_ids=list(ids)), metadata=metadata, timeout=10).released


def wait_until(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_target_refuses_another_owners_session_and_it_decodes_unchanged(target):
    stub, _ = target
    b, r = prefill(stub, "b", md("B")), prefill(stub, "r", md("R"))  # r: b's untouched twin
    a = prefill(stub, "a", md("A"), prompt=[3, 4, 5])
    assert b.first_token == r.first_token
    sa = Stream(stub.Verify, target_pb2.VerifyRequest, md("A"))
    sb = Stream(stub.Verify, target_pb2.VerifyRequest, md("B"))
    sr = Stream(stub.Verify, target_pb2.VerifyRequest, md("R"))
    anon = Stream(stub.Verify, target_pb2.VerifyRequest)
    root_a, root_b, root_r = a.first_token, b.first_token, r.first_token
    for _ in range(5):
        mine, theirs = sa(vitem("a", root_a), vitem("b", root_b))     # one message, two items
        assert mine.status.code == 0
        root_a = mine.bonus_token
        assert theirs.status.code == PERMISSION_DENIED and theirs.status.reason == Reason.NOT_OWNER.value
        (other,) = anon(vitem("b", root_b))                            # anonymous may touch anonymous only
        assert other.status.code == PERMISSION_DENIED and other.status.reason == Reason.NOT_OWNER.value
        assert release(stub, ["b"], md("A")) == 0 and release(stub, ["b"]) == 0
        (got,), (want,) = sb(vitem("b", root_b)), sr(vitem("r", root_r))
        assert got.status.code == 0 and want.status.code == 0
        assert (got.bonus_token, got.committed_length) == (want.bonus_token, want.committed_length)
        root_b, root_r = got.bonus_token, want.bonus_token
    assert release(stub, ["r"], md("R")) == 1


def test_target_release_by_another_owner_keeps_the_session(target):
    stub, _ = target
    b = prefill(stub, "b", md("B"))
    assert release(stub, ["b", "nope"], md("A")) == 0 and release(stub, ["b"]) == 0
    assert free_slots(stub, md("B")) == SLOTS - 1
    (res,) = Stream(stub.Verify, target_pb2.VerifyRequest, md("B"))(vitem("b", b.first_token))
    assert res.status.code == 0
    assert release(stub, ["b"], md("B")) == 1 and free_slots(stub) == SLOTS


def _width(stub) -> int:
    info = stub.Info(draft_pb2.DrafterInfoRequest(), timeout=10)
    return len(info.target_layer_ids) * info.model.hidden_size


def pitem(sid: str, features: torch.Tensor | None, root: int, committed: int) -> draft_pb2.ProposeItem:
    msg = draft_pb2.ProposeItem(session_id=sid, root_token=root, committed_length=committed,
                                tree=draft_pb2.TreeParams(max_depth=4))
    if features is not None:
        msg.features.CopyFrom(tensor_to_proto(features))
    return msg


def rows(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_drafter_refuses_another_owners_session_and_it_drafts_unchanged(draft):
    stub, servicer = draft
    w = _width(stub)
    sa = Stream(stub.Propose, draft_pb2.ProposeRequest, md("A"))
    sb = Stream(stub.Propose, draft_pb2.ProposeRequest, md("B"))
    sr = Stream(stub.Propose, draft_pb2.ProposeRequest, md("R"))
    length = 0
    for step in range(4):
        f = rows(3 if step == 0 else 1, w, seed=step)
        length += f.shape[0]
        (got,), (want,) = sb(pitem("b", f, 7, length)), sr(pitem("r", f, 7, length))
        assert got.status.code == 0 and want.status.code == 0   # LENGTH_MISMATCH had A's rows gone in
        assert list(got.tree.tokens) == list(want.tree.tokens) and list(got.tree.parents) == list(want.tree.parents)
        # A tries B's session (as if it were its own next step), then releases it
        (theirs,) = sa(pitem("b", rows(1, w, seed=50 + step), 9, length + 1))
        assert theirs.status.code == PERMISSION_DENIED and theirs.status.reason == Reason.NOT_OWNER.value
        assert release(stub, ["b"], md("A")) == 0 and release(stub, ["b"]) == 0
        assert servicer.session_length("b") == length
    # a session id nobody holds is the caller's after its first successful Propose
    (mine,) = sa(pitem("a", rows(2, w, 9), 7, 2))
    assert mine.status.code == 0 and servicer.loop.owners.owner_of("a") == Owner("A", "e1")


def test_dropped_stream_frees_the_owners_sessions_after_its_lease(target, draft):
    lease = 0.5
    stub, loop = target
    loop.owners.lease_s = lease
    dstub, dservicer = draft
    dservicer.loop.owners.lease_s = lease
    w = _width(dstub)
    a1, a2, b = prefill(stub, "a1", md("A")), prefill(stub, "a2", md("A")), prefill(stub, "b", md("B"))
    sa = Stream(stub.Verify, target_pb2.VerifyRequest, md("A"))
    sb = Stream(stub.Verify, target_pb2.VerifyRequest, md("B"))
    assert all(r.status.code == 0 for r in sa(vitem("a1", a1.first_token), vitem("a2", a2.first_token)))
    (rb,) = sb(vitem("b", b.first_token))
    pa = Stream(dstub.Propose, draft_pb2.ProposeRequest, md("A"))
    assert pa(pitem("a1", rows(2, w, 1), 7, 2))[0].status.code == 0
    time.sleep(3 * lease)          # idle, but the open streams hold the leases
    assert free_slots(stub) == SLOTS - 3 and dservicer.num_sessions == 1
    sa.cancel()
    pa.cancel()                    # A's streams drop; A makes no call
    took = wait_until(lambda: free_slots(stub) == SLOTS - 1, lease + 1.5, "A's target sessions released")
    assert took >= 0.8 * lease, "released before the lease ran out"
    wait_until(lambda: dservicer.num_sessions == 0, 1.0, "A's drafter session released")
    (again,) = sb(vitem("b", rb.bonus_token))          # B's session was not touched
    assert again.status.code == 0 and again.committed_length == rb.committed_length + 1
    assert loop.owners.expired_sessions == 2 and dservicer.loop.owners.expired_sessions == 1


def test_a_new_epoch_frees_the_older_epochs_sessions_at_once(target, draft):
    stub, loop = target                                 # no leases: only the epoch can free them
    dstub, dservicer = draft
    w = _width(dstub)
    for sid in ("x", "y"):
        prefill(stub, sid, md("orch", "e1"))
    c = prefill(stub, "c", md("other", "e1"))
    assert Stream(dstub.Propose, draft_pb2.ProposeRequest, md("orch", "e1"))(pitem("x", rows(2, w, 1), 7, 2))[0].status.code == 0
    assert free_slots(stub) == SLOTS - 3 and dservicer.num_sessions == 1
    # the restarted owner's first call (its startup Info) already sees the slots free
    assert free_slots(stub, md("orch", "e2")) == SLOTS - 1
    dstub.Info(draft_pb2.DrafterInfoRequest(), metadata=md("orch", "e2"), timeout=10)
    assert dservicer.num_sessions == 0
    (gone,) = Stream(stub.Verify, target_pb2.VerifyRequest, md("orch", "e1"))(vitem("x", 1))
    assert gone.status.code == NOT_FOUND
    # the other owner's session is untouched; the superseded epoch never frees the newer one's
    z = prefill(stub, "z", md("orch", "e2"))
    assert free_slots(stub, md("orch", "e1")) == SLOTS - 2
    results = Stream(stub.Verify, target_pb2.VerifyRequest, md("orch", "e2"))(vitem("z", z.first_token))
    assert results[0].status.code == 0
    assert Stream(stub.Verify, target_pb2.VerifyRequest, md("other", "e1"))(vitem("c", c.first_token))[0].status.code == 0
    assert loop.owners.superseded_sessions == 2

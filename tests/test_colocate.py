"""The target in the orchestrator's process (orchestrator/local_target.py, ``--target in-process``,
``dflash-grpc serve --colocate``): the in-process peer answers as the target service over gRPC
does (replies, item statuses, call refusals with code and reason, leases held by an open Verify
stream), and decoding through a co-located target and a separate draft service is lossless."""

from __future__ import annotations

import time

import grpc
import pytest

import client as sdk
from client.launcher import ServiceGroup, dflash_services, free_ports
from dflash_grpc.transport import reason_of
from dflash_grpc.v1 import common_pb2, target_pb2
from orchestrator.local_target import LocalTargetPeer
from orchestrator.peers import StreamError
from runtime.owners import EPOCH_KEY, OWNER_KEY

MD = ((OWNER_KEY, "orch-test"), (EPOCH_KEY, "e1"))


@pytest.fixture(scope="module")
def peer(tiny_llama):
    from target_service.__main__ import build_servicer, stop_servicer
    from target_service.config import TargetConfig

    servicer = build_servicer(TargetConfig(model=str(tiny_llama.path), device="cpu", max_sessions=2, lease_s=0.0))
    p = LocalTargetPeer(servicer, metadata=MD)
    yield p
    p.close()
    stop_servicer(servicer)


def _prefill(peer, sid: str, tokens=(1, 2, 3, 4), layers=()):
    item = target_pb2.PrefillItem(session_id=sid, prompt_tokens=list(tokens), feature_layer_ids=list(layers))
    return peer.stub.Prefill.future(target_pb2.PrefillRequest(items=[item])).result(timeout=60).results[0]


def test_info_prefill_verify_release(peer, tiny_llama):
    info = peer.info()
    assert info.vocab_size == tiny_llama.vocab and info.max_sessions == 2
    first = _prefill(peer, "a", layers=[0])
    assert first.committed_length == 4 and first.features.shape == [4, info.hidden_size]
    stream = peer.verify_stream(None)
    root = first.first_token
    for _ in range(3):   # root-only trees: one token per exchange, as plain decoding
        reply = stream.exchange(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
            session_id="a", tree=common_pb2.TokenTree(tokens=[root], parents=[-1]))]))
        (res,) = reply.results
        assert res.status.code == 0 and res.accepted_nodes == [0] and reply.compute_s > 0
        assert res.features.shape == [1, info.hidden_size]
        root = res.bonus_token
    assert res.committed_length == 7
    # an item refused (unknown session) comes back in the reply; the stream goes on
    reply = stream.exchange(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
        session_id="nope", tree=common_pb2.TokenTree(tokens=[1], parents=[-1]))]))
    assert reply.results[0].status.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert not stream.broken
    stream.close()
    assert stream.broken
    with pytest.raises(StreamError) as e:
        stream.exchange(target_pb2.VerifyRequest())
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert peer.stub.Release(common_pb2.ReleaseRequest(session_ids=["a", "nope"])).released == 1


def test_refused_call_raises_with_code_and_reason(peer):
    """A whole call refused (bad sampling in a Prefill) raises a grpc.RpcError with the code and
    the reason trailing metadata, through ``.future`` as through the plain call."""
    item = target_pb2.PrefillItem(session_id="b", prompt_tokens=[1, 2],
                                  sampling=common_pb2.SamplingParams(temperature=-1.0))
    fut = peer.stub.Prefill.future(target_pb2.PrefillRequest(items=[item]))
    err = fut.exception(timeout=60)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason_of(err) == "INVALID_SAMPLING"
    assert "b" not in peer.servicer.loop.engine.sessions   # nothing opened


def test_futures_time_out_as_grpc_futures():
    """The scheduler catches ``grpc.FutureTimeoutError`` from ``future.result(timeout)``."""
    from orchestrator.local_target import _Future

    with pytest.raises(grpc.FutureTimeoutError):
        _Future().result(timeout=0.01)


def test_open_stream_holds_the_lease(tiny_llama):
    """An open in-process Verify stream keeps its owner's sessions through the lease; closing it
    lets the lease run out (as a gRPC stream that ends)."""
    from target_service.__main__ import build_servicer, stop_servicer
    from target_service.config import TargetConfig

    servicer = build_servicer(TargetConfig(model=str(tiny_llama.path), device="cpu", max_sessions=1, lease_s=0.3))
    p = LocalTargetPeer(servicer, metadata=MD)
    try:
        _prefill(p, "s")
        stream = p.verify_stream(None)
        stream.exchange(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
            session_id="s", tree=common_pb2.TokenTree(tokens=[1], parents=[-1]))]))
        time.sleep(1.0)
        servicer.loop.call(lambda: None)
        assert "s" in servicer.loop.engine.sessions   # held: the stream is open
        stream.close()
        deadline = time.monotonic() + 10
        while "s" in servicer.loop.engine.sessions and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "s" not in servicer.loop.engine.sessions       # the lease ran out
    finally:
        p.close()
        stop_servicer(servicer)


@pytest.mark.slow
def test_colocated_services_are_lossless(tiny_llama, tiny_drafter):
    """Two processes (draft service; orchestrator with the target inside): speculative output
    equals target-only output, greedy and seeded, and the drafter was used."""
    ports = free_ports(3)
    services = dflash_services(str(tiny_llama.path), tiny_drafter, ports=ports, colocate=True,
                               target_args=["--max-sessions", "2"])
    assert [s.name for s in services] == ["draft", "orchestrator"]
    with ServiceGroup(services, grace=5.0) as group:
        group.wait_healthy(timeout=300)
        with sdk.Client(services[-1].address, timeout=120) as api:
            # the orchestrator may be up before the draft service: its probe picks the drafter up
            deadline = time.monotonic() + 60
            while not (info := api.info()).drafter.available and time.monotonic() < deadline:
                time.sleep(0.25)
            assert info.drafter.available and info.drafter.compatible
            for ids in ([5, 6, 7, 8], [9, 10, 11]):
                spec = api.generate(tokens=ids, max_tokens=20, ignore_eos=True)
                ar = api.generate(tokens=ids, max_tokens=20, ignore_eos=True, speculative=False)
                assert spec.token_ids == ar.token_ids and len(ar.token_ids) == 20
                assert spec.stats.drafts > 0 and ar.stats.drafts == 0
            kw = dict(tokens=[3, 4, 5], max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
            assert api.generate(**kw).token_ids == api.generate(speculative=False, **kw).token_ids

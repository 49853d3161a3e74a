"""In-process CPU cost of one Verify / Propose stream message in the target and draft services.

    PYTHONPATH=.:proto python benchmarks/cpu-host-per-item/run5/svc_bench.py [--n 2000] [--streams 1,16,64]

The real servicers behind :func:`dflash_grpc.serving.make_server`'s interceptors, reached as the
same-host hop reaches them (:func:`dflash_grpc.localhop.resolve`, the request parsed from bytes
and the reply serialised as ``HopServer`` does), over ``tools/host_per_item.py``'s instant fake
engines (their CPU subtracted); no sockets, no other threads. Requests as the orchestrator sends
them in speculative mode (the default tree of 16 nodes, 4 feature rows of 5 x 576 bf16 per item;
per item below 4 items, as columns from 4). Prints us of thread CPU per message and per item
(median of 5 rounds of ``--n`` messages).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

sys.path[:0] = [".", "proto", "tools"]

import torch  # noqa: E402

import host_per_item as hpi  # noqa: E402
from dflash_grpc import serving  # noqa: E402
from dflash_grpc.columns import fill_trees, Rows  # noqa: E402
from dflash_grpc.localhop import LocalContext, resolve  # noqa: E402
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc  # noqa: E402
from dflash_grpc.wire import fill_tensor  # noqa: E402

NODES = 16
PARENTS = [-1, 0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 0, 1, 2]
FEATS = torch.randn(4, len(hpi.LAYERS) * hpi.HIDDEN).to(torch.bfloat16)


def _handler(add, method):
    server, _, _ = serving.make_server(add, "127.0.0.1:0", max_workers=8, local_hop=True)
    hop = server._dflash_hop
    h = resolve(hop.interceptors, hop.handlers, method, (("dflash-owner", "bench"),))
    return server, h


def verify_request(sids, rnd):
    req = target_pb2.VerifyRequest()
    toks = [[(rnd + i * 7 + j) % hpi.VOCAB for j in range(NODES)] for i in range(len(sids))]
    if len(sids) < 4:
        for sid, t in zip(sids, toks):
            req.items.add(session_id=sid, tree=common_pb2.TokenTree(tokens=t, parents=PARENTS))
    else:
        c = req.columns
        c.session_ids.extend(sids)
        fill_trees(c.trees, [NODES] * len(sids), [x for t in toks for x in t], PARENTS * len(sids))
    return req.SerializeToString()


def propose_request(sids, lengths):
    req = draft_pb2.ProposeRequest()
    if len(sids) < 4:
        for sid, L in zip(sids, lengths):
            it = req.items.add(session_id=sid, root_token=5, committed_length=L)
            fill_tensor(it.features, FEATS)
            it.tree.budget, it.tree.top_k, it.tree.max_depth = 15, 4, 6
    else:   # as the orchestrator sends it: the rows after the message (features_tail), in a writable frame
        from orchestrator.messages import ProposeItems

        batch = ProposeItems()
        raw = bytes(FEATS.view(torch.uint8).numpy().tobytes())
        for sid, L in zip(sids, lengths):
            batch.add(sid, 5, L, 15, 4, 6, Rows(common_pb2.DTYPE_BF16, FEATS.shape[1], 4, raw))
        wire = b"".join(bytes(p) for p in batch.request(True, True).pieces)
        frame = memoryview(bytearray(len(wire)))
        frame[:] = wire
        return frame
    return req.SerializeToString()


def bench_target(streams, n):
    eng = hpi.InstantTarget()
    from runtime.owners import Owners
    from runtime.step_loop import StepLoop
    from target_service.servicer import TargetServicer
    servicer = TargetServicer(StepLoop(eng, name="target", owners=Owners()), common_pb2.ModelInfo())
    server, h = _handler(lambda s: (target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
                                    ["dflash_grpc.v1.TargetService"])[1], "/dflash_grpc.v1.TargetService/Verify")
    sids = [f"s{i}" for i in range(streams)]
    for sid in sids:
        eng.sessions[sid] = [10, len(hpi.LAYERS) * hpi.HIDDEN]
        servicer.loop.owners.record(sid, None)
    reqs = [verify_request(sids, r) for r in range(8)]
    out = []
    for _ in range(5):
        ctx = LocalContext((("dflash-owner", "bench"),))
        ctx.accepts_frames = True   # as the hop's context (a Frames reply: its buffers go to writev as they are)
        gen = h.stream_stream((h.request_deserializer(reqs[i % 8]) if h.request_deserializer else reqs[i % 8]
                               for i in range(n)), ctx)
        ser = h.response_serializer
        e0, t0 = eng.clock.s, time.thread_time()
        for reply in gen:
            if type(reply).__name__ != "Frames":
                ser(reply) if ser else reply
        out.append((time.thread_time() - t0 - (eng.clock.s - e0)) / n * 1e6)
        ctx.end()
    servicer.loop.stop()
    server.stop(0)
    return out


def bench_draft(streams, n):
    eng = hpi.InstantDrafter("x")
    from draft_service.servicer import SERVICE_NAME, DraftServiceServicer
    servicer = DraftServiceServicer(eng)
    import draft_service.servicer as ds
    add = getattr(ds, "add_to_server", draft_pb2_grpc.add_DraftServiceServicer_to_server)   # (older checkouts)
    server, h = _handler(lambda s: (add(servicer, s), [SERVICE_NAME])[1],
                         "/dflash_grpc.v1.DraftService/Propose")
    sids = [f"s{i}" for i in range(streams)]
    out = []
    L = [0]

    def reqs():
        for _ in range(n):
            L[0] += 4
            yield propose_request(sids, [L[0]] * streams)

    for _ in range(5):
        eng.sessions.clear()
        L[0] = 0
        pre = list(reqs())
        ctx = LocalContext((("dflash-owner", "bench"),))
        ctx.accepts_frames = True
        gen = h.stream_stream((h.request_deserializer(r) if h.request_deserializer else r for r in pre), ctx)
        ser = h.response_serializer
        e0, t0 = eng.clock.s, time.thread_time()
        for reply in gen:
            ser(reply) if ser else reply
        out.append((time.thread_time() - t0 - (eng.clock.s - e0)) / n * 1e6)
        ctx.end()
    servicer.close()
    server.stop(0)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--streams", default="1,16,64")
    a = ap.parse_args()
    for s in map(int, a.streams.split(",")):
        for name, fn in (("target verify", bench_target), ("draft propose", bench_draft)):
            r = fn(s, max(200, a.n // s))
            m = statistics.median(r)
            print(f"{name:14s} streams {s:3d}: {m:7.1f} us/msg  {m / s:6.2f} us/item   (rounds {min(r):.1f}-{max(r):.1f})",
                  flush=True)


if __name__ == "__main__":
    main()

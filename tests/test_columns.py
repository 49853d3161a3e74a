"""The columnar form of the Verify and Propose messages (``dflash_grpc.columns``, issue 23).

* The codec: int32 columns, trees and feature rows round-trip; columns that do not fit together
  raise ``ColumnsError``.
* The target (both engines) and the draft service over gRPC answer the same batch the same way
  whether it comes per item or as columns (tokens, nodes, bonus, lengths, features, trees, and
  each refused item's code and reason); malformed columns end the stream INVALID_ARGUMENT and the
  server serves the next one.
* The orchestrator's side (``orchestrator.messages``) writes either form and reads either reply.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from dflash_grpc import columns as C
from dflash_grpc import serving
from dflash_grpc.transport import GRPC_OPTIONS, reason_of
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from dflash_grpc.wire import tensor_to_proto
from orchestrator.messages import ProposeItems, propose_results, verify_request, verify_results

VOCAB = 300
CONTEXT = 32
IA = grpc.StatusCode.INVALID_ARGUMENT


# ------------------------------------------------------------------------------------------------
# the codec


def test_int32_columns_round_trip_and_check_their_length():
    values = [0, -1, 7, 2**31 - 1, -2**31]
    assert C.unpack_i32(C.pack_i32(values)) == values
    assert C.pack_i32([1]) == b"\x01\x00\x00\x00"   # little-endian
    with pytest.raises(C.ColumnsError):
        C.unpack_i32(b"\x00" * 5)
    with pytest.raises(C.ColumnsError):
        C.unpack_i32(C.pack_i32([1, 2]), 3)


def test_trees_round_trip_and_sizes_must_add_up():
    msg = common_pb2.TreeColumns()
    C.fill_trees(msg, [2, 0, 1], [5, 6, 7], [-1, 0, -1])
    assert C.read_trees(msg, 3) == [([5, 6], [-1, 0]), ([], []), ([7], [-1])]
    for sizes, tokens, parents, count in (([2, 2], [5, 6, 7], [-1, 0, -1], 2),    # sizes past the tokens
                                          ([1], [5, 6], [-1, 0], 1),                # tokens left over
                                          ([1], [5], [-1, 0], 1),                   # parents differ
                                          ([-1, 2], [5], [-1], 2),                  # negative size
                                          ([1], [5], [-1], 2)):                     # another item count
        bad = common_pb2.TreeColumns(sizes=C.pack_i32(sizes), tokens=C.pack_i32(tokens), parents=C.pack_i32(parents))
        with pytest.raises(C.ColumnsError):
            C.read_trees(bad, count)


def test_feature_rows_round_trip_and_must_fit_their_tensor():
    a = C.Rows(common_pb2.DTYPE_BF16, 3, 2, bytes(range(12)))
    b = C.Rows(common_pb2.DTYPE_BF16, 3, 1, bytes(range(12, 18)))
    msg = common_pb2.FeatureColumns()
    assert C.fill_features(msg, [a, None, b])
    got = C.read_features(msg, 3)
    assert got[1] is None and [(r.rows, bytes(r.data)) for r in (got[0], got[2])] == [(2, a.data), (1, b.data)]
    assert not C.fill_features(common_pb2.FeatureColumns(), [a, C.Rows(common_pb2.DTYPE_BF16, 4, 1, bytes(8))])
    empty = common_pb2.FeatureColumns()
    assert C.fill_features(empty, [None, None]) and C.read_features(empty, 2) == [None, None]
    for mutate in (lambda m: setattr(m.rows_data, "data", m.rows_data.data[:-1]),       # bytes short
                   lambda m: m.rows_data.shape.__setitem__(0, 4),                        # rows differ
                   lambda m: setattr(m.rows_data, "dtype", 99),                          # unknown dtype
                   lambda m: setattr(m, "rows", C.pack_i32([2, 1]))):                    # another item count
        bad = common_pb2.FeatureColumns()
        bad.CopyFrom(msg)
        mutate(bad)
        with pytest.raises(C.ColumnsError):
            C.read_features(bad, 3)


def test_propose_as_wire_bytes_is_the_message_the_columns_make():
    """ProposeItems.request(serialized=True): the rows written after the message's own bytes
    (features_tail, straight from their buffers, views included) parse to the very message the
    columnar request is; without rows, or of mixed widths, it is that request too."""
    big = bytes(range(256)) * 600                                  # rows past a one-byte length
    view = memoryview(big)
    cases = [
        [("a", 5, 9, 6, 3, 4, C.Rows(common_pb2.DTYPE_BF16, 64, 2, view[:256])), ("b", 6, 3, 0, 0, 2, None),
         ("c", 7, 11, 15, 4, 15, C.Rows(common_pb2.DTYPE_BF16, 64, 1200, big[:153600]))],
        [("a", 5, 9, 6, 3, 4, None), ("b", 6, 3, 0, 0, 2, None)],
        [("a", 1, 1, 0, 0, 0, C.Rows(common_pb2.DTYPE_BF16, 2, 1, bytes(4))),
         ("b", 1, 1, 0, 0, 0, C.Rows(common_pb2.DTYPE_BF16, 3, 1, bytes(6)))],
    ]
    for items in cases:
        batch = ProposeItems()
        for it in items:
            batch.add(*it)
        want = batch.request(True)
        got = batch.request(True, True)
        assert draft_pb2.ProposeRequest.FromString(got.SerializeToString()) == want


def test_tree_checker_takes_a_batch_only_when_every_tree_fits_as_it_came():
    """TreeChecker.check: a batch of drafted trees is taken as its columns exactly when the
    per-item reading would keep every tree as it came (fit_tree leaves it whole, its root is the
    request's); then each size and depth are fit_tree's. A shape seen before is checked again
    from its cached depth (a second batch of the same trees gives the same answer)."""
    import random

    from orchestrator.messages import TreeChecker
    from orchestrator.scheduler import fit_tree
    from runtime.tree import TreeError

    rng = random.Random(3)
    checker = TreeChecker(limit=8)   # (small: the memory starts again within this test)
    for _ in range(300):
        trees, roots, depths = [], [], []
        for _ in range(rng.randrange(1, 6)):
            n = rng.randrange(0, 7)
            parents = [-1] + [rng.randrange(0, i) for i in range(1, n)]
            if n and rng.random() < 0.1:
                parents[rng.randrange(n)] = rng.choice([-1, n, 0])        # maybe malformed
            tokens = [rng.randrange(50) for _ in range(n)]
            roots.append(tokens[0] if n and rng.random() < 0.95 else 99)
            depths.append(rng.randrange(0, 6))
            trees.append((tokens, parents))
        msg = common_pb2.TreeColumns()
        C.fill_trees(msg, [len(t) for t, _ in trees], [x for t, _ in trees for x in t], [x for _, p in trees for x in p])
        whole = True
        want = []
        for (tokens, parents), root, depth in zip(trees, roots, depths):
            try:
                fit = fit_tree(tokens, parents, depth, 5)
            except TreeError:
                whole = False
                continue
            whole = whole and fit[:2] == (tokens, parents) and bool(tokens) and tokens[0] == root
            want.append((len(tokens), fit[2]))
        for _ in range(2):
            got = checker.check(msg, roots, depths, 5)
            assert (got is not None) == whole
            if got is not None:
                assert got.columns is msg and list(zip(got.sizes, got.depths)) == want


def test_verify_reply_parsed_without_copying_its_rows_reads_as_the_message(monkeypatch):
    """parse_verify_reply (the Verify streams' deserializer) keeps a columnar reply's feature
    rows as a view of the bytes it came in and parses the rest alone (its nested lengths
    rewritten; from ZERO_COPY_FROM bytes): every reply reads as FromString reads it (verify_columns: statuses, tokens,
    bonus, lengths, feature bytes), the view's bytes are the message's, and any other layout
    (per item, no rows, a field met twice, a malformed message) is parsed as it is."""
    import os
    import random

    from google.protobuf.message import DecodeError

    from orchestrator import messages
    from orchestrator.messages import VerifyReply, parse_verify_reply, verify_columns

    rng = random.Random(11)

    def reply(n, width, rows):
        msg = target_pb2.VerifyResponse(compute_s=rng.random(), device_s=rng.random(), batch_items=n)
        cols = msg.columns
        k = [rng.randrange(0, 4) for _ in range(n)]
        cols.accepted = C.pack_i32(k)
        cols.accepted_tokens = C.pack_i32([rng.randrange(VOCAB) for _ in range(sum(k))])
        cols.bonus_tokens = C.pack_i32([rng.randrange(VOCAB) for _ in range(n)])
        cols.committed_lengths = C.pack_i32([rng.randrange(1, 9000) for _ in range(n)])
        if n > 1:
            cols.refused.add(index=n - 1, status=common_pb2.ItemStatus(code=5, message="gone", reason="SESSION_NOT_FOUND"))
        C.fill_features(cols.features, [C.Rows(common_pb2.DTYPE_BF16, width, r, os.urandom(2 * width * r)) if r else None
                                        for r in rows])
        return msg

    def read(parsed, n):
        refused, acc, bonus, lengths, feats = verify_columns(parsed, n)
        return ({i: (s.code, s.reason) for i, s in refused.items()}, acc, bonus, lengths,
                [bytes(f.data) if f is not None else None for f in feats])

    cases = []
    for n, width in ((1, 3), (4, 64), (64, 2880), (7, 70)):
        rows = [rng.randrange(0, 5) for _ in range(n)]
        cases.append((n, reply(n, width, rows).SerializeToString(), sum(rows) > 0))
    cases.append((3, reply(3, 4, [0, 0, 0]).SerializeToString(), False))                       # no rows at all
    split, rest = reply(3, 8, [2, 0, 1]), target_pb2.VerifyResponse()
    rest.columns.features.CopyFrom(split.columns.features)
    split.columns.ClearField("features")
    cases.append((3, split.SerializeToString() + rest.SerializeToString(), False))             # columns twice
    per_item = target_pb2.VerifyResponse(results=[target_pb2.VerifyResult(accepted_tokens=[1], bonus_token=2)])
    cases.append((1, per_item.SerializeToString(), False))
    small = cases[0][1]
    assert len(small) < messages.ZERO_COPY_FROM and not isinstance(parse_verify_reply(small), VerifyReply)
    monkeypatch.setattr(messages, "ZERO_COPY_FROM", 0)   # (every reply walked, the small ones too)
    for n, data, viewed in cases:
        got = parse_verify_reply(memoryview(b"\x00" + data)[1:])
        assert isinstance(got, VerifyReply) == viewed, n
        assert read(got, n) == read(target_pb2.VerifyResponse.FromString(data), n)
        assert (got.compute_s, got.HasField("columns")) == (target_pb2.VerifyResponse.FromString(data).compute_s,
                                                            not per_item.SerializeToString() == data)
        if viewed:
            whole = target_pb2.VerifyResponse()
            whole.CopyFrom(got.message)
            whole.columns.features.rows_data.data = bytes(got.rows_data)
            assert whole == target_pb2.VerifyResponse.FromString(data)
    with pytest.raises(DecodeError):
        parse_verify_reply(b"\x32\x05\x3a\x03\x12\x01")   # lengths past the end


def test_refused_indices_must_be_in_range_once_and_not_ok():
    ok = [common_pb2.IndexedStatus(index=1, status=common_pb2.ItemStatus(code=5, reason="SESSION_NOT_FOUND"))]
    assert C.index_statuses(ok, 2)[1].reason == "SESSION_NOT_FOUND"
    for bad in ([common_pb2.IndexedStatus(index=2, status=common_pb2.ItemStatus(code=5))],
                [common_pb2.IndexedStatus(index=0, status=common_pb2.ItemStatus(code=0))],
                ok + ok):
        with pytest.raises(C.ColumnsError):
            C.index_statuses(bad, 2)


# ------------------------------------------------------------------------------------------------
# the services over gRPC


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from draft_service.init_random import write_random_drafter
    from fixtures.tiny_models import write_tiny_llama

    d = tmp_path_factory.mktemp("columns")
    target = write_tiny_llama(d / "target.gguf", vocab=VOCAB, seed=3)
    drafter = d / "drafter.gguf"
    write_random_drafter(target.path, drafter, block_size=4, num_target_layers=2, layers=1, dtype="f32", seed=1)
    return str(target.path), str(drafter)


def _serve(add):
    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=4)
    return server, grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)


@pytest.fixture(params=["reference", "batched"])
def target(request, tiny):
    from runtime.step_loop import StepLoop
    from target_service.__main__ import build_engine
    from target_service.servicer import TargetServicer

    engine, info = build_engine(tiny[0], max_sessions=4, max_context=CONTEXT, max_tree_width=8, max_tree_depth=8,
                                engine=request.param)
    loop = StepLoop(engine, name="columns-target")
    servicer = TargetServicer(loop, info)

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.TargetService"]

    server, channel = _serve(add)
    try:
        yield target_pb2_grpc.TargetServiceStub(channel), servicer
    finally:
        channel.close()
        server.stop(None)
        loop.stop()


def _prefill(stub, sid, prompt, layers=(0, 1)):
    item = target_pb2.PrefillItem(session_id=sid, prompt_tokens=prompt, feature_layer_ids=list(layers))
    return stub.Prefill(target_pb2.PrefillRequest(items=[item]), timeout=60).results[0]


def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    return ei.value.code(), reason_of(ei.value)


def _verify(stub, columnar, sids, trees):
    req = verify_request(columnar, sids, [len(t) for t, _ in trees], [x for t, _ in trees for x in t],
                         [x for _, p in trees for x in p])
    (reply,) = stub.Verify(iter([req]), timeout=60)
    assert reply.HasField("columns") == columnar
    return [(r.status.code if r.status else 0, r.status.reason if r.status else "", r.accepted, r.bonus, r.length,
             bytes(r.features.data) if r.features is not None else b"") for r in verify_results(reply, len(sids))]


def test_target_answers_columns_as_it_answers_items(target):
    """Sessions of the same prompts verify the same trees, per item and as columns, step after
    step: every answer and feature byte is the same; refused items keep their code and reason."""
    stub, servicer = target
    assert C.COLUMNAR in servicer.info.features
    roots = {}
    for form in ("i", "c"):
        roots[form] = [_prefill(stub, f"{form}0", [1, 2, 3]).first_token,
                       _prefill(stub, f"{form}1", [4, 5], layers=()).first_token]   # no features
    assert roots["i"] == roots["c"]
    for step in range(3):
        got = {}
        for form in ("i", "c"):
            r0, r1 = roots[form]
            trees = [([r0, (r0 + 1) % VOCAB, 7], [-1, 0, 1]),
                     ([(r1 + 1) % VOCAB], [-1]),                  # not the session's root
                     ([1], [-1]),                                 # no such session
                     ([r0, 1], [-1, 5])]                          # malformed, and session 0 again
            got[form] = _verify(stub, form == "c", [f"{form}0", f"{form}1", "nope", f"{form}0"], trees)
        assert got["i"] == got["c"], step
        codes = [g[:2] for g in got["c"]]
        assert codes[0] == (0, "") and codes[1] == (IA.value[0], "INVALID_TREE")
        assert codes[2] == (grpc.StatusCode.NOT_FOUND.value[0], "SESSION_NOT_FOUND") and codes[3][0] == IA.value[0]
        assert got["c"][0][5], "the accepted item's features travel"
        for form in ("i", "c"):
            roots[form][0] = got[form][0][3]


def test_target_refuses_malformed_columns_and_serves_on(target):
    stub, _ = target
    root = _prefill(stub, "m", [1, 2]).first_token
    bad = target_pb2.VerifyRequest()
    bad.columns.session_ids.append("m")
    C.fill_trees(bad.columns.trees, [2], [root], [-1])            # sizes past the tokens
    assert _refused(lambda: list(stub.Verify(iter([bad]), timeout=30))) == (IA, "INVALID_ARGUMENT")
    assert _verify(stub, True, ["m"], [([root], [-1])])[0][:2] == (0, "")


@pytest.fixture()
def drafter(tiny):
    from draft_service.servicer import SERVICE_NAME, DraftServiceServicer

    servicer = DraftServiceServicer.from_paths(tiny[1], tiny[0], max_sessions=4, max_context=16)

    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    server, channel = _serve(add)
    try:
        yield draft_pb2_grpc.DraftServiceStub(channel), servicer
    finally:
        channel.close()
        server.stop(None)
        servicer.close()


def _propose(stub, columnar, items):
    batch = ProposeItems()
    for it in items:
        batch.add(*it)
    (reply,) = stub.Propose(iter([batch.request(columnar)]), timeout=60)
    assert reply.HasField("trees") == columnar
    return [(r.status.code if r.status else 0, r.status.reason if r.status else "", r.tokens, r.parents)
            for r in propose_results(reply, len(items))]


def test_drafter_answers_columns_as_it_answers_items(drafter):
    stub, servicer = drafter
    assert C.COLUMNAR in servicer.info().model.features
    width = servicer.config.feature_size
    torch.manual_seed(0)
    rows = [C.Rows.of_tensor(tensor_to_proto(torch.randn(n, width).to(torch.bfloat16))) for n in (3, 1, 2)]
    for form in ("i", "c"):
        cases = [
            [(f"{form}a", 5, 3, 0, 0, 3, rows[0]), (f"{form}b", 6, 1, 6, 3, 3, rows[1])],   # chain; tree
            [(f"{form}a", 7, 5, 6, 3, 0, rows[2]), (f"{form}b", 8, 9, 0, 0, 2, rows[0]),    # length mismatch
             ("", 1, 3, 0, 0, 0, rows[0]), (f"{form}c", VOCAB + 1, 3, 0, 0, 0, rows[0])],   # empty id; bad root
        ]
        got = [_propose(stub, form == "c", case) for case in cases]
        if form == "i":
            want = got
            continue
        assert got == want
        assert [g[:2] for g in got[1]] == [(0, ""), (grpc.StatusCode.FAILED_PRECONDITION.value[0], "LENGTH_MISMATCH"),
                                           (IA.value[0], "INVALID_ARGUMENT"), (IA.value[0], "INVALID_TOKEN")]
        assert got[0][1][2] and len(got[0][0][2]) == 4   # a tree; a chain of 3 + the root


def test_drafter_refuses_malformed_columns_and_serves_on(drafter):
    stub, servicer = drafter
    width = servicer.config.feature_size
    good = ProposeItems()
    good.add("x", 1, 2, 0, 0, 0, C.Rows.of_tensor(tensor_to_proto(torch.randn(2, width).to(torch.bfloat16))))
    bad = good.request(True)
    bad.columns.features.rows = C.pack_i32([3])                   # rows past the tensor's
    assert _refused(lambda: list(stub.Propose(iter([bad]), timeout=30))) == (IA, "INVALID_ARGUMENT")
    (reply,) = stub.Propose(iter([good.request(True)]), timeout=60)
    assert not reply.refused and propose_results(reply, 1)[0].status is None



def test_drafter_refuses_only_the_item_whose_rows_are_not_finite(drafter, monkeypatch):
    """A columnar Propose's rows are checked for NaN / inf as one tensor; with a NaN in one item's
    rows that item alone is refused (INVALID_FEATURES) and the others are drafted; all finite, no
    item is checked again one by one."""
    import draft_service.batched as B

    stub, servicer = drafter
    width = servicer.config.feature_size
    torch.manual_seed(1)
    rows = [torch.randn(n, width).to(torch.bfloat16) for n in (2, 3, 1)]
    rows[1][2, 5] = float("nan")
    items = [(f"nf{i}", 4, n, 0, 0, 0, C.Rows.of_tensor(tensor_to_proto(r))) for i, (r, n) in enumerate(zip(rows, (2, 3, 1)))]
    got = _propose(stub, True, items)
    assert [g[:2] for g in got] == [(0, ""), (IA.value[0], "INVALID_FEATURES"), (0, "")]
    servicer.release(["nf0", "nf2"])   # (4 session slots)
    calls = []
    real = B.all_finite
    monkeypatch.setattr(B, "all_finite", lambda t: calls.append(t.shape) or real(t))
    rows[1][2, 5] = 0.0
    items = [(f"ok{i}", 4, n, 0, 0, 0, C.Rows.of_tensor(tensor_to_proto(r))) for i, (r, n) in enumerate(zip(rows, (2, 3, 1)))]
    assert [g[:2] for g in _propose(stub, True, items)] == [(0, "")] * 3
    assert calls == []   # (the servicer's whole-tensor check is its own import; per item: none)

def test_propose_items_fall_back_to_items_when_widths_differ():
    batch = ProposeItems()
    batch.add("a", 1, 1, 0, 0, 0, C.Rows(common_pb2.DTYPE_BF16, 2, 1, bytes(4)))
    batch.add("b", 1, 1, 0, 0, 0, C.Rows(common_pb2.DTYPE_BF16, 3, 1, bytes(6)))
    req = batch.request(True)
    assert not req.HasField("columns") and [list(i.features.shape) for i in req.items] == [[1, 2], [1, 3]]



def test_tune_malloc_applies_on_glibc_and_can_be_turned_off(monkeypatch):
    """The services' processes let glibc reuse the memory of large messages (serving.tune_malloc)."""
    import platform

    monkeypatch.setenv("DFLASH_NO_MALLOC_TUNING", "1")
    assert serving.tune_malloc() is False
    monkeypatch.delenv("DFLASH_NO_MALLOC_TUNING")
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert serving.tune_malloc() is True


def test_orchestrator_batches_as_columns_and_stays_lossless(tiny_llama, tiny_drafter, monkeypatch):
    """Six speculative streams at once against the real services: the ticks go as columns (both
    exchanges), and every stream's tokens are its plain (non-speculative) decoding's."""
    import threading
    import uuid

    from dflash_grpc.v1 import generation_pb2, generation_pb2_grpc
    from orchestrator import messages, scheduler
    from runtime.owners import EPOCH_KEY, OWNER_KEY
    from tests.conftest import draft_in_process, orchestrator_in_process, target_in_process

    forms = {"verify": set(), "propose": set()}
    verify_request, request = messages.verify_request, messages.ProposeItems.request

    def spy_verify(columnar, *a):
        forms["verify"].add(columnar)
        return verify_request(columnar, *a)

    def spy_propose(self, columnar, *a):
        forms["propose"].add(columnar)
        return request(self, columnar, *a)

    monkeypatch.setattr(scheduler, "verify_request", spy_verify)
    monkeypatch.setattr(messages.ProposeItems, "request", spy_propose)
    prompts = [[1 + i, 7, 3 + 2 * i] for i in range(6)]
    md = [(OWNER_KEY, "columns-orchestrator"), (EPOCH_KEY, uuid.uuid4().hex)]
    with target_in_process(tiny_llama.path, max_sessions=8, max_context=128) as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=8, max_context=128) as (_, dport), \
            orchestrator_in_process(tiny_llama.path, tport, dport, max_sessions=8, max_tokens=24, metadata=md) as (_, oport), \
            grpc.insecure_channel(f"127.0.0.1:{oport}", options=GRPC_OPTIONS) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)

        def run(prompt, spec):
            req = generation_pb2.GenerateRequest(prompt_tokens=generation_pb2.PromptTokens(ids=prompt), max_tokens=24,
                                                 ignore_eos=True)
            req.speculative.enabled = spec
            return [t for m in stub.Generate(req, timeout=120) for t in m.token_ids]

        def all_at_once(spec):
            out = [None] * len(prompts)
            barrier = threading.Barrier(len(prompts))

            def one(i):
                barrier.wait()
                out[i] = run(prompts[i], spec)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return out

        plain = [run(p, False) for p in prompts]
        assert all_at_once(True) == plain
    assert True in forms["verify"] and True in forms["propose"], forms


def test_varint_is_protobufs_encoding_at_every_length():
    """columns.varint (the one-byte values from a table, the rest in a loop) writes what
    protobuf's own encoder writes (features_tail's hand-written Tensor head: the serialised
    Propose test above)."""
    from google.protobuf.internal.encoder import _VarintBytes

    from dflash_grpc.columns import varint

    for n in (0, 1, 0x7F, 0x80, 300, 0x3FFF, 0x4000, 1 << 21, (1 << 35) + 5, (1 << 63) - 1):
        assert varint(n) == _VarintBytes(n), n


# ------------------------------------------------------------------------------------------------
# the target's columnar reply on the same-host hop, as wire bytes (target_service.servicer.verify_columns_frames)


def _outcome(k: int, rows: int | None, width: int = 6, seed: int = 0, dtype=torch.bfloat16, contiguous=True):
    from target_service.engine import VerifyOutcome

    feats = None
    if rows is not None:
        g = torch.Generator().manual_seed(seed)
        feats = torch.randn(rows, width * (1 if contiguous else 2), generator=g).to(dtype)
        if not contiguous:
            feats = feats[:, ::2]
    return VerifyOutcome(list(range(k + 1)), [10 + i for i in range(k)], 40 + k, 7 + k, feats)


@pytest.mark.parametrize("case", ["mixed", "one", "none", "noncontiguous", "f32", "widths", "many"])
def test_target_frames_are_the_bytes_of_the_columns_reply(case):
    """verify_columns_frames's buffers joined are byte for byte the SerializeToString of
    verify_columns_response's reply (and parse to it); where the rows cannot go as they are (none,
    not contiguous, not bf16, widths that differ) it returns that reply itself."""
    from runtime.errors import InvalidArgument, Reason
    from runtime.step_loop import BatchResult
    from dflash_grpc.localhop import Frames
    from target_service.servicer import verify_columns_frames, verify_columns_response

    refused = InvalidArgument("bad tree", reason=Reason.INVALID_TREE)
    outs = {
        "mixed": [_outcome(2, 3, seed=1), refused, _outcome(0, None), _outcome(1, 0), _outcome(3, 4, seed=2)],
        "one": [_outcome(1, 2, seed=3)],
        "none": [_outcome(1, None), refused],
        "noncontiguous": [_outcome(1, 2, seed=4), _outcome(2, 3, seed=5, contiguous=False)],
        "f32": [_outcome(1, 2, seed=6, dtype=torch.float32)],
        "widths": [_outcome(1, 2, width=6), _outcome(1, 2, width=4)],
        "many": [_outcome(i % 4, i % 4 + 1, width=2880, seed=i) for i in range(70)],
    }[case]
    items = [(f"s{i}", [1], [-1]) for i in range(len(outs))]
    done = BatchResult([], 0.00125, len(outs), 3e-5, 0.0)
    want = verify_columns_response(items, outs, done)
    got = verify_columns_frames(items, outs, done)
    if case in ("mixed", "one", "many"):
        assert type(got) is Frames
        wire = b"".join(bytes(b) for b in got.buffers)
        assert wire == want.SerializeToString()
        assert target_pb2.VerifyResponse.FromString(wire) == want
        assert len(got.buffers) == 1 + sum(1 for o in outs if not isinstance(o, Exception)
                                           and o.features is not None and o.features.shape[0])
    else:
        assert type(got) is target_pb2.VerifyResponse and got == want
    assert want.HasField("columns") == (case != "widths")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_target_over_the_hop_answers_as_over_grpc(tiny, dtype, monkeypatch):
    """A real target served with its same-host hop: each columnar Verify reply read from the hop
    (as wire bytes, parsed as the orchestrator parses them) is the reply gRPC gives for the same
    request, feature bytes included; sent as Frames where the engine's rows are bf16 (the
    reference engine's are its model's float32: cast here, as the wire casts them), as a
    message where not."""
    from dflash_grpc.localhop import Frames
    from orchestrator.messages import parse_verify_reply
    from orchestrator.peers import LocalHopCall, open_local, open_stream
    from runtime.step_loop import StepLoop
    from target_service import servicer as target_servicer
    from target_service.__main__ import build_engine
    from target_service.servicer import TargetServicer

    sent = []
    frames = target_servicer.verify_columns_frames
    monkeypatch.setattr(target_servicer, "verify_columns_frames",
                        lambda *a: sent.append(frames(*a)) or sent[-1])

    method = "/dflash_grpc.v1.TargetService/Verify"
    engine, info = build_engine(tiny[0], max_sessions=10, max_context=CONTEXT, max_tree_width=8, max_tree_depth=8,
                                engine="reference")
    verify_batch = engine.verify_batch

    def cast(items):   # the engine's rows in ``dtype`` (the wire carries bf16 either way)
        outs = verify_batch(items)
        for o in outs:
            if not isinstance(o, Exception) and o.features is not None:
                o.features = o.features.to(dtype)
        return outs

    engine.verify_batch = cast
    loop = StepLoop(engine, name="frames-target")
    servicer = TargetServicer(loop, info)

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.TargetService"]

    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=4, local_hop=True)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    try:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        call = open_local(serving.local_endpoint(server), method, parse_verify_reply)
        assert isinstance(call, LocalHopCall)
        over_grpc = open_stream(channel, method, stub.Verify, target_pb2.VerifyResponse.FromString)
        roots = {}
        for form in ("h", "g"):   # the same prompts in two sets of sessions: one per transport
            roots[form] = [_prefill(stub, f"{form}{i}", [1 + i, 2, 3], layers=(0, 1) if i != 2 else ()).first_token
                           for i in range(5)]
        assert roots["h"] == roots["g"]
        for step in range(3):
            replies = {}
            for form, c in (("h", call), ("g", over_grpc)):
                trees = [([r, (r + 1) % VOCAB, 7], [-1, 0, 1]) for r in roots[form]]
                trees[3] = ([1], [-1])   # not the session's root: refused
                req = verify_request(True, [f"{form}{i}" for i in range(5)], [len(t) for t, _ in trees],
                                     [x for t, _ in trees for x in t], [x for _, p in trees for x in p])
                replies[form] = verify_results(c.exchange(req, timeout=30), 5)
            h, g = ([(r.status.code if r.status else 0, r.accepted, r.bonus, r.length,
                      bytes(r.features.data) if r.features is not None else b"") for r in replies[f]] for f in "hg")
            assert h == g, step
            assert h[0][4] and not h[2][4] and h[3][0] == IA.value[0]
            for form in ("h", "g"):
                roots[form] = [r[2] if r[0] == 0 else roots[form][i] for i, r in enumerate(h if form == "h" else g)]
        call.close()
        over_grpc.close()
        assert len(sent) == 3 and {type(r) for r in sent} == {Frames if dtype is torch.bfloat16 else target_pb2.VerifyResponse}
    finally:
        channel.close()
        server.stop(None)
        serving.stop_local_hop(server)
        loop.stop()


# ------------------------------------------------------------------------------------------------
# the drafter's Propose on the same-host hop: the rows read in place (draft_service.servicer.parse_propose_request)


def _writable(data: bytes) -> memoryview:
    """``data`` in a writable buffer, as the hop's frames come (localhop.recv_frame)."""
    return memoryview(bytearray(data))


def _propose_batch(n: int, width: int = 2880, rows=lambda i: 1 + i % 4, mixed: bool = False) -> ProposeItems:
    batch = ProposeItems()
    g = torch.Generator().manual_seed(n)
    for i in range(n):
        r = rows(i)
        f = None
        if r:
            w = width + (2 if mixed and i == n - 1 else 0)
            t = torch.randn(r, w, generator=g).to(torch.bfloat16)
            f = C.Rows(common_pb2.DTYPE_BF16, w, r, t.view(torch.uint8).numpy().tobytes())
        batch.add(f"s{i}", 5 + i, 10 * i + r, 15, 4, 6, f)
    return batch


@pytest.mark.parametrize("case", ["serialized", "message", "small", "no-rows", "mixed", "read-only", "twice"])
def test_propose_rows_in_place_read_as_the_message(case):
    """parse_propose_request of a writable buffer leaves a columnar request's rows where they are
    (ProposeInPlace: the tensor shares the buffer) and the items read from it are the items the
    message gives (features equal); anything else is parsed as FromString parses it."""
    from draft_service.servicer import ProposeInPlace, parse_propose_request, propose_columns

    n = {"small": 2}.get(case, 16)
    batch = _propose_batch(n, rows=(lambda i: 0) if case == "no-rows" else (lambda i: 1 + i % 4), mixed=case == "mixed")
    req = batch.request(True, case != "message")
    pieces = getattr(req, "pieces", None)   # (mixed widths: a message per item)
    wire = b"".join(bytes(p) for p in pieces) if pieces is not None else req.SerializeToString()
    if case == "twice":   # the rows' bytes set twice (the last wins): parsed as it is
        wire += b"".join(bytes(p) for p in pieces[1:])   # (the tail again: header and rows)
    want = draft_pb2.ProposeRequest.FromString(wire)
    buf = wire if case == "read-only" else _writable(wire)
    got = parse_propose_request(buf)
    in_place = case in ("serialized", "message")
    assert (type(got) is ProposeInPlace) == in_place
    if not in_place:
        assert got == want
        return
    assert got.message.columns.features.rows_data.data == b""
    t = got.message.columns.features.rows_data
    t.data = bytes(got.rows_data)
    assert got.message == want
    mine = propose_columns(want.columns)
    theirs = propose_columns(got.message.columns, parse_propose_request(buf).rows_data)
    assert len(mine) == len(theirs) == n
    for a, b in zip(mine, theirs):
        assert a._replace(features=None) == b._replace(features=None)
        assert torch.equal(a.features, b.features)
    import numpy as np

    again = parse_propose_request(buf)
    first = propose_columns(again.message.columns, again.rows_data)[0].features
    aligned = np.frombuffer(again.rows_data, np.uint8).ctypes.data % 2 == 0
    first[0, 0] = 1.0   # where the rows are aligned to bf16 the tensor shares the buffer (no copy); else a copy
    one = torch.tensor([1.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert (bytes(again.rows_data[:2]) == one) == aligned
    assert aligned or case == "message"   # (the orchestrator's layout puts the rows at an even offset here)


def test_drafter_over_the_hop_answers_as_over_grpc(tiny, monkeypatch):
    """A real draft service registered by add_to_server with its same-host hop: Propose over the
    hop, as the orchestrator sends it (its rows after the message, in a buffer they are read in
    place from), answers what gRPC answers, step after step, for sessions fed the same rows."""
    from dflash_grpc.localhop import recv_frame
    from draft_service import servicer as draft_servicer
    from draft_service.servicer import SERVICE_NAME, DraftServiceServicer, add_to_server
    from orchestrator.peers import LocalHopCall, open_local, open_stream

    method = "/dflash_grpc.v1.DraftService/Propose"
    servicer = DraftServiceServicer.from_paths(tiny[1], tiny[0], max_sessions=16, max_context=64)
    parsed = []
    parse = draft_servicer.parse_propose_request
    monkeypatch.setattr(draft_servicer, "parse_propose_request", lambda data: parsed.append(parse(data)) or parsed[-1])
    monkeypatch.setattr(draft_servicer, "ZERO_COPY_FROM", 0)   # (the tiny drafter's rows are a few KB)

    def add(server):
        add_to_server(servicer, server)
        return [SERVICE_NAME]

    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=4, local_hop=True)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    try:
        width = servicer.config.hidden_size * len(servicer.config.target_layer_ids)
        call = open_local(serving.local_endpoint(server), method, draft_pb2.ProposeResponse.FromString)
        assert isinstance(call, LocalHopCall) and recv_frame is not None
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        over_grpc = open_stream(channel, method, stub.Propose, draft_pb2.ProposeResponse.FromString)
        g = torch.Generator().manual_seed(5)
        held = [0] * 6
        for step in range(3):
            rows = [3 + (i + step) % 2 for i in range(6)]
            feats = [torch.randn(r, width, generator=g).to(torch.bfloat16) for r in rows]
            replies = {}
            for form, c in (("h", call), ("g", over_grpc)):
                batch = ProposeItems()
                for i, (r, f) in enumerate(zip(rows, feats)):
                    batch.add(f"{form}{i}", 7 + i, held[i] + r, 6, 3, 3,
                              C.Rows(common_pb2.DTYPE_BF16, width, r, f.view(torch.uint8).numpy().tobytes()))
                replies[form] = [(r.status.code if r.status else 0, r.tokens, r.parents)
                                 for r in propose_results(c.exchange(batch.request(True, True), timeout=60), 6)]
            assert replies["h"] == replies["g"], step
            assert all(code == 0 for code, _, _ in replies["h"]) and replies["h"][0][1]
            held = [h + r for h, r in zip(held, rows)]
        call.close()
        over_grpc.close()
        assert [type(r).__name__ for r in parsed].count("ProposeInPlace") == 3   # the hop's; gRPC's are messages
        assert len(parsed) == 6
    finally:
        channel.close()
        server.stop(None)
        serving.stop_local_hop(server)
        servicer.close()

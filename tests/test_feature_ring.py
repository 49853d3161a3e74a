"""The feature ring (runtime.feature_ring): the rows a target stores are the rows a drafter maps
and gathers, at the positions the layout says; the GPU ring through CUDA IPC in another process."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from runtime.feature_ring import FeatureRing, RingUnavailable, slot_rows_for


def _reference_rows(slots, ends, counts, slot_rows):
    return [s * slot_rows + p % slot_rows for s, e, k in zip(slots, ends, counts) for p in range(e - k, e)]


def test_rows_of_is_the_layout():
    ring = FeatureRing.create(4, 8, 3, torch.bfloat16, "cpu")
    try:
        slots, ends, counts = [2, 0, 3, 1], [5, 17, 8, 1], [3, 8, 0, 1]
        assert ring.rows_of(slots, ends, counts).tolist() == _reference_rows(slots, ends, counts, 8)
        with pytest.raises(ValueError):
            ring.rows_of([4], [3], [1])          # no slot 4
        with pytest.raises(ValueError):
            ring.rows_of([0], [20], [9])         # more rows than a slot holds
        with pytest.raises(ValueError):
            ring.rows_of([0], [2], [3])          # before position 0
    finally:
        ring.close()


def test_store_then_open_and_gather_shm():
    """A verify step's accepted rows (counts per batch row) land at their positions, padding rows
    in the dump row; another mapping of the descriptor reads them."""
    g = torch.Generator().manual_seed(0)
    B, W, F, C = 3, 5, 4, 8
    ring = FeatureRing.create(4, C, F, torch.bfloat16, "cpu")
    try:
        feats = torch.randn(B, W, F, generator=g).to(torch.bfloat16)
        counts = torch.tensor([2, 5, 1])
        # batch rows 0 and 2 store (slots 3 and 1, committed lengths 6 and 7 before the step); row 1 does not
        ring.store(feats, [0, 2], [3, 1], [6, 7], counts)
        other = FeatureRing.open(ring.descriptor, "cpu")
        got = other.gather(other.rows_of([3, 1], [8, 8], [2, 1]))
        assert torch.equal(got, torch.cat([feats[0, :2], feats[2, :1]]))
        # the rows wrap around a slot: positions 6, 7, 8, 9 of slot 3 are rows 6, 7, 0, 1
        ring.store(feats, [1], [3], [8], counts)
        got = other.gather(other.rows_of([3], [13], [5]))
        assert torch.equal(got, feats[1])
        assert torch.equal(other.table[3 * C + 6], feats[0, 0])    # not overwritten: 8 positions on
        untouched = torch.ones(4 * C + 1, dtype=torch.bool)
        untouched[torch.tensor([3 * C + i for i in range(C)] + [1 * C + 7, ring.dump])] = False
        assert not other.table[untouched].any()
    finally:
        ring.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_warm_writes_only_the_dump_row(device):
    """FeatureRing.warm (run when the target makes its ring, so the store's kernel compiles then)
    changes no row a reader could be named, only the dump row."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ring = FeatureRing.create(3, 4, 8, torch.bfloat16, device)
    try:
        ring.table.fill_(1.0)
        ring.warm()
        assert torch.equal(ring.table[: ring.dump], torch.ones(ring.dump, 8, dtype=torch.bfloat16, device=device))
        assert not ring.table[ring.dump].any()
    finally:
        ring.close()


def test_capture_makes_the_ring_where_the_taps_are_known(tiny_llama):
    """BatchedEngine.capture makes the feature ring (and warms its store) when the engine was
    built with feature layers, as the launcher starts the target, so no request pays for it; an
    engine without taps makes none; the ring is the one later calls get."""
    from target_service.batched_engine import BatchedEngine
    from target_service.models.llama import LlamaModel

    model = LlamaModel.from_gguf(str(tiny_llama.path))
    kw = dict(max_sessions=2, max_context=64, max_tree_width=8, max_tree_depth=8, pad_to_buckets=True, ring_rows=25)
    eng = BatchedEngine(model, feature_layers=[0, 1], **kw)
    assert eng.ring is None
    eng.capture()
    ring = eng.ring
    assert ring is not None and ring.width == eng.feature_width and eng.feature_ring() is ring
    ring.close()
    bare = BatchedEngine(model, **kw)
    bare.capture()
    assert bare.ring is None


def test_open_refuses_what_it_cannot_map(tmp_path):
    ring = FeatureRing.create(2, 4, 3, torch.float32, "cpu")
    desc = type(ring.descriptor)()
    desc.CopyFrom(ring.descriptor)
    ring.close()
    with pytest.raises(RingUnavailable):
        FeatureRing.open(desc, "cpu")                       # its file is gone
    desc.kind = "carrier-pigeon"
    with pytest.raises(RingUnavailable):
        FeatureRing.open(desc, "cpu")
    desc.kind, desc.slots = "shm", 0
    with pytest.raises(RingUnavailable):
        FeatureRing.open(desc, "cpu")


def test_slot_rows_for():
    assert slot_rows_for(256, 2880, 2, 128, 256 << 20, 16) == 128
    assert slot_rows_for(256, 2880, 2, 128, 64 << 20, 16) == (64 << 20) // (256 * 2880 * 2)
    assert slot_rows_for(256, 2880, 2, 128, 1 << 20, 16) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_ring_in_another_process():
    """The GPU ring mapped by another process (CUDA IPC) reads the rows this one stored."""
    F, C = 64, 16
    ring = FeatureRing.create(4, C, F, torch.bfloat16, "cuda")
    feats = torch.randn(2, 4, F, device="cuda").to(torch.bfloat16)
    ring.store(feats, [0, 1], [2, 0], [14, 0], torch.tensor([4, 3], device="cuda"))
    torch.cuda.synchronize()
    want = torch.cat([feats[0, :4], feats[1, :3]]).float().cpu().numpy()
    code = textwrap.dedent("""
        import sys, numpy as np, torch
        from dflash_grpc.v1 import common_pb2
        from runtime.feature_ring import FeatureRing
        desc = common_pb2.FeatureRing.FromString(sys.stdin.buffer.read())
        ring = FeatureRing.open(desc, "cuda")
        got = ring.gather(ring.rows_of([2, 0], [18, 3], [4, 3])).float().cpu().numpy()
        sys.stdout.buffer.write(got.tobytes())
    """)
    out = subprocess.run([sys.executable, "-c", code], input=ring.descriptor.SerializeToString(),
                         capture_output=True, timeout=120, check=True).stdout
    got = np.frombuffer(out, dtype=np.float32).reshape(want.shape)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("pad,device", [(False, "cpu"), (True, "cpu"),
                                        pytest.param(True, "cuda", marks=pytest.mark.gpu)], ids=["exact", "padded", "cuda"])
def test_target_rows_in_the_ring_equal_the_rows_it_sends(tiny_llama, pad, device):
    """Two engines decode the same trees: one sends every verified row's features in its
    outcomes, the other, its sessions on the ring, writes them into the ring and says where; the
    rows read back at those positions are the sent rows, bit for bit (on CUDA: replayed graphs,
    the ring written after the replay, before the step's sync)."""
    import random

    from target_service.batched_engine import BatchedEngine
    from target_service.engine import Sampling
    from target_service.models.llama import LlamaModel

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = LlamaModel.from_gguf(str(tiny_llama.path), device=device) if device == "cuda" else \
        LlamaModel.from_gguf(str(tiny_llama.path))
    layers = [0, 1]
    make = lambda: BatchedEngine(model, max_sessions=3, max_context=128, max_tree_width=8, max_tree_depth=8,
                                 feature_layers=layers, pad_to_buckets=pad, ring_rows=25)
    plain, ringed = make(), make()
    s = Sampling.checked(0.0, 0, 0.0, 0)
    rng = random.Random(3)
    prompts = [[rng.randrange(model.cfg.vocab_size) for _ in range(n)] for n in (5, 9)]
    roots = []
    prefilled = []
    for i, p in enumerate(prompts):
        a = plain.prefill(f"s{i}", p, s, layers)
        if i == 0:   # the prompt's rows into the ring too
            job = ringed.start_prefill(f"s{i}", p, s, layers, ring=True)
            while job.outcome is None:
                ringed.run_prefill(job, 512)
            b = job.outcome
            assert b.features is None and b.ring_slot >= 0
            prefilled.append((b, a.features))
        else:
            b = ringed.prefill(f"s{i}", p, s, layers)
            assert b.ring_slot == -1 and torch.equal(b.features, a.features)
        assert a.first_token == b.first_token
        roots.append(a.first_token)
    assert ringed.ring_features(["s0", "s1", "nobody"]) == 2
    ring = ringed.ring
    assert ring is not None and ring.slot_rows == 25   # (the least: max_tree_width + 1 + 16)
    for b, want in prefilled:
        got = ring.gather(ring.rows_of([b.ring_slot], [b.committed_length], [b.committed_length]))
        assert torch.equal(got.cpu(), want)
    if device == "cuda":
        plain.capture()
        ringed.capture()
    reader = FeatureRing.open(ring.descriptor, "cpu") if device == "cpu" else ring
    for step in range(22):   # past 25 positions of a slot: the rows wrap around
        items = []
        for i in range(2):
            tokens, parents = [roots[i]], [-1]
            for d in range(rng.randrange(4)):   # a chain of random guesses (some accepted at T=0 rarely)
                tokens.append(rng.randrange(model.cfg.vocab_size))
                parents.append(len(tokens) - 2)
            items.append((f"s{i}", tokens, parents))
        want, got = plain.verify_batch(items), ringed.verify_batch(items)
        for w, g in zip(want, got):
            assert g.accepted_nodes == w.accepted_nodes and g.bonus_token == w.bonus_token
            assert g.features is None and g.ring_slot >= 0 and w.ring_slot == -1
            rows = reader.gather(reader.rows_of([g.ring_slot], [g.committed_length], [len(g.accepted_nodes)]))
            assert torch.equal(rows.cpu(), w.features)
        roots = [w.bonus_token for w in want]
    if reader is not ring:
        reader.close()
    ring.close()


def test_the_ring_is_only_for_calls_from_this_host(tiny_llama, tiny_drafter):
    """The target honours ``feature_ring`` only for a call over the hop or in process (its reply
    over gRPC carries the rows and no descriptor); the draft service reads a ring only for such a
    call, and refuses an item whose ring it cannot map (RING_UNAVAILABLE) without failing the
    others."""
    from dflash_grpc.v1 import common_pb2, draft_pb2, target_pb2
    from draft_service.servicer import DraftServiceServicer
    from target_service.__main__ import build_servicer, stop_servicer
    from target_service.config import TargetConfig

    target = build_servicer(TargetConfig(model=str(tiny_llama.path), device="cpu", engine="batched", max_sessions=4,
                                         max_context=128, lease_s=0.0))
    drafter = DraftServiceServicer.from_paths(tiny_drafter, str(tiny_llama.path), max_sessions=4, max_context=64)
    try:
        layers = list(drafter.info().target_layer_ids)
        from dflash_grpc.localhop import LocalContext

        for sid in ("a", "b"):
            target.Prefill(target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(
                session_id=sid, prompt_tokens=[1, 2, 3], feature_layer_ids=layers)]), LocalContext())

        def verify(sid, local, ring=True, **kw):
            root = target.loop.engine.sessions[sid].root
            req = target_pb2.VerifyRequest(feature_ring=ring, items=[target_pb2.VerifyItem(
                session_id=sid, tree=common_pb2.TokenTree(tokens=[root], parents=[-1]))], **kw)
            return next(target._verify(iter([req]), None, False, local))

        class Remote:   # (a gRPC context: not this host)
            def is_active(self):
                return True

            def set_trailing_metadata(self, md):
                pass

            def abort(self, code, details):
                raise AssertionError(f"{code}: {details}")

        for sid, context, rows in (("p", Remote(), 0), ("q", LocalContext(), 3)):
            got = target._prefill(target_pb2.PrefillRequest(feature_ring=True, items=[target_pb2.PrefillItem(
                session_id=sid, prompt_tokens=[1, 2, 3], feature_layer_ids=layers)]), context, None)
            assert got.results[0].ring_rows == rows and got.HasField("ring") == bool(rows)
            assert bool(got.results[0].features.data) != bool(rows)
        far = verify("a", local=False)
        assert not far.HasField("ring") and far.results[0].ring_rows == 0 and far.results[0].features.shape[0] == 1
        near = verify("b", local=True)
        res = near.results[0]
        assert near.HasField("ring") and res.ring_rows == 1 and not res.features.data
        desc = near.ring
        # a request without feature_ring takes "q" (on the ring since its prefill) off it: rows in the reply
        back = verify("q", local=True, ring=False).results[0]
        assert back.ring_rows == 0 and back.features.shape[0] == 1 and not target.loop.engine.sessions["q"].ring
        # ring_off keeps a session off for that request; the next that does not name it puts it back
        assert verify("b", local=True, ring_off=["b"]).results[0].ring_rows == 0
        assert verify("b", local=True).results[0].ring_rows == 1
        # stop_features: no rows at all, none into the ring either
        stopped = verify("b", local=True, stop_features=["b"]).results[0]
        assert stopped.ring_rows == 0 and not stopped.features.data and not target.loop.engine.sessions["b"].ring
        # the drafter: the prompt's rows as bytes (3) and the verified row in the ring, local
        feats = FeatureRing.open(desc, "cpu")
        prompt = torch.zeros(3, desc.width)
        item = draft_pb2.ProposeItem(session_id="b", root_token=res.bonus_token, committed_length=4,
                                     ring_slot=res.ring_slot, ring_rows=1)
        item.features.dtype, item.features.data = common_pb2.DTYPE_F32, prompt.numpy().tobytes()
        item.features.shape.extend([3, desc.width])
        ok = drafter.propose(draft_pb2.ProposeRequest(items=[item], ring=desc), None, local=True)
        assert ok.results[0].status.code == 0 and drafter.session_length("b") == 4
        # not local, or a ring that cannot be mapped: that item refused, the other served
        other = draft_pb2.ProposeItem(session_id="c", root_token=1, committed_length=3)
        other.features.CopyFrom(item.features)
        item.session_id = "d"
        for local, ring in ((False, desc), (True, common_pb2.FeatureRing(id="gone", kind="shm", path="/nonexistent",
                                                                           slots=2, slot_rows=64, width=desc.width,
                                                                           dtype=desc.dtype))):
            out = drafter.propose(draft_pb2.ProposeRequest(items=[item, other], ring=ring), None, local=local)
            assert out.results[0].status.reason == "RING_UNAVAILABLE"
            assert out.results[1].status.code == 0
            other.session_id += "c"
        feats.close()
    finally:
        drafter.close()
        stop_servicer(target)
    assert not os.path.exists(os.path.dirname(desc.path))   # the shared file went with the target


def test_the_drafter_unmaps_rings_no_one_names(tiny_llama, tiny_drafter, monkeypatch):
    """A drafter keeps at most RINGS rings mapped, the least recently named going first, and
    unmaps a ring no request named for RING_IDLE_S once another is mapped (a restarted target's
    old ring)."""
    from draft_service.servicer import DraftServiceServicer

    drafter = DraftServiceServicer.from_paths(tiny_drafter, str(tiny_llama.path), max_sessions=2, max_context=16)
    now = [1000.0]
    monkeypatch.setattr("draft_service.servicer.time.monotonic", lambda: now[0])
    made = [FeatureRing.create(1, 8, 4, torch.float32, "cpu") for _ in range(6)]
    try:
        opened = {}
        for i in range(4):
            opened[i] = drafter.feature_ring(made[i].descriptor)
            now[0] += 1
        assert drafter.feature_ring(made[0].descriptor) is opened[0]     # named again: most recent
        drafter.feature_ring(made[4].descriptor)                          # a fifth: the least recent (1) goes
        assert set(drafter._rings) == {made[i].id for i in (0, 2, 3, 4)}
        assert opened[1].table.numel() == 0 and opened[0].table.numel() > 0
        now[0] += 61
        drafter.feature_ring(made[4].descriptor)                          # (named: not idle)
        drafter.feature_ring(made[5].descriptor)                          # the idle ones go
        assert set(drafter._rings) == {made[4].id, made[5].id}
    finally:
        for r in made:
            r.close()
        drafter.close()


def test_columnar_messages_carry_ring_rows(tiny_llama, tiny_drafter):
    """The columnar forms (four items and more): the target's columnar reply names each item's
    ring rows (read back by the orchestrator's verify_columns as RingRows), and a columnar Propose
    naming them (ProposeItems with the ring) is served by the draft service from the ring."""
    from dflash_grpc.localhop import LocalContext
    from dflash_grpc.v1 import common_pb2, draft_pb2, target_pb2
    from draft_service.servicer import DraftServiceServicer
    from orchestrator.messages import ProposeItems, RingRows, verify_columns, verify_request
    from target_service.__main__ import build_servicer, stop_servicer
    from target_service.config import TargetConfig

    target = build_servicer(TargetConfig(model=str(tiny_llama.path), device="cpu", engine="batched", max_sessions=4,
                                         max_context=128, lease_s=0.0))
    drafter = DraftServiceServicer.from_paths(tiny_drafter, str(tiny_llama.path), max_sessions=4, max_context=64)
    try:
        layers = list(drafter.info().target_layer_ids)
        sids = [f"s{i}" for i in range(4)]
        pre = target._prefill(target_pb2.PrefillRequest(feature_ring=True, items=[target_pb2.PrefillItem(
            session_id=sid, prompt_tokens=[1 + i, 2, 3], feature_layer_ids=layers) for i, sid in enumerate(sids)]),
            LocalContext(), None)
        assert all(r.ring_rows == 3 for r in pre.results) and pre.HasField("ring")
        roots = [r.first_token for r in pre.results]
        ask = verify_request(True, sids, [1] * 4, roots, [-1] * 4)
        ask.feature_ring = True
        reply = next(target._verify(iter([ask]), None, False, True))
        refused, accepted, bonus, lengths, feats = verify_columns(reply, 4)
        assert not refused and all(f == RingRows(f.slot, 1) for f in feats) and lengths == [4] * 4
        items = ProposeItems()
        items.ring = reply.ring
        for sid, root, f in zip(sids, bonus, feats):   # the prompt's 3 rows and the verified one, all in the ring
            items.add(sid, root, 4, 4, 2, 0, None, RingRows(f.slot, 4))
        request = items.request(True)
        assert request.HasField("columns") and request.HasField("ring")
        out = drafter.propose(request, None, local=True)
        assert not out.refused and drafter.session_length("s0") == 4
        # the same rows sent as bytes (read back from the ring) to another drafter: the same trees
        from dflash_grpc.columns import Rows

        ring = FeatureRing.open(reply.ring, "cpu")
        twin = DraftServiceServicer.from_paths(tiny_drafter, str(tiny_llama.path), max_sessions=4, max_context=64)
        try:
            as_bytes = ProposeItems()
            for sid, root, f in zip(sids, bonus, feats):
                rows = ring.gather(ring.rows_of([f.slot], [4], [4])).contiguous()
                as_bytes.add(sid, root, 4, 4, 2, 0, Rows(common_pb2.DTYPE_BF16 if rows.dtype == torch.bfloat16 else
                                                         common_pb2.DTYPE_F32, rows.shape[1], 4,
                                                         rows.numpy().tobytes() if rows.dtype != torch.bfloat16 else
                                                         rows.view(torch.int16).numpy().tobytes()))
            want = twin.propose(as_bytes.request(True), None, local=True)
            assert not want.refused and out.trees == want.trees and len(out.trees.tokens) > 4
        finally:
            twin.close()
            ring.close()
    finally:
        drafter.close()
        stop_servicer(target)

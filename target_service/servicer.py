"""gRPC servicer of the target service: a thin map from the v1 contract onto an engine run by a
:class:`~runtime.step_loop.StepLoop`.

Errors are mapped in one place (:mod:`runtime.status`): an engine error carries the status it
maps to (``runtime.errors.Code``) and its reason code (``runtime.errors.Reason``), out-of-memory
is RESOURCE_EXHAUSTED / ``OUT_OF_MEMORY``, anything else INTERNAL (logged). A unary call
(Prefill) aborts with the status and the reason in trailing metadata (``dflash-reason``); inside
a Verify stream message each item gets its own ``ItemStatus`` (``code``, ``reason``,
``message``), so one bad item touches no other session.

A Verify message comes per item (``items``) or as columns (``columns``, listed as "columnar" in
the Info features: :mod:`dflash_grpc.columns`); a columnar one is answered as columns, with the
refused items listed by index. Columns that do not fit together end the stream
INVALID_ARGUMENT.

Owners (:mod:`runtime.owners`): every call is made by the owner its metadata names (anonymous
without it). A Prefill records the sessions it opens as the caller's; a Verify item or a Release
naming another owner's session is refused for that item (PERMISSION_DENIED, reason
``NOT_OWNER``; a Release just skips it) and the session is not touched. Every call, a Verify
stream for its whole life, holds the caller's lease (:meth:`runtime.step_loop.StepLoop.enter`).
"""

from __future__ import annotations

import ctypes
import logging

import grpc
import torch

from dflash_grpc.columns import COLUMNAR, ColumnsError, pack_i32, read_trees, varint
from dflash_grpc.localhop import Frames, LocalContext
from dflash_grpc.transport import MAX_MESSAGE_BYTES
from dflash_grpc.v1 import common_pb2, target_pb2, target_pb2_grpc
from dflash_grpc.wire import fill_tensor, tensor_to_proto
from target_service.engine import Sampling
from runtime.errors import EngineError, InvalidArgument, Reason, ResourceExhausted
from runtime.owners import caller
from runtime.status import abort_with, batch_reply, item_status, status_of  # noqa: F401 (re-exported)
from runtime.step_loop import StepLoop, run_items

log = logging.getLogger(__name__)

FEATURES = ["tree-verify", "sampling", "features-bf16", "chunked-prefill", "batched-verify", COLUMNAR]

def _decode_verify_item(item: target_pb2.VerifyItem) -> tuple[str, list[int], list[int]]:
    if not item.HasField("tree"):
        raise InvalidArgument("item has no tree", reason=Reason.INVALID_TREE)
    tree = item.tree
    return item.session_id, tree.tokens[:], tree.parents[:]


#: Bytes a ``PrefillResult`` may carry besides its features (session id, ints, the tensor's dtype
#: and shape): a generous bound, so that :func:`prefill_reply_bytes` never underestimates.
RESULT_OVERHEAD_BYTES = 1024


def prefill_reply_bytes(items, hidden_size: int) -> int:
    """An upper bound on the bytes of the ``PrefillResponse`` answering ``items``
    (``PrefillItem`` messages): ``len(prompt) * len(feature_layer_ids) * hidden_size * 2``
    (bfloat16 features of every prompt row) plus :data:`RESULT_OVERHEAD_BYTES` per item. Known
    before any work, so a reply too large to send is refused before a session is opened.

    Layers are counted once each: a list naming a layer twice is refused by the engine
    (INVALID_ARGUMENT, the closer reason), not as too large."""
    return sum(len(it.prompt_tokens) * len(set(it.feature_layer_ids)) * hidden_size * 2 + RESULT_OVERHEAD_BYTES
               for it in items)


def _features_proto(t: torch.Tensor | None) -> common_pb2.Tensor | None:
    return tensor_to_proto(t, torch.bfloat16) if t is not None else None


def _fill_verify(r: target_pb2.VerifyResult, out) -> None:
    """An accepted item's fields of its ``VerifyResult`` (a :class:`~target_service.engine.VerifyOutcome`)."""
    r.accepted_tokens.extend(out.accepted_tokens)
    r.accepted_nodes.extend(out.accepted_nodes)
    r.bonus_token, r.committed_length = out.bonus_token, out.committed_length
    if out.features is not None:
        fill_tensor(r.features, out.features, torch.bfloat16)
    if out.ring_slot >= 0:   # (its rows are in the feature ring)
        r.ring_slot, r.ring_rows = out.ring_slot, len(out.accepted_nodes)


def verify_response(items, outs, done, ring: common_pb2.FeatureRing | None = None) -> target_pb2.VerifyResponse:
    """The ``VerifyResponse`` answering ``items`` (``VerifyItem`` messages) with their outcomes
    ``outs`` (a :class:`~target_service.engine.VerifyOutcome` or the exception that refused the
    item, in order) and the batch's timing ``done`` (:class:`~runtime.step_loop.BatchResult`),
    built in place (:func:`runtime.status.batch_reply`); ``ring``: the feature ring's descriptor,
    set on the reply when some item's rows are in it."""
    response = batch_reply(target_pb2.VerifyResponse, items, outs, done, _fill_verify)
    if ring is not None and any(not isinstance(o, BaseException) and o.ring_slot >= 0 for o in outs):
        response.ring.CopyFrom(ring)
    return response


class _Named:
    """An item of a columnar request as :func:`runtime.status.batch_reply` reads it."""

    __slots__ = ("session_id",)

    def __init__(self, session_id: str):
        self.session_id = session_id


def _same(item):
    return item


def verify_columns(columns: target_pb2.VerifyColumns) -> list[tuple[str, list[int], list[int]]]:
    """The engine items ``(session_id, tokens, parents)`` of a columnar Verify message.

    Raises:
        ColumnsError: columns that do not fit together.
    """
    sids = columns.session_ids[:]
    return [(sid, tokens, parents) for sid, (tokens, parents) in zip(sids, read_trees(columns.trees, len(sids)))]


def _columns_reply(items, outs, done, ring: common_pb2.FeatureRing | None = None):
    """The columnar reply's message without its feature rows, and those rows: ``(response,
    feats)`` (``response.columns.features.rows`` set, ``rows_data`` not; ``feats`` the accepted
    items' ``[rows, width]`` tensors with rows, in order), or the per-item reply when the items'
    widths differ (:func:`verify_columns_response`)."""
    response = target_pb2.VerifyResponse(compute_s=done.compute_s, batch_items=done.batch_items, queue_s=done.queue_s,
                                         device_s=done.device_s)
    cols = response.columns
    cols.SetInParent()
    accepted, tokens, nodes, bonus, lengths, rows, feats = [], [], [], [], [], [], []
    ring_slots: list[int] | None = None   # (the feature ring's columns, once an item's rows are in it)
    width = None
    for i, out in enumerate(outs):
        if isinstance(out, BaseException):
            cols.refused.add(index=i).status.CopyFrom(item_status(out))
            accepted.append(0)
            bonus.append(0)
            lengths.append(0)
            rows.append(0)
            continue
        t = out.accepted_tokens
        accepted.append(len(t))
        tokens += t
        nodes += out.accepted_nodes
        bonus.append(out.bonus_token)
        lengths.append(out.committed_length)
        if out.ring_slot >= 0:
            if ring_slots is None:
                ring_slots, ring_rows = [-1] * len(outs), [0] * len(outs)
            ring_slots[i], ring_rows[i] = out.ring_slot, len(t) + 1
        f = out.features
        if f is None or not f.shape[0]:
            rows.append(0)
            continue
        if width is None:
            width = f.shape[1:]
        elif f.shape[1:] != width:
            return verify_response([_Named(sid) for sid, _, _ in items], outs, done, ring)
        rows.append(f.shape[0])
        feats.append(f)
    cols.accepted = pack_i32(accepted)
    cols.accepted_tokens = pack_i32(tokens)
    cols.accepted_nodes = pack_i32(nodes)
    cols.bonus_tokens = pack_i32(bonus)
    cols.committed_lengths = pack_i32(lengths)
    cols.features.rows = pack_i32(rows)
    if ring_slots is not None:
        cols.features.ring_slots = pack_i32(ring_slots)
        cols.features.ring_rows = pack_i32(ring_rows)
        if ring is not None:
            response.ring.CopyFrom(ring)
    return response, feats


def verify_columns_response(items, outs, done, ring: common_pb2.FeatureRing | None = None) -> target_pb2.VerifyResponse:
    """The ``VerifyResponse`` answering a columnar request's ``items`` (engine items, in order)
    with their outcomes ``outs`` and the batch's timing ``done``, as columns (the refused items by
    index; every item's feature rows in one bf16 tensor). When the items' features differ in
    width (sessions that asked for other layers), one tensor cannot hold them: the reply is then
    per item (:func:`verify_response`), which a columnar client reads too. ``ring``: as
    :func:`verify_response`."""
    built = _columns_reply(items, outs, done, ring)
    if type(built) is not tuple:
        return built
    response, feats = built
    if feats:
        fill_tensor(response.columns.features.rows_data, feats[0] if len(feats) == 1 else torch.cat(feats),
                    torch.bfloat16)
    return response


def _host_bytes(f: torch.Tensor) -> memoryview | None:
    """The memory of ``f`` as a byte view (format ``B``; ``f`` must outlive it), or None unless
    ``f`` is a contiguous 2-D bf16 CPU tensor (what the wire carries as it is)."""
    if f.dtype is not torch.bfloat16 or f.dim() != 2 or not f.is_cpu or not f.is_contiguous():
        return None
    return memoryview((ctypes.c_char * f.nbytes).from_address(f.data_ptr())).cast("B")


def verify_columns_frames(items, outs, done, ring: common_pb2.FeatureRing | None = None
                          ) -> Frames | target_pb2.VerifyResponse:
    """:func:`verify_columns_response`'s reply for the same-host hop: its wire bytes as
    :class:`~dflash_grpc.localhop.Frames`, the feature rows sent from the items' own tensors (one
    buffer each, not copied: ``torch.cat``, the bytes read out, set into the message and its
    serialisation were four copies of every row, about 1.5 MB a tick at 64 streams; issue 23).
    The bytes are exactly ``verify_columns_response(...).SerializeToString()``: a message's fields
    are written in field-number order, and the rows are the last field of the last field at each
    level (``VerifyResponse.columns`` 6, ``.features`` 7, ``.rows_data`` 2, ``Tensor.data`` 3), so
    they end the message; only the three lengths around them are written here. The message as
    :func:`verify_columns_response` builds it where no item has rows, or one's rows are not a
    contiguous bf16 CPU tensor, or some item's rows are in the feature ring (``ring``: fields
    after the rows)."""
    built = _columns_reply(items, outs, done, ring)
    if type(built) is not tuple:
        return built
    response, feats = built
    views = [_host_bytes(f) for f in feats]
    if not feats or None in views or response.columns.features.ring_slots:
        if feats:
            fill_tensor(response.columns.features.rows_data, feats[0] if len(feats) == 1 else torch.cat(feats),
                        torch.bfloat16)
        return response
    n = sum(map(len, views))
    cols = response.columns
    features = cols.features
    fc = common_pb2.FeatureColumns(rows=features.rows).SerializeToString()
    cols.ClearField("features")
    body = cols.SerializeToString()            # the columns' fields before ``features`` (1-6)
    response.ClearField("columns")
    top = response.SerializeToString()         # the reply's fields before ``columns`` (2-5)
    tensor = common_pb2.Tensor(dtype=common_pb2.DTYPE_BF16, shape=(sum(f.shape[0] for f in feats), feats[0].shape[1]))
    head = tensor.SerializeToString() + b"\x1a" + varint(n)                   # Tensor.data (3): the rows follow
    fc += b"\x12" + varint(len(head) + n) + head                              # FeatureColumns.rows_data (2)
    body += b"\x3a" + varint(len(fc) + n) + fc                                # VerifyResultColumns.features (7)
    return Frames([top + b"\x32" + varint(len(body) + n) + body, *views], feats)   # VerifyResponse.columns (6)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    """Implements ``dflash_grpc.v1.TargetService`` over an engine run by ``loop``.

    A Prefill is all or nothing: when any item is refused, or the reply would pass
    :attr:`max_reply_bytes` (checked before any work from :func:`prefill_reply_bytes`, and again
    on the built reply), or the call ended before its reply, the items of the call that opened
    are released and no session is left behind.
    """

    #: Most bytes of one reply: the transport's message limit (a larger reply cannot be sent).
    max_reply_bytes: int = MAX_MESSAGE_BYTES

    def __init__(self, loop: StepLoop, info: common_pb2.ModelInfo):
        self.loop = loop
        self.info = info

    def Info(self, request, context):
        with self.loop.enter(caller(context)):   # a restarted owner frees its predecessor's sessions here
            return self._info()

    def _info(self) -> common_pb2.ModelInfo:
        info = common_pb2.ModelInfo()
        info.CopyFrom(self.info)
        engine = self.loop.engine
        info.graph_captures = getattr(engine, "captures", 0)
        pool = getattr(engine, "pool", None)
        info.free_slots = pool.free if pool is not None else engine.max_sessions - len(engine.sessions)
        return info

    def Prefill(self, request, context):
        owner = caller(context)
        with self.loop.enter(owner):
            return self._prefill(request, context, owner)

    def _prefill(self, request, context, owner):
        engine = self.loop.engine
        need = prefill_reply_bytes(request.items, engine.cfg.hidden_size)
        if need > self.max_reply_bytes:   # refused before work: no session opened
            abort_with(context, ResourceExhausted(
                f"the reply would carry about {need} bytes of features (prompt rows x feature layers x hidden "
                f"{engine.cfg.hidden_size} x 2 bytes), over the {self.max_reply_bytes}-byte message limit: "
                "ask fewer feature layers or send fewer/shorter prompts per call"))
        futures = []
        # the feature ring: for callers on this host (as Verify's), and engines that have one
        ring = (True,) if request.feature_ring and isinstance(context, LocalContext) and hasattr(engine, "feature_ring") \
            else ()
        for item in request.items:
            s = item.sampling
            try:
                sampling = Sampling.checked(s.temperature, s.top_k, s.top_p, s.seed if s.HasField("seed") else None)
                futures.append((item.session_id, self.loop.submit_prefill(item.session_id, list(item.prompt_tokens), sampling,
                                                                           list(item.feature_layer_ids), *ring, owner=owner)))
            except EngineError as e:  # bad sampling, or the loop is stopped (UNAVAILABLE)
                futures.append((item.session_id, e))
        results, opened, error = [], [], None
        for sid, fut in futures:
            try:
                if isinstance(fut, BaseException):
                    raise fut
                out = fut.result()
            except BaseException as e:  # noqa: BLE001 - mapped below
                error = error or e
                continue
            opened.append(sid)
            res = target_pb2.PrefillResult(session_id=sid, first_token=out.first_token,
                                           committed_length=out.committed_length, features=_features_proto(out.features))
            if out.ring_slot >= 0:
                res.ring_slot, res.ring_rows = out.ring_slot, out.committed_length
            results.append(res)
        response = target_pb2.PrefillResponse(results=results)
        if any(r.ring_rows for r in results) and engine.ring is not None:
            response.ring.CopyFrom(engine.ring.descriptor)
        if error is None and response.ByteSize() > self.max_reply_bytes:
            error = ResourceExhausted(f"the reply of {response.ByteSize()} bytes is over the "
                                      f"{self.max_reply_bytes}-byte message limit")
        if error is not None or not context.is_active():   # refused, or cancelled / past its deadline
            if opened:  # all-or-nothing: undo the items of this call that did open
                self.loop.release(opened, owner)
            if error is not None:
                abort_with(context, error)
        return response

    def Verify(self, request_iterator, context):
        owner = caller(context)
        scope = self.loop.enter(owner)   # the open stream holds the owner's lease
        context.add_callback(scope.close)
        with scope:
            try:
                # on the same-host hop a columnar reply goes as its wire bytes (verify_columns_frames)
                yield from self._verify(request_iterator, owner, getattr(context, "accepts_frames", False),
                                        isinstance(context, LocalContext))
            except ColumnsError as e:
                abort_with(context, InvalidArgument(f"malformed columns: {e}"))

    def _verify(self, request_iterator, owner, frames: bool = False, local: bool = False):
        """The replies of one Verify stream; ``local``: the call came over the same-host hop or
        from this process, the only callers for which ``feature_ring`` is honoured (the ring's
        memory is this host's; its descriptor never leaves over gRPC)."""
        columns_reply = verify_columns_frames if frames else verify_columns_response
        ringed: set[str] = set()   # sessions this stream has put on the feature ring
        for request in request_iterator:
            if request.stop_features:   # sessions decoded plainly from now on: no more feature rows
                try:
                    self.loop.stop_features(list(request.stop_features), owner)
                except EngineError:   # (a stopped loop: the items below get its status each)
                    pass
            columnar = request.HasField("columns")
            ring = None
            if local and request.feature_ring:
                sids = request.columns.session_ids if columnar else [it.session_id for it in request.items]
                off = request.ring_off
                if off:   # (these stay off the ring: their rows in the reply)
                    self._ring_off(off, ringed, owner)
                    off = set(off)
                    sids = [sid for sid in sids if sid not in off]
                ring = self._ring_for(sids, ringed, owner)
            elif getattr(self.loop.engine, "ring", None) is not None:   # (rows in the reply: off the ring)
                self._ring_off(request.columns.session_ids if columnar else [it.session_id for it in request.items],
                               ringed, owner)
            if columnar:
                items = verify_columns(request.columns)
                outs, done = run_items(self.loop, items, _same, owner)
                yield columns_reply(items, outs, done, ring)
                continue
            items = request.items
            outs, done = run_items(self.loop, items, _decode_verify_item, owner)
            yield verify_response(items, outs, done, ring)

    #: most session ids a Verify stream remembers as put on the feature ring (then it starts over:
    #: asking the engine again is harmless)
    RINGED_IDS = 1 << 16

    def _ring_off(self, session_ids, ringed: set[str], owner) -> None:
        """Take the sessions of a request without ``feature_ring`` (or not from this host) off
        the engine's feature ring, those on it (its rows then come in the reply again)."""
        sessions = self.loop.engine.sessions
        on = [sid for sid in session_ids if getattr(sessions.get(sid), "ring", False)]
        if on:
            ringed.difference_update(on)
            try:
                self.loop.ring_features(on, owner, on=False)
            except EngineError:
                pass

    def _ring_for(self, session_ids, ringed: set[str], owner) -> common_pb2.FeatureRing | None:
        """Put the sessions of a ``feature_ring`` request on the engine's feature ring (those
        the stream has not yet: one call to the step loop when there are any) and return the
        ring's descriptor, or None when the engine has no ring."""
        new = [sid for sid in session_ids if sid not in ringed]
        if new:
            if len(ringed) > self.RINGED_IDS:
                ringed.clear()
            try:
                self.loop.ring_features(new, owner)
            except EngineError:   # (a stopped loop: the items get its status each)
                return None
            ringed.update(new)
        ring = getattr(self.loop.engine, "ring", None)
        return ring.descriptor if ring is not None else None

    def Release(self, request, context):
        owner = caller(context)
        with self.loop.enter(owner):
            return common_pb2.ReleaseResponse(released=self.loop.release(list(request.session_ids), owner))

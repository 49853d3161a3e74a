"""gRPC ``dflash_grpc.v1.DraftService``: a thin map from the v1 contract onto a drafter engine run
by a :class:`runtime.step_loop.StepLoop`.

Per ``ProposeItem`` (docs/ARCHITECTURE.md, "One speculative step", step 1):

1. decode ``features`` (``[rows, N*H]``, bf16/f16/f32 raw bytes; unset = 0 rows);
2. check ``committed_length == rows held + rows`` for the session (created on first sight);
3. append the rows' context K/V, run the block ``[root, MASK x (B-1)]`` at positions
   ``L..L+B-1``, build the tree (``TreeParams``: depth ``max_depth`` or ``B-1`` when 0; DDTree
   with ``top_k`` candidates per depth and at most ``budget`` non-root nodes when both are > 1,
   else the greedy chain, cut to ``budget`` nodes when ``budget > 0``; ``draft_service.tree``).

Steps 2-3 are the engine's (:mod:`draft_service.batched`): :class:`ReferenceDrafterEngine`
(per-session contexts, the CPU default and the oracle) or :class:`BatchedDrafter` (context pool,
batched steps, CUDA graphs; the CUDA default). A ``ProposeRequest`` of N items is one
``loop.batch(items)``: the step loop's thread owns the engine and serves every queued item of
every stream in one ``propose_batch`` per tick (no lock around compute).

Per-item failures go into ``ProposeResult.status`` (``code`` = ``grpc.StatusCode`` number and
``reason`` = ``runtime.errors.Reason`` name, mapped from the engine's errors by
:func:`runtime.status.item_status`) and leave that session exactly as it was (a new session is
not created) and every other item alone:

* ``INVALID_ARGUMENT``: empty session id (reason ``INVALID_ARGUMENT``), malformed features
  (dtype, byte count, shape other than ``[rows, N*H]``, non-finite values: ``INVALID_FEATURES``),
  root token outside the vocabulary (``INVALID_TOKEN``), negative tree params
  (``INVALID_ARGUMENT``);
* ``FAILED_PRECONDITION``: ``committed_length`` differs from rows held + rows sent
  (``LENGTH_MISMATCH``);
* ``RESOURCE_EXHAUSTED``: all session slots are taken and this session is new
  (``NO_FREE_SLOT``); the session would exceed ``max_context`` rows (``CONTEXT_FULL``); out of
  device memory (``OUT_OF_MEMORY``);
* ``PERMISSION_DENIED``: the session belongs to another owner (reason ``NOT_OWNER``: the
  caller's ``dflash-owner`` metadata differs from the one that opened it; :mod:`runtime.owners`);
* ``INTERNAL``: anything unexpected (reason ``INTERNAL``, logged).

A Propose message comes per item (``items``) or as columns (``columns``, listed as "columnar"
in the Info features: :mod:`dflash_grpc.columns`), answered the same way (a columnar one with
the refused items by index and the trees as columns). Columns that do not fit together (their
lengths, the feature tensor's shape, dtype or bytes) end the stream INVALID_ARGUMENT.

Owners: a session is the caller's that opened it (its first Propose); a Release naming another
owner's session skips it. Every call, a Propose stream for its whole life, holds the caller's
lease (:meth:`runtime.step_loop.StepLoop.enter`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from typing import Iterable, Iterator, NamedTuple

import grpc
import torch

from dflash_grpc.columns import COLUMNAR, ColumnsError, fill_trees, length_delimited, unpack_i32, varint
from dflash_grpc.localhop import LocalContext
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from dflash_grpc.wire import _FROM_WIRE, _ITEMSIZE, WireError, tensor_from_proto
from draft_service.config import DraftConfig
from draft_service.batched import BatchedDrafter, DraftItem, ReferenceDrafterEngine, all_finite
from draft_service.drafter import DFlashDrafter
from draft_service.gguf_io import load_drafter
from runtime.errors import InvalidArgument, Reason
from runtime.feature_ring import FeatureRing, RingUnavailable
from runtime.owners import Owner, caller
from runtime.status import abort_with, batch_reply, item_status
from runtime.step_loop import StepLoop, run_items

logger = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name

#: Capabilities advertised in ``ModelInfo.features``.
FEATURES = ("chain", "tree", COLUMNAR)

#: ``max_context`` of the batched engine when neither the caller nor the target gives one.
DEFAULT_BATCHED_CONTEXT = DraftConfig.BATCHED_CONTEXT_CAP


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 hex digest of a file's bytes (the drafter's ``ModelInfo.model_fingerprint``)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def decode_item(item: draft_pb2.ProposeItem, ring=None) -> DraftItem:
    """A wire ``ProposeItem`` as an engine :class:`DraftItem` (features decoded to a CPU tensor,
    unset = ``None``; ring rows as ``(ring, slot, rows)`` with ``ring`` the request's mapped
    feature ring, None where there is none to read).

    Raises:
        InvalidArgument: empty session id (reason INVALID_ARGUMENT), or features that do not
            decode (dtype, byte count; reason INVALID_FEATURES).
    """
    session_id = item.session_id
    if not session_id:
        raise InvalidArgument("empty session_id")
    features = None
    if item.HasField("features"):
        msg = item.features
        # an all-default Tensor is 0 rows too (the bytes field, a copy when read, is read last)
        if msg.dtype != common_pb2.DTYPE_UNSPECIFIED or msg.shape or msg.data:
            try:
                features = tensor_from_proto(msg)
            except WireError as e:
                raise InvalidArgument(f"features: {e}", reason=Reason.INVALID_FEATURES) from None
    t = item.tree   # (message fields read as Python ints already)
    n = item.ring_rows
    return DraftItem(session_id, features, item.root_token, item.committed_length, t.budget, t.top_k, t.max_depth,
                     False, (ring, item.ring_slot, n) if n else None)


#: the least bytes of a Propose request whose feature rows :func:`parse_propose_request` leaves in
#: place (below, a few items' rows: copying them costs less than the walk)
ZERO_COPY_FROM = 1 << 16


class ProposeInPlace(NamedTuple):
    """A columnar Propose request parsed without copying its feature rows
    (:func:`parse_propose_request`): the message, its ``columns.features.rows_data`` tensor
    without its bytes, and ``rows_data``, those bytes as a (writable) view of the buffer the request
    came in, which the rows' tensor then shares."""

    message: draft_pb2.ProposeRequest
    rows_data: memoryview


#: ``ProposeRequest.columns`` (2) ``.features`` (7) ``.rows_data`` (2) ``.data`` (3)
_ROWS_PATH = (2, 7, 2, 3)


def parse_propose_request(data) -> draft_pb2.ProposeRequest | ProposeInPlace:
    """A Propose request from its wire bytes (the Propose method's deserializer,
    :func:`add_to_server`). A columnar request that came in a writable buffer (the same-host hop's
    frame, :func:`dflash_grpc.localhop.recv_frame`) keeps its feature rows there
    (:class:`ProposeInPlace`): the message is parsed without them (the lengths around them
    rewritten) and the rows' tensor is a view of that buffer (parsing them into the message,
    reading them out and copying them into a tensor were three copies of every row: about 1.5 MB
    a tick at 64 streams; issue 23). The orchestrator sends them as a second ``columns`` field
    after the message (:func:`dflash_grpc.columns.features_tail`), which a parser merges; any
    occurrence is found. Anything else (read-only bytes, as gRPC gives them; under
    :data:`ZERO_COPY_FROM` bytes; no rows, or their bytes twice) is parsed as it is.

    Raises:
        google.protobuf.message.DecodeError: bytes that do not parse (as ``FromString``).
    """
    view = memoryview(data)
    if view.readonly or len(view) < ZERO_COPY_FROM or view.ndim != 1 or view.itemsize != 1:
        return draft_pb2.ProposeRequest.FromString(data)
    try:
        paths = [()]
        for number in _ROWS_PATH:
            paths = [(*p, f) for p in paths
                     for f in length_delimited(view, *(p[-1][1:] if p else (0, len(view))), number)]
    except (IndexError, ValueError):
        return draft_pb2.ProposeRequest.FromString(data)
    if len(paths) != 1:   # no rows, or bytes set twice (the last wins): as it is
        return draft_pb2.ProposeRequest.FromString(data)
    path = paths[0]
    data_head, data_start, data_end = path[3]
    removed = data_end - data_head                 # the data field, header and all
    headers = []
    for (head, start, end), number in zip(path[2::-1], _ROWS_PATH[2::-1]):   # rows_data, features, columns
        header = varint(number << 3 | 2) + varint(end - start - removed)
        removed += (start - head) - len(header)
        headers.append((head, start, header))
    pieces, o = [], 0
    for head, start, header in reversed(headers):  # outer first
        pieces += [view[o:head], header]
        o = start
    pieces += [view[o:data_head], view[data_end:]]
    return ProposeInPlace(draft_pb2.ProposeRequest.FromString(b"".join(pieces)), view[data_start:data_end])


def _tensor_in_place(msg: common_pb2.Tensor, data: memoryview) -> torch.Tensor:
    """:func:`~dflash_grpc.wire.tensor_from_proto` of ``msg`` (a 2-D tensor) with ``data`` (writable)
    as its bytes, shared, not copied (copied only where they are not aligned to the dtype).

    Raises:
        WireError: unknown dtype, not 2-D, a negative dimension, or not ``prod(shape) * itemsize`` bytes.
    """
    dtype = _FROM_WIRE.get(msg.dtype)
    if dtype is None:
        raise WireError(f"unsupported wire dtype {msg.dtype}")
    shape = msg.shape[:]
    if len(shape) != 2 or min(shape) < 0:
        raise WireError(f"a tensor of shape {tuple(shape)}, not [rows, width]")
    itemsize = _ITEMSIZE[dtype]
    if len(data) != shape[0] * shape[1] * itemsize:
        raise WireError(f"tensor of shape {tuple(shape)} and dtype {dtype} needs {shape[0] * shape[1] * itemsize} "
                        f"bytes, got {len(data)}")
    if not len(data):
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(data, dtype=dtype).view(shape)
    return t if t.data_ptr() % itemsize == 0 else t.clone()


def propose_columns(columns: draft_pb2.ProposeColumns, rows_data: memoryview | None = None, ring=None) -> list[DraftItem]:
    """The engine items of a columnar Propose message (each item's feature rows a view of one
    tensor decoded from the message; an item of 0 rows has None). An empty session id is left
    for :func:`check_session` to refuse, for that item only. ``rows_data``: the bytes of the
    features' tensor where the message was parsed without them (:class:`ProposeInPlace`): the
    tensor is made over them. Ring rows (``features.ring_slots`` / ``ring_rows``) as
    :func:`decode_item`'s, from ``ring``.

    Raises:
        ColumnsError: columns that do not fit together (lengths, the features' rows, dtype, shape
            or bytes).
    """
    sids = columns.session_ids[:]
    n = len(sids)
    roots = unpack_i32(columns.root_tokens, n, "root_tokens")
    lengths = unpack_i32(columns.committed_lengths, n, "committed_lengths")
    budgets = unpack_i32(columns.budgets, n, "budgets")
    top_ks = unpack_i32(columns.top_ks, n, "top_ks")
    depths = unpack_i32(columns.max_depths, n, "max_depths")
    fc = columns.features
    rows = unpack_i32(fc.rows, n, "features.rows") if fc.rows or fc.HasField("rows_data") else [0] * n
    if rows and min(rows) < 0:
        raise ColumnsError("features.rows: a negative row count")
    feats: list = [None] * n
    finite = False   # (no rows: nothing to check)
    total = sum(rows)
    if total:
        try:
            t = tensor_from_proto(fc.rows_data) if rows_data is None else _tensor_in_place(fc.rows_data, rows_data)
        except WireError as e:
            raise ColumnsError(f"features: {e}") from None
        if t.dim() != 2 or t.shape[0] != total:
            raise ColumnsError(f"features: a tensor of shape {tuple(t.shape)} for {total} rows")
        nonzero = [r for r in rows if r]
        parts = iter(torch.split(t, nonzero) if len(nonzero) > 1 else (t,))
        feats = [next(parts) if r else None for r in rows]
        # the step's rows checked at once (a per-item check costs ~12 us of fixed overhead each);
        # a non-finite value anywhere leaves every item to its own check, so only its item fails
        finite = t.is_floating_point() and all_finite(t)
    rings = [None] * n
    if fc.ring_rows:
        counts = unpack_i32(fc.ring_rows, n, "features.ring_rows")
        slots = unpack_i32(fc.ring_slots, n, "features.ring_slots")
        rings = [(ring, slot, k) if k else None for slot, k in zip(slots, counts)]
    return [DraftItem(*x, finite, rr) for *x, rr in zip(sids, feats, roots, lengths, budgets, top_ks, depths, rings)]


def check_session(item: DraftItem) -> DraftItem:
    """``item`` itself, if its session id is not empty.

    Raises:
        InvalidArgument: an empty session id.
    """
    if not item.session_id:
        raise InvalidArgument("empty session_id")
    return item


def propose_columns_response(outs, done) -> draft_pb2.ProposeResponse:
    """The ``ProposeResponse`` of a columnar request: the refused items by index (a tree of 0
    nodes each), every tree as columns, and the batch's timing ``done``."""
    response = draft_pb2.ProposeResponse(compute_s=done.compute_s, batch_items=done.batch_items, queue_s=done.queue_s,
                                         device_s=done.device_s)
    sizes, tokens, parents = [], [], []
    for i, out in enumerate(outs):
        if isinstance(out, BaseException):
            response.refused.add(index=i).status.CopyFrom(item_status(out))
            sizes.append(0)
            continue
        sizes.append(len(out.tokens))
        tokens += out.tokens
        parents += out.parents
    fill_trees(response.trees, sizes, tokens, parents)
    response.trees.SetInParent()
    return response


def _fill_propose(r: draft_pb2.ProposeResult, out) -> None:
    """An accepted item's tree in its ``ProposeResult`` (present even if empty)."""
    tree = r.tree
    tree.SetInParent()
    tree.tokens.extend(out.tokens)
    tree.parents.extend(out.parents)


class DraftServiceServicer(draft_pb2_grpc.DraftServiceServicer):
    """The draft service over one drafter engine, run by a :class:`StepLoop`.

    Args:
        engine: a :class:`ReferenceDrafterEngine` or :class:`BatchedDrafter` (anything with
            ``drafter``, ``max_sessions``, ``max_context``, ``propose_batch``, ``release``,
            ``session_length``); a bare :class:`DFlashDrafter` is wrapped in a
            :class:`ReferenceDrafterEngine` with ``max_sessions`` / ``max_context``.
        max_sessions, max_context: only used to wrap a bare drafter (0 = unlimited context).
        model_name: ``ModelInfo.model_name``.
        model_fingerprint: ``ModelInfo.model_fingerprint`` of the drafter (e.g. its file's sha256).
        tokenizer_fingerprint: the target's tokenizer fingerprint (the vocabulary spoken).
        loop: the step loop to run the engine on (default: a new one, owned: :meth:`close` stops it).
    """

    def __init__(
        self,
        engine: "ReferenceDrafterEngine | BatchedDrafter | DFlashDrafter",
        *,
        max_sessions: int = 64,
        max_context: int = 0,
        model_name: str = "dflash-drafter",
        model_fingerprint: str = "",
        tokenizer_fingerprint: str = "",
        loop: StepLoop | None = None,
    ):
        if isinstance(engine, DFlashDrafter):
            engine = ReferenceDrafterEngine(engine, max_sessions=max_sessions, max_context=max_context)
        self.engine = engine
        self.drafter = engine.drafter
        self._rings: dict[str, list] = {}   # feature rings by id: [the ring or None, last named] (feature_ring)
        self._rings_lock = threading.Lock()
        self.config = engine.drafter.config
        self.max_sessions = int(engine.max_sessions)
        self.max_context = int(engine.max_context)
        self.model_name = model_name
        self.model_fingerprint = model_fingerprint
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.loop = loop if loop is not None else StepLoop(engine, name="draft", batch_method="propose_batch")
        #: the same-host hop's endpoint for Info (``ModelInfo.local_endpoint``; set by the main)
        self.local_endpoint = ""
        #: read the feature rings requests name (``--no-feature-ring``: False, set by the main)
        self.read_rings = True

    @classmethod
    def from_paths(
        cls,
        drafter_path: str,
        target_path: str,
        *,
        device: str = DraftConfig.device,
        dtype: torch.dtype | None = None,
        max_sessions: int = DraftConfig.max_sessions,
        max_context: int | None = DraftConfig.max_context,
        engine: str = DraftConfig.engine,
        cuda_graphs: bool = DraftConfig.cuda_graphs,
        fused_step: bool = DraftConfig.fused_step,
        memory_budget: int | None = DraftConfig.gpu_memory_bytes,
        batch_buckets: tuple[int, ...] | None = None,
        max_top_k: int | None = None,
        prefill_chunk: int = DraftConfig.prefill_chunk,
        weights: str = "bf16",
        progress: bool = False,
    ) -> "DraftServiceServicer":
        """Load the drafter for ``target_path``, build its engine and serve it.

        Args:
            device, dtype: where the drafter runs; ``dtype`` None: float32 on CPU, bfloat16 on CUDA.
            max_sessions: most concurrent sessions (the batched engine may hold fewer when
                ``memory_budget`` is smaller).
            max_context: rows per session; None: the target's ``{arch}.context_length`` (0 if
                absent = unlimited for the reference engine; the batched engine, whose pool is
                allocated at start, caps it at :data:`DEFAULT_BATCHED_CONTEXT`).
            engine: ``auto`` (batched on CUDA, reference on the CPU), ``reference`` or ``batched``.
            cuda_graphs, fused_step, memory_budget, batch_buckets, max_top_k, prefill_chunk: the batched
                engine's options (:class:`BatchedDrafter`; None: :class:`DraftConfig`'s defaults);
                its graphs are captured here (``progress``: a tqdm bar).
            weights: the target's embedding and LM head as ``"bf16"`` (dequantized to ``dtype``) or
                ``"quantized"`` (GGUF blocks; :func:`draft_service.gguf_io.load_drafter`).

        ``drafter_path`` is a drafter GGUF or a z-lab checkpoint directory (loaded in memory).

        Raises:
            draft_service.drafter.DrafterError: the drafter belongs to another target or does not
                fit it (the message names the field).
            ValueError: unknown ``engine`` or ``weights``.
            runtime.errors.ResourceExhausted: the memory budget holds no session slot.
        """
        from draft_service.gguf_io import is_trained
        from runtime.fingerprint import tokenizer_fingerprint
        from runtime.gguf_loader import open_gguf

        auto = DraftConfig(device=str(device), engine=engine, weights=weights).resolved()  # the auto rules live there
        engine = auto.engine
        if engine not in ("reference", "batched"):
            raise ValueError(f"unknown drafter engine {engine!r} (auto, reference, batched)")
        if dtype is None:
            dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[auto.dtype]
        target = open_gguf(target_path)
        drafter = load_drafter(drafter_path, target, device=device, dtype=dtype, weights=auto.weights)
        target_context = int(target.get("{arch}.context_length", 0) or 0)
        if not is_trained(drafter_path):
            logger.warning("the drafter is untrained (random init): expect acceptance near zero", extra={"drafter": drafter_path})
        if engine == "batched":
            ctx = max_context if max_context else min(target_context or DEFAULT_BATCHED_CONTEXT, DEFAULT_BATCHED_CONTEXT)
            eng = BatchedDrafter(drafter, max_sessions=max_sessions, max_context=ctx, memory_budget=memory_budget,
                                 cuda_graphs=cuda_graphs, batch_buckets=batch_buckets or None,
                                 max_top_k=max_top_k or DraftConfig.max_top_k, prefill_chunk=prefill_chunk,
                                 fused=None if fused_step else False)
            eng.capture(progress=progress)
        else:
            eng = ReferenceDrafterEngine(drafter, max_sessions=max_sessions,
                                         max_context=target_context if max_context is None else max_context)
        if os.path.isdir(drafter_path):   # a z-lab checkpoint directory (draft_service.convert)
            from draft_service.convert import directory_sha256

            name, fingerprint = os.path.basename(os.path.normpath(drafter_path)), directory_sha256(drafter_path)
        else:
            name = open_gguf(drafter_path).get("general.name", "") or os.path.basename(drafter_path)
            fingerprint = file_sha256(drafter_path)
        return cls(
            eng,
            model_name=str(name),
            model_fingerprint=fingerprint,
            tokenizer_fingerprint=tokenizer_fingerprint(target),
        )

    def close(self) -> None:
        """Stop the step loop (queued work fails)."""
        self.loop.stop()

    # ---- RPCs ----------------------------------------------------------------------------------

    def Info(self, request: draft_pb2.DrafterInfoRequest, context: grpc.ServicerContext) -> draft_pb2.DrafterInfo:
        with self.loop.enter(caller(context)):   # a restarted owner frees its predecessor's sessions here
            return self.info()

    def Propose(self, request_iterator: Iterable[draft_pb2.ProposeRequest], context: grpc.ServicerContext) -> Iterator[draft_pb2.ProposeResponse]:
        owner = caller(context)
        scope = self.loop.enter(owner)   # the open stream holds the owner's lease
        context.add_callback(scope.close)
        with scope:
            local = isinstance(context, LocalContext)   # (the only callers whose feature ring is read)
            try:
                for request in request_iterator:
                    yield self.propose(request, owner, local)
            except ColumnsError as e:
                abort_with(context, InvalidArgument(f"malformed columns: {e}"))

    def Release(self, request: common_pb2.ReleaseRequest, context: grpc.ServicerContext) -> common_pb2.ReleaseResponse:
        owner = caller(context)
        with self.loop.enter(owner):
            return common_pb2.ReleaseResponse(released=self.release(request.session_ids, owner))

    # ---- plain-Python API (the RPCs call these) ------------------------------------------------

    def info(self) -> draft_pb2.DrafterInfo:
        c = self.config
        graphs = bool(getattr(self.engine, "cuda_graphs", False))
        return draft_pb2.DrafterInfo(
            model=common_pb2.ModelInfo(
                model_name=self.model_name,
                architecture="qwen3",
                vocab_size=c.vocab_size,
                tokenizer_fingerprint=self.tokenizer_fingerprint,
                model_fingerprint=self.model_fingerprint,
                block_size=c.block_size,
                max_context=self.max_context,
                max_tree_width=0,
                max_sessions=self.max_sessions,
                hidden_size=c.hidden_size,
                num_layers=c.num_layers,
                features=list(FEATURES) + (["cuda-graphs"] if graphs else []),
                device=str(self.drafter.device),
                graph_captures=int(getattr(self.engine, "captures", 0)),
                free_slots=int(self.loop.call(lambda: self.engine.free_slots)),
                local_endpoint=self.local_endpoint,
            ),
            target_fingerprint=c.target_fingerprint,
            target_layer_ids=list(c.target_layer_ids),
            mask_token_id=c.mask_token_id,
        )

    def propose(self, request: draft_pb2.ProposeRequest | ProposeInPlace,
                owner: Owner | None = None, local: bool = True) -> draft_pb2.ProposeResponse:
        """One result per item, in order; the items that decode go to the engine as one batch
        (for ``owner``: an item naming another owner's session is refused, ``NOT_OWNER``; None:
        unchecked). A columnar request is answered as columns. Items with rows in the request's
        feature ring read them from it when ``local`` (the call came over the same-host hop or
        from this process), :attr:`read_rings` is on and the ring maps here (:meth:`feature_ring`);
        elsewhere they are refused, ``RING_UNAVAILABLE``.

        Raises:
            ColumnsError: a columnar request whose columns do not fit together.
        """
        message = request.message if type(request) is ProposeInPlace else request
        ring = self.feature_ring(message.ring) if local and self.read_rings and message.HasField("ring") else None
        if type(request) is ProposeInPlace:   # (parse_propose_request: the rows left where they came)
            outs, done = run_items(self.loop, propose_columns(request.message.columns, request.rows_data, ring),
                                   check_session, owner)
            return propose_columns_response(outs, done)
        if request.HasField("columns"):
            outs, done = run_items(self.loop, propose_columns(request.columns, None, ring), check_session, owner)
            return propose_columns_response(outs, done)
        items = request.items
        outs, done = run_items(self.loop, items, lambda item: decode_item(item, ring), owner)
        return batch_reply(draft_pb2.ProposeResponse, items, outs, done, _fill_propose)

    #: feature rings kept mapped at once (a target that restarted made a new one; the least
    #: recently used goes), and seconds after which a ring no request named is unmapped when
    #: another is mapped (a mapped CUDA-IPC ring keeps its GPU memory alive after its target exited)
    RINGS, RING_IDLE_S = 4, 60.0

    def feature_ring(self, desc: common_pb2.FeatureRing) -> FeatureRing | None:
        """The feature ring ``desc`` names, mapped on the drafter's device the first time
        (:meth:`runtime.feature_ring.FeatureRing.open`), or None when it cannot be here (logged
        once per ring)."""
        rings, now = self._rings, time.monotonic()
        got = rings.get(desc.id)
        if got is not None:
            got[1] = now
            return got[0]
        with self._rings_lock:   # (Propose streams map and unmap on their own threads)
            got = rings.get(desc.id)
            if got is not None:
                return got[0]
            try:
                ring = FeatureRing.open(desc, self.drafter.device)
            except RingUnavailable as e:
                logger.warning("cannot read the target's feature ring: its rows must come as bytes", extra={"error": str(e)})
                ring = None
            for rid, (old, used) in sorted(rings.items(), key=lambda kv: kv[1][1]):
                if len(rings) < self.RINGS and now - used < self.RING_IDLE_S:
                    break
                rings.pop(rid, None)   # (the least recently used first: none named it for a while, or
                if old is not None:    # four newer rings are in use)
                    old.close()
            rings[desc.id] = [ring, now]
            return ring

    def release(self, session_ids: Iterable[str], owner: Owner | None = None) -> int:
        """Drop the sessions (on the loop thread); returns how many existed (unknown ids, and with
        ``owner`` those of another owner, are skipped)."""
        return self.loop.release(list(session_ids), owner)

    def session_length(self, session_id: str) -> int | None:
        """Context rows held for a session, or None when it does not exist."""
        return self.loop.call(lambda: self.engine.session_length(session_id))

    @property
    def num_sessions(self) -> int:
        return self.loop.call(lambda: len(self.engine.sessions))


def add_to_server(servicer: DraftServiceServicer, server) -> None:
    """Register ``servicer`` on ``server`` as ``draft_pb2_grpc.add_DraftServiceServicer_to_server``
    does, with Propose's requests parsed by :func:`parse_propose_request` (on the same-host hop,
    a columnar request's feature rows stay in the buffer they came in; over gRPC it is
    ``ProposeRequest.FromString``)."""
    handlers = {
        "Info": grpc.unary_unary_rpc_method_handler(servicer.Info, draft_pb2.DrafterInfoRequest.FromString,
                                                    draft_pb2.DrafterInfo.SerializeToString),
        "Propose": grpc.stream_stream_rpc_method_handler(servicer.Propose, parse_propose_request,
                                                         draft_pb2.ProposeResponse.SerializeToString),
        "Release": grpc.unary_unary_rpc_method_handler(servicer.Release, common_pb2.ReleaseRequest.FromString,
                                                       common_pb2.ReleaseResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


__all__ = ["DraftServiceServicer", "FEATURES", "ProposeInPlace", "SERVICE_NAME", "add_to_server", "decode_item",
           "file_sha256", "parse_propose_request"]

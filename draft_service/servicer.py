"""gRPC ``dflash_grpc.v1.DraftService``: per-session drafter contexts and chain proposals.

Per ``ProposeItem`` (DESIGN.md "One speculative step", step 1):

1. decode ``features`` (``[rows, N*H]``, bf16/f16/f32 raw bytes; unset = 0 rows);
2. check ``committed_length == rows held + rows`` for the session (created on first sight);
3. append the rows' context K/V, run the block ``[root, MASK x (B-1)]`` at positions
   ``L..L+B-1``, build the tree (``TreeParams``: depth ``max_depth`` or ``B-1`` when 0; DDTree
   with ``top_k`` candidates per depth and at most ``budget`` non-root nodes when both are > 1,
   else the greedy chain, cut to ``budget`` nodes when ``budget > 0``; ``draft_service.tree``).

Per-item failures go into ``ProposeResult.status`` (``code`` = ``grpc.StatusCode`` number) and
leave that session exactly as it was (a new session is not created) and every other item alone:

* ``INVALID_ARGUMENT``: empty session id, malformed features (dtype, byte count, shape other than
  ``[rows, N*H]``, non-finite values), root token outside the vocabulary, negative tree params;
* ``FAILED_PRECONDITION``: ``committed_length`` differs from rows held + rows sent;
* ``RESOURCE_EXHAUSTED``: ``max_sessions`` sessions are open and this one is new; the session would
  exceed ``max_context`` rows; out of device memory;
* ``INTERNAL``: anything unexpected (logged).

Thread safety: one lock around the session table and all model compute.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Iterable, Iterator

import grpc
import torch

from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from dflash_grpc.wire import WireError, tensor_from_proto, tree_to_proto
from draft_service.drafter import DFlashDrafter, DrafterContext
from draft_service.tree import build_tree

logger = logging.getLogger(__name__)

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name

#: Capabilities advertised in ``ModelInfo.features``.
FEATURES = ("chain", "tree")


class _ItemError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _status(code: grpc.StatusCode, message: str = "") -> common_pb2.ItemStatus:
    return common_pb2.ItemStatus(code=code.value[0], message=message)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 hex digest of a file's bytes (the drafter's ``ModelInfo.model_fingerprint``)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class DraftServiceServicer(draft_pb2_grpc.DraftServiceServicer):
    """The draft service over one :class:`DFlashDrafter`.

    Args:
        drafter: the model (already on its device, in eval mode).
        max_sessions: most concurrent sessions; a new one beyond it gets RESOURCE_EXHAUSTED.
        max_context: most context rows per session (0 = unlimited).
        model_name: ``ModelInfo.model_name``.
        model_fingerprint: ``ModelInfo.model_fingerprint`` of the drafter (e.g. its file's sha256).
        tokenizer_fingerprint: the target's tokenizer fingerprint (the vocabulary spoken).
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        *,
        max_sessions: int = 64,
        max_context: int = 0,
        model_name: str = "dflash-drafter",
        model_fingerprint: str = "",
        tokenizer_fingerprint: str = "",
    ):
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.drafter = drafter.eval()
        self.config = drafter.config
        self.max_sessions = int(max_sessions)
        self.max_context = int(max_context)
        self.model_name = model_name
        self.model_fingerprint = model_fingerprint
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self._sessions: dict[str, DrafterContext] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_paths(
        cls,
        drafter_path: str,
        target_path: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        max_sessions: int = 64,
        max_context: int | None = None,
    ) -> "DraftServiceServicer":
        """Load the drafter for ``target_path`` and wrap it.

        ``dtype`` None: float32 on CPU, bfloat16 on CUDA. ``max_context`` None: the target's
        ``{arch}.context_length`` (0 if absent = unlimited).

        Raises:
            draft_service.drafter.DrafterError: the drafter belongs to another target.
        """
        from draft_service.gguf_io import is_trained
        from target_service.fingerprint import tokenizer_fingerprint
        from target_service.gguf_loader import GGUFFile, open_gguf

        if dtype is None:
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        target = open_gguf(target_path)
        drafter = DFlashDrafter.from_gguf(drafter_path, target, device=device, dtype=dtype)
        if max_context is None:
            max_context = int(target.get("{arch}.context_length", 0) or 0)
        if not is_trained(drafter_path):
            logger.warning("the drafter is untrained (random init): expect acceptance near zero", extra={"drafter": drafter_path})
        name = open_gguf(drafter_path).get("general.name", "") or os.path.basename(drafter_path)
        return cls(
            drafter,
            max_sessions=max_sessions,
            max_context=max_context,
            model_name=str(name),
            model_fingerprint=file_sha256(drafter_path),
            tokenizer_fingerprint=tokenizer_fingerprint(target),
        )

    # ---- RPCs ----------------------------------------------------------------------------------

    def Info(self, request: draft_pb2.DrafterInfoRequest, context: grpc.ServicerContext) -> draft_pb2.DrafterInfo:
        return self.info()

    def Propose(self, request_iterator: Iterable[draft_pb2.ProposeRequest], context: grpc.ServicerContext) -> Iterator[draft_pb2.ProposeResponse]:
        for request in request_iterator:
            yield self.propose(request)

    def Release(self, request: common_pb2.ReleaseRequest, context: grpc.ServicerContext) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(released=self.release(request.session_ids))

    # ---- plain-Python API (the RPCs call these) ------------------------------------------------

    def info(self) -> draft_pb2.DrafterInfo:
        c = self.config
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
                features=list(FEATURES),
                device=str(self.drafter.device),
            ),
            target_fingerprint=c.target_fingerprint,
            target_layer_ids=list(c.target_layer_ids),
            mask_token_id=c.mask_token_id,
        )

    def propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        """One result per item, in order."""
        return draft_pb2.ProposeResponse(results=[self.propose_item(item) for item in request.items])

    def release(self, session_ids: Iterable[str]) -> int:
        """Drop the sessions' contexts; returns how many existed (unknown ids are ignored)."""
        with self._lock:
            return sum(self._sessions.pop(sid, None) is not None for sid in session_ids)

    def session_length(self, session_id: str) -> int | None:
        """Context rows held for a session, or None when it does not exist."""
        with self._lock:
            ctx = self._sessions.get(session_id)
            return None if ctx is None else ctx.length

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def propose_item(self, item: draft_pb2.ProposeItem) -> draft_pb2.ProposeResult:
        """Serve one item; every failure becomes the result's status (see the module docstring)."""
        sid = item.session_id
        try:
            features = self._decode_features(item)
            root = int(item.root_token)
            if not 0 <= root < self.config.vocab_size:
                raise _ItemError(grpc.StatusCode.INVALID_ARGUMENT, f"root token {root} outside the vocabulary [0, {self.config.vocab_size})")
            depth = self._depth(item.tree)
            logits = self._advance(sid, features, root, int(item.committed_length))
            tokens, parents = build_tree(root, logits[:depth], int(item.tree.budget), int(item.tree.top_k))
            return draft_pb2.ProposeResult(session_id=sid, status=_status(grpc.StatusCode.OK), tree=tree_to_proto(tokens, parents))
        except _ItemError as e:
            return draft_pb2.ProposeResult(session_id=sid, status=_status(e.code, e.message))
        except _OOM as e:
            logger.warning("out of memory in propose", extra={"session_id": sid})
            return draft_pb2.ProposeResult(session_id=sid, status=_status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {e}"))
        except Exception as e:  # noqa: BLE001 - one item must not break the stream
            logger.exception("propose failed", extra={"session_id": sid})
            return draft_pb2.ProposeResult(session_id=sid, status=_status(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))

    # ---- helpers -------------------------------------------------------------------------------

    def _decode_features(self, item: draft_pb2.ProposeItem) -> torch.Tensor:
        width = self.config.feature_size
        if not item.session_id:
            raise _ItemError(grpc.StatusCode.INVALID_ARGUMENT, "empty session_id")
        msg = item.features
        if not item.HasField("features") or (msg.dtype == common_pb2.DTYPE_UNSPECIFIED and not msg.shape and not msg.data):
            return torch.empty(0, width)
        try:
            t = tensor_from_proto(msg)
        except WireError as e:
            raise _ItemError(grpc.StatusCode.INVALID_ARGUMENT, f"features: {e}") from None
        if t.dim() != 2 or t.shape[1] != width:
            raise _ItemError(grpc.StatusCode.INVALID_ARGUMENT, f"features must be [rows, {width}] (N={self.config.num_target_layers} x hidden {self.config.hidden_size}), got {list(t.shape)}")
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise _ItemError(grpc.StatusCode.INVALID_ARGUMENT, "features hold NaN or infinite values")
        return t

    def _depth(self, tree: draft_pb2.TreeParams) -> int:
        if tree.budget < 0 or tree.top_k < 0 or tree.max_depth < 0:
            raise _ItemError(grpc.StatusCode.INVALID_ARGUMENT, f"negative tree params (budget={tree.budget}, top_k={tree.top_k}, max_depth={tree.max_depth})")
        full = self.config.block_size - 1
        return full if tree.max_depth == 0 else min(tree.max_depth, full)

    def _advance(self, sid: str, features: torch.Tensor, root: int, committed_length: int) -> torch.Tensor:
        """Append ``features`` to the session and return the block logits ``[B-1, V]``; on any
        failure the session is left as it was (and not created)."""
        rows = features.shape[0]
        with self._lock:
            ctx = self._sessions.get(sid)
            held = 0 if ctx is None else ctx.length
            if ctx is None and len(self._sessions) >= self.max_sessions:
                raise _ItemError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {self.max_sessions} session slots are in use")
            if committed_length != held + rows:
                raise _ItemError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"committed_length {committed_length} != rows held ({held}) + rows sent ({rows})",
                )
            if self.max_context and held + rows > self.max_context:
                raise _ItemError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"context full: {held + rows} rows > max_context {self.max_context}")
            new = ctx is None
            if new:
                ctx = self.drafter.new_context()
            try:
                self.drafter.append_context(ctx, features)
                logits = self.drafter.block_logits(ctx, root)
            except BaseException:
                ctx.truncate(held)
                raise
            if new:
                self._sessions[sid] = ctx
            return logits

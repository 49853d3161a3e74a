"""Target engine: session slots, prefill, tree verify, acceptance, commit and rollback.

A session owns a KV cache (its slot), the root token (the last emitted token, not yet in the
cache), its sampling settings and the target layers whose outputs the drafter wants. All state
changes of a session go through :meth:`TargetEngine.prefill` and :meth:`TargetEngine.verify`,
which validate their input completely before touching anything: a rejected request leaves the
session exactly as it was (docs/ARCHITECTURE.md, "Errors").

One verify step (docs/ARCHITECTURE.md, "One speculative step", steps 2-4):

1. forward every tree node over the committed cache with the ancestor mask (nothing written);
2. the target's choice at every node (argmax, or Gumbel-max sample keyed by position);
3. the acceptance walk on device tensors (``kernels.sampling.accept_path``), one host read;
4. commit: the path's K/V rows are copied to cache rows ``[L, L + k + 1)``; the rest is dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import torch

from kernels.sampling import accept_path, select_tokens
from runtime.errors import EngineError, FailedPrecondition, InvalidArgument, Reason, ResourceExhausted, SessionNotFound  # noqa: F401 (re-exported)
from runtime.sampling import MIN_TEMPERATURE, Sampling  # noqa: F401 (re-exported)
from runtime.tree import TreeError, chain, tree_tensors, validate_tree
from target_service.config import TargetConfig

log = logging.getLogger(__name__)

#: Prompt rows per prefill forward (bounds the attention score matrix).
PREFILL_CHUNK = 256


def check_prompt(session_id: str, prompt: list[int], feature_layers: list[int], cfg, max_context: int) -> None:
    """The checks of a new session that need no engine state (both engines run them first).

    Raises:
        InvalidArgument: empty session id or prompt, a token outside ``[0, cfg.vocab_size)``, a
            feature layer outside ``[0, cfg.num_layers)`` or named twice (so at most
            ``cfg.num_layers`` layers: each duplicate would repeat ``rows * hidden`` values of
            the reply).
        ResourceExhausted: the prompt leaves no room in ``max_context``.
    """
    if not session_id:
        raise InvalidArgument("session_id is empty")
    if not prompt:
        raise InvalidArgument("prompt is empty")
    arr = np.asarray(prompt, dtype=np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= cfg.vocab_size))
    if bad.size:
        raise InvalidArgument(f"prompt[{bad[0]}] = {prompt[bad[0]]} is outside the vocabulary [0, {cfg.vocab_size})", reason=Reason.INVALID_TOKEN)
    seen: set[int] = set()
    for i in feature_layers:
        if not 0 <= i < cfg.num_layers:
            raise InvalidArgument(f"feature layer {i} outside [0, {cfg.num_layers})")
        if i in seen:
            raise InvalidArgument(f"feature layer {i} is named twice (each layer at most once, at most {cfg.num_layers} layers)")
        seen.add(i)
    if len(prompt) >= max_context:
        raise ResourceExhausted(f"prompt of {len(prompt)} tokens leaves no room in a context of {max_context}", reason=Reason.PROMPT_TOO_LONG)




@dataclasses.dataclass
class Session:
    """State of one generation on the target."""

    session_id: str
    cache: object
    sampling: Sampling
    feature_layers: list[int]
    root: int = -1

    @property
    def length(self) -> int:
        """``L``: tokens committed in the cache."""
        return self.cache.length


@dataclasses.dataclass
class PrefillOutcome:
    """First token (the next root), committed length, prompt-row features ``[L, N*H]`` or ``None``,
    and the prompt tokens of each forward that committed it (``chunks``, in order; empty where
    the engine does not record them)."""

    first_token: int
    committed_length: int
    features: torch.Tensor | None
    chunks: tuple[int, ...] = ()
    #: the feature ring slot holding the prompt's rows instead of ``features`` (positions
    #: ``[0, committed_length)``), or -1
    ring_slot: int = -1


@dataclasses.dataclass
class PrefillJob:
    """A prefill in progress: the request, how many prompt tokens are committed, and at the end its
    :class:`PrefillOutcome` (``outcome``)."""

    session_id: str
    prompt: list[int]
    sampling: "Sampling"
    feature_layers: list[int]
    done: int = 0
    outcome: PrefillOutcome | None = None
    state: object = None
    #: prompt tokens committed by each chunk so far (``BatchedEngine.run_prefill``)
    chunks: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class VerifyOutcome:
    """Result of one verify step.

    Attributes:
        accepted_nodes: path node indices, root first (``k + 1``).
        accepted_tokens: the ``k`` accepted draft tokens.
        bonus_token: the target's token after the path (the next root).
        committed_length: ``L`` after the commit.
        features: ``[k + 1, N*H]`` features of the committed rows, or ``None``.
        ring_slot: the feature ring slot the committed rows were written to instead
            (:mod:`runtime.feature_ring`: positions ``[committed_length - k - 1,
            committed_length)``), or -1: none.
    """

    accepted_nodes: list[int]
    accepted_tokens: list[int]
    bonus_token: int
    committed_length: int
    features: torch.Tensor | None
    ring_slot: int = -1


class TargetEngine:
    """Owns the target model and every session's state.

    Args:
        model: a loaded model (``target_service.models``: ``LlamaModel`` or ``Qwen35Model``).
        max_sessions: concurrent session slots.
        max_context: tokens per session (prompt + generated).
        max_tree_width: most nodes a verify may carry.
        max_tree_depth: deepest node a verify may carry (the drafter's block size - 1 or more).

    Thread safety: one lock serialises model compute and session-table changes (the services
    call an engine from one step-loop thread, ``runtime.step_loop``).
    """

    def __init__(self, model, max_sessions: int = TargetConfig.MAX_SESSIONS_CPU, max_context: int = TargetConfig.max_context,
                 max_tree_width: int = TargetConfig.max_tree_width, max_tree_depth: int = TargetConfig.max_tree_depth):
        self.model = model
        self.cfg = model.cfg
        self.max_sessions = max_sessions
        self.max_context = min(max_context, model.cfg.context_length)
        self.max_tree_width = max_tree_width
        self.max_tree_depth = max_tree_depth
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.forwards = 0

    # ------------------------------------------------------------------ helpers
    def _select(self, session: Session, logits: torch.Tensor, next_positions: list[int]) -> torch.Tensor:
        s = session.sampling
        return select_tokens(logits, next_positions, s.temperature, s.top_k, s.top_p, s.seed)

    def session(self, session_id: str) -> Session:
        """The live session ``session_id`` (raises :class:`SessionNotFound`)."""
        try:
            return self.sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"unknown session {session_id!r}") from None

    # ------------------------------------------------------------------ API
    def prefill(self, session_id: str, prompt: list[int], sampling: Sampling, feature_layers: list[int]) -> PrefillOutcome:
        """Open ``session_id``: commit the prompt to a fresh cache and choose the first token.

        Raises:
            InvalidArgument: empty id or prompt, token outside the vocabulary, bad feature layer,
                session id already live.
            ResourceExhausted: no free slot, or prompt longer than ``max_context - 1``.
        """
        check_prompt(session_id, prompt, feature_layers, self.cfg, self.max_context)
        with self._lock:
            if session_id in self.sessions:
                raise InvalidArgument(f"session {session_id!r} already exists", reason=Reason.SESSION_EXISTS)
            if len(self.sessions) >= self.max_sessions:
                raise ResourceExhausted(f"all {self.max_sessions} session slots are in use", reason=Reason.NO_FREE_SLOT)
            cache = self.model.new_cache(self.max_context)
            session = Session(session_id, cache, sampling, list(feature_layers))
            self.sessions[session_id] = session
            try:
                feats = []
                toks = torch.tensor(prompt, dtype=torch.long, device=self.model.device)
                for start in range(0, len(prompt), PREFILL_CHUNK):
                    part = toks[start : start + PREFILL_CHUNK]
                    n = part.shape[0]
                    tr = chain(part.tolist(), self.model.device)
                    positions = torch.arange(start, start + n, device=self.model.device)
                    last = start + n == len(prompt)
                    out = self.model.forward(
                        part, positions, tr.ancestors, cache, session.feature_layers,
                        logits_rows=torch.tensor([n - 1], device=self.model.device) if last else torch.empty(0, dtype=torch.long, device=self.model.device),
                    )
                    self.model.commit(cache, out, torch.arange(n, device=self.model.device))
                    if out.features is not None:
                        feats.append(out.features)
                    self.forwards += 1
                first = int(self._select(session, out.logits, [len(prompt)])[0])
            except BaseException:
                del self.sessions[session_id]
                raise
            session.root = first
            features = torch.cat(feats) if feats else None
            return PrefillOutcome(first, cache.length, features)

    def verify(self, session_id: str, tokens: list[int], parents: list[int]) -> VerifyOutcome:
        """Verify a token tree of ``session_id``, commit the accepted path, drop the rest.

        ``tokens[0]`` must be the session's root (the token emitted last).

        Raises:
            SessionNotFound: unknown session.
            InvalidArgument: malformed tree (:func:`runtime.tree.validate_tree`) or a root
                other than the session's.
            ResourceExhausted: the tree's deepest position would pass ``max_context``.
        """
        with self._lock:
            session = self.session(session_id)
            L = session.length
            try:
                validate_tree(tokens, parents, self.cfg.vocab_size, self.max_tree_width, self.max_tree_depth)
            except TreeError as e:
                raise InvalidArgument(f"invalid tree: {e}", reason=Reason.INVALID_TREE) from None
            if tokens[0] != session.root:
                raise InvalidArgument(f"tree root {tokens[0]} is not the session's last token {session.root}", reason=Reason.INVALID_TREE)
            tree = tree_tensors(tokens, parents, self.model.device)
            if L + tree.max_depth + 1 > self.max_context:
                raise ResourceExhausted(
                    f"context full: {L} committed + depth {tree.max_depth + 1} exceeds {self.max_context}", reason=Reason.CONTEXT_FULL
                )
            positions = L + tree.depth
            out = self.model.forward(tree.tokens, positions, tree.ancestors, session.cache, session.feature_layers, parents=parents)
            self.forwards += 1
            choice = self._select(session, out.logits, [L + d + 1 for d in tree.depth_host])
            path_mask = accept_path(tree.tokens, tree.parents, tree.ancestors, tree.depth, choice)
            # Path nodes first, by depth (ancestors before descendants), without a host sync.
            t = tree.tokens.shape[0]
            order = torch.argsort(torch.where(path_mask, tree.depth, tree.depth + t + 1), stable=True)
            n_path = path_mask.sum().reshape(1)
            bonus = choice.gather(0, order.gather(0, n_path - 1))
            # The one host read of the step: the path, its length and the bonus token.
            host = torch.cat([order, n_path, bonus]).tolist()
            n = host[t]
            nodes, bonus_token = host[:n], host[t + 1]
            path = order[:n]
            self.model.commit(session.cache, out, path)
            session.root = bonus_token
            features = out.features.index_select(0, path) if out.features is not None else None
            return VerifyOutcome(nodes, [tokens[i] for i in nodes[1:]], bonus_token, session.length, features)

    def verify_batch(self, items: list[tuple[str, list[int], list[int]]]) -> list["VerifyOutcome | EngineError"]:
        """Verify several sessions' trees (``(session_id, tokens, parents)`` each), one forward
        each; a refused item gets its error in its place and leaves the others alone."""
        out: list[VerifyOutcome | EngineError] = []
        for sid, tokens, parents in items:
            try:
                out.append(self.verify(sid, tokens, parents))
            except EngineError as e:
                out.append(e)
        return out

    def start_prefill(self, session_id: str, prompt: list[int], sampling: Sampling, feature_layers: list[int]) -> "PrefillJob":
        """A prefill the step loop runs with :meth:`run_prefill` (this engine prefills whole, in
        its own chunks, on the first call).

        The request is checked here first, as :class:`BatchedEngine.start_prefill` does, so a
        refused prompt naming a live session is refused before the step loop holds a job for it
        (the loop releases the session of a job that fails).

        Raises:
            InvalidArgument, ResourceExhausted: what :func:`check_prompt` raises; the session id
                is already live (``SESSION_EXISTS``).
        """
        check_prompt(session_id, prompt, feature_layers, self.cfg, self.max_context)
        if session_id in self.sessions:
            raise InvalidArgument(f"session {session_id!r} already exists", reason=Reason.SESSION_EXISTS)
        return PrefillJob(session_id, prompt, sampling, list(feature_layers))

    def run_prefill(self, job: "PrefillJob", budget: int) -> int:
        """Run ``job`` to the end (``budget`` is ignored); returns the prompt tokens processed."""
        job.outcome = self.prefill(job.session_id, job.prompt, job.sampling, job.feature_layers)
        return len(job.prompt)

    def release(self, session_ids: list[str]) -> int:
        """Drop sessions and free their slots; unknown ids are ignored. Returns how many were live."""
        with self._lock:
            n = 0
            for sid in session_ids:
                if self.sessions.pop(sid, None) is not None:
                    n += 1
            return n

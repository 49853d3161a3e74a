"""The public ``GenerationService``: validates requests, runs the speculative loop, streams text.

Status codes (docs/ARCHITECTURE.md, "Errors"): INVALID_ARGUMENT for an empty prompt, token ids outside the
vocabulary, bad sampling values or options; FAILED_PRECONDITION when the configured drafter was
built for another target; RESOURCE_EXHAUSTED when the target has no free slot or the prompt
does not fit; UNAVAILABLE when the target is down. A failing drafter is never an error: the
request continues autoregressively (a warning in the log and ``draft_fallbacks`` counted).
"""

from __future__ import annotations

import logging
import math
import time
import uuid

import grpc

from dflash_grpc.v1 import common_pb2, draft_pb2, generation_pb2, generation_pb2_grpc
from orchestrator import metrics
from orchestrator.detok import TextStream
from orchestrator.loop import DraftPlan, speculative_tokens
from orchestrator.peers import DraftPeer, ItemError, TargetPeer
from orchestrator.stats import AcceptanceStats, GlobalStats

log = logging.getLogger(__name__)

VERSION = "0.1.0"


class RequestError(Exception):
    """A request refused before generation starts."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Serves Generate / GetStats / Info over a target and an optional drafter.

    Args:
        target: the target service peer (its Info must be reachable at construction).
        draft: the draft service peer (may have no address).
        tokenizer: a ``GGUFTokenizer`` of the same model (its fingerprint must equal the target's).
        default_max_tokens: used when a request leaves ``max_tokens`` at 0.
        tree: default tree request (``budget``, ``top_k``, ``max_depth``).

    Raises:
        ValueError: the tokenizer does not match the target (fingerprints differ).
    """

    def __init__(self, target: TargetPeer, draft: DraftPeer, tokenizer, default_max_tokens: int = 256,
                 tree: draft_pb2.TreeParams | None = None, request_timeout: float | None = None):
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.target_info = target.info()
        if tokenizer.fingerprint != self.target_info.tokenizer_fingerprint:
            raise ValueError("the orchestrator's tokenizer does not match the target's (fingerprints differ)")
        self.default_max_tokens = default_max_tokens
        self.tree = tree or draft_pb2.TreeParams()
        self.request_timeout = request_timeout
        self.stats = GlobalStats()

    # ------------------------------------------------------------------ validation
    def _prompt_ids(self, req: generation_pb2.GenerateRequest) -> list[int]:
        which = req.WhichOneof("input")
        if which == "prompt":
            if not req.prompt:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True)
        elif which == "prompt_tokens":
            ids = list(req.prompt_tokens.ids)
            vocab = self.target_info.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"token id {bad[0]} outside the vocabulary [0, {vocab})")
        elif which == "chat":
            if not req.chat.messages:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "chat has no messages")
            messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.chat.add_generation_prompt)
            except Exception as e:  # template errors are the caller's (bad roles, ...) or the model's
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"chat template failed: {e}") from e
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no input: set prompt, prompt_tokens or chat")
        if not ids:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if len(ids) >= self.target_info.max_context:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"prompt of {len(ids)} tokens does not fit the context of {self.target_info.max_context}")
        return ids

    @staticmethod
    def _check_sampling(s: common_pb2.SamplingParams) -> None:
        if not (math.isfinite(s.temperature) and s.temperature >= 0):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"temperature must be finite and >= 0, got {s.temperature}")
        if s.top_k < 0:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"top_k must be >= 0, got {s.top_k}")
        if not (0.0 <= s.top_p <= 1.0):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"top_p must be in [0, 1], got {s.top_p}")

    def _plan(self, req: generation_pb2.GenerateRequest) -> DraftPlan:
        spec = req.speculative
        tree = draft_pb2.TreeParams()
        tree.CopyFrom(self.tree)
        for field, name in (("tree_budget", "budget"), ("top_k", "top_k"), ("max_depth", "max_depth")):
            if spec.HasField(field):
                value = getattr(spec, field)
                if value < 0:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"speculative.{field} must be >= 0, got {value}")
                setattr(tree, name, value)
        if spec.HasField("enabled") and not spec.enabled:
            return DraftPlan(None, tree)
        info = self.draft.state()
        if info is None:
            return DraftPlan(None, tree)
        if info.target_fingerprint != self.target_info.model_fingerprint:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the drafter at {self.draft.address} was built for target {info.target_fingerprint[:12]}, "
                f"not for the served target {self.target_info.model_fingerprint[:12]}; "
                "serve a matching drafter or disable speculation for this request",
            )
        if info.model.vocab_size != self.target_info.vocab_size:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "drafter vocabulary differs from the target's")
        return DraftPlan(info, tree)

    # ------------------------------------------------------------------ RPCs
    def Generate(self, request, context):
        t0 = time.monotonic()
        stats = AcceptanceStats(requests=1)
        try:
            self._check_sampling(request.sampling)
            if request.max_tokens < 0:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens must be >= 0, got {request.max_tokens}")
            prompt = self._prompt_ids(request)
            plan = self._plan(request)
        except RequestError as e:
            metrics.REQUESTS.labels(outcome=e.code.name).inc()
            context.abort(e.code, str(e))
        max_tokens = request.max_tokens or self.default_max_tokens
        stats.prompt_tokens = len(prompt)
        session_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        text = TextStream(self.tokenizer.decode, list(request.stop))
        eos = set() if request.ignore_eos else set(self.tokenizer.eos_token_ids)
        finish = generation_pb2.FINISH_REASON_LENGTH
        first = True
        gen = speculative_tokens(self.target, self.draft, plan, session_id, prompt, request.sampling, max_tokens,
                                 self.target_info, stats, timeout=self.request_timeout)
        try:
            for step in gen:
                if not context.is_active():
                    metrics.REQUESTS.labels(outcome="CANCELLED").inc()
                    return
                room = max_tokens - stats.generated_tokens
                new = step[:room]
                for i, tok in enumerate(new):
                    if tok in eos:
                        new = new[:i]
                        finish = generation_pb2.FINISH_REASON_EOS
                        break
                stats.generated_tokens += len(new)
                delta = text.push(new)
                if text.stopped:
                    finish = generation_pb2.FINISH_REASON_STOP
                done = finish != generation_pb2.FINISH_REASON_LENGTH or text.stopped or stats.generated_tokens >= max_tokens
                if delta or new or first:
                    yield generation_pb2.GenerateResponse(text=delta, token_ids=new, prompt_tokens=len(prompt) if first else 0)
                    first = False
                if done:
                    break
        except ItemError as e:
            if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "context full" in str(e):
                finish = generation_pb2.FINISH_REASON_CONTEXT
            else:
                metrics.REQUESTS.labels(outcome=e.code.name).inc()
                context.abort(e.code, f"target: {e}")
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                msg = f"target service: {e.details()}"
            else:
                msg = f"target service error: {e.details()}"
            metrics.REQUESTS.labels(outcome=code.name).inc()
            context.abort(code, msg)
        finally:
            gen.close()
        stats.wall_time_s = time.monotonic() - t0
        self.stats.add(stats)
        metrics.observe_request(stats)
        tail = text.finish()
        yield generation_pb2.GenerateResponse(text=tail, finished=True, finish_reason=finish, stats=stats.to_proto())

    def GetStats(self, request, context):
        return self.stats.snapshot()

    def Info(self, request, context):
        info = self.draft.state()
        status = generation_pb2.DrafterStatus(
            available=info is not None,
            compatible=info is not None and info.target_fingerprint == self.target_info.model_fingerprint,
            address=self.draft.address or "",
            detail=self.draft.detail,
        )
        if info is not None:
            status.model.CopyFrom(info.model)
        return generation_pb2.ServiceInfo(target=self.target_info, drafter=status, version=VERSION)

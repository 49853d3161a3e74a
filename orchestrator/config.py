"""The orchestrator's settings, each with its default once (``python -m orchestrator`` flags).

Imports no torch (nor does anything the orchestrator imports).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dflash_grpc.defaults import DEFAULT_HOST, ORCHESTRATOR_PORT
from dflash_grpc.transport import MAX_MESSAGE_BYTES
from runtime.config import setting


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig:
    """Settings of ``python -m orchestrator``; each field is the flag ``--<field-with-dashes>``.
    ``target`` has no default (``--target`` is required): an address, or :attr:`IN_PROCESS` to run
    the target service's engine in the orchestrator's process (:mod:`orchestrator.local_target`).

    Units: ``max_tokens`` in tokens; ``tree_budget`` and ``step_nodes`` in tree nodes (draft nodes,
    the root not counted, resp. verify nodes); ``draft_top_k`` in candidates per depth;
    ``max_depth`` in tree levels; ``max_sessions`` and ``max_queue`` in requests;
    ``step_timeout``, ``target_wait`` and ``shutdown_timeout`` in seconds; ``draft_deadline_min_ms`` and
    ``draft_deadline_ms`` in milliseconds, ``draft_deadline_row_us`` in microseconds per feature
    row; ``draft_deadline_factor`` in measured Propose round trips; ``draft_history_mib`` in MiB (2**20 bytes);
    ``max_prompt_chars`` in characters (Unicode code points); ``max_request_bytes`` in bytes.

    Defaults that depend on the target are 0 (auto) and decided by :meth:`resolved()` once the
    target's ``Info`` is known: ``step_nodes`` (:attr:`STEP_NODES_CUDA` on a CUDA target,
    :attr:`STEP_NODES_CPU` on a CPU one), ``max_sessions`` (the target's session slots,
    :attr:`FALLBACK_SESSIONS` if it reports none), ``max_prompt_chars``
    (:attr:`PROMPT_CHARS_PER_TOKEN` times the target's context) and ``max_request_bytes`` (4 bytes,
    UTF-8's most per character, times ``max_prompt_chars``, plus :attr:`REQUEST_BYTES_SLACK` for
    the other fields, at most 256 MiB). Defaults that depend on the drafter are decided when it is
    reached (:meth:`draft_deadline_for`): ``draft_deadline_ms`` and ``draft_deadline_row_us``
    (:attr:`DRAFT_DEADLINE_MS_CUDA`, :attr:`DRAFT_ROW_US_CUDA` for a CUDA drafter, the ``_CPU``
    ones for any other).

    Size limits are checked before any tokenizing, so a huge prompt is refused at once instead of
    stalling the server while it is tokenized (a 20 MB prompt took 22 s and 2.7 GB to be refused
    by its token count): a prompt, or a chat's roles and contents together, longer than
    ``max_prompt_chars`` is refused with RESOURCE_EXHAUSTED, reason PROMPT_TOO_LONG; a request
    message larger than ``max_request_bytes`` is refused by grpc itself (RESOURCE_EXHAUSTED, no
    reason) before it is decoded. Why 16 characters per token: a BPE token of text or code averages
    3 to 5 characters (this repository's Python: 3.3 with SmolLM2's tokenizer) and rarely passes 16,
    so a longer prompt would almost never fit the context anyway, and tokenizing 16 characters per
    token of an 8192-token context (131072) takes about 0.1 s. Only long runs of one character
    (SmolLM2: 64 spaces in one token) pack denser; raise ``max_prompt_chars`` for such input.

    The default tree, a DDTree of 15 draft nodes with 4 candidates per depth: with the root it
    fills the 16-wide verify bucket of the GPU engine (16 draft nodes pad to 32: tok/s 1.27x the
    chain vs 1.17x at qwen35 0.8B, benchmarks/gpu/RESULTS.md "Tree vs chain"); on the CPU a
    16-node tree ran 18.0 tokens/s vs 14.6 for the chain, 12.6 plain (benchmarks/tau-cpu.txt).
    """

    #: ``target`` value that runs the target in this process
    IN_PROCESS: ClassVar[str] = "in-process"
    #: ``step_nodes`` 0 resolves to this on a CUDA target ...
    STEP_NODES_CUDA: ClassVar[int] = 512
    #: ... and to this on any other
    STEP_NODES_CPU: ClassVar[int] = 64
    #: ``max_sessions`` when neither the flag nor the target's Info gives one
    FALLBACK_SESSIONS: ClassVar[int] = 8
    #: ``max_prompt_chars`` 0 resolves to this many characters per token of the target's context
    PROMPT_CHARS_PER_TOKEN: ClassVar[int] = 16
    #: bytes ``max_request_bytes`` 0 allows beyond 4 per prompt character (stop strings, roles, ...)
    REQUEST_BYTES_SLACK: ClassVar[int] = 1 << 20
    #: ``draft_deadline_ms`` 0 resolves to this for a CUDA drafter ...
    DRAFT_DEADLINE_MS_CUDA: ClassVar[int] = 500
    #: ... and to this for any other (CPU Propose round trips of the shipped drafter: 0.4 s median, 1.5 s with
    #: two torch threads on a busy 2-core machine)
    DRAFT_DEADLINE_MS_CPU: ClassVar[int] = 10000
    #: ``draft_deadline_row_us`` 0 resolves to this for a CUDA drafter ...
    DRAFT_ROW_US_CUDA: ClassVar[int] = 50
    #: ... and to this for any other (the shipped drafter appends about 1 ms per row on a busy 2-core CPU)
    DRAFT_ROW_US_CPU: ClassVar[int] = 2000

    target: str = setting(help="target service address host:port, or in-process: run the target in this process "
                               "(no gRPC between the orchestrator and the target; its flags: --target-args)")
    target_args: str = setting("", "with --target in-process: the target's flags (those of python -m target_service) "
                                   "as one string; its --model defaults to --model")
    draft: str | None = setting(None, "draft service address host:port (omit: autoregressive only)")
    local_hop: bool = setting(True, "reach the target and draft services over their Unix socket when they offer one on "
                                    "this host (docs/ARCHITECTURE.md, 'The same-host hop'); off: gRPC always")
    feature_ring: bool = setting(True, "ask the target to hand the drafter its feature rows through its feature ring "
                                       "(shared memory) when both are reached over the same-host hop, instead of "
                                       "through this process (docs/ARCHITECTURE.md, 'The feature ring')")
    grpc_server: str = setting(
        "aio", "the public gRPC server: aio (gRPC's asyncio server, each Generate stream a coroutine: about half the "
        "host time per streamed message) or threads (a thread per stream; docs/ARCHITECTURE.md, 'Serving many "
        "sessions')", choices=("aio", "threads"))
    model: str | None = setting(None, "target GGUF, read for its tokenizer and chat template (default: the default model)")
    host: str = setting(DEFAULT_HOST, "interface to listen on")
    port: int = setting(ORCHESTRATOR_PORT, "port to listen on (0 picks a free one)")
    max_tokens: int = setting(256, "default max_tokens of a request")
    tree_budget: int = setting(
        15, "default draft tree budget (0: chain); 15 draft nodes + the root fill the 16-wide verify bucket")
    draft_top_k: int = setting(4, "default candidates per depth (1: chain)")
    max_depth: int = setting(0, "default draft depth (0: block_size - 1)")
    max_sessions: int = setting(0, "most requests decoding at once (0: the target's session slots)")
    max_queue: int = setting(256, "most requests waiting for a session; beyond it RESOURCE_EXHAUSTED at once")
    step_nodes: int = setting(
        0, f"verify nodes per tick shared by the batch: trees shrink as the batch grows "
        f"(0: {STEP_NODES_CUDA} on a CUDA target, {STEP_NODES_CPU} on a CPU one)")
    draft_policy: str = setting(
        "always", "when a tick drafts: always (whenever the drafter is up) or measured (when drafting emits more "
        "tokens per second than plain decoding at that batch size, as measured, and a request starting where plain "
        "ticks measured faster decodes plainly for its life; experimental: on the GPU it has not yet beaten always, "
        "docs/ARCHITECTURE.md, 'When to draft')", choices=("always", "measured"))
    step_timeout: float = setting(120.0, "seconds a Verify may take before the target counts as failed (and the most a "
                                         "Propose may take, past its own deadline)")
    draft_deadline_factor: float = setting(
        4.0, "a Propose may take this many times the drafter's measured round trip (moving average) before the "
        "tick goes on without trees and the drafter's circuit opens (0: no drafter deadline but the step timeout)")
    draft_deadline_min_ms: float = setting(50.0, "least Propose deadline (ms)")
    draft_deadline_ms: float = setting(
        0.0, "most Propose deadline (ms), and the deadline before a round trip is measured "
        f"(0: {DRAFT_DEADLINE_MS_CUDA:g} for a CUDA drafter, {DRAFT_DEADLINE_MS_CPU:g} for a CPU one)")
    draft_deadline_row_us: float = setting(
        0.0, "more Propose deadline per feature row of a new or recreated drafter session (a prompt or recomputed rows), "
        "and the least deadline per row the drafter holds for the asked sessions (a miss recomputes them all; at most "
        "--draft-deadline-ms) "
        f"(us; 0: {DRAFT_ROW_US_CUDA:g} for a CUDA drafter, {DRAFT_ROW_US_CPU:g} for a CPU one)")
    stream_interval_ms: float = setting(
        0.0, "most milliseconds a request's tokens wait to be streamed: tokens of the ticks within this interval go "
        "out as one message (its first token and its end at once). Each message costs the orchestrator tens of "
        "microseconds of host time, so under many streams a few milliseconds here cut its host time per token "
        "several fold (tools/host_per_item.py); 0: every tick's tokens at once")
    stream_hold_max_ms: float = setting(
        50.0, "most milliseconds the adaptive hold keeps a request's tokens back: with several requests in a tick, "
        "tokens are held as with stream_interval_ms, long enough that streaming takes at most stream_host_share of a "
        "core (each message's cost measured), so under many streams fast ticks go out as fewer messages; one stream, "
        "or ticks slower than the hold, stream every tick (0: never hold)")
    stream_host_share: float = setting(
        0.25, "share of one core the orchestrator's Generate messages may take before the adaptive hold "
        "(stream_hold_max_ms) coalesces ticks (0: never hold)")
    draft_history_mib: float = setting(
        64.0, "most feature rows kept per request for a drafter session that has not had them yet (MiB); past it the "
              "session is re-created later from rows the target recomputes")
    max_prompt_chars: int = setting(
        0, "most characters of a prompt, or of a chat's roles and contents together, checked before "
        f"tokenizing; beyond: RESOURCE_EXHAUSTED, reason PROMPT_TOO_LONG (0: {PROMPT_CHARS_PER_TOKEN} per token "
        "of the target's context)")
    max_request_bytes: int = setting(
        0, "most bytes of a GenerateRequest message; grpc refuses a larger one (RESOURCE_EXHAUSTED) before "
        "decoding it (0: 4 x max_prompt_chars + 1 MiB, at most 256 MiB)")
    target_wait: float = setting(120.0, "seconds to wait for the target at start")
    instance_name: str | None = setting(
        None, "this orchestrator's name to the target and draft services (dflash-owner metadata): keep it across "
        "restarts, so that a restart frees its predecessor's sessions at once (default: orchestrator@<host>:<port>)")
    shutdown_timeout: float = setting(
        30.0, "on SIGTERM: admit no new request, let running and queued ones finish for this long at most, then "
        "end them UNAVAILABLE (SHUTTING_DOWN), release every session and exit", metavar="SECONDS")
    metrics_port: int = setting(0, "Prometheus metrics HTTP port (0: off)")
    http_port: int = setting(
        0, "OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) on "
        "--host, with the gRPC TLS flags' certificate (0: off)")
    api_key_file: str | None = setting(
        None, "with --http-port: file holding the API key every /v1/ call must send ('Authorization: Bearer <key>'; "
        "a file only its owner may read, chmod 600; default: $DFLASH_API_KEY if set, else no key)", metavar="PATH")
    served_model_name: str | None = setting(
        None, "with --http-port: the model id of /v1/models and requests (default: the target's model name)")
    max_workers: int | None = setting(
        None, "most Generate streams open at once (default: max sessions + max queue + 16; more: RESOURCE_EXHAUSTED, "
        "STREAMS_BUSY): with --grpc-server threads the gRPC worker threads (one per stream; 8 more are kept for unary "
        "calls), with aio also the threads that check and tokenize new requests (at most 32)")
    log_level: str | None = setting(None, "log level (default WARNING, or $DFLASH_LOG_LEVEL)")

    @classmethod
    def auto_step_nodes(cls, target_device: str) -> int:
        """``step_nodes`` 0 decided for a target on ``target_device`` (its ``ModelInfo.device``)."""
        return cls.STEP_NODES_CUDA if str(target_device).startswith("cuda") else cls.STEP_NODES_CPU

    @classmethod
    def draft_deadline_for(cls, drafter_device: str, max_ms: float = 0.0, row_us: float = 0.0) -> tuple[float, float]:
        """``(draft_deadline_ms, draft_deadline_row_us)`` for a drafter on ``drafter_device`` (its
        ``ModelInfo.device``): ``max_ms`` and ``row_us``, each of them 0 decided by the device
        (:attr:`DRAFT_DEADLINE_MS_CUDA` / :attr:`DRAFT_ROW_US_CUDA` on CUDA, the ``_CPU`` ones
        otherwise). Resolved when the drafter is reached, not at start: it may be reached later."""
        cuda = str(drafter_device).startswith("cuda")
        return (max_ms or (cls.DRAFT_DEADLINE_MS_CUDA if cuda else cls.DRAFT_DEADLINE_MS_CPU),
                row_us or (cls.DRAFT_ROW_US_CUDA if cuda else cls.DRAFT_ROW_US_CPU))

    @classmethod
    def sessions_for(cls, requested: int, target_slots: int) -> int:
        """Requests decoding at once: ``requested`` (0: all of the target's ``target_slots``), never
        more than the target holds; :attr:`FALLBACK_SESSIONS` when neither is known."""
        return min(requested or target_slots, target_slots or requested or cls.FALLBACK_SESSIONS) or cls.FALLBACK_SESSIONS

    @classmethod
    def prompt_chars_for(cls, requested: int, target_context: int) -> int:
        """``max_prompt_chars``: ``requested``, or (0) :attr:`PROMPT_CHARS_PER_TOKEN` times the
        target's ``target_context`` (tokens; 0 if unknown: the 256 MiB message's characters)."""
        if requested > 0:
            return requested
        return cls.PROMPT_CHARS_PER_TOKEN * target_context if target_context > 0 else MAX_MESSAGE_BYTES

    @classmethod
    def request_bytes_for(cls, requested: int, prompt_chars: int) -> int:
        """``max_request_bytes``: ``requested``, or (0) 4 bytes per character of ``prompt_chars``
        plus :attr:`REQUEST_BYTES_SLACK`; never more than ``MAX_MESSAGE_BYTES`` (256 MiB)."""
        wanted = requested if requested > 0 else 4 * prompt_chars + cls.REQUEST_BYTES_SLACK
        return min(wanted, MAX_MESSAGE_BYTES)

    @property
    def history_bytes(self) -> int:
        """``draft_history_mib`` in bytes."""
        return int(self.draft_history_mib * (1 << 20))

    def resolved(self, target_device: str, target_slots: int, target_context: int = 0) -> OrchestratorConfig:
        """This config with its auto (0) values decided for a target on ``target_device`` holding
        ``target_slots`` sessions of ``target_context`` tokens (its ``ModelInfo``): ``step_nodes``,
        ``max_sessions``, ``max_prompt_chars`` and ``max_request_bytes``."""
        chars = self.prompt_chars_for(self.max_prompt_chars, target_context)
        return dataclasses.replace(self, step_nodes=self.step_nodes or self.auto_step_nodes(target_device),
                                   max_sessions=self.sessions_for(self.max_sessions, target_slots),
                                   max_prompt_chars=chars,
                                   max_request_bytes=self.request_bytes_for(self.max_request_bytes, chars))

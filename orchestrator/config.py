"""The orchestrator's settings, each with its default once (``python -m orchestrator`` flags).

Imports no torch (nor does anything the orchestrator imports).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dflash_grpc.defaults import DEFAULT_HOST, ORCHESTRATOR_PORT
from runtime.config import setting


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig:
    """Settings of ``python -m orchestrator``; each field is the flag ``--<field-with-dashes>``.
    ``target`` has no default (``--target`` is required).

    Units: ``max_tokens`` in tokens; ``tree_budget`` and ``step_nodes`` in tree nodes (draft nodes,
    the root not counted, resp. verify nodes); ``draft_top_k`` in candidates per depth;
    ``max_depth`` in tree levels; ``max_sessions`` and ``max_queue`` in requests;
    ``step_timeout`` and ``target_wait`` in seconds; ``draft_history_mib`` in MiB (2**20 bytes).

    Defaults that depend on the target are 0 (auto) and decided by :meth:`resolved()` once the
    target's ``Info`` is known: ``step_nodes`` (:attr:`STEP_NODES_CUDA` on a CUDA target,
    :attr:`STEP_NODES_CPU` on a CPU one) and ``max_sessions`` (the target's session slots,
    :attr:`FALLBACK_SESSIONS` if it reports none).

    The default tree, a DDTree of 15 draft nodes with 4 candidates per depth: with the root it
    fills the 16-wide verify bucket of the GPU engine (16 draft nodes pad to 32: tok/s 1.27x the
    chain vs 1.17x at qwen35 0.8B, benchmarks/gpu/RESULTS.md "Tree vs chain"); on the CPU a
    16-node tree ran 18.0 tokens/s vs 14.6 for the chain, 12.6 plain (benchmarks/tau-cpu.txt).
    """

    #: ``step_nodes`` 0 resolves to this on a CUDA target ...
    STEP_NODES_CUDA: ClassVar[int] = 512
    #: ... and to this on any other
    STEP_NODES_CPU: ClassVar[int] = 64
    #: ``max_sessions`` when neither the flag nor the target's Info gives one
    FALLBACK_SESSIONS: ClassVar[int] = 8

    target: str = setting(help="target service address host:port")
    draft: str | None = setting(None, "draft service address host:port (omit: autoregressive only)")
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
    step_timeout: float = setting(120.0, "seconds a Propose or Verify may take before the peer counts as failed")
    draft_history_mib: float = setting(
        64.0, "feature history kept per request to resume drafting after a drafter restart (MiB)")
    target_wait: float = setting(120.0, "seconds to wait for the target at start")
    metrics_port: int = setting(0, "Prometheus metrics HTTP port (0: off)")
    max_workers: int | None = setting(
        None, "gRPC worker threads (one per open Generate stream; default: max sessions + max queue + 16); "
        "8 more are kept for unary calls")
    log_level: str | None = setting(None, "log level (default WARNING, or $DFLASH_LOG_LEVEL)")

    @classmethod
    def auto_step_nodes(cls, target_device: str) -> int:
        """``step_nodes`` 0 decided for a target on ``target_device`` (its ``ModelInfo.device``)."""
        return cls.STEP_NODES_CUDA if str(target_device).startswith("cuda") else cls.STEP_NODES_CPU

    @classmethod
    def sessions_for(cls, requested: int, target_slots: int) -> int:
        """Requests decoding at once: ``requested`` (0: all of the target's ``target_slots``), never
        more than the target holds; :attr:`FALLBACK_SESSIONS` when neither is known."""
        return min(requested or target_slots, target_slots or requested or cls.FALLBACK_SESSIONS) or cls.FALLBACK_SESSIONS

    @property
    def history_bytes(self) -> int:
        """``draft_history_mib`` in bytes."""
        return int(self.draft_history_mib * (1 << 20))

    def resolved(self, target_device: str, target_slots: int) -> OrchestratorConfig:
        """This config with its auto (0) values decided for a target on ``target_device`` holding
        ``target_slots`` sessions (its ``ModelInfo``): ``step_nodes`` and ``max_sessions``."""
        return dataclasses.replace(self, step_nodes=self.step_nodes or self.auto_step_nodes(target_device),
                                   max_sessions=self.sessions_for(self.max_sessions, target_slots))

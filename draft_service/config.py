"""The draft service's settings, each with its default once (``python -m draft_service`` flags).

Imports no torch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dflash_grpc.defaults import DEFAULT_HOST, DRAFT_PORT
from runtime.config import session_lifetime_settings, setting


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Settings of ``python -m draft_service``; each field is the flag ``--<field-with-dashes>``
    (``cuda_graphs``: ``--no-cuda-graphs``, ``fused_step``: ``--no-fused-step``).

    Units: ``max_context`` and ``prefill_chunk`` in rows (tokens) per session; ``max_top_k`` in
    candidates per tree depth; ``gpu_memory_bytes`` in bytes; ``batch_buckets`` in sessions;
    ``session_idle_timeout``, ``lease_s`` and ``shutdown_timeout`` in seconds.

    Device-dependent defaults are ``auto`` / ``None``: :meth:`resolved()` decides ``dtype`` (bf16 on
    CUDA, f32 on the CPU), ``engine`` (batched on CUDA, reference on the CPU) and ``weights`` (bf16); ``max_context``
    None is the target's context length, which the batched engine (its pool is allocated at start)
    caps at :attr:`BATCHED_CONTEXT_CAP`; ``batch_buckets`` None follows the session slots granted
    (:func:`runtime.config.batch_buckets_for`).
    """

    #: the batched engine's ``max_context`` when ``max_context`` is None: at most this many rows
    BATCHED_CONTEXT_CAP: ClassVar[int] = 4096
    #: accepted ``dtype`` values
    DTYPES: ClassVar[tuple[str, ...]] = ("auto", "f32", "f16", "bf16")
    #: accepted ``engine`` values
    ENGINES: ClassVar[tuple[str, ...]] = ("auto", "batched", "reference")
    #: accepted ``weights`` values
    WEIGHTS: ClassVar[tuple[str, ...]] = ("auto", "bf16", "quantized")

    drafter: str | None = setting(None, "drafter GGUF or z-lab checkpoint directory (default: the default drafter of the target)")
    target: str | None = setting(None, "target GGUF the drafter was built for (default: the default model)")
    host: str = setting(DEFAULT_HOST, "interface to listen on")
    port: int = setting(DRAFT_PORT, "port to listen on (0 picks a free one)")
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str = setting("auto", "auto: f32 on CPU, bf16 on CUDA", choices=DTYPES)
    engine: str = setting(
        "auto", "auto: the batched engine (context pool, CUDA graphs) on CUDA, the per-session reference on the CPU",
        choices=ENGINES)
    weights: str = setting(
        "auto", "the target's embedding and LM head the drafter borrows: quantized keeps a GGUF block type the kernels "
        "read (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) as blocks on the device (no float copy of the vocabulary table), bf16 "
        "dequantizes them to --dtype at load (auto: bf16, as the target's --weights)", choices=WEIGHTS)
    local_hop: bool = setting(True, "also serve Propose on a Unix socket for an orchestrator on this host (the same checks: "
                                    "docs/ARCHITECTURE.md, 'The same-host hop')")
    feature_ring: bool = setting(True, "read the feature rows a target on this host names in its feature ring (off: such "
                                       "items are refused RING_UNAVAILABLE and the orchestrator sends the rows; "
                                       "docs/ARCHITECTURE.md, 'The feature ring')")
    cuda_graphs: bool = setting(True, "batched engine: capture the steps as CUDA graphs (off: run them eagerly)")
    fused_step: bool = setting(True, "batched engine on CUDA: run the step on the fused kernels "
                                     "(off: its plain-PyTorch reference, for bisecting a numerical difference)")
    gpu_memory_bytes: int | None = setting(
        None, "batched engine: bytes for the context pool (fewer session slots if it holds fewer than --max-sessions)")
    batch_buckets: tuple[int, ...] | None = setting(
        None, "batched engine: batch sizes steps are padded to (default: the powers of two below the session slots, "
        "then the slot count: 1,2,4,...,64 for 64 slots, ...,128,256 for 256)")
    max_top_k: int = setting(8, "batched engine: candidates per depth in the step's top-K table "
                                "(larger top_k requests are cut to it)")
    prefill_chunk: int = setting(512, "batched engine: most context rows per eager append (the rows beyond what one step carries)")
    max_sessions: int = setting(
        64, "most concurrent sessions (the batched engine may hold fewer: --gpu-memory-bytes; logged, and Info reports "
        "the real number); give the target's --max-sessions to draft for every session (the orchestrator decodes "
        "the requests beyond the drafter's sessions plainly)")
    max_context: int | None = setting(
        None, f"rows per session (default: the target's context length; the batched engine caps that default "
        f"at {BATCHED_CONTEXT_CAP})")
    max_workers: int | None = setting(
        None, "gRPC worker threads for streams (one per open Propose stream; default: session slots + 16); "
        "8 more are kept for unary calls")
    session_idle_timeout: float
    lease_s: float
    shutdown_timeout: float
    session_idle_timeout, lease_s, shutdown_timeout = session_lifetime_settings()
    metrics_port: int = setting(0, "Prometheus metrics HTTP port on --host: step time, batch size, pool use (0: off)")
    log_level: str | None = setting(None, "log level (default WARNING, or $DFLASH_LOG_LEVEL)")

    def resolved(self, device: str | None = None) -> DraftConfig:
        """This config with ``dtype``, ``engine`` and ``weights`` decided for ``device`` (default:
        ``self.device``)."""
        cuda = str(device or self.device).startswith("cuda")
        return dataclasses.replace(
            self,
            dtype=("bf16" if cuda else "f32") if self.dtype == "auto" else self.dtype,
            engine=("batched" if cuda else "reference") if self.engine == "auto" else self.engine,
            weights="bf16" if self.weights == "auto" else self.weights,
        )

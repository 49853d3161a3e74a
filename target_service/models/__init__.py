"""Target model definitions, one module per GGUF architecture, and the loader that picks one.

Every model has the same interface: ``cfg`` (with ``vocab_size``, ``hidden_size``,
``num_layers``, ``context_length``), ``device``, ``new_cache(max_length)`` (an object with
``length`` and ``reset()``), ``forward(tokens, positions, mask, cache, feature_layers,
logits_rows, parents)`` that writes nothing, and ``commit(cache, out, rows)``.
"""

from __future__ import annotations

import torch

from runtime.gguf_loader import GGUFError, GGUFFile, open_gguf

#: GGUF ``general.architecture`` values the target service runs.
ARCHITECTURES = ("llama", "qwen3", "qwen3moe", "qwen35")


def load_model(g: GGUFFile | str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, progress: bool = False,
               weights: str = "bf16"):
    """Load the model of a GGUF file (``LlamaModel`` for ``llama``, ``qwen3`` and ``qwen3moe``,
    ``Qwen35Model``).

    ``weights`` (:data:`target_service.models.weights.WEIGHT_MODES`): ``bf16`` dequantizes every
    tensor to ``dtype`` at load; ``quantized`` keeps the block-quantized projection, embedding and
    LM head tensors of the supported types as GGUF blocks on ``device``; ``auto`` is bf16 for now
    (:func:`~target_service.models.weights.resolve_weights`).

    Raises:
        GGUFError: an architecture not in :data:`ARCHITECTURES`, a DFlash drafter file (its
            architecture is ``qwen3`` too), or a malformed file.
        ValueError: an unknown ``weights`` mode.
    """
    from target_service.models.weights import resolve_weights

    quantized = resolve_weights(weights, device) == "quantized"
    if not isinstance(g, GGUFFile):
        g = open_gguf(g)
    if g.get("{arch}.dflash.block_size") is not None:
        raise GGUFError(f"{g.path} is a DFlash drafter, not a target model")
    if g.architecture in ("llama", "qwen3", "qwen3moe"):
        from target_service.models.llama import LlamaModel

        return LlamaModel.from_gguf(g, device=device, dtype=dtype, progress=progress, quantized=quantized)
    if g.architecture == "qwen35":
        from target_service.models.qwen35 import Qwen35Model

        return Qwen35Model.from_gguf(g, device=device, dtype=dtype, progress=progress, quantized=quantized)
    raise GGUFError(f"architecture {g.architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

"""How a target model's weights are held: dequantized at load (``bf16``: the model's dtype, the
reference path) or, for GGUF block-quantized tensors, kept as the file's blocks on the device
(``quantized``: :class:`kernels.quant.QuantizedWeight`, read by the fused dequantize-matmul;
docs/ARCHITECTURE.md, "Weights").

* :data:`WEIGHT_MODES`, :func:`resolve_weights`: the ``--weights`` choice (``auto``: dequantized,
  until the quantized path has run on a GPU; ``quantized`` is opt-in).
* :func:`load_weights`: a model's tensors from a GGUF file in either form, one warning naming the
  quantized types that had to be dequantized.
* :func:`place`, :func:`pack_rows`, :func:`permute_rows`: move, stack and permute rows of a weight
  of either form (the models' packed ``qkv`` / ``gate_up`` and llama's rotary un-permutation).
* :func:`weight_bytes`: the bytes a loaded model's weights hold (the benchmark's memory table and
  the service's load log).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch

from kernels.quant import PackedWeight, QuantizedWeight, pack_rows, weight_nbytes
from runtime.gguf_loader import FLOAT_TYPES, GGUFFile

log = logging.getLogger(__name__)

#: accepted ``--weights`` values
WEIGHT_MODES = ("auto", "bf16", "quantized")

__all__ = ["FLOAT_TYPES", "WEIGHT_MODES", "load_weights", "pack_rows", "permute_rows", "place", "resolve_weights",
           "weight_bytes"]


def resolve_weights(mode: str, device: "str | torch.device") -> str:
    """``"bf16"`` (dequantize at load to the model dtype) or ``"quantized"`` for ``mode`` on
    ``device``: ``auto`` is bf16 on every device for now (the quantized CUDA path, tested on the
    CPU under the Triton interpreter, has not run on a GPU yet: issue 19); ``quantized`` is opt-in.

    Raises:
        ValueError: ``mode`` not in :data:`WEIGHT_MODES`.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {mode!r}")
    if mode == "auto":
        return "bf16"
    return mode


def load_weights(g: GGUFFile, names: Iterable[str], dtype: torch.dtype, device: "str | torch.device",
                 quantized: bool, keep_quantized: Callable[[str], bool],
                 float32: Callable[[str], bool] = lambda name: False,
                 progress: bool = False) -> dict[str, "torch.Tensor | QuantizedWeight"]:
    """Tensors ``names`` of ``g``: name -> tensor (PyTorch order) or :class:`QuantizedWeight`.

    With ``quantized``, a tensor ``keep_quantized(name)`` accepts that is stored in one of
    :data:`kernels.quant.QTYPES` is copied to ``device`` as its blocks (no float copy is made);
    every other tensor is dequantized as :meth:`GGUFFile.load_tensor` does, to float32 where
    ``float32(name)``, else to ``dtype``. One warning names the block-quantized types of the
    tensors ``keep_quantized`` accepts that were dequantized although ``quantized`` was asked
    (types the kernels do not read, such as Q2_K, Q3_K, the IQ and TQ types). Without
    ``quantized``: every tensor dequantized, as before.

    Raises:
        GGUFError: a tensor is missing or unreadable.
    """
    names = list(names)
    it = names
    if progress:
        from tqdm import tqdm

        it = tqdm(names, desc="loading target", unit="tensor", leave=False)
    out: dict = {}
    fallback: set[str] = set()
    for name in it:
        keep = quantized and keep_quantized(name)
        w = out[name] = g.load_weight(name, torch.float32 if float32(name) else dtype, device, keep)
        if keep and not isinstance(w, QuantizedWeight):
            t = g.tensor_info(name).type_name
            if t not in FLOAT_TYPES:
                fallback.add(t)
    if fallback:
        log.warning("GGUF types %s have no quantized kernel: dequantized at load", ", ".join(sorted(fallback)),
                    extra={"types": sorted(fallback), "model": g.path})
    return out


def place(w: "torch.Tensor | QuantizedWeight", device: torch.device, dtype: torch.dtype) -> "torch.Tensor | QuantizedWeight":
    """A float tensor moved to ``device`` / ``dtype`` and made contiguous; a quantized weight moved
    to ``device`` (its bytes are never cast)."""
    if isinstance(w, (QuantizedWeight, PackedWeight)):
        return w.to(device)
    return w.to(device=device, dtype=dtype).contiguous()


def permute_rows(w: "torch.Tensor | QuantizedWeight", fn: Callable[[torch.Tensor], torch.Tensor]) -> "torch.Tensor | QuantizedWeight":
    """``fn`` (a permutation of the rows of a 2-D tensor, such as llama's rotary un-permutation)
    applied to a weight: to the tensor, or to a quantized weight's byte rows (a row of ``[N, K]``
    is a row of blocks, so permuting output features permutes byte rows)."""
    if isinstance(w, QuantizedWeight):
        return QuantizedWeight(fn(w.data).contiguous(), w.qtype, w.shape)
    return fn(w)


def weight_bytes(model) -> int:
    """Bytes held by a loaded model's weights (``embed``, ``lm_head``, ``norm`` and every layer
    dict's values), each object once (a tied LM head is the embedding): float tensors by
    ``numel * element_size``, quantized and packed weights by their bytes."""
    return sum(weight_nbytes(t) for t in model_weights(model))


def model_weights(model) -> list:
    """The weights of a loaded model, each object once (see :func:`weight_bytes`)."""
    seen, out = set(), []
    for t in [model.embed, model.lm_head, model.norm] + [x for lw in model.layers for x in lw.values()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out

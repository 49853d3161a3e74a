"""A Hugging Face target model as a source of drafter training features: the outputs of chosen
decoder layers for every row of a batch of sequences (the oracle that the project's own target
engine is compared with in the tests).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class _StopForward(Exception):
    """Raised by the hook of the deepest tapped layer: the rest of the target is not needed."""


def hf_decoder_layers(model: Any) -> Any:
    """The list of decoder layers of a Hugging Face causal LM (``model.model.layers``)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


@torch.no_grad()
def hf_features(model: Any, sequences: Sequence[torch.Tensor], layer_ids: Sequence[int], pad_token_id: int = 0) -> list[torch.Tensor]:
    """Outputs of target layers ``layer_ids`` (residual stream after each layer, 0-based,
    concatenated in ``layer_ids`` order) for every row of each sequence.

    The sequences run as one right-padded batch through a Hugging Face model; forward hooks on the
    decoder layers collect the outputs and the forward stops after the deepest tapped layer (HF's
    ``hidden_states[i + 1]`` is the same for ``i < L - 1``, but its last entry has the final norm
    applied).

    Returns:
        per sequence ``[n_i, N*H]`` in the model's dtype, on its device.
    """
    layers = hf_decoder_layers(model)
    device = next(model.parameters()).device
    want = sorted(set(int(i) for i in layer_ids))
    last = want[-1]
    width = max(int(s.numel()) for s in sequences)
    ids = torch.full((len(sequences), width), int(pad_token_id), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for r, s in enumerate(sequences):
        ids[r, : s.numel()] = s.cpu()
        mask[r, : s.numel()] = 1
    got: dict[int, torch.Tensor] = {}

    def hook(i: int):
        def fn(_module, _inputs, output):
            got[i] = output[0] if isinstance(output, (tuple, list)) else output
            if i == last:
                raise _StopForward

        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in want]
    try:
        inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        inner(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    feats = torch.cat([got[i] for i in layer_ids], dim=-1)  # [S, T, N*H]
    return [feats[r, : s.numel()] for r, s in enumerate(sequences)]

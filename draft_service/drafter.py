"""The DFlash block-diffusion drafter in plain PyTorch (CPU or CUDA, any float dtype).

Source of the formulas: "DFlash: Block Diffusion for Flash Speculative Decoding" and its reference
code (z-lab/dflash, ``Qwen3DFlashAttention`` / ``Qwen3DFlashDecoderLayer`` / ``DFlashDraftModel``).

Model (``L`` decoder layers, Qwen3 style, hidden size ``H`` = the target's)::

    ctx   = hidden_norm(fc(features))                   features [n, N*H]: outputs of N target layers
    x     = target_embedding([root, MASK, ..., MASK])   [B, H]   positions P..P+B-1
    for each layer:
        h      = attn_norm(x)
        q      = rope(q_norm(heads(h @ Wq^T)))          [nh, B, D]    (block rows only)
        K, V   = [rope(k_norm(heads(ctx @ Wk^T))) ; rope(k_norm(heads(h @ Wk^T)))]   context then block
                 [heads(ctx @ Wv^T) ; heads(h @ Wv^T)]                [nkv, n+B, D]
        a      = softmax(q K^T / sqrt(D)) V             no causal mask: every block row sees every
                                                        context row and every block row (a sliding
                                                        layer: only keys within its window)
        x      = x + a @ Wo^T
        x      = x + down(silu(gate(ffn_norm(x))) * up(ffn_norm(x)))
    logits = output_norm(x) @ target_lm_head^T          [B, V]; row d (d >= 1) predicts position P+d

* RMSNorm: ``x / sqrt(mean(x^2) + eps) * w`` (computed in float32, weight applied in the model dtype,
  as ``Qwen3RMSNorm``); ``q_norm`` / ``k_norm`` are per head over ``head_dim``.
* RoPE: NeoX style (``rotate_half``) over the whole ``head_dim``, ``inv_freq = theta^(-2i/D)``, at the
  absolute position of each row (context row ``j`` is position ``j``; the block starts at ``P`` =
  number of context rows, the target's committed length).
* Sliding layers (``DrafterConfig.layer_types[i] == "sliding_attention"``, window ``W`` =
  ``DrafterConfig.sliding_window``): the block query at position ``p`` sees the key at position
  ``j`` only when ``|p - j| <= W - 1`` (:func:`window_visible`: flash-attn's non-causal
  ``window_size = (W-1, W-1)``, what z-lab's reference runs under flash-attention 2). The
  context rows are all kept (cache and pool); the window is a mask. Full layers see everything.
* GQA: query head ``h`` uses kv head ``h // (nh / nkv)`` (``repeat_kv``).
* The context K/V of a row depend on that row only (fc, hidden_norm, k/v projections, k_norm, RoPE
  are per row), so they are computed once per session and cached (:class:`DrafterContext`): the
  cached path (:meth:`DFlashDrafter.append_context` + :meth:`DFlashDrafter.block_logits`) and the
  uncached one (:meth:`DFlashDrafter.forward_block`) run the same functions
  (``_context_kv``, ``_layer``, ``_attention``). The pooled GPU engine
  (:class:`draft_service.batched.BatchedDrafter`) runs them too (``context_rows``,
  ``_context_kv``, ``run_blocks`` / ``_layer``), with attention over its context pool
  (``kernels.attention.pool_attention``) as the layer's attention backend instead of
  :meth:`DFlashDrafter._attention`.
* The drafter has no embedding or LM head of its own: it borrows the target's ``token_embd.weight``
  and ``output.weight`` (``token_embd.weight`` when tied), read from the target GGUF. Both are
  buffers (frozen), not parameters.
* Attention scores, softmax and the weighted sum, RMSNorm statistics and RoPE run in float32
  whatever the model dtype (float64 for a float64 model, used as a test oracle).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels.norm.reference import rms_norm
from kernels.quant import QuantizedWeight, embedding
from kernels.rope.reference import apply_rope, rope_cos_sin

logger = logging.getLogger(__name__)

#: Default number of draft layers, block size and number of target layers tapped.
DEFAULT_NUM_LAYERS = 2
DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_TARGET_LAYERS = 5

#: An attention backend of :meth:`DFlashDrafter._layer`: ``(q [nb, nh, B, D], k_blk [nb, nkv, B, D],
#: v_blk [nb, nkv, B, D]) -> [nb, B, nh * D]`` in ``q``'s dtype.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: ``DrafterConfig.layer_types`` values (z-lab / transformers ``layer_types``).
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

# GGUF tokenizer token types (llama.cpp ``llama_token_type``).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_UNUSED = 5


class DrafterError(ValueError):
    """A drafter file or config is inconsistent, or does not belong to the given target."""


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DrafterConfig:
    """Shape and metadata of a DFlash drafter.

    Attributes:
        hidden_size: ``H``, equal to the target's embedding length.
        num_layers: draft decoder layers.
        num_heads, num_kv_heads, head_dim: attention shape (``num_heads % num_kv_heads == 0``,
            ``head_dim`` even).
        intermediate_size: SwiGLU width.
        rms_eps: RMSNorm epsilon.
        rope_theta: RoPE base frequency.
        block_size: ``B``: the block is ``[root, MASK x (B-1)]``; ``B-1`` draft positions.
        target_layer_ids: the ``N`` target layers whose outputs (residual stream after the layer,
            0-based) form the context features, in feature order.
        mask_token_id: target token id used as MASK.
        vocab_size: target vocabulary size (rows of its embedding / LM head).
        target_fingerprint: :func:`runtime.fingerprint.model_fingerprint` of the target.
        target_architecture: the target's ``general.architecture``.
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"`` (z-lab's
            ``layer_types``); empty = every layer full. Kept normalised: empty unless some layer
            slides (:meth:`validate`).
        sliding_window: ``W``, the window of the sliding layers in tokens (> 0 when a layer
            slides, else 0). A sliding layer's block query at position ``p`` sees key position
            ``j`` only when ``|p - j| <= W - 1`` (flash-attn ``window_size = (W-1, W-1)``,
            non-causal, as transformers passes ``sliding_window`` to flash-attn; see
            :func:`window_visible` and docs/ARCHITECTURE.md, "Sliding-window drafter layers").
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    vocab_size: int
    target_fingerprint: str = ""
    target_architecture: str = ""
    layer_types: list[str] = dataclasses.field(default_factory=list)
    sliding_window: int = 0

    def layer_window(self, i: int) -> int:
        """The attention window of layer ``i`` in tokens: :attr:`sliding_window` for a sliding
        layer, 0 (none: full attention) otherwise."""
        return self.sliding_window if self.layer_types and self.layer_types[i] == SLIDING else 0

    @property
    def layer_windows(self) -> list[int]:
        """:meth:`layer_window` of every layer."""
        return [self.layer_window(i) for i in range(self.num_layers)]

    @property
    def num_target_layers(self) -> int:
        """``N``, the number of target layers tapped."""
        return len(self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of one context feature row: ``N * H``."""
        return len(self.target_layer_ids) * self.hidden_size

    def validate(self) -> "DrafterConfig":
        """Check the fields are consistent; returns ``self``.

        Raises:
            DrafterError: a field is out of range.
        """
        checks = [
            (self.hidden_size > 0, "hidden_size > 0"),
            (self.num_layers >= 1, "num_layers >= 1"),
            (self.num_heads >= 1 and self.num_kv_heads >= 1, "heads >= 1"),
            (self.num_heads % self.num_kv_heads == 0, "num_heads % num_kv_heads == 0"),
            (self.head_dim > 0 and self.head_dim % 2 == 0, "head_dim even and > 0"),
            (self.intermediate_size > 0, "intermediate_size > 0"),
            (self.rms_eps > 0, "rms_eps > 0"),
            (self.rope_theta > 0, "rope_theta > 0"),
            (self.block_size >= 2, "block_size >= 2"),
            (len(self.target_layer_ids) >= 1, "at least one target layer"),
            (all(i >= 0 for i in self.target_layer_ids), "target_layer_ids >= 0"),
            (self.vocab_size > 0, "vocab_size > 0"),
            (0 <= self.mask_token_id < self.vocab_size, "0 <= mask_token_id < vocab_size"),
            (not self.layer_types or len(self.layer_types) == self.num_layers, "one layer_types entry per layer"),
            (all(t in LAYER_TYPES for t in self.layer_types), f"layer_types in {LAYER_TYPES}"),
            (self.sliding_window >= 0, "sliding_window >= 0"),
            (SLIDING not in self.layer_types or self.sliding_window >= 1, "sliding_window >= 1 with sliding layers"),
        ]
        bad = [what for ok, what in checks if not ok]
        if bad:
            raise DrafterError(f"invalid drafter config ({', '.join(bad)}): {self}")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.layer_types = [str(t) for t in self.layer_types]
        self.sliding_window = int(self.sliding_window)
        if SLIDING not in self.layer_types:  # normalised: no window unless a layer slides
            self.layer_types, self.sliding_window = [], 0
        return self

    @classmethod
    def for_target(
        cls,
        target: Any,
        *,
        num_layers: int = DEFAULT_NUM_LAYERS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_target_layers: int = DEFAULT_NUM_TARGET_LAYERS,
        target_layer_ids: Sequence[int] | None = None,
        mask_token_id: int | None = None,
    ) -> "DrafterConfig":
        """Default drafter config for a target GGUF.

        Hidden size, heads, kv heads, head_dim (``{arch}.attention.key_length``, else
        ``hidden / heads``), ffn width, RoPE theta and RMS eps are copied from the target;
        ``target_layer_ids`` defaults to :func:`default_target_layer_ids` with
        ``min(num_target_layers, target layers)`` taps; ``mask_token_id`` to
        :func:`choose_mask_token`.

        Args:
            target: a :class:`runtime.gguf_loader.GGUFFile` or a path to one.

        Raises:
            DrafterError: the target lacks a needed key, or the options are out of range.
        """
        from runtime.fingerprint import model_fingerprint
        from runtime.gguf_loader import GGUFFile

        g = target if isinstance(target, GGUFFile) else GGUFFile(target)

        def num(key: str, default: Any = None) -> Any:
            v = g.get(key, default)
            if isinstance(v, list):  # per-layer arrays (hybrid models): the attention layers' value
                v = max((x for x in v if x), default=default)
            if v is None:
                raise DrafterError(f"{g.path}: missing {key.replace('{arch}', g.architecture)}")
            return v

        hidden = int(num("{arch}.embedding_length"))
        n_layers_target = int(num("{arch}.block_count"))
        heads = int(num("{arch}.attention.head_count"))
        kv_heads = int(num("{arch}.attention.head_count_kv", heads))
        head_dim = int(num("{arch}.attention.key_length", hidden // heads))
        ffn = int(num("{arch}.feed_forward_length"))
        theta = float(num("{arch}.rope.freq_base", 10000.0))
        eps = float(num("{arch}.attention.layer_norm_rms_epsilon", 1e-6))
        vocab = target_vocab_size(g)
        if target_layer_ids is None:
            if num_target_layers < 1:
                raise DrafterError("num_target_layers must be >= 1")
            target_layer_ids = default_target_layer_ids(n_layers_target, min(num_target_layers, n_layers_target))
        target_layer_ids = [int(i) for i in target_layer_ids]
        if len(target_layer_ids) > n_layers_target or any(not 0 <= i < n_layers_target for i in target_layer_ids):
            raise DrafterError(f"target_layer_ids {target_layer_ids} do not fit a {n_layers_target}-layer target")
        if mask_token_id is None:
            mask_token_id = choose_mask_token(
                g.get("tokenizer.ggml.tokens") or [],
                g.get("tokenizer.ggml.token_type") or [],
                {k: g.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot", "eom", "unknown", "padding", "sep", "cls")},
                g.get("tokenizer.chat_template"),
                vocab_size=vocab,
            )
        return cls(
            hidden_size=hidden,
            num_layers=int(num_layers),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=ffn,
            rms_eps=eps,
            rope_theta=theta,
            block_size=int(block_size),
            target_layer_ids=target_layer_ids,
            mask_token_id=int(mask_token_id),
            vocab_size=vocab,
            target_fingerprint=model_fingerprint(g),
            target_architecture=g.architecture,
        ).validate()


def target_vocab_size(g: Any) -> int:
    """Rows of the target's ``token_embd.weight`` (the vocabulary the drafter speaks)."""
    from runtime.gguf_loader import vocab_size

    return vocab_size(g)


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """``n`` target layers evenly spaced from layer 1 to layer ``num_target_layers - 3``.

    The reference formula (z-lab/dflash ``build_target_layer_ids``):
    ``round(1 + i * (L - 4) / (n - 1))`` for ``i < n`` (Python rounding), and ``[L // 2]`` for
    ``n == 1``. E.g. ``L = 30, n = 5 -> [1, 8, 14, 20, 27]``. When ``[1, L-3]`` holds fewer than
    ``n`` layers (very shallow targets) the ids are spread over ``[0, L-1]`` instead so they stay
    distinct.

    Raises:
        DrafterError: ``n < 1`` or ``n > num_target_layers``.
    """
    L = int(num_target_layers)
    if not 1 <= n <= L:
        raise DrafterError(f"cannot tap {n} layers of a {L}-layer target")
    if n == 1:
        return [L // 2]
    start, end = 1, L - 3
    if end - start + 1 < n:
        start, end = 0, L - 1
    span = end - start
    return [int(round(start + i * span / (n - 1))) for i in range(n)]


_MASK_NAMES = re.compile(r"^(<\|?mask\|?>|\[mask\])$", re.IGNORECASE)
_RESERVED_NAMES = re.compile(r"reserved|unused|pad", re.IGNORECASE)


def choose_mask_token(
    tokens: Sequence[str],
    token_types: Sequence[int],
    special_ids: Mapping[str, int | None],
    chat_template: str | None = None,
    vocab_size: int | None = None,
) -> int:
    """Pick a target token id to serve as the drafter's MASK token. First match wins:

    1. a token named like a mask (``<|MASK|>``, ``<mask>``, ``[MASK]``, any case);
    2. the padding token, when it is not bos / eos / eot / eom;
    3. the first UNUSED-type token (token_type 5: e.g. llama.cpp's ``[PAD123]`` rows that pad the
       vocabulary to the embedding size; the DFlash Qwen3 drafters use such a row);
    4. a CONTROL token (token_type 3) that is not one of the special ids and does not appear in the
       chat template: the last one whose name says reserved / unused / pad, else the last one;
    5. the unknown token if it is not bos/eos; else the last id of the vocabulary.

    For SmolLM2 (padding = eos = ``<|im_end|>``, control tokens 0..16) this gives 16,
    ``<empty_output>``.

    Args:
        tokens, token_types: ``tokenizer.ggml.tokens`` / ``.token_type`` (may be empty).
        special_ids: ``{"bos": id, "eos": id, "eot": ..., "eom": ..., "unknown": ..., "padding": ...}``
            (missing or None entries are ignored).
        chat_template: ``tokenizer.chat_template`` (tokens it names are never chosen in step 4).
        vocab_size: embedding rows (ids must be below it); default ``len(tokens)``.
    """
    vocab = int(vocab_size if vocab_size is not None else len(tokens))
    ids = {k: int(v) for k, v in special_ids.items() if v is not None and 0 <= int(v) < vocab}
    ends = {ids[k] for k in ("bos", "eos", "eot", "eom") if k in ids}
    tokens = list(tokens)[:vocab]
    types = list(token_types)[:vocab]
    for i, tok in enumerate(tokens):
        if _MASK_NAMES.match(tok):
            return i
    pad = ids.get("padding")
    if pad is not None and pad not in ends:
        return pad
    for i, ty in enumerate(types):
        if ty == _TOKEN_TYPE_UNUSED:
            return i
    taken = set(ids.values())
    template = chat_template or ""
    candidates = [
        i for i, ty in enumerate(types)
        if ty == _TOKEN_TYPE_CONTROL and i not in taken and i < len(tokens) and tokens[i] not in template
    ]
    reserved = [i for i in candidates if _RESERVED_NAMES.search(tokens[i])]
    if reserved:
        return reserved[-1]
    if candidates:
        return candidates[-1]
    unk = ids.get("unknown")
    if unk is not None and unk not in ends:
        return unk
    return vocab - 1


# --------------------------------------------------------------------------------------------
# Math (shared by the cached and the uncached path)
# --------------------------------------------------------------------------------------------


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """The sliding-window mask of a sliding drafter layer: ``[..., Q] x [..., K] -> [..., Q, K]``
    bool, True where the query at position ``q_pos[..., i]`` may see the key at ``k_pos[..., j]``:
    ``|q - k| <= window - 1``.

    This is flash-attn's ``window_size = (W - 1, W - 1)`` (transformers passes a layer's
    ``sliding_window`` ``W`` so) for the drafter's non-causal block over ``[context ; block]``:
    flash-attn aligns the queries bottom-right, so block row ``i`` of a step with ``L`` context
    rows stands at position ``L + i`` and key ``j`` at ``j``, which is what the positions here
    are. With ``B <= W`` every block row sees every other one and the window only drops context
    rows older than ``p - (W - 1)``."""
    return (q_pos[..., :, None] - k_pos[..., None, :]).abs() <= int(window) - 1


class RMSNorm(nn.Module):
    """RMSNorm with a weight (ones at init); see :func:`rms_norm`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DFlashLayer(nn.Module):
    """One draft decoder layer. Attribute names follow the GGUF tensor names
    (``blk.{i}.<name>.weight``); all linears are bias-free, weights ``[out, in]``."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        H, D, F_ = c.hidden_size, c.head_dim, c.intermediate_size
        self.attn_norm = RMSNorm(H, c.rms_eps)
        self.attn_q = nn.Linear(H, c.num_heads * D, bias=False)
        self.attn_k = nn.Linear(H, c.num_kv_heads * D, bias=False)
        self.attn_v = nn.Linear(H, c.num_kv_heads * D, bias=False)
        self.attn_output = nn.Linear(c.num_heads * D, H, bias=False)
        self.attn_q_norm = RMSNorm(D, c.rms_eps)
        self.attn_k_norm = RMSNorm(D, c.rms_eps)
        self.ffn_norm = RMSNorm(H, c.rms_eps)
        self.ffn_gate = nn.Linear(H, F_, bias=False)
        self.ffn_up = nn.Linear(H, F_, bias=False)
        self.ffn_down = nn.Linear(F_, H, bias=False)


@dataclasses.dataclass
class DrafterContext:
    """Per-session context cache: for every draft layer, the keys and values of the context rows
    (RoPE applied at their absolute positions ``0..length-1``).

    Buffers ``keys[i]`` / ``values[i]`` are ``[num_kv_heads, capacity, head_dim]`` in the model's
    dtype and device; rows ``[0, length)`` are valid. They grow by doubling when appended to.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def k(self, layer: int) -> torch.Tensor:
        """Valid keys of ``layer``: ``[num_kv_heads, length, head_dim]`` (a view)."""
        return self.keys[layer][:, : self.length]

    def v(self, layer: int) -> torch.Tensor:
        """Valid values of ``layer``: ``[num_kv_heads, length, head_dim]`` (a view)."""
        return self.values[layer][:, : self.length]

    def truncate(self, length: int) -> None:
        """Forget rows ``[length, self.length)`` (no copy)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a context of {self.length} rows to {length}")
        self.length = length

    def nbytes(self) -> int:
        """Bytes held by the buffers (capacity, not length)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class DFlashDrafter(nn.Module):
    """The DFlash drafter (see the module docstring for the math).

    Args:
        config: the drafter shape.
        embed_weight: the target's token embedding ``[vocab, H]``: a float tensor, or the target
            GGUF's blocks as a :class:`kernels.quant.QuantizedWeight` (``--weights quantized``).
        lm_head_weight: the target's LM head ``[vocab, H]``, either form; ``None`` = tied
            (``embed_weight``).

    The module's parameters are initialised like ``nn.Linear`` defaults; use
    :meth:`reset_parameters` for the HF-style init, :meth:`from_gguf` to load a drafter file.
    Move it with ``.to(device, dtype)``: a float target embedding / head are buffers and follow;
    quantized ones stay where they were made (:meth:`borrow`).

    Raises:
        DrafterError: the embedding or LM head is not ``[vocab, H]``.
    """

    def __init__(self, config: DrafterConfig, embed_weight: "torch.Tensor | QuantizedWeight",
                 lm_head_weight: "torch.Tensor | QuantizedWeight | None" = None):
        super().__init__()
        config.validate()
        self.config = config
        c = config
        self.fc = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_layers))
        self.output_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.borrow(embed_weight, lm_head_weight)

    def borrow(self, embed_weight: "torch.Tensor | QuantizedWeight",
               lm_head_weight: "torch.Tensor | QuantizedWeight | None" = None) -> None:
        """Take the target's embedding and LM head (``[vocab, H]`` each; ``lm_head_weight`` None:
        tied). A float tensor becomes a non-persistent buffer (it follows ``.to()``); a
        :class:`kernels.quant.QuantizedWeight` (the target GGUF's blocks, no float copy) is a plain
        attribute that stays on its device, read by ``kernels.quant``'s embedding gather and
        fused dequantize-matmul.

        Raises:
            DrafterError: a weight is not ``[vocab, H]``.
        """
        c = self.config
        for what, w in (("embedding", embed_weight), ("LM head", lm_head_weight)):
            if w is not None and tuple(w.shape) != (c.vocab_size, c.hidden_size):
                raise DrafterError(f"target {what} has shape {tuple(w.shape)}, expected {(c.vocab_size, c.hidden_size)}")
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            self._buffers.pop(name, None)
            self.__dict__.pop(name, None)
            if isinstance(w, QuantizedWeight):
                object.__setattr__(self, name, w)
            else:
                self.register_buffer(name, None if w is None else w.detach(), persistent=False)
        self.tied = lm_head_weight is None

    # ---- construction ------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> "DFlashDrafter":
        """HF-style init: every linear ``N(0, std)``, every norm weight 1. Drawn in float32 on the
        CPU from ``generator`` (reproducible across devices), then copied in."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * std)
        return self

    # ---- properties --------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def head_weight(self) -> "torch.Tensor | QuantizedWeight":
        """The target LM head ``[vocab, H]`` (the embedding when tied), a float tensor or GGUF blocks."""
        return self.embed_weight if self.lm_head_weight is None else self.lm_head_weight

    # ---- shared math ---------------------------------------------------------------------------

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(features))``: ``[n, N*H]`` (any float dtype) -> ``[n, H]`` model dtype."""
        c = self.config
        if features.dim() != 2 or features.shape[1] != c.feature_size:
            raise ValueError(f"features must be [rows, {c.feature_size}], got {tuple(features.shape)}")
        if not features.is_floating_point():
            raise ValueError(f"features must be floating point, got {features.dtype}")
        return self.context_rows(features)

    def context_rows(self, features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(features))`` without shape checks: ``[..., N*H]`` (any float dtype,
        any device) -> ``[..., H]`` in the model dtype and device. The pooled engine
        (:mod:`draft_service.batched`) calls it on padded ``[B, A, N*H]`` batches."""
        x = features.to(device=self.device, dtype=self.dtype)
        return self.hidden_norm(self.fc(x))

    def _kv(self, layer: DFlashLayer, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm + RoPE) and values of rows ``h`` ``[..., rows, H]`` at ``positions``
        ``[..., rows]`` -> ``[..., nkv, rows, D]`` each."""
        c = self.config
        shape = h.shape[:-1]
        k = layer.attn_k(h).view(*shape, c.num_kv_heads, c.head_dim)
        v = layer.attn_v(h).view(*shape, c.num_kv_heads, c.head_dim)
        k = layer.attn_k_norm(k).transpose(-2, -3)  # [..., nkv, rows, D]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        return apply_rope(k, cos, sin), v.transpose(-2, -3)

    def _context_kv(self, layer: DFlashLayer, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context keys/values of one layer: ``ctx`` ``[..., n, H]`` (projected features) at
        ``positions`` ``[..., n]`` -> ``[..., nkv, n, D]`` each. Uses the layer's own k/v projections and
        k_norm on ``ctx`` directly (no ``attn_norm``: the reference feeds ``target_hidden`` as is)."""
        return self._kv(layer, ctx, positions)

    def _attention(
        self,
        q: torch.Tensor,
        k_ctx: torch.Tensor,
        v_ctx: torch.Tensor,
        k_blk: torch.Tensor,
        v_blk: torch.Tensor,
        ctx_visible: torch.Tensor | None,
        window: int = 0,
        positions: torch.Tensor | None = None,
        ctx_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block queries over ``[context ; block]`` keys, no causal mask, in float32 (float64 for a
        float64 model).

        Args:
            q: ``[nb, nh, B, D]`` (RoPE applied).
            k_ctx, v_ctx: ``[nkv, n, D]``, shared by the ``nb`` blocks.
            k_blk, v_blk: ``[nb, nkv, B, D]``.
            ctx_visible: ``[nb, n]`` bool (which context rows each block may see) or None (all).
            window: the layer's window ``W`` in tokens (0: none). With a window, the query at
                position ``p`` sees a key at position ``j`` (context or block) only when
                ``|p - j| <= W - 1`` (:func:`window_visible`), on top of ``ctx_visible``.
            positions: ``[nb, B]`` positions of the block rows (needed with a window).
            ctx_positions: ``[n]`` positions of the context rows (needed with a window).

        Returns:
            ``[nb, B, nh * D]`` in ``q``'s dtype.
        """
        c = self.config
        nb, nh, B, D = q.shape
        g = nh // c.num_kv_heads
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf = q.to(acc).reshape(nb, c.num_kv_heads, g, B, D)
        scale = 1.0 / math.sqrt(D)
        s_ctx = torch.einsum("bkgqd,knd->bkgqn", qf, k_ctx.to(acc)) * scale
        s_blk = torch.einsum("bkgqd,bknd->bkgqn", qf, k_blk.to(acc)) * scale
        if ctx_visible is not None:
            s_ctx = s_ctx.masked_fill(~ctx_visible[:, None, None, None, :], float("-inf"))
        if window:
            if positions is None or ctx_positions is None:
                raise ValueError("a windowed attention needs the block and context positions")
            s_ctx = s_ctx.masked_fill(~window_visible(positions, ctx_positions, window)[:, None, None], float("-inf"))
            s_blk = s_blk.masked_fill(~window_visible(positions, positions, window)[:, None, None], float("-inf"))
        n = s_ctx.shape[-1]
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
        out = torch.einsum("bkgqn,knd->bkgqd", p[..., :n], v_ctx.to(acc))
        out = out + torch.einsum("bkgqn,bknd->bkgqd", p[..., n:], v_blk.to(acc))
        return out.reshape(nb, nh, B, D).transpose(1, 2).reshape(nb, B, nh * D).to(q.dtype)

    def _layer(self, layer: DFlashLayer, x: torch.Tensor, positions: torch.Tensor, attend: "Attend") -> torch.Tensor:
        """One decoder layer over blocks ``x`` ``[nb, B, H]`` at ``positions`` ``[nb, B]``.

        ``attend(q, k_blk, v_blk) -> [nb, B, nh * D]`` is the attention backend: ``q``
        ``[nb, nh, B, D]`` (q_norm + RoPE applied), ``k_blk`` / ``v_blk`` ``[nb, nkv, B, D]`` the
        block's own keys (k_norm + RoPE) and values. The dense backend (:meth:`_dense_attend`:
        context K/V held as tensors) serves training, the uncached and the per-session cached
        path; the pooled engine's backend writes the block K/V into its context pool and runs
        ``kernels.attention.pool_attention`` (:mod:`draft_service.batched`). Everything else of
        the layer is this function, shared by all of them.
        """
        c = self.config
        nb, B, _ = x.shape
        h = layer.attn_norm(x)
        q = layer.attn_q_norm(layer.attn_q(h).view(nb, B, c.num_heads, c.head_dim)).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self._kv(layer, h, positions)
        x = x + layer.attn_output(attend(q, k_blk, v_blk))
        h = layer.ffn_norm(x)
        return x + layer.ffn_down(F.silu(layer.ffn_gate(h)) * layer.ffn_up(h))

    def _dense_attend(self, k_ctx: torch.Tensor, v_ctx: torch.Tensor, ctx_visible: torch.Tensor | None,
                      window: int = 0, positions: torch.Tensor | None = None,
                      ctx_positions: torch.Tensor | None = None) -> "Attend":
        """The dense attention backend of :meth:`_layer` over context K/V tensors (see
        :meth:`_attention` for the shapes and the window)."""
        return lambda q, k_blk, v_blk: self._attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_visible,
                                                       window, positions, ctx_positions)

    def embed_blocks(self, block_tokens: torch.Tensor) -> torch.Tensor:
        """Target embedding of ``block_tokens`` ``[nb, B]`` -> ``[nb, B, H]`` in the model dtype
        (a quantized embedding: only the looked-up rows dequantized, ``kernels.quant.embedding``)."""
        return embedding(self.embed_weight, block_tokens.to(self.device), self.dtype)

    def run_blocks(self, block_tokens: torch.Tensor, positions: torch.Tensor, attends: Sequence["Attend"]) -> torch.Tensor:
        """Embed ``block_tokens`` ``[nb, B]``, run every layer ``i`` with attention backend
        ``attends[i]`` at ``positions`` ``[nb, B]``, apply ``output_norm`` -> ``[nb, B, H]``."""
        x = self.embed_blocks(block_tokens)
        for layer, attend in zip(self.layers, attends):
            x = self._layer(layer, x, positions, attend)
        return self.output_norm(x)

    def _blocks_hidden(
        self,
        ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_tokens: torch.Tensor,
        positions: torch.Tensor,
        ctx_visible: torch.Tensor | None,
        ctx_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embed ``block_tokens`` ``[nb, B]``, run every layer, apply ``output_norm`` -> ``[nb, B, H]``.

        ``ctx_positions`` ``[n]``: the positions of the context rows of ``ctx_kv`` (default
        ``0..n-1``), which a sliding layer's window is measured against (``positions`` ``[nb, B]``
        are the block rows')."""
        if ctx_positions is None and any(self.config.layer_windows):
            n = ctx_kv[0][0].shape[1]
            ctx_positions = torch.arange(n, device=positions.device)
        attends = [self._dense_attend(k, v, ctx_visible, self.config.layer_window(i), positions, ctx_positions)
                   for i, (k, v) in enumerate(ctx_kv)]
        return self.run_blocks(block_tokens, positions, attends)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[..., H]`` -> float32 logits ``[..., vocab]`` with the target's LM head
        (float64 for a float64 model). A quantized head: ``kernels.linear.linear`` (the fused
        dequantize-matmul on CUDA, float32 out; the float32 reference on the CPU)."""
        head = self.head_weight
        if isinstance(head, QuantizedWeight):
            from kernels.linear import linear

            return linear(hidden, head, torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        out = F.linear(hidden, head.to(hidden.dtype))
        return out if out.dtype == torch.float64 else out.float()

    # ---- uncached path (tests, training) -------------------------------------------------------

    def forward_block_hidden(
        self,
        features: torch.Tensor,
        block_tokens: torch.Tensor,
        start_pos: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Non-cached forward of one or several blocks over one sequence's context features.

        Args:
            features: ``[n, N*H]`` (any float dtype): context rows at positions ``0..n-1``.
            block_tokens: ``[B]`` or ``[nb, B]`` token ids (any ``B >= 1``; usually
                ``[root, MASK x (B-1)]``).
            start_pos: position of each block's first token: an int or ``[nb]`` tensor, each
                ``<= n``; ``None`` = ``n``. Block ``j`` sees context rows ``< start_pos[j]`` (the
                target rows before its root) and all of its own rows.

        Returns:
            ``[B, H]`` or ``[nb, B, H]`` (model dtype) after ``output_norm``.
        """
        single = block_tokens.dim() == 1
        tokens = block_tokens.view(1, -1) if single else block_tokens
        nb, B = tokens.shape
        n = features.shape[0]
        ctx = self.project_context(features)
        ctx_pos = torch.arange(n, device=self.device)
        ctx_kv = [self._context_kv(layer, ctx, ctx_pos) for layer in self.layers]
        if start_pos is None:
            start = torch.full((nb,), n, device=self.device, dtype=torch.long)
        else:
            start = torch.as_tensor(start_pos, device=self.device, dtype=torch.long).reshape(-1).expand(nb)
        if bool((start > n).any()) or bool((start < 0).any()):
            raise ValueError(f"start_pos must be in [0, {n}]")
        positions = start[:, None] + torch.arange(B, device=self.device)
        visible = None if start_pos is None else ctx_pos[None, :] < start[:, None]
        out = self._blocks_hidden(ctx_kv, tokens, positions, visible)
        return out[0] if single else out

    def forward_block(
        self,
        features: torch.Tensor,
        block_tokens: torch.Tensor,
        start_pos: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward_block_hidden` followed by the target LM head.

        Returns:
            float32 logits ``[B, V]`` or ``[nb, B, V]`` for **every** block row (row 0, the root,
            included; the draft distributions are rows ``1..B-1``).
        """
        return self.logits(self.forward_block_hidden(features, block_tokens, start_pos))

    forward = forward_block

    # ---- cached path (serving) -------------------------------------------------------------------

    def new_context(self, capacity: int = 0) -> DrafterContext:
        """An empty per-session context cache (buffers of ``capacity`` rows, grown on demand)."""
        c = self.config
        mk = lambda: torch.zeros(c.num_kv_heads, capacity, c.head_dim, device=self.device, dtype=self.dtype)  # noqa: E731
        return DrafterContext([mk() for _ in self.layers], [mk() for _ in self.layers], 0)

    def _reserve(self, ctx: DrafterContext, rows: int) -> None:
        if rows <= ctx.capacity:
            return
        cap = max(rows, 2 * ctx.capacity, 64)
        for bufs in (ctx.keys, ctx.values):
            for i, old in enumerate(bufs):
                new = torch.zeros(old.shape[0], cap, old.shape[2], device=old.device, dtype=old.dtype)
                new[:, : ctx.length] = old[:, : ctx.length]
                bufs[i] = new

    @torch.no_grad()
    def append_context(self, ctx: DrafterContext, features: torch.Tensor) -> None:
        """Append context rows to ``ctx``.

        Args:
            ctx: the session's cache; rows get positions ``ctx.length .. ctx.length + n - 1``.
            features: ``[n, N*H]``, any float dtype (``n`` may be 0).

        Raises:
            ValueError: wrong shape or dtype (``ctx`` is left unchanged).
        """
        ctx_h = self.project_context(features)
        n = ctx_h.shape[0]
        if n == 0:
            return
        positions = torch.arange(ctx.length, ctx.length + n, device=self.device)
        kvs = [self._context_kv(layer, ctx_h, positions) for layer in self.layers]
        self._reserve(ctx, ctx.length + n)
        for i, (k, v) in enumerate(kvs):
            ctx.keys[i][:, ctx.length : ctx.length + n] = k
            ctx.values[i][:, ctx.length : ctx.length + n] = v
        ctx.length += n

    @torch.no_grad()
    def block_hidden(self, ctx: DrafterContext, root_token: int, block_size: int | None = None) -> torch.Tensor:
        """Hidden states ``[B, H]`` (after ``output_norm``) of the block ``[root, MASK x (B-1)]``
        at positions ``ctx.length .. ctx.length + B - 1`` over every cached context row.
        ``block_size`` defaults to the config's. Does not modify ``ctx``."""
        B = self.config.block_size if block_size is None else int(block_size)
        if not 0 <= root_token < self.config.vocab_size:
            raise ValueError(f"root token {root_token} outside the vocabulary [0, {self.config.vocab_size})")
        tokens = torch.full((1, B), self.config.mask_token_id, dtype=torch.long, device=self.device)
        tokens[0, 0] = int(root_token)
        positions = (ctx.length + torch.arange(B, device=self.device))[None, :]
        ctx_kv = [(ctx.k(i), ctx.v(i)) for i in range(len(self.layers))]
        return self._blocks_hidden(ctx_kv, tokens, positions, None)[0]

    @torch.no_grad()
    def block_logits(self, ctx: DrafterContext, root_token: int, block_size: int | None = None) -> torch.Tensor:
        """The ``B-1`` draft distributions for the block rooted at ``root_token``.

        Returns:
            float32 logits ``[B-1, V]``: row ``d-1`` is the distribution of the token at position
            ``ctx.length + d`` (depth ``d`` of the tree). ``ctx`` is not modified.

        Raises:
            ValueError: ``root_token`` outside the vocabulary.
        """
        return self.logits(self.block_hidden(ctx, root_token, block_size)[1:])

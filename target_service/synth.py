"""Synthetic **random-weight** Qwen3.5 (``qwen35``) GGUF files, for tests and benchmarks.

.. warning::
   The output is **NOT a trained model**: every weight is random noise. It has the exact tensor
   names, shapes, metadata and storage layout of a llama.cpp conversion of a real Qwen3.5 dense
   checkpoint, so loaders, kernels, memory use and speed can be tested on it, but the text it
   generates is gibberish. ``general.name`` says so in every file.

Usage::

    python -m target_service.synth --arch qwen35 --preset 0.8b --dtype q4_k --out q35-0.8b.gguf
    python -m target_service.synth --arch qwen35 --preset tiny --dtype f32 --out tiny.gguf

or from Python: :func:`write_qwen35` with a :class:`Qwen35SynthConfig` (:data:`PRESETS` holds the
real shapes).

How a file is made (the writer = random HF weights -> :func:`hf_to_gguf_tensors` -> write):

1. Random weights are drawn in **Hugging Face layout** (``transformers.Qwen3_5ForCausalLM`` names
   and shapes: grouped value heads, zero-centred norm weights, ``A_log``, ``dt_bias``, conv1d
   ``[C, 1, K]``, MTP tensors under ``mtp.*``), each tensor from its own seed
   (``(seed, crc32(name), chunk)``), so adding or removing the MTP block or the LM head leaves the
   other tensors unchanged.
2. :func:`hf_to_gguf_tensor` applies **exactly** llama.cpp's conversion (``convert_hf_to_gguf.py``:
   ``Qwen3_5TextModel(_Qwen35MtpMixin, _Qwen35MRopeMixin, _LinearAttentionVReorderBase)`` on top of
   ``Qwen3NextModel``), in its order:

   * MTP (``_Qwen35MtpMixin``): ``mtp.layers.{j}.X`` -> ``model.layers.{L+j}.X``; ``mtp.fc`` ->
     ``eh_proj``, ``mtp.pre_fc_norm_embedding`` -> ``enorm``, ``mtp.pre_fc_norm_hidden`` ->
     ``hnorm``, ``mtp.norm`` -> ``shared_head.norm`` (one copy per MTP block ``L..L+n-1``).
   * value-head reorder (``_LinearAttentionVReorderBase``, only when ``Hk != Hv``): grouped
     (``k0v0 k0v1 .. k1v0 ..``) -> tiled (``v0k0 v0k1 .. v1k0 ..``) on the V rows of
     ``in_proj_qkv`` and of ``conv1d``, the rows of ``in_proj_z`` (per value element), of
     ``in_proj_a`` / ``in_proj_b`` / ``A_log`` / ``dt_bias`` (per head), and the **columns** of
     ``out_proj``.
   * ``Qwen3NextModel``: ``A_log`` -> ``-exp(A_log)``; ``dt_bias`` -> ``dt_proj.bias``; conv1d
     squeezed to ``[C, K]``; every ``*norm.weight`` except ``linear_attn.norm.weight`` -> ``w + 1``.
   * names (gguf-py ``TensorNameMap`` for ``MODEL_ARCH.QWEN35``): see :data:`HF_TO_GGUF_NAMES`.
   * ``lm_head.weight`` is absent when the embeddings are tied (``tie_word_embeddings``).

   transformers (``integrations/gguf/gguf_conversion_mapping.py::_qwen35``) undoes exactly these,
   which ``tests/test_synth.py`` checks logit by logit.
3. Storage types: 1-D tensors and ``ssm_conv1d`` are F32 (the converter forces them, llama-quantize
   never quantizes them); ``f32`` / ``bf16`` store every other tensor so; ``q8_0`` uses
   ``gguf.quants.quantize`` and falls back to F16 for a row length that is not a multiple of 32
   (as the converter does). ``q4_k`` is a **Q4_K_M-like mix** (see :func:`storage_type`): Q4_K for
   the 2-D weights (including ``token_embd`` when untied), Q8_0 for the LM head (``output``, or
   ``token_embd`` when tied: llama.cpp's Q4_K_M uses Q6_K there, which gguf-py cannot write) and
   for ``ssm_alpha`` / ``ssm_beta`` (as published Qwen3.5 Q4_K_M files have them), Q8_0 (then F16)
   for rows that are not a multiple of 256 (then 32). gguf 0.19 cannot quantize K-quants, so
   Q4_K tensors are **random Q4_K blocks** written directly (ggml ``block_q4_K``: fp16 ``d``,
   fp16 ``dmin``, 12 bytes of packed 6-bit scales/mins, 128 bytes of 4-bit quants per 256
   values), with scales chosen so the dequantized values have mean ~0 and std ~``init_std``;
   their values are therefore not the random HF weights of step 1.
4. Streaming: tensors are written one by one (the two vocabulary-sized ones chunk by chunk), on a
   thread pool, with a tqdm bar on stderr; nothing like the whole model is ever in memory.

Metadata: ``general.*`` (``general.name`` = "synthetic random Qwen3.5 <preset> (not a trained
model)"), every ``qwen35.*`` key llama.cpp and transformers read, with llama.cpp's value types
(uint32 counts, float32 eps / rope base, int32 array ``rope.dimension_sections``), and the
tokenizer (``tokenizer.ggml.*``, ``tokenizer.chat_template``) copied with its types from a
tokenizer GGUF (SmolLM2-135M-Instruct by default, 49152 tokens). When the model's vocabulary is
larger (the real presets use Qwen3.5's 248320), the token list is padded as llama.cpp's converter
pads it: ``[PAD{i}]`` tokens of type UNUSED (5).

Weights: linear / embedding ``N(0, init_std)`` (0.02 for the real presets, 0.15 for ``tiny`` so the
logits are not flat), zero-centred norms ``N(0, 0.1)`` (stored ``1 + w``), ``ssm_norm``
``1 + N(0, 0.1)`` (stored as is), ``A_log = log(U(1, 16))``, ``dt_bias ~ N(0, 0.5)``, conv1d
``N(0, 1/sqrt(3K))`` (the spread of PyTorch's default conv init).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import math
import os
import re
import sys
import zlib
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType, GGUFValueType

ARCH = "qwen35"
DTYPES = ("f32", "bf16", "q8_0", "q4_k")
NOT_TRAINED = "random weights, NOT a trained model (for tests and benchmarks)"

#: Elements per generation chunk (rows of a 2-D tensor are grouped up to about this many values).
CHUNK_ELEMS = 1 << 22
#: Standard deviation of the zero-centred norm weights (and of ``ssm_norm - 1``).
NORM_STD = 0.1
#: Standard deviation of ``dt_bias``.
DT_BIAS_STD = 0.5
#: Range of ``A = exp(A_log)`` (HF draws ``U(0.01, 16)``; 1 keeps the decay away from 0).
A_RANGE = (1.0, 16.0)
#: A model with at most this many parameters keeps its tensors in the returned :class:`SynthResult`.
KEEP_TENSORS_MAX_PARAMS = 20_000_000
#: llama.cpp's token type of padding tokens (``gguf.TokenType.UNUSED``).
TOKEN_TYPE_UNUSED = int(gguf.TokenType.UNUSED)


# ------------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class Qwen35SynthConfig:
    """Shapes and constants of a Qwen3.5 dense text model (the fields of HF ``Qwen3_5TextConfig``).

    Attributes:
        hidden_size, num_hidden_layers, intermediate_size: the trunk.
        num_attention_heads, num_key_value_heads, head_dim: gated full attention (``q_proj`` has
            ``2 * heads * head_dim`` rows: per head ``[query | gate]``).
        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
            linear_conv_kernel_dim: Gated DeltaNet (``Hv`` a multiple of ``Hk``; llama.cpp
            assumes ``Dk == Dv``).
        full_attention_interval: layer ``i`` is full attention iff ``(i + 1) % interval == 0``.
        partial_rotary_factor: rotary dims = ``head_dim * factor`` (``rope.dimension_count``).
        mrope_section: interleaved-mrope sections (sum = rotary dims / 2), written padded to 4.
        rope_theta, rms_norm_eps, max_position_embeddings: as in the HF config.
        vocab_size: rows of the embedding; ``None`` = the tokenizer's size (else the token list is
            padded with ``[PAD{i}]`` UNUSED tokens up to it).
        tie_word_embeddings: no ``output.weight`` (LM head = ``token_embd``).
        mtp_num_hidden_layers: multi-token-prediction blocks written as ``blk.{L..L+n-1}``.
        init_std: std of the random linear / embedding weights.
        name: preset name (in ``general.name``).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262_144
    vocab_size: int | None = None
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    init_std: float = 0.02
    name: str = "custom"

    # -- derived
    @property
    def rope_dim(self) -> int:
        """Rotary dimensions (``qwen35.rope.dimension_count``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """``qwen35.ssm.inner_size``."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN conv (``[q | k | v]``)."""
        return 2 * self.key_dim + self.value_dim

    def is_attention(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` is gated full attention (else Gated DeltaNet)."""
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if self.is_attention(i) else "linear_attention" for i in range(self.num_hidden_layers)]

    def validate(self) -> None:
        """Raise ``ValueError`` for inconsistent shapes."""
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.linear_key_head_dim != self.linear_value_head_dim:
            problems.append("llama.cpp's qwen35 assumes linear_key_head_dim == linear_value_head_dim")
        if self.rope_dim % 2 or self.rope_dim <= 0 or self.rope_dim > self.head_dim:
            problems.append(f"rotary dims {self.rope_dim} must be even and in (0, head_dim]")
        if len(self.mrope_section) > 4 or 2 * sum(self.mrope_section) != self.rope_dim:
            problems.append(f"mrope_section {self.mrope_section} must have <= 4 entries summing to rope_dim / 2")
        if self.full_attention_interval < 1 or self.num_hidden_layers < 1:
            problems.append("need num_hidden_layers >= 1 and full_attention_interval >= 1")
        if self.mtp_num_hidden_layers < 0:
            problems.append("mtp_num_hidden_layers must be >= 0")
        if problems:
            raise ValueError(f"Qwen35SynthConfig {self.name!r}: " + "; ".join(problems))

    def hf_config_kwargs(self, vocab_size: int | None = None, **extra: Any) -> dict[str, Any]:
        """Keyword arguments of ``transformers.Qwen3_5TextConfig`` for the same model."""
        vocab = vocab_size if vocab_size is not None else self.vocab_size
        if vocab is None:
            raise ValueError("vocab_size unknown: pass it")
        kw = dict(
            vocab_size=int(vocab),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
            layer_types=self.layer_types,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act="silu",
            attention_bias=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": float(self.rope_theta),
                "partial_rotary_factor": self.rope_dim / self.head_dim,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": True,
            },
        )
        kw.update(extra)
        return kw


#: Real Qwen3.5 dense shapes. Sources: the HF ``config.json`` (``text_config``) of the
#: Qwen/Qwen3.5-* checkpoints as quoted in public code, the Qwen model cards, and llama.cpp's
#: ``llama-model.cpp`` (it names the sizes by ``n_layer`` / ``n_embd``: 24 & 1024 -> 0.8B, 24 -> 2B,
#: 32 & 2560 -> 4B, 32 -> 9B, 64 -> 27B). All: head_dim 256, partial_rotary_factor 0.25 (64 rotary
#: dims), mrope_section [11, 11, 10] interleaved, rope_theta 1e7, rms_norm_eps 1e-6, 262144
#: context, full_attention_interval 4, GDN head dims 128, conv kernel 4, vocabulary 248320,
#: mtp_num_hidden_layers 1.
PRESETS: dict[str, Qwen35SynthConfig] = {
    # Not a real model: the smallest shapes that still exercise every code path (2 GDN value
    # heads per key head, partial rotary, >= 1 attention layer and several GDN layers).
    "tiny": Qwen35SynthConfig(
        hidden_size=64, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, partial_rotary_factor=0.5, mrope_section=(3, 3, 2), max_position_embeddings=4096,
        vocab_size=None, tie_word_embeddings=False, mtp_num_hidden_layers=0, init_std=0.15, name="tiny",
    ),
    # Qwen/Qwen3.5-0.8B config.json: hidden 1024, 24 layers, 8 q / 2 kv heads, ffn 3584,
    # GDN 16 k / 16 v heads, tie_word_embeddings true, mtp_num_hidden_layers 1.
    "0.8b": Qwen35SynthConfig(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        intermediate_size=3584, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True, mtp_num_hidden_layers=1, name="0.8b",
    ),
    # Qwen3.5-2B model card: hidden 2048, 24 layers, 8 q / 2 kv heads, ffn 6144, tied, 1 MTP.
    # GDN head counts not found verbatim: 16 k / 16 v taken from the 0.8B sibling (same layer
    # count and attention heads); the published 2.27B total (with vision) agrees with it.
    "2b": Qwen35SynthConfig(
        hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        intermediate_size=6144, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True, mtp_num_hidden_layers=1, name="2b",
    ),
    # Qwen3.5-4B model card + a Q4_K_M GGUF's tensor list (ssm_a [32], ssm_conv1d [4, 8192]):
    # hidden 2560, 32 layers, 16 q / 4 kv heads, ffn 9216, GDN 16 k / 32 v heads, tied
    # embeddings (4.66B published total with vision only fits tied), 1 MTP.
    "4b": Qwen35SynthConfig(
        hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        intermediate_size=9216, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True, mtp_num_hidden_layers=1, name="4b",
    ),
    # Qwen/Qwen3.5-9B model card: hidden 4096, 32 layers, 16 q / 4 kv heads, ffn 12288, GDN 16 QK /
    # 32 V heads; untied (the GGUF's 8.95B parameters only fit an untied LM head), 1 MTP.
    "9b": Qwen35SynthConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        intermediate_size=12288, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False, mtp_num_hidden_layers=1, name="9b",
    ),
    # Qwen/Qwen3.5-27B config.json (text_config): hidden 5120, 64 layers, 24 q / 4 kv heads,
    # ffn 17408, GDN 16 k / 48 v heads, tie_word_embeddings false, mtp_num_hidden_layers 1.
    "27b": Qwen35SynthConfig(
        hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        intermediate_size=17408, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False, mtp_num_hidden_layers=1, name="27b",
    ),
}


# -------------------------------------------------------------------------------- HF-layout specs
@dataclasses.dataclass(frozen=True)
class HFTensorSpec:
    """One tensor of the HF checkpoint: name, shape and how it is initialised.

    ``kind``: ``"linear"`` (``N(0, init_std)``), ``"norm"`` (zero-centred, ``N(0, 0.1)``),
    ``"gated_norm"`` (``1 + N(0, 0.1)``), ``"conv"``, ``"a_log"``, ``"dt_bias"``.
    """

    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def hf_tensor_specs(config: Qwen35SynthConfig, vocab_size: int | None = None) -> list[HFTensorSpec]:
    """The HF-layout tensors of ``config`` (``Qwen3_5ForCausalLM`` names, plus ``mtp.*``), in
    checkpoint order. ``lm_head.weight`` only when untied."""
    c = config
    vocab = vocab_size if vocab_size is not None else c.vocab_size
    if vocab is None:
        raise ValueError("vocab_size unknown")
    H, hd = c.hidden_size, c.head_dim
    out = [HFTensorSpec("model.embed_tokens.weight", (vocab, H), "linear")]

    def attention(p: str) -> list[HFTensorSpec]:
        return [
            HFTensorSpec(p + "self_attn.q_proj.weight", (2 * c.num_attention_heads * hd, H), "linear"),
            HFTensorSpec(p + "self_attn.k_proj.weight", (c.num_key_value_heads * hd, H), "linear"),
            HFTensorSpec(p + "self_attn.v_proj.weight", (c.num_key_value_heads * hd, H), "linear"),
            HFTensorSpec(p + "self_attn.o_proj.weight", (H, c.num_attention_heads * hd), "linear"),
            HFTensorSpec(p + "self_attn.q_norm.weight", (hd,), "norm"),
            HFTensorSpec(p + "self_attn.k_norm.weight", (hd,), "norm"),
        ]

    def mlp(p: str) -> list[HFTensorSpec]:
        return [
            HFTensorSpec(p + "mlp.gate_proj.weight", (c.intermediate_size, H), "linear"),
            HFTensorSpec(p + "mlp.up_proj.weight", (c.intermediate_size, H), "linear"),
            HFTensorSpec(p + "mlp.down_proj.weight", (H, c.intermediate_size), "linear"),
        ]

    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out.append(HFTensorSpec(p + "input_layernorm.weight", (H,), "norm"))
        if c.is_attention(i):
            out += attention(p)
        else:
            la = p + "linear_attn."
            out += [
                HFTensorSpec(la + "in_proj_qkv.weight", (c.conv_dim, H), "linear"),
                HFTensorSpec(la + "in_proj_z.weight", (c.value_dim, H), "linear"),
                HFTensorSpec(la + "in_proj_b.weight", (c.linear_num_value_heads, H), "linear"),
                HFTensorSpec(la + "in_proj_a.weight", (c.linear_num_value_heads, H), "linear"),
                HFTensorSpec(la + "conv1d.weight", (c.conv_dim, 1, c.linear_conv_kernel_dim), "conv"),
                HFTensorSpec(la + "dt_bias", (c.linear_num_value_heads,), "dt_bias"),
                HFTensorSpec(la + "A_log", (c.linear_num_value_heads,), "a_log"),
                HFTensorSpec(la + "norm.weight", (c.linear_value_head_dim,), "gated_norm"),
                HFTensorSpec(la + "out_proj.weight", (H, c.value_dim), "linear"),
            ]
        out.append(HFTensorSpec(p + "post_attention_layernorm.weight", (H,), "norm"))
        out += mlp(p)
    out.append(HFTensorSpec("model.norm.weight", (H,), "norm"))
    if not c.tie_word_embeddings:
        out.append(HFTensorSpec("lm_head.weight", (vocab, H), "linear"))
    if c.mtp_num_hidden_layers:
        out += [
            HFTensorSpec("mtp.fc.weight", (H, 2 * H), "linear"),
            HFTensorSpec("mtp.pre_fc_norm_embedding.weight", (H,), "norm"),
            HFTensorSpec("mtp.pre_fc_norm_hidden.weight", (H,), "norm"),
        ]
        for j in range(c.mtp_num_hidden_layers):
            p = f"mtp.layers.{j}."
            out.append(HFTensorSpec(p + "input_layernorm.weight", (H,), "norm"))
            out += attention(p)
            out.append(HFTensorSpec(p + "post_attention_layernorm.weight", (H,), "norm"))
            out += mlp(p)
        out.append(HFTensorSpec("mtp.norm.weight", (H,), "norm"))
    return out


def count_parameters(config: Qwen35SynthConfig, vocab_size: int | None = None, include_mtp: bool = True) -> int:
    """Parameters of the model (analytically, nothing is allocated); the tied LM head counts once."""
    c = config if include_mtp else dataclasses.replace(config, mtp_num_hidden_layers=0)
    return sum(s.numel for s in hf_tensor_specs(c, vocab_size))


# ------------------------------------------------------------------- llama.cpp's HF -> GGUF rules
#: HF name (after the MTP remap, ``model.layers.{i}.`` prefix stripped) -> GGUF leaf name, as gguf-py's
#: ``TensorNameMap`` resolves them for ``MODEL_ARCH.QWEN35`` (plus the NextN names of the MTP block).
HF_TO_GGUF_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_proj.bias": "ssm_dt.bias",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "eh_proj.weight": "nextn.eh_proj.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
_TOP_LEVEL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_MTP_SHARED = {
    "mtp.fc": "eh_proj",
    "mtp.pre_fc_norm_embedding": "enorm",
    "mtp.pre_fc_norm_hidden": "hnorm",
    "mtp.norm": "shared_head.norm",
}


def reorder_v_heads(t: torch.Tensor, dim: int, num_k_heads: int, num_v_per_k: int, head_dim: int) -> torch.Tensor:
    """llama.cpp's ``_LinearAttentionVReorderBase._reorder_v_heads``: along ``dim``, value heads
    grouped by key head (``[k0: v0..v{r-1}, k1: ...]``) -> tiled (``[v0: k0 k1 .., v1: k0 k1 ..]``)."""
    shape = list(t.shape)
    if dim < 0:
        dim += len(shape)
    t = t.reshape(*shape[:dim], num_k_heads, num_v_per_k, head_dim, *shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if not m or m.group(2) not in HF_TO_GGUF_NAMES:
        raise KeyError(f"no GGUF name for {hf_name!r}")
    return f"blk.{m.group(1)}.{HF_TO_GGUF_NAMES[m.group(2)]}"


def _mtp_remap(name: str, config: Qwen35SynthConfig) -> list[str]:
    """``_Qwen35MtpMixin.modify_tensors``'s renaming of ``mtp.*`` (one name per MTP block for the
    shared ``fc`` / norms)."""
    L = config.num_hidden_layers
    m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", name)
    if m:
        return [f"model.layers.{L + int(m.group(1))}.{m.group(2)}"]
    stem, _, suffix = name.rpartition(".")
    if stem not in _MTP_SHARED:
        raise KeyError(f"unknown MTP tensor {name!r}")
    return [f"model.layers.{b}.{_MTP_SHARED[stem]}.{suffix}" for b in range(L, L + config.mtp_num_hidden_layers)]


def _transform(name: str, t: torch.Tensor, config: Qwen35SynthConfig) -> tuple[str, torch.Tensor]:
    """``_LinearAttentionVReorderBase`` then ``Qwen3NextModel.modify_tensors`` on one (renamed)
    tensor; returns the (possibly renamed) HF name and the new value."""
    c = config
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    if hk != hv and "linear_attn." in name:
        r, dk, dv = hv // hk, c.linear_key_head_dim, c.linear_value_head_dim
        qk = 2 * hk * dk
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:qk], reorder_v_heads(t[qk:], 0, hk, r, dv)], dim=0)
        elif ".in_proj_z." in name:
            t = reorder_v_heads(t, 0, hk, r, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            t = reorder_v_heads(t, 0, hk, r, 1)
        elif ".A_log" in name or ".dt_bias" in name or ".dt_proj" in name:
            t = reorder_v_heads(t.unsqueeze(-1), 0, hk, r, 1).squeeze(-1) if t.dim() == 1 else reorder_v_heads(t, -1, hk, r, 1)
        elif ".conv1d" in name:
            t = t.squeeze()
            t = torch.cat([t[:qk], reorder_v_heads(t[qk:], 0, hk, r, dv)], dim=0)
        elif ".out_proj." in name:
            t = reorder_v_heads(t, 1, hk, r, dv)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return name, t


def hf_to_gguf_tensor(name: str, tensor: torch.Tensor, config: Qwen35SynthConfig) -> list[tuple[str, torch.Tensor]]:
    """llama.cpp's conversion of one HF tensor: ``[(gguf_name, value), ...]`` (PyTorch order).

    Empty for ``lm_head.weight`` of a tied model; several entries for the shared MTP tensors
    when ``config.mtp_num_hidden_layers > 1``. Works on ``meta`` tensors (for shapes).
    """
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return []
    names = _mtp_remap(name, config) if name.startswith("mtp.") else [name]
    out = []
    for n in names:
        n2, t2 = _transform(n, tensor, config)
        out.append((_gguf_name(n2), t2))
    return out


def hf_to_gguf_tensors(hf_state_dict: Mapping[str, torch.Tensor], config: Qwen35SynthConfig) -> dict[str, torch.Tensor]:
    """Apply llama.cpp's Qwen3.5 conversion (module docstring) to a whole HF-layout state dict.

    Args:
        hf_state_dict: ``Qwen3_5ForCausalLM`` names (``model.*``, ``lm_head.weight``) plus the
            checkpoint's ``mtp.*`` tensors; float tensors.
        config: the model's config (``tie_word_embeddings`` drops ``lm_head.weight``,
            ``mtp_num_hidden_layers`` sets the MTP blocks).

    Returns:
        GGUF name -> tensor in PyTorch order (``[out, in]``), float32, before quantization.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_state_dict.items():
        for gname, gt in hf_to_gguf_tensor(name, t.detach().to(torch.float32), config):
            out[gname] = gt.contiguous()
    return out


# ---------------------------------------------------------------------------------- storage types
_FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
               "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M}


def storage_type(gguf_name: str, shape: Sequence[int], dtype: str, tied: bool) -> GGMLQuantizationType:
    """GGML type of one tensor for the requested ``dtype`` (module docstring, step 3)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}")
    if len(shape) == 1 or gguf_name.endswith("ssm_conv1d.weight"):
        return GGMLQuantizationType.F32
    cols = shape[-1]
    if dtype == "f32":
        return GGMLQuantizationType.F32
    if dtype == "bf16":
        return GGMLQuantizationType.BF16
    q8 = GGMLQuantizationType.Q8_0 if cols % 32 == 0 else GGMLQuantizationType.F16
    if dtype == "q8_0":
        return q8
    # q4_k: a Q4_K_M-like mix
    lm_head = gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight")
    if lm_head or gguf_name.endswith(("ssm_alpha.weight", "ssm_beta.weight")):
        return q8
    return GGMLQuantizationType.Q4_K if cols % 256 == 0 else q8


def _nbytes(shape: Sequence[int], qtype: GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


# ------------------------------------------------------------------------------- random generation
def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    return int(np.random.SeedSequence([seed, zlib.crc32(name.encode()), chunk]).generate_state(1, np.uint64)[0] >> 1)


def _row_chunks(shape: Sequence[int]) -> list[tuple[int, int]]:
    """Row ranges a tensor is generated in (a 1-D or 3-D tensor is one chunk)."""
    if len(shape) != 2:
        return [(0, shape[0] if shape else 1)]
    rows, cols = shape
    step = max(1, CHUNK_ELEMS // max(cols, 1))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _gen_chunk(spec: HFTensorSpec, r0: int, r1: int, chunk: int, seed: int, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(_chunk_seed(seed, spec.name, chunk))
    shape = (r1 - r0, *spec.shape[1:])
    k = spec.kind
    if k == "linear":
        return torch.randn(shape, generator=g) * std
    if k == "norm":
        return torch.randn(shape, generator=g) * NORM_STD
    if k == "gated_norm":
        return 1.0 + torch.randn(shape, generator=g) * NORM_STD
    if k == "conv":
        return torch.randn(shape, generator=g) / math.sqrt(3 * spec.shape[-1])
    if k == "dt_bias":
        return torch.randn(shape, generator=g) * DT_BIAS_STD
    if k == "a_log":
        lo, hi = A_RANGE
        return torch.log(lo + (hi - lo) * torch.rand(shape, generator=g))
    raise ValueError(f"unknown init kind {k!r}")


def random_q4_k_blocks(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random ggml ``block_q4_K`` data (``uint8 [rows, cols / 256 * 144]``) whose dequantized
    values have mean ~0 and std ~``std``.

    Per 256-value block: ``d``, ``dmin`` (fp16), 8 sub-block 6-bit scales ``sc`` in [24, 40] and
    mins ``m = round(sc * 7.5 / 8)`` (with ``dmin = 8 d`` the value ``d sc q - dmin m`` is centred
    on ``q = 7.5``), packed as ggml's ``get_scale_min_k4`` reads them, then 128 bytes of uniformly
    random 4-bit quants. ``std = d * 4.61 * sqrt(E[sc^2])`` (4.61: std of a uniform nibble).
    """
    if cols % 256:
        raise ValueError("Q4_K needs rows of a multiple of 256 values")
    nb = rows * cols // 256
    sc = rng.integers(24, 41, size=(nb, 8), dtype=np.uint8)
    mn = np.rint(sc.astype(np.float32) * (7.5 / 8.0)).astype(np.uint8)
    d = np.float16(std / (math.sqrt(255.0 / 12.0) * math.sqrt(1048.0)))  # E[sc^2] = 24 + 32^2
    dmin = np.float16(8.0 * float(d))
    blocks = np.empty((nb, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    blocks[:, 2:4] = np.frombuffer(dmin.tobytes(), dtype=np.uint8)
    # bytes 0-3: sc[0..3] | (sc[4..7] >> 4) << 6; 4-7: m[0..3] | (m[4..7] >> 4) << 6;
    # 8-11: (sc[4..7] & 15) | (m[4..7] & 15) << 4
    blocks[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    blocks[:, 8:12] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    blocks[:, 12:16] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    blocks[:, 16:] = rng.integers(0, 256, size=(nb, 128), dtype=np.uint8)
    return blocks.reshape(rows, cols // 256 * 144)


def _encode(values: torch.Tensor, qtype: GGMLQuantizationType) -> np.ndarray:
    """Float values (PyTorch order) -> the array whose bytes GGUF stores for ``qtype``."""
    if qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(values.to(torch.float32).numpy())
    if qtype == GGMLQuantizationType.F16:
        return np.ascontiguousarray(values.to(torch.float16).numpy())
    if qtype == GGMLQuantizationType.BF16:
        return np.ascontiguousarray(values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    return gguf.quants.quantize(np.ascontiguousarray(values.to(torch.float32).numpy()), qtype)


# ----------------------------------------------------------------------------------- tokenizer
TokenizerKV = list[tuple[str, Any, GGUFValueType, "GGUFValueType | None"]]
_TOKENIZER_CACHE: dict[tuple[str, int, int], TokenizerKV] = {}


def _guess_type(key: str, value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, int):
        return (GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32), None
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    if isinstance(value, (list, tuple)) and value:
        sub = value[0]
        if isinstance(sub, str):
            return GGUFValueType.ARRAY, GGUFValueType.STRING
        if isinstance(sub, float):
            return GGUFValueType.ARRAY, GGUFValueType.FLOAT32
        if isinstance(sub, int):
            return GGUFValueType.ARRAY, GGUFValueType.INT32
    raise TypeError(f"tokenizer key {key!r}: cannot store {type(value).__name__}")


def load_tokenizer_kv(source: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> TokenizerKV:
    """The ``tokenizer.*`` metadata to copy, as ``(key, value, type, array_subtype)``.

    Args:
        source: a GGUF file (its ``tokenizer.*`` keys are copied with their GGUF types), a mapping
            of key -> Python value (types guessed: ids uint32, lists of str string arrays, lists of
            int int32 arrays), or ``None`` for :func:`target_service.default_model_path`
            (SmolLM2-135M-Instruct, 49152 tokens).

    Raises:
        FileNotFoundError: ``None`` and the default model is not installed.
        ValueError: no ``tokenizer.ggml.tokens``.
    """
    if isinstance(source, Mapping):
        kv = [(k, v, *_guess_type(k, v)) for k, v in source.items() if k.startswith("tokenizer.")]
    else:
        if source is None:
            from target_service import default_model_path

            source = default_model_path()
        path = os.fspath(source)
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        if key not in _TOKENIZER_CACHE:
            from target_service.gguf_loader import open_gguf

            g = open_gguf(path)
            reader = getattr(g, "_reader", None) or gguf.GGUFReader(path, "r")
            kv = []
            for name, field in reader.fields.items():
                if not name.startswith("tokenizer."):
                    continue
                vtype = GGUFValueType(field.types[0])
                sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
                value = field.contents()
                if isinstance(value, np.generic):
                    value = value.item()
                kv.append((name, value, vtype, sub))
            _TOKENIZER_CACHE[key] = kv
        kv = list(_TOKENIZER_CACHE[key])
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in kv):
        raise ValueError("tokenizer source has no tokenizer.ggml.tokens")
    return kv


def _pad_tokenizer(kv: TokenizerKV, vocab_size: int) -> TokenizerKV:
    """Pad the token list to ``vocab_size`` as llama.cpp's converter does (``[PAD{i}]``, UNUSED)."""
    tokens = next(v for k, v, *_ in kv if k == "tokenizer.ggml.tokens")
    n = len(tokens)
    if vocab_size < n:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n} tokens")
    if vocab_size == n:
        return kv
    out = []
    for k, v, t, sub in kv:
        if k == "tokenizer.ggml.tokens":
            v = list(v) + [f"[PAD{i}]" for i in range(n, vocab_size)]
        elif k == "tokenizer.ggml.token_type":
            v = list(v) + [TOKEN_TYPE_UNUSED] * (vocab_size - n)
        elif k == "tokenizer.ggml.scores":
            v = list(v) + [0.0] * (vocab_size - n)
        out.append((k, v, t, sub))
    return out


# ------------------------------------------------------------------------------------- the writer
@dataclasses.dataclass
class SynthResult:
    """What :func:`write_qwen35` wrote.

    Attributes:
        path: the GGUF file.
        config: the config as written (``vocab_size``, ``tie_word_embeddings`` and
            ``mtp_num_hidden_layers`` resolved).
        dtype: ``"f32"``, ``"bf16"``, ``"q8_0"`` or ``"q4_k"``.
        seed: the seed.
        tensor_types: GGUF name -> GGML type name, in file order.
        n_params: parameters (:func:`count_parameters`).
        hf_state_dict: the random weights in HF layout (``Qwen3_5ForCausalLM`` names plus ``mtp.*``;
            for a tied model ``lm_head.weight`` is ``model.embed_tokens.weight``), or ``None`` (a
            large model, or ``q4_k`` whose Q4_K tensors are random blocks instead).
        gguf_tensors: :func:`hf_to_gguf_tensors` of it (float32, before quantization), or ``None``.
    """

    path: str
    config: Qwen35SynthConfig
    dtype: str
    seed: int
    tensor_types: dict[str, str]
    n_params: int
    hf_state_dict: dict[str, torch.Tensor] | None
    gguf_tensors: dict[str, torch.Tensor] | None

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def tied(self) -> bool:
        return self.config.tie_word_embeddings

    def hf_config(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments of ``transformers.Qwen3_5TextConfig`` for the same model."""
        return self.config.hf_config_kwargs(**extra)

    def hf_model_state_dict(self) -> dict[str, torch.Tensor]:
        """:attr:`hf_state_dict` without the ``mtp.*`` tensors (what ``Qwen3_5ForCausalLM`` holds)."""
        if self.hf_state_dict is None:
            raise ValueError("this result kept no tensors")
        return {k: v for k, v in self.hf_state_dict.items() if not k.startswith("mtp.")}


@dataclasses.dataclass
class _Planned:
    gguf_name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    nbytes: int


def _ordered_map(pool: concurrent.futures.Executor, fn: Callable[[Any], Any], items: Iterable[Any], window: int) -> Iterator[Any]:
    """``pool.map`` with at most ``window`` items in flight (bounded memory), results in order."""
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


class _StreamWriter:
    """``gguf.GGUFWriter`` fed one tensor at a time, each possibly in several row chunks."""

    def __init__(self, writer: gguf.GGUFWriter, progress: Any):
        self.w = writer
        self.progress = progress

    def write(self, name: str, nbytes: int, chunks: Iterable[np.ndarray]) -> None:
        w = self.w
        assert w.fout is not None and len(w.fout) == 1
        first = next(iter(w.tensors[0]))
        if first != name:
            raise RuntimeError(f"writing {name!r} but the next tensor info is {first!r}")
        ti = w.tensors[0].pop(name)
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        written = 0
        for c in chunks:
            c = np.ascontiguousarray(c)
            c.tofile(fout)
            written += c.nbytes
            if self.progress is not None:
                self.progress.update(c.nbytes)
        if written != ti.nbytes or written != nbytes:
            raise RuntimeError(f"{name}: wrote {written} bytes, expected {ti.nbytes}")
        w.write_padding(fout, written)
        w.state = gguf.gguf_writer.WriterState.WEIGHTS


def write_qwen35(
    path: str | os.PathLike[str],
    config: Qwen35SynthConfig,
    dtype: str = "f32",
    seed: int = 0,
    tied: bool | None = None,
    tokenizer_from: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    mtp_layers: int | None = None,
    *,
    vocab_size: int | None = None,
    std: float | None = None,
    keep_tensors: bool | None = None,
    progress: bool = False,
    threads: int | None = None,
) -> SynthResult:
    """Write a random-weight (NOT trained) Qwen3.5 GGUF (module docstring for the rules).

    Args:
        path: output ``.gguf`` file.
        config: shapes (e.g. ``PRESETS["tiny"]``).
        dtype: ``"f32"``, ``"bf16"``, ``"q8_0"`` or ``"q4_k"`` (a Q4_K_M-like mix).
        seed: every tensor is a deterministic function of ``(seed, its HF name)``.
        tied: tie the LM head to the embeddings (``None``: ``config.tie_word_embeddings``).
        tokenizer_from: tokenizer source (:func:`load_tokenizer_kv`; default SmolLM2's).
        mtp_layers: MTP blocks to write (``None``: ``config.mtp_num_hidden_layers``).
        vocab_size: embedding rows (``None``: ``config.vocab_size``, else the tokenizer's size;
            ``0``: the tokenizer's size); a larger vocabulary pads the token list.
        std: weight std (``None``: ``config.init_std``).
        keep_tensors: return :attr:`SynthResult.hf_state_dict` / ``gguf_tensors`` (``None``: for
            models up to :data:`KEEP_TENSORS_MAX_PARAMS` parameters, not for ``q4_k``).
        progress: tqdm bar (bytes written) on stderr.
        threads: worker threads (``None``: all CPUs).

    Returns:
        :class:`SynthResult`.
    """
    path = os.fspath(path)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    tok_kv = load_tokenizer_kv(tokenizer_from)
    n_tokens = len(next(v for k, v, *_ in tok_kv if k == "tokenizer.ggml.tokens"))
    if vocab_size is None:
        vocab_size = config.vocab_size
    if not vocab_size:
        vocab_size = n_tokens
    cfg = dataclasses.replace(
        config,
        vocab_size=int(vocab_size),
        tie_word_embeddings=config.tie_word_embeddings if tied is None else bool(tied),
        mtp_num_hidden_layers=config.mtp_num_hidden_layers if mtp_layers is None else int(mtp_layers),
        init_std=config.init_std if std is None else float(std),
    )
    cfg.validate()
    tok_kv = _pad_tokenizer(tok_kv, cfg.vocab_size)
    specs = hf_tensor_specs(cfg)
    n_params = sum(s.numel for s in specs)
    if keep_tensors is None:
        keep_tensors = n_params <= KEEP_TENSORS_MAX_PARAMS and dtype != "q4_k"

    # plan: GGUF names / shapes (llama.cpp's conversion run on meta tensors) and storage types
    plan: list[tuple[HFTensorSpec, list[_Planned]]] = []
    for spec in specs:
        outs = []
        for gname, gt in hf_to_gguf_tensor(spec.name, torch.empty(spec.shape, device="meta"), cfg):
            shape = tuple(gt.shape)
            qtype = storage_type(gname, shape, dtype, cfg.tie_word_embeddings)
            outs.append(_Planned(gname, shape, qtype, _nbytes(shape, qtype)))
        plan.append((spec, outs))

    writer = gguf.GGUFWriter(path, ARCH)
    _add_metadata(writer, cfg, dtype, tok_kv)
    for _, outs in plan:
        for p in outs:
            writer.add_tensor_info(p.gguf_name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
    total_bytes = sum(p.nbytes for _, outs in plan for p in outs)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=os.path.basename(path),
                   file=sys.stderr, dynamic_ncols=True)
    hf_keep: dict[str, torch.Tensor] | None = {} if keep_tensors else None
    gguf_keep: dict[str, torch.Tensor] | None = {} if keep_tensors else None
    workers = max(1, threads or os.cpu_count() or 1)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        sw = _StreamWriter(writer, bar)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for spec, outs in plan:
                _write_spec(sw, pool, 2 * workers, spec, outs, cfg, seed, hf_keep, gguf_keep)
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    if hf_keep is not None and cfg.tie_word_embeddings:
        hf_keep["lm_head.weight"] = hf_keep["model.embed_tokens.weight"]
    return SynthResult(
        path=path, config=cfg, dtype=dtype, seed=seed,
        tensor_types={p.gguf_name: p.qtype.name for _, outs in plan for p in outs},
        n_params=n_params, hf_state_dict=hf_keep, gguf_tensors=gguf_keep,
    )


def _is_identity(spec: HFTensorSpec) -> bool:
    """The vocabulary-sized tensors, which llama.cpp only renames (so they can be streamed)."""
    return spec.name in ("model.embed_tokens.weight", "lm_head.weight")


def _write_spec(sw: _StreamWriter, pool, window: int, spec: HFTensorSpec, outs: list[_Planned], cfg: Qwen35SynthConfig,
                seed: int, hf_keep: dict | None, gguf_keep: dict | None) -> None:
    std = cfg.init_std
    chunks = _row_chunks(spec.shape)
    if not outs:  # tied lm_head: nothing stored
        return
    # Q4_K tensors: random blocks, straight to the file (not the HF weights)
    if all(p.qtype == GGMLQuantizationType.Q4_K for p in outs) and hf_keep is None:
        for p in outs:
            rows, cols = p.shape
            pchunks = _row_chunks(p.shape)

            def q4(item, p=p, cols=cols):
                ci, (r0, r1) = item
                rng = np.random.default_rng(_chunk_seed(seed, "q4_k:" + p.gguf_name, ci))
                return random_q4_k_blocks(r1 - r0, cols, std, rng)

            sw.write(p.gguf_name, p.nbytes, _ordered_map(pool, q4, enumerate(pchunks), window))
        return
    if _is_identity(spec) and hf_keep is None:
        (p,) = outs

        def gen_encode(item):
            ci, (r0, r1) = item
            return _encode(_gen_chunk(spec, r0, r1, ci, seed, std), p.qtype)

        sw.write(p.gguf_name, p.nbytes, _ordered_map(pool, gen_encode, enumerate(chunks), window))
        return
    parts = list(pool.map(lambda item: _gen_chunk(spec, item[1][0], item[1][1], item[0], seed, std), enumerate(chunks)))
    value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    del parts
    if hf_keep is not None:
        hf_keep[spec.name] = value.clone()
    converted = dict(hf_to_gguf_tensor(spec.name, value, cfg))
    for p in outs:
        t = converted[p.gguf_name].contiguous()
        if tuple(t.shape) != p.shape:  # pragma: no cover - planned on the same function
            raise RuntimeError(f"{p.gguf_name}: shape {tuple(t.shape)} != planned {p.shape}")
        if gguf_keep is not None:
            gguf_keep[p.gguf_name] = t.clone()
        if p.qtype == GGMLQuantizationType.Q4_K:
            # kept tensors of a q4_k file (keep_tensors=True): Q4_K from random blocks anyway
            rows, cols = p.shape
            rng = np.random.default_rng(_chunk_seed(seed, "q4_k:" + p.gguf_name, 0))
            sw.write(p.gguf_name, p.nbytes, [random_q4_k_blocks(rows, cols, std, rng)])
            continue
        row_chunks = _row_chunks(p.shape) if t.dim() == 2 else [(0, t.shape[0])]
        sw.write(p.gguf_name, p.nbytes, _ordered_map(pool, lambda rr, t=t, q=p.qtype: _encode(t[rr[0]:rr[1]], q), row_chunks, window))


def _add_metadata(w: gguf.GGUFWriter, c: Qwen35SynthConfig, dtype: str, tok_kv: TokenizerKV) -> None:
    """``general.*``, ``qwen35.*`` (types as llama.cpp's converter writes them) and the tokenizer."""
    w.add_type("model")
    w.add_name(f"synthetic random Qwen3.5 {c.name} (not a trained model)")
    w.add_description(f"Synthetic Qwen3.5 ({c.name} shapes) with {NOT_TRAINED}; written by target_service.synth")
    w.add_file_type(int(_FILE_TYPES[dtype]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(c.num_hidden_layers + c.mtp_num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_theta))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_vocab_size(int(c.vocab_size))
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.value_dim)
    w.add_full_attention_interval(c.full_attention_interval)
    w.add_rope_dimension_count(c.rope_dim)
    w.add_rope_dimension_sections(list(c.mrope_section) + [0] * (4 - len(c.mrope_section)))
    if c.mtp_num_hidden_layers:
        w.add_nextn_predict_layers(c.mtp_num_hidden_layers)
    for key, value, vtype, sub in tok_kv:
        w.add_key_value(key, value, vtype, sub_type=sub)


# -------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    rows = "\n".join(
        f"  {n:5s} hidden {c.hidden_size}, {c.num_hidden_layers} layers, ffn {c.intermediate_size}, "
        f"attn {c.num_attention_heads}/{c.num_key_value_heads}x{c.head_dim}, GDN {c.linear_num_key_heads}k/"
        f"{c.linear_num_value_heads}v x{c.linear_key_head_dim}, vocab {c.vocab_size or 'tokenizer'}, "
        f"{'tied' if c.tie_word_embeddings else 'untied'}, mtp {c.mtp_num_hidden_layers}, "
        f"~{count_parameters(c, c.vocab_size or 49152) / 1e9:.2f}B params"
        for n, c in PRESETS.items()
    )
    p = argparse.ArgumentParser(
        prog="python -m target_service.synth",
        description=(
            "Write a SYNTHETIC Qwen3.5 GGUF with RANDOM weights -- NOT a trained model (its text is "
            "gibberish) -- at the real Qwen3.5 dense shapes, laid out exactly like a llama.cpp "
            "conversion (loadable by llama.cpp-style loaders and transformers), for tests and benchmarks."
        ),
        epilog=(
            "presets (real Qwen3.5 shapes but for tiny; see PRESETS in the source for the sources):\n" + rows +
            "\n\nTokenizer: SmolLM2-135M-Instruct's (49152 tokens) unless --vocab-from; a larger vocabulary "
            "(the presets use Qwen3.5's 248320) pads the token list with [PAD{i}] UNUSED tokens, as llama.cpp does.\n"
            "The output is NOT a trained model: random weights, for tests and benchmarks only."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arch", default=ARCH, choices=[ARCH], help="architecture (only qwen35)")
    p.add_argument("--preset", required=True, choices=list(PRESETS), help="model shapes")
    p.add_argument("--dtype", default="bf16", choices=DTYPES,
                   help="storage: f32, bf16, q8_0, or q4_k (Q4_K_M-like mix, random Q4_K blocks); default bf16")
    p.add_argument("--out", required=True, help="output .gguf path")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None, help="tie the LM head to the embeddings")
    tie.add_argument("--untied", dest="tied", action="store_false", help="separate output.weight")
    p.add_argument("--mtp", type=int, default=None, metavar="N", help="MTP blocks (default: the preset's real model)")
    p.add_argument("--vocab-from", default=None, metavar="PATH",
                   help="GGUF whose tokenizer.* metadata to copy (default: SmolLM2-135M-Instruct)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="embedding rows (default: the preset's; 0 = the tokenizer's size); pads the token list")
    p.add_argument("--std", type=float, default=None, help="weight std (default: the preset's)")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: all CPUs)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = PRESETS[args.preset]
    res = write_qwen35(
        args.out, cfg, dtype=args.dtype, seed=args.seed, tied=args.tied, tokenizer_from=args.vocab_from,
        mtp_layers=args.mtp, vocab_size=args.vocab_size, std=args.std, keep_tensors=False,
        progress=args.progress, threads=args.threads,
    )
    size = os.path.getsize(res.path)
    print(f"wrote {res.path}: synthetic random Qwen3.5 {cfg.name} ({NOT_TRAINED}), {res.dtype}, "
          f"{res.n_params / 1e9:.3f}B params, vocab {res.vocab_size}, {'tied' if res.tied else 'untied'}, "
          f"mtp {res.config.mtp_num_hidden_layers}, {size / 2**30:.2f} GiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The project's drafter computes what z-lab's DFlash reference computes.

The reference draft model is built here, independently of the project's code, from transformers'
Qwen3 pieces (``Qwen3RMSNorm``, ``Qwen3RotaryEmbedding``, ``Qwen3MLP``) and an attention written
below, following z-lab/dflash ``dflash/model.py`` (``Qwen3DFlashAttention``,
``Qwen3DFlashDecoderLayer``, ``DFlashDraftModel``, ``dflash_generate``):

* the context rows (target features through ``fc`` and ``hidden_norm``) and the block rows
  (target embedding of ``[root, MASK x (B-1)]``) are both projected by each layer's k/v
  projections (``k_norm`` on both), RoPE at their absolute positions; the block's queries attend,
  without a mask, over ``[cached context ; new context ; block]``;
* the draft K/V cache keeps every row it was given and is cut back to the committed length after
  each draft (``past_key_values_draft.crop(start)``), so the next round's new context (the
  accepted rows) is appended at the committed length;
* the draft distributions are the LM head over the last ``B - 1`` block rows;
* a ``"sliding_attention"`` layer gets ``sliding_window`` from transformers' ``Qwen3Config``
  (None unless ``use_sliding_window``), which the reference hands to the attention function; the
  project follows what flash-attention 2 (the reference benchmark's backend) does with it:
  ``window_size = (W - 1, W - 1)`` when the keys outnumber ``W``, queries aligned to the last
  keys (bottom-right), non-causal. Written below as that explicit mask.

One random checkpoint, written as a z-lab directory (config.json + model.safetensors, HF names,
fp32), is loaded into that model and into the project (``draft_service.gguf_io.load_drafter`` on
the directory: the converter's reader) and both run the same greedy decode loop over a tiny
random llama target (transformers' ``LlamaForCausalLM`` gives the features). The target's
choices are scripted so the acceptance varies (0 .. B-1 drafts accepted): at each step the
reference's first ``a`` drafts are accepted and the next token is another one; the project's loop
computes its own acceptance against that same token sequence. Checked at every step: the draft
logits within 1e-4 (fp32) and the acceptance lengths equal. The same for drafters with
sliding-window layers (windows shorter than the context, one shorter than the block too), and
the window is shown to change the logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding  # noqa: E402

BLOCK = 8
TAPS = [0, 2]         # target layers read (of the tiny llama's 4)
DRAFT_LAYERS = 2
MASK = 4              # a control token of the tiny vocabulary
#: drafts accepted at each step (the scripted target): none, some, all B-1
SCHEDULE = [2, 0, 7, 1, 4, 0, 3, 6, 5]


# ------------------------------------------------------------------------- the reference model


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class DraftCache:
    """Per-layer K/V ``[1, nkv, rows, D]`` with ``crop`` (transformers' ``DynamicCache`` as the
    reference uses it: update appends, crop cuts back)."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers

    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def update(self, k, v, layer):
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def crop(self, n: int) -> None:
        self.k = [None if t is None else t[:, :, :n] for t in self.k]
        self.v = [None if t is None else t[:, :, :n] for t in self.v]


def flash_window_mask(q_len: int, kv_len: int, window: int | None) -> torch.Tensor | None:
    """What flash-attention 2 does with a layer's ``sliding_window`` under transformers
    (``_flash_attention_forward``): nothing unless ``kv_len > window``; then
    ``window_size = (window - 1, window - 1)``, non-causal, with query ``i`` aligned to key
    position ``i + kv_len - q_len`` (flash-attn's bottom-right alignment): it sees keys ``j``
    with ``|i + kv_len - q_len - j| <= window - 1``. ``[q_len, kv_len]`` bool, or None."""
    if window is None or kv_len <= window:
        return None
    qpos = torch.arange(q_len)[:, None] + (kv_len - q_len)
    return (qpos - torch.arange(kv_len)[None, :]).abs() <= window - 1


class RefAttention(nn.Module):
    """``Qwen3DFlashAttention``: queries from the block, keys/values from ``[context ; block]``,
    q/k RMSNorm per head, RoPE (queries at the block's positions), eager softmax; no mask on a
    full layer, :func:`flash_window_mask` on a sliding one."""

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        # the reference's rule (cfg.sliding_window is None unless use_sliding_window)
        self.sliding_window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding_attention" else None
        self.head_dim = cfg.head_dim
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        H, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, cfg.num_attention_heads * D, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_key_value_heads * D, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * D, H, bias=False)
        self.q_norm = Qwen3RMSNorm(D, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(D, eps=cfg.rms_norm_eps)

    def forward(self, hidden, target_hidden, cos, sin, cache: DraftCache):
        bsz, q_len = hidden.shape[:2]
        ctx_len = target_hidden.shape[1]
        q = self.q_norm(self.q_proj(hidden).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(target_hidden), self.k_proj(hidden)], dim=1).view(bsz, ctx_len + q_len, -1, self.head_dim)
        v = torch.cat([self.v_proj(target_hidden), self.v_proj(hidden)], dim=1).view(bsz, ctx_len + q_len, -1, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos[..., -q_len:, :] + _rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + _rotate_half(k) * sin
        k, v = cache.update(k, v, self.layer_idx)
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        scores = (q @ k.transpose(2, 3)) * self.scaling
        mask = flash_window_mask(q_len, k.shape[2], self.sliding_window)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((p @ v).transpose(1, 2).reshape(bsz, q_len, -1))


class RefLayer(nn.Module):
    """``Qwen3DFlashDecoderLayer``: pre-norm attention and SwiGLU MLP with residuals."""

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.self_attn = RefAttention(cfg, layer_idx)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, hidden, target_hidden, cos, sin, cache):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), target_hidden, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class RefDraftModel(nn.Module):
    """``DFlashDraftModel``: ``ctx = hidden_norm(fc(target_hidden))``, the layers over the noise
    embedding, final ``norm``."""

    def __init__(self, cfg, num_taps: int):
        super().__init__()
        self.layers = nn.ModuleList(RefLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg)
        self.fc = nn.Linear(num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, position_ids, noise_embedding, target_hidden, cache):
        hidden = noise_embedding
        target_hidden = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, target_hidden, cos, sin, cache)
        return self.norm(hidden)


# ------------------------------------------------------------------------- the checkpoint


def _zlab_checkpoint(path, tiny, seed: int = 11, windows: dict | None = None) -> dict:
    """Write a random fp32 z-lab drafter directory for ``tiny`` (``windows``: extra config
    fields, the sliding-window ones); returns its config dict."""
    H, heads, kv, D, F = tiny.hidden, 4, 2, 16, 96
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": F,
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": D, "num_hidden_layers": DRAFT_LAYERS,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": tiny.vocab, "max_position_embeddings": 2048,
           "attention_bias": False, "hidden_act": "silu", "block_size": BLOCK, "num_target_layers": tiny.layers,
           "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TAPS}, "torch_dtype": "float32"} | (windows or {})
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: torch.randn(*s, generator=g) * 0.15  # noqa: E731
    norm = lambda n: 1 + 0.2 * torch.randn(n, generator=g)  # noqa: E731
    t = {"fc.weight": w(H, len(TAPS) * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
              p + "self_attn.q_proj.weight": w(heads * D, H), p + "self_attn.k_proj.weight": w(kv * D, H),
              p + "self_attn.v_proj.weight": w(kv * D, H), p + "self_attn.o_proj.weight": w(H, heads * D),
              p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D),
              p + "mlp.gate_proj.weight": w(F, H), p + "mlp.up_proj.weight": w(F, H), p + "mlp.down_proj.weight": w(H, F)}
    os.makedirs(path, exist_ok=True)
    safetensors_torch.save_file(t, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return cfg


def _reference_model(directory: str, cfg: dict) -> RefDraftModel:
    qcfg = transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "dflash_config", "torch_dtype")})
    model = RefDraftModel(qcfg, len(TAPS))
    state = safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary_emb" in m for m in missing), (missing, unexpected)
    return model.eval()


# ------------------------------------------------------------------------- the test


#: the drafters compared: full attention; a sliding first layer with a window shorter than the
#: block (5 < 8: the window bites inside the block too); a sliding second layer with B <= W = 10
#: (the published drafters' case: only old context rows drop out). Contexts reach 44 rows.
WINDOWS = {
    "full": None,
    "window-5": {"use_sliding_window": True, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]},
    "window-10": {"use_sliding_window": True, "sliding_window": 10, "layer_types": ["full_attention", "sliding_attention"]},
}


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("windows", list(WINDOWS.values()), ids=list(WINDOWS))
@torch.no_grad()
def test_project_drafter_matches_the_reference_over_a_greedy_decode(tiny_llama, tmp_path, windows):
    from draft_service.batched import DraftItem, ReferenceDrafterEngine
    from draft_service.gguf_io import load_drafter

    tiny = tiny_llama
    directory = str(tmp_path / "zlab-drafter")
    cfg = _zlab_checkpoint(directory, tiny, windows=windows)
    ref = _reference_model(directory, cfg)
    project = ReferenceDrafterEngine(load_drafter(directory, tiny.path, dtype=torch.float32), max_sessions=1)
    want_windows = [0] * DRAFT_LAYERS if windows is None else [
        windows["sliding_window"] if t == "sliding_attention" else 0 for t in windows["layer_types"]]
    assert project.drafter.config.layer_windows == want_windows
    assert [layer.self_attn.sliding_window or 0 for layer in ref.layers] == want_windows
    window_bit = []                                             # |windowed - full| of the reference's logits

    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny.hf_config())).eval()
    target.load_state_dict(tiny.hf_state_dict)
    embed, lm_head = target.model.embed_tokens, target.lm_head
    target_cache = transformers.DynamicCache()

    def target_features(rows: list[int]) -> torch.Tensor:
        """Features of newly committed rows (outputs of the TAPS layers: hidden_states[i + 1])."""
        out = target(torch.tensor([rows]), past_key_values=target_cache, use_cache=True, output_hidden_states=True)
        return torch.cat([out.hidden_states[i + 1] for i in TAPS], dim=-1)

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(20, tiny.vocab, (7,), generator=gen).tolist()
    seq = list(prompt)                                          # the committed tokens (+ root)
    new_ctx = target_features(prompt)                           # [1, 7, N*H]
    seq.append(int(torch.randint(20, tiny.vocab, (1,), generator=gen)))   # the first root, at len(prompt)
    start = len(prompt)
    draft_cache = DraftCache(DRAFT_LAYERS)
    accepted_ref, accepted_project = [], []
    for step, planned in enumerate(SCHEDULE):
        root = seq[start]
        # -- the reference (z-lab dflash_generate's loop body)
        block = torch.full((1, BLOCK), MASK, dtype=torch.long)
        block[0, 0] = root
        positions = torch.arange(draft_cache.length(), start + BLOCK)[None]
        hidden = ref(positions, embed(block), new_ctx, draft_cache)
        ref_logits = lm_head(hidden[:, 1 - BLOCK:])[0]          # [B-1, V]
        if windows is not None:                                 # the same step without the windows
            saved = [layer.self_attn.sliding_window for layer in ref.layers]
            for layer in ref.layers:
                layer.self_attn.sliding_window = None
            draft_cache.crop(start - new_ctx.shape[1])
            full = lm_head(ref(positions, embed(block), new_ctx, draft_cache)[:, 1 - BLOCK:])[0]
            for layer, w in zip(ref.layers, saved):
                layer.self_attn.sliding_window = w
            window_bit.append(float((full - ref_logits).abs().max()))
        draft_cache.crop(start)
        drafts = ref_logits.argmax(-1).tolist()
        # -- the project (the draft service's CPU engine: append the new rows, draft the block)
        out = project.propose_batch([DraftItem("s", new_ctx[0], root, start, budget=0, top_k=0, max_depth=0)])[0]
        assert not isinstance(out, BaseException), out
        project_logits = project.drafter.block_logits(project.sessions["s"], root)
        torch.testing.assert_close(project_logits, ref_logits, atol=1e-4, rtol=0, msg=lambda m: f"step {step}: {m}")
        assert out.tokens[0] == root and out.parents == list(range(-1, BLOCK - 1))
        # -- the scripted target: accept the reference's first `planned` drafts, then another token
        seq[start + 1:] = drafts[:planned]
        if planned < BLOCK - 1:
            seq.append((drafts[planned] + 7) % tiny.vocab)
        else:
            seq.append((root * 3 + 1) % tiny.vocab)
        truth = seq[start + 1: start + BLOCK]
        accept = lambda d: next((j for j, (a, b) in enumerate(zip(d, truth)) if a != b), len(truth))  # noqa: E731
        accepted_ref.append(accept(drafts))
        accepted_project.append(accept(out.tokens[1:]))
        assert accepted_project[-1] == accepted_ref[-1] == planned, (step, accepted_project, accepted_ref)
        committed = seq[start: start + planned + 1]             # root and the accepted drafts
        new_ctx = target_features(committed)
        start += planned + 1
    assert accepted_project == accepted_ref == SCHEDULE
    if windows is not None:                                     # the windows changed the drafts' logits
        assert max(window_bit) > 1e-2, window_bit
    assert project.session_length("s") == start - (SCHEDULE[-1] + 1)

"""The drafter step on the project's fused kernels: the fast path of
:func:`draft_service.batched.draft_step` (its plain-PyTorch reference and test oracle).

Why: the reference step is written with ``nn.Linear`` / ``RMSNorm`` modules and elementwise
PyTorch, about 250 small kernels for the shipped 3-layer drafter; captured in a CUDA graph it
still cost 1.06 ms of device time on an H200 for a drafter whose weights take microseconds to read
(``benchmarks/gpu/smollm2-135m-q4_1.json``, ``draft_propose``). This step runs the same math with
the kernels the target engine uses (docs/ARCHITECTURE.md, "The drafter step"):

* ``kernels.linear.linear`` on packed weights: ``[q; k; v]`` for the block, ``[k; v]`` for the
  context rows, ``[gate; up]`` for the MLP (one launch each instead of three or two);
* ``kernels.norm.rms_norm`` / ``add_rms_norm`` (the residual add fused into the next norm, as in
  the target models' ``layers_forward``);
* ``kernels.rope.rope_store``: RoPE of ``q`` and ``k`` and the K/V write into the context pool in
  one launch, with ``cos`` / ``sin`` read from a table made once
  (``kernels.rope.reference.rope_table``: the float64 angles rounded to float32, which is what
  the reference's ``apply_rope`` computes with);
* ``kernels.linear.linear_swiglu`` for the gate-up projection and SwiGLU;
* ``kernels.attention.pool_attention`` with the layer's window on sliding layers
  (``DrafterConfig.layer_window``; the kernel skips key tiles below the window);
* ``kernels.topk.topk_log_softmax`` for the per-depth top-K of the log-softmax (two launches
  instead of torch's softmax kernel and ~15 of radix select; lower token id first among equal
  logits).

The order of the writes is the reference's: every layer's context K/V first (padding context rows
land at scratch rows the block then overwrites), then the block's K/V layer by layer. On the CPU
every kernel is its PyTorch reference, so the two steps agree to float32 rounding there
(``tests/test_drafter_fused.py``); on CUDA they agree to bf16 rounding (the fused kernels round
once where the reference rounds after each op).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kernels import attention as attn_ops
from kernels.embed import embed_block
from kernels.linear import linear, linear_swiglu
from kernels.norm import add_rms_norm, rms_norm
from kernels.quant import QuantizedWeight
from kernels.rope import rope_store
from kernels.rope.reference import rope_table
from kernels.topk import topk_log_softmax


@dataclasses.dataclass
class FusedLayer:
    """One draft layer's weights for the fused step (``[out, in]``, model dtype, contiguous)."""

    qkv: torch.Tensor       # [(nh + 2 nkv) D, H]
    kv: torch.Tensor        # [2 nkv D, H]  (the context rows need no queries)
    o: torch.Tensor         # [H, nh D]
    gate_up: torch.Tensor   # [2F, H]
    down: torch.Tensor      # [H, F]
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor


class FusedDrafter:
    """Packed weights and the rotary table of a :class:`draft_service.drafter.DFlashDrafter` for
    :meth:`step`. The drafter's own parameters are not copied where they can be shared (norm
    weights, ``fc``, ``o``, ``down``, the target's embedding and LM head); the packed ``qkv``,
    ``kv`` and ``gate_up`` are new tensors (for the shipped drafter: 3 layers, about 12 MB in bf16).

    Args:
        drafter: the model, on its device and dtype, in eval mode.
        max_positions: rotary table rows (positions ``0..max_positions-1``; the pool's rows).
    """

    def __init__(self, drafter, max_positions: int):
        c = drafter.config
        self.drafter, self.config = drafter, c
        self.eps = float(c.rms_eps)
        self.layers = []
        with torch.no_grad():
            for layer in drafter.layers:
                q, k, v = layer.attn_q.weight, layer.attn_k.weight, layer.attn_v.weight
                self.layers.append(FusedLayer(
                    qkv=torch.cat([q, k, v]).contiguous(), kv=torch.cat([k, v]).contiguous(),
                    o=layer.attn_output.weight.contiguous(),
                    gate_up=torch.cat([layer.ffn_gate.weight, layer.ffn_up.weight]).contiguous(),
                    down=layer.ffn_down.weight.contiguous(),
                    attn_norm=layer.attn_norm.weight, ffn_norm=layer.ffn_norm.weight,
                    q_norm=layer.attn_q_norm.weight, k_norm=layer.attn_k_norm.weight))
            head = drafter.head_weight          # GGUF blocks (--weights quantized) are read as they are
            self.head = head if isinstance(head, QuantizedWeight) else head.to(drafter.dtype).contiguous()
            self.embed = drafter.embed_weight
        self.cos, self.sin = rope_table(max_positions, c.head_dim, c.rope_theta, drafter.device)
        self._anc: list[torch.Tensor] = []   # (_ancestors)

    def _ancestors(self, b: int, device) -> torch.Tensor:
        """``[b, B]`` int64 ancestor masks of the block, every bit set (each block row sees every
        other): a slice of one tensor made outside any graph capture (the captures' warm-up runs
        make it, largest batch first), so a replayed step does not refill it. Tensors made
        before are kept: a graph captured with one of them still reads it."""
        t = self._anc[-1] if self._anc else None
        if t is None or t.shape[0] < b or t.device != torch.device(device):
            B = self.config.block_size
            t = torch.full((b, B), (1 << B) - 1 if B < 64 else -1, dtype=torch.long, device=device)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return t   # (made inside a capture: the graph refills it, and it is not kept)
            self._anc.append(t)
        return t[:b]

    def _context(self, pool, slots: torch.Tensor, held: torch.Tensor, features: torch.Tensor) -> None:
        """Every layer's context K/V of ``features`` ``[b, a, N*H]`` at rows ``held..held+a-1``
        (positions = pool rows: :func:`kernels.rope.rope_store` reads the rotary table at them)."""
        c, d = self.config, self.drafter
        b, a = features.shape[:2]
        nkv, D = c.num_kv_heads, c.head_dim
        ctx = rms_norm(linear(features.reshape(b * a, -1).to(d.dtype), d.fc.weight),
                       d.hidden_norm.weight, self.eps)                          # [b*a, H]
        for i, lw in enumerate(self.layers):
            kv = linear(ctx, lw.kv)
            k = rms_norm(kv[:, : nkv * D].reshape(b * a, nkv, D), lw.k_norm, self.eps)   # (read in place)
            v = kv[:, nkv * D :].reshape(b * a, nkv, D)
            rope_store(k, k, v, self.cos, self.sin, pool.k[i], pool.v[i], slots, held, table=True)

    @torch.no_grad()
    def step(self, pool, slots: torch.Tensor, held: torch.Tensor, n_rows: torch.Tensor, roots: torch.Tensor,
             features: torch.Tensor, k: int, splits: int = 1,
             max_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`draft_service.batched.draft_step` on the fused kernels (same arguments and
        returns: ``(logprobs [b, B-1, k] float32, tokens [b, B-1, k] int64)``). Graph-safe."""
        c = self.config
        B, nh, nkv, D = c.block_size, c.num_heads, c.num_kv_heads, c.head_dim
        dev = features.device
        b = features.shape[0]
        self._context(pool, slots, held, features)
        lengths = held + n_rows                                                  # L: the block at rows L..L+B-1
        ancestors = self._ancestors(b, dev)
        scale = 1.0 / math.sqrt(D)
        x = embed_block(self.embed, roots, c.mask_token_id, B, self.drafter.dtype)   # [b*B, H]
        h = rms_norm(x, self.layers[0].attn_norm, self.eps)
        n = b * B
        for i, lw in enumerate(self.layers):
            qkv = linear(h, lw.qkv)
            q = rms_norm(qkv[:, : nh * D].reshape(n, nh, D), lw.q_norm, self.eps)
            kk = rms_norm(qkv[:, nh * D : (nh + nkv) * D].reshape(n, nkv, D), lw.k_norm, self.eps)
            v = qkv[:, (nh + nkv) * D :].reshape(n, nkv, D)
            q = rope_store(q, kk, v, self.cos, self.sin, pool.k[i], pool.v[i], slots, lengths, table=True)
            o = attn_ops.pool_attention(q.reshape(b, B, nh, D), pool.k[i], pool.v[i], slots, lengths, ancestors,
                                        scale, splits=splits, window=c.layer_window(i),
                                        max_splits=max_splits)
            x, h = add_rms_norm(x, linear(o.reshape(n, nh * D), lw.o), lw.ffn_norm, self.eps)
            nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.drafter.output_norm.weight
            x, h = add_rms_norm(x, linear(linear_swiglu(h, lw.gate_up), lw.down), nxt, self.eps)
        hidden = h.reshape(b, B, -1)[:, 1:].reshape(b * (B - 1), -1)
        logits = linear(hidden, self.head, torch.float32)                       # [b*(B-1), V]
        values, indices = topk_log_softmax(logits, k)
        return values.reshape(b, B - 1, k), indices.reshape(b, B - 1, k)


__all__ = ["FusedDrafter", "FusedLayer"]

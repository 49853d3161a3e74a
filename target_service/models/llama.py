"""The ``llama``, ``qwen3`` and ``qwen3moe`` architectures (attention-only decoders: SmolLM2,
Llama 2/3, Qwen3 dense, Qwen3-MoE and the like), plain PyTorch.

One forward serves prefill and tree verify: ``T`` new tokens at given positions attend to the
committed KV cache ``[0, L)`` and, among themselves, to what ``mask`` allows (causal for a prefill
chunk, ancestors for a token tree). The forward never writes the cache: it returns the new
tokens' K/V, and :meth:`LlamaModel.commit` copies the accepted rows into place. So the committed
state is untouched until the accepted path is known (docs/ARCHITECTURE.md, "State and rollback"), and
rollback of a llama model is simply not copying the rejected rows.

GGUF facts (llama.cpp ``convert_hf_to_gguf.py``, ``LlamaModel.permute``): the rows of
``attn_q`` / ``attn_k`` are permuted for ggml's interleaved (GPT-J style) rotary. We undo that
permutation on load (as transformers' GGUF loader does, ``reverse_permute``) and apply rotary in
the HF "rotate_half" (NeoX) form, so the weights and activations match
``transformers.LlamaForCausalLM`` loaded from the same file.

``qwen3`` (llama.cpp ``LLM_ARCH_QWEN3``; converter ``Qwen3Model(Qwen2Model)``) is the same decoder
plus a per-head RMSNorm of q and k (``blk.{i}.attn_q_norm`` / ``attn_k_norm``, ``[head_dim]``, stored
as is, the layer's RMS eps) applied before the rotary embedding, and ``head_dim`` from
``qwen3.attention.key_length`` (it may differ from ``hidden / heads``: Qwen3-0.6B has 1024 / 16 heads
and head_dim 128). Its converter does not permute q/k rows (NeoX rotary in llama.cpp), so nothing is
un-permuted. One class runs both (:attr:`LlamaConfig.qk_norm` switches the norm on), so the batched
GPU engine runs a qwen3 model through the same ``layers_forward``, kernels and graphs.

``qwen3moe`` (llama.cpp ``LLM_ARCH_QWEN3MOE``; converter ``Qwen3MoeModel(Qwen2MoeModel)``) is
``qwen3``'s attention with a sparse mixture-of-experts FFN in every layer instead of the MLP:
``blk.{i}.ffn_gate_inp`` ``[E, H]`` (the router; llama.cpp's converter stores it F32),
``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, F, H]`` and ``ffn_down_exps`` ``[E, H, F]`` (the HF
experts' ``gate_proj`` / ``up_proj`` / ``down_proj`` stacked on a leading expert axis; PyTorch
order), with ``qwen3moe.expert_count`` (E), ``expert_used_count`` (k) and
``expert_feed_forward_length`` (F; llama.cpp falls back to ``feed_forward_length / k``).
Routing is softmax over the router logits in float32, top-k, the k probabilities renormalised
(llama.cpp's ``qwen3moe.cpp`` passes ``norm_w = true``; transformers' GGUF loader sets
``norm_topk_prob = True`` for it), :func:`~target_service.models.layers.moe_ffn`. On load the
experts are restacked for that function's two dense projections (``gate_up_exps`` ``[E * 2F, H]``,
``down_exps`` ``[H, E * F]``) and always held as floats: quantized expert tensors are dequantized
at load (a warning names their types when ``--weights quantized`` was asked).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from kernels.attention import tree_attention
from kernels.linear import linear
from kernels.quant import embedding
from kernels.norm import add_rms_norm, rms_norm
from target_service.models.layers import apply_rope_rows, mlp_then_norm, moe_then_norm, rope_cos_sin
from runtime.gguf_loader import GGUFError, GGUFFile, open_gguf, vocab_size
from target_service.models.kv_cache import KVCache
from target_service.models.weights import FLOAT_TYPES, load_weights, pack_rows, permute_rows, place

log = logging.getLogger(__name__)


#: GGUF architectures this module runs.
ARCHITECTURES = ("llama", "qwen3", "qwen3moe")
#: Per-layer tensors of the MoE FFN (``qwen3moe``), in place of ``ffn_gate`` / ``ffn_up`` / ``ffn_down``.
MOE_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclasses.dataclass
class LlamaConfig:
    """Shapes and constants of a llama, qwen3 or qwen3moe model, from GGUF ``{arch}.*`` metadata.

    ``qk_norm``: q and k are RMS-normed per head before the rotary embedding (``qwen3``, ``qwen3moe``).
    ``arch``: the GGUF architecture (``llama`` q/k rows are un-permuted on load).
    ``num_experts``: experts per layer (``qwen3moe``; 0 = a dense MLP); ``num_experts_used``: the
    top-k; ``expert_ffn``: each expert's intermediate size; ``norm_topk_prob``: the chosen experts'
    probabilities renormalised to sum 1 (true for qwen3moe, as llama.cpp runs it).
    ``intermediate_size`` is the dense MLP's (for qwen3moe, what the file states; unused).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    context_length: int
    tied_embeddings: bool
    qk_norm: bool = False
    arch: str = "llama"
    num_experts: int = 0
    num_experts_used: int = 0
    expert_ffn: int = 0
    norm_topk_prob: bool = True

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "LlamaConfig":
        """Read ``{arch}.*`` keys (``block_count``, ``embedding_length``, ``attention.head_count``,
        ``attention.head_count_kv``, ``attention.key_length``, ``feed_forward_length``,
        ``attention.layer_norm_rms_epsilon``, ``rope.freq_base``, ``rope.dimension_count``,
        ``context_length``; for ``qwen3moe`` also ``expert_count``, ``expert_used_count``,
        ``expert_feed_forward_length``).

        Raises:
            GGUFError: a required key is missing, an expert count is out of range, or the
                architecture is not ``llama`` / ``qwen3`` / ``qwen3moe``.
        """
        if g.architecture not in ARCHITECTURES:
            raise GGUFError(f"expected architecture llama, qwen3 or qwen3moe, got {g.architecture}")
        moe = g.architecture == "qwen3moe"
        hidden = int(g.require("{arch}.embedding_length"))
        heads = int(g.require("{arch}.attention.head_count"))
        head_dim = int(g.get("{arch}.attention.key_length", hidden // heads))
        if g.get("{arch}.rope.scaling.type") not in (None, "none"):
            log.warning("rope scaling %s is not supported; ignoring it", g.get("{arch}.rope.scaling.type"))
        ffn = int(g.get("{arch}.feed_forward_length", 0)) if moe else int(g.require("{arch}.feed_forward_length"))
        experts = used = expert_ffn = 0
        if moe:
            experts, used = int(g.require("{arch}.expert_count")), int(g.require("{arch}.expert_used_count"))
            if not 1 <= used <= experts:
                raise GGUFError(f"{g.path}: expert_used_count {used} must be in [1, expert_count {experts}]")
            expert_ffn = int(g.get("{arch}.expert_feed_forward_length", 0)) or ffn // used   # llama.cpp's fallback
            if expert_ffn < 1:
                raise GGUFError(f"{g.path}: no qwen3moe.expert_feed_forward_length (nor feed_forward_length)")
        return cls(
            vocab_size=vocab_size(g),
            hidden_size=hidden,
            num_layers=int(g.require("{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(g.get("{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            intermediate_size=ffn,
            rms_eps=float(g.get("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(g.get("{arch}.rope.freq_base", 10000.0)),
            rope_dim=int(g.get("{arch}.rope.dimension_count", head_dim)),
            context_length=int(g.get("{arch}.context_length", 4096)),
            tied_embeddings=not g.has_tensor("output.weight"),
            qk_norm=g.architecture in ("qwen3", "qwen3moe"),
            arch=g.architecture,
            num_experts=experts,
            num_experts_used=used,
            expert_ffn=expert_ffn,
        )


def unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of ``attn_q``/``attn_k`` rows (``[n_heads*D, in]``).

    llama.cpp: ``w.reshape(n_head, 2, D//2, in).swapaxes(1, 2).reshape(...)``; the inverse is
    ``w.reshape(n_head, D//2, 2, in).swapaxes(1, 2).reshape(...)`` (transformers ``reverse_permute``).
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def stack_experts(cfg: LlamaConfig, router: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  device: str | torch.device, dtype: torch.dtype, layer: str = "") -> dict[str, torch.Tensor]:
    """One layer's MoE tensors (``ffn_gate_inp`` ``[E, H]``, ``ffn_gate_exps`` / ``ffn_up_exps``
    ``[E, F, H]``, ``ffn_down_exps`` ``[E, H, F]``, float) as
    :func:`~target_service.models.layers.moe_ffn` reads them: ``router`` ``[E, H]`` (float32, or
    float64 for a float64 model), ``gate_up_exps`` ``[E * 2F, H]`` (per expert its gate rows, then
    its up rows) and ``down_exps`` ``[H, E * F]`` (per expert its down matrix as columns), on
    ``device`` in ``dtype``.

    Raises:
        GGUFError: a tensor is not a float tensor of the shape ``cfg`` implies (``layer`` prefixes
            the name in the message).
    """
    e, f, hid = cfg.num_experts, cfg.expert_ffn, cfg.hidden_size
    want = {"ffn_gate_inp": (e, hid), "ffn_gate_exps": (e, f, hid), "ffn_up_exps": (e, f, hid), "ffn_down_exps": (e, hid, f)}
    for n, t in zip(MOE_TENSORS, (router, gate, up, down)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want[n]:
            raise GGUFError(f"{layer}{n}.weight: shape {tuple(getattr(t, 'shape', ()))}, expected {want[n]}")
    return {
        "router": router.to(device=device, dtype=torch.promote_types(dtype, torch.float32)).contiguous(),
        "gate_up_exps": torch.stack([gate.to(device=device, dtype=dtype), up.to(device=device, dtype=dtype)], dim=1)
        .reshape(e * 2 * f, hid),
        "down_exps": down.to(device=device, dtype=dtype).permute(1, 0, 2).reshape(hid, e * f).contiguous(),
    }


@dataclasses.dataclass
class ForwardOutput:
    """Result of :meth:`LlamaModel.forward` for ``T`` new tokens.

    Attributes:
        logits: ``[R, V]`` float32 for the requested rows (``R = T`` unless ``logits_rows`` is given).
        new_k, new_v: layer -> ``[Hkv, T, D]``: K/V of the new tokens (not yet committed).
        features: ``[T, N*H]`` outputs of the requested layers, concatenated, or ``None``.
    """

    logits: torch.Tensor
    new_k: dict[int, torch.Tensor]
    new_v: dict[int, torch.Tensor]
    features: torch.Tensor | None


class SessionKV:
    """Attention backend of the reference forward: one session's committed :class:`KVCache`
    (read, never written) and the new tokens' mask; it keeps each layer's new K/V
    (``[Hkv, T, D]``) in ``new_k`` / ``new_v`` for the commit."""

    def __init__(self, cache: KVCache, mask: torch.Tensor):
        self.cache, self.mask = cache, mask
        self.new_k: dict[int, torch.Tensor] = {}
        self.new_v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``[T, Hq, D]`` queries and ``[T, Hkv, D]`` keys, attend over the cache rows
        ``[0, L)`` and the masked new rows -> ``[T, Hq * D]``."""
        n = self.cache.length
        q, k = apply_rope_rows(q, cos, sin), apply_rope_rows(k, cos, sin)
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)
        o = tree_attention(q.transpose(0, 1), self.cache.k[layer][:, :n], self.cache.v[layer][:, :n], kt, vt, self.mask, scale)
        self.new_k[layer], self.new_v[layer] = kt, vt
        return o.transpose(0, 1).reshape(q.shape[0], -1)


class LlamaModel:
    """Weights and forward of a llama, qwen3 or qwen3moe model; stateless apart from the caches it
    is given.

    Args:
        cfg: the config.
        weights: name -> tensor in GGUF tensor names (``token_embd.weight``, ``blk.{i}.attn_q.weight``,
            ...; with ``cfg.qk_norm`` also ``blk.{i}.attn_q_norm.weight`` / ``attn_k_norm.weight``;
            with ``cfg.num_experts`` the :data:`MOE_TENSORS` instead of ``ffn_gate`` / ``ffn_up`` /
            ``ffn_down``, float tensors, restacked by :func:`stack_experts`; not read for the layers
            ``experts`` gives),
            PyTorch order, rotary rows of q/k already un-permuted; a 2-D weight may be a
            :class:`kernels.quant.QuantizedWeight` (kept as GGUF blocks; ``qkv`` / ``gate_up`` are
            then packed by :func:`~target_service.models.weights.pack_rows`).
        device, dtype: where and in which float type to compute (float32 on CPU is the reference).
        experts: per layer, its MoE weights already made by :func:`stack_experts` (what
            :meth:`from_gguf` passes, so that the file's expert tensors are freed layer by layer).
    """

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 experts: list[dict[str, torch.Tensor]] | None = None):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return place(weights[name], self.device, dtype)

        self.embed = w("token_embd.weight")
        self.lm_head = self.embed if cfg.tied_embeddings else w("output.weight")
        self.norm = w("output_norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            self.layers.append(
                {
                    "attn_norm": w(p + "attn_norm.weight"),
                    "qkv": pack_rows([w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")]),
                    "o": w(p + "attn_output.weight"),
                    "ffn_norm": w(p + "ffn_norm.weight"),
                }
            )
            if cfg.num_experts:
                self.layers[-1].update(experts[i] if experts is not None else
                                       stack_experts(cfg, *(weights[p + n + ".weight"] for n in MOE_TENSORS),
                                                     device=self.device, dtype=dtype, layer=p))
            else:
                self.layers[-1].update(gate_up=pack_rows([w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")]),
                                       down=w(p + "ffn_down.weight"))
            if cfg.qk_norm:
                self.layers[-1].update(q_norm=w(p + "attn_q_norm.weight"), k_norm=w(p + "attn_k_norm.weight"))

    @classmethod
    def from_gguf(cls, g: GGUFFile | str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, progress: bool = False,
                  quantized: bool = False) -> "LlamaModel":
        """Load a llama GGUF (un-permuting q/k rotary rows), a qwen3 or a qwen3moe GGUF: every tensor
        dequantized to ``dtype``, or with ``quantized`` the 2-D weights of the types of
        :data:`kernels.quant.QTYPES` kept as GGUF blocks on ``device``
        (:func:`~target_service.models.weights.load_weights`); the MoE router and experts are
        always dequantized (the router to float32), with a warning naming the block-quantized
        types of experts when ``quantized`` was asked.

        Raises:
            GGUFError: wrong architecture, missing key or tensor.
        """
        if isinstance(g, str):
            g = open_gguf(g)
        cfg = LlamaConfig.from_gguf(g)
        names = ["token_embd.weight", "output_norm.weight"] + ([] if cfg.tied_embeddings else ["output.weight"])
        ffn = () if cfg.num_experts else ("ffn_gate", "ffn_up", "ffn_down")
        for i in range(cfg.num_layers):
            names += [f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", *ffn)]
            if cfg.qk_norm:
                names += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
        load_dtype = torch.float32 if dtype == torch.float64 else dtype
        weights = load_weights(g, names, load_dtype, device, quantized,
                               keep_quantized=lambda name: not name.endswith("norm.weight"), progress=progress)
        experts = None
        if cfg.num_experts:                         # layer by layer: one layer's file tensors alive at a time
            experts = [stack_experts(cfg, *(g.load_tensor(f"blk.{i}.{n}.weight", device=device,
                                                          dtype=torch.float32 if n == "ffn_gate_inp" else load_dtype)
                                            for n in MOE_TENSORS),
                                     device=device, dtype=dtype, layer=f"blk.{i}.") for i in range(cfg.num_layers)]
            types = sorted({g.tensor_info(f"blk.{i}.{n}.weight").type_name for i in range(cfg.num_layers) for n in MOE_TENSORS}
                           - set(FLOAT_TYPES))
            if quantized and types:
                log.warning("qwen3moe expert tensors (%s) have no quantized path: dequantized at load", ", ".join(types),
                            extra={"types": types, "model": g.path})
        permuted = cfg.arch == "llama"               # qwen3's converter keeps HF row order
        for name, t in weights.items():
            if permuted and name.endswith("attn_q.weight"):
                t = permute_rows(t, lambda x: unpermute_rotary_rows(x, cfg.num_heads))
            elif permuted and name.endswith("attn_k.weight"):
                t = permute_rows(t, lambda x: unpermute_rotary_rows(x, cfg.num_kv_heads))
            weights[name] = place(t, t.device, dtype)
        return cls(cfg, weights, device, dtype, experts=experts)

    def new_cache(self, max_length: int) -> KVCache:
        """An empty :class:`KVCache` for one session."""
        c = self.cfg
        return KVCache(range(c.num_layers), c.num_kv_heads, c.head_dim, max_length, self.device, self.dtype)

    def layers_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend,
                       taps: list[int] | tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers over ``N`` token rows (one sequence or a flattened batch).

        Each residual add is fused into the norm that follows it (``kernels.norm.add_rms_norm``),
        so the result is the final hidden state already through ``output_norm``.

        Args:
            x: ``[N, H]`` embeddings.
            cos, sin: the rotary tables, passed to ``backend.attend`` as they are: ``[N, rope_dim]``
                of the rows' positions (float64 or float32 holding the float64 values rounded,
                :func:`~target_service.models.layers.rope_table`), or for ``PoolBackend`` the
                engine's whole ``[P, rope_dim]`` tables, which it reads at the nodes' positions.
            backend: where K/V live: ``backend.attend(layer, q [N, Hq, D], k [N, Hkv, D],
                v [N, Hkv, D], scale, cos, sin) -> [N, Hq * D]`` applies the rotary embedding to
                ``q`` and ``k`` and attends (this module's :class:`SessionKV` for one session's
                cache; ``target_service.pooled.PoolBackend`` for the GPU engine's pool).
            taps: layers whose outputs (residual stream after the layer) to return.

        Returns:
            ``(h [N, H] normed by output_norm, {layer: [N, H]} for the taps)``.
        """
        c = self.cfg
        n = x.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        scale = 1.0 / math.sqrt(c.head_dim)
        want = set(taps)
        feats = {}
        h = rms_norm(x, self.layers[0]["attn_norm"], c.rms_eps)
        for i, lw in enumerate(self.layers):
            qkv = linear(h, lw["qkv"])
            q = qkv[:, :q_size].reshape(n, c.num_heads, c.head_dim)
            k = qkv[:, q_size : q_size + kv_size].reshape(n, c.num_kv_heads, c.head_dim)
            v = qkv[:, q_size + kv_size :].reshape(n, c.num_kv_heads, c.head_dim)
            if c.qk_norm:                            # qwen3: per-head RMSNorm before the rotary
                q, k = rms_norm(q, lw["q_norm"], c.rms_eps), rms_norm(k, lw["k_norm"], c.rms_eps)
            x, h = add_rms_norm(x, linear(backend.attend(i, q, k, v, scale, cos, sin), lw["o"]), lw["ffn_norm"], c.rms_eps)
            nxt = self.layers[i + 1]["attn_norm"] if i + 1 < len(self.layers) else self.norm
            if c.num_experts:                        # qwen3moe: the sparse MoE FFN
                x, h = moe_then_norm(x, h, lw, nxt, c.rms_eps, c.num_experts_used, c.norm_topk_prob)
            else:
                x, h = mlp_then_norm(x, h, lw, nxt, c.rms_eps)
            if i in want:
                feats[i] = x
        return h, feats

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, V]`` of final normed hidden rows ``h`` ``[N, H]`` (LM head)."""
        return linear(h, self.lm_head, torch.float32)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache,
        feature_layers: list[int] | tuple[int, ...] = (),
        logits_rows: torch.Tensor | None = None,
        parents: list[int] | None = None,
    ) -> ForwardOutput:
        """Run ``T`` new tokens over the committed cache.

        Args:
            tokens: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 absolute positions (``L + depth`` for a tree).
            mask: ``[T, T]`` bool attention mask among the new tokens (see ``tree_attention``).
            cache: the session's committed K/V; rows ``[0, cache.length)`` are attended, nothing is written.
            feature_layers: layer indices whose outputs (residual stream after the layer) to return.
            logits_rows: ``[R]`` int64 rows to compute logits for (default: all ``T``).
            parents: tree parents; unused (``mask`` carries the tree for attention-only models).

        Returns:
            :class:`ForwardOutput`.
        """
        c = self.cfg
        cos, sin = rope_cos_sin(positions, c.rope_dim, c.rope_theta)
        backend = SessionKV(cache, mask)
        x, feats = self.layers_forward(embedding(self.embed, tokens, self.dtype), cos, sin, backend, feature_layers)
        features = torch.cat([feats[i] for i in feature_layers], dim=-1) if feature_layers else None
        logits = self.logits(x if logits_rows is None else x[logits_rows])
        return ForwardOutput(logits, backend.new_k, backend.new_v, features)

    def commit(self, cache: KVCache, out: ForwardOutput, rows: torch.Tensor) -> None:
        """Append the K/V of new-token ``rows`` (``[n]`` int64, in path order) to the cache.

        The rows land at cache positions ``[L, L + n)`` through ``index_copy_`` with an index
        tensor (no view whose offset moves per step), then ``cache.length`` advances by ``n``.

        Raises:
            ValueError: the cache would exceed its maximum length.
        """
        cache.append(out.new_k, out.new_v, rows)

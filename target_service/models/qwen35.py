"""The ``qwen35`` architecture (Qwen3.5 / 3.6 dense hybrids), plain PyTorch.

Every ``full_attention_interval``-th layer (``(i + 1) % interval == 0``) is gated full attention;
the others are Gated DeltaNet (GDN). GGUF facts, from llama.cpp's converter (and undone the same
way by transformers' ``integrations/gguf/gguf_conversion_mapping.py::_qwen35``):

* ``attn_norm``, ``post_attention_norm``, ``output_norm``, ``attn_q_norm``, ``attn_k_norm`` hold
  ``1 + w`` (multiplied directly); ``ssm_norm`` holds ``w`` of the gated RMSNorm
  ``rmsnorm(o) * w * silu(z)`` per value head.
* ``ssm_a`` holds ``-exp(A_log)``; ``ssm_dt.bias`` is ``dt_bias``;
  ``g = ssm_a * softplus(x @ ssm_alpha + dt_bias)``, ``beta = sigmoid(x @ ssm_beta)``.
* ``attn_qkv`` is the GDN in-projection ``[q | k | v]``, ``attn_gate`` is ``z``, ``ssm_conv1d`` is
  ``[channels, K]``: causal depthwise conv + SiLU over ``[q | k | v]``; q and k are L2-normalised
  per head, q scaled by ``1/sqrt(Dk)``.
* Value heads are stored **tiled** (``v0k0, v0k1, ...``): we keep that order everywhere and map
  value head ``j`` to key head ``j mod Hk`` (HF's grouped order would be ``j // (HV/Hk)``).
* Attention layers: ``attn_q`` rows hold per head ``[query(D) | gate(D)]``; q/k RMS-normed per
  head; rotary on the first ``rope.dimension_count`` dims in NeoX halves (text positions make
  Qwen3.5's interleaved mrope equal to plain rope); output times ``sigmoid(gate)``.
* ``block_count`` includes ``nextn_predict_layers`` MTP blocks, which are skipped.

State and rollback (docs/ARCHITECTURE.md, "State and rollback"): a forward never writes the
session's state. Prefill (``parents is None``) runs the chain and returns the final recurrent
state and conv tail, which :meth:`Qwen35Model.commit` installs. Verify over a tree returns per-node values and
:meth:`commit` builds the state of the accepted path; two strategies are implemented:

* ``"gather"``: the tree forward keeps every node's recurrent state ``[T, HV, Dk, Dv]`` and
  commit copies the last path node's state.
* ``"recompute"``: the tree forward keeps each node's ``(k, v, g, beta)`` (a few KB) and commit
  re-runs the recurrence from the committed state along the accepted path only (``k + 1``
  steps, one pass per layer that reads and writes the state once).

Measured with ``python -m bench.rollback`` (one GDN layer at Qwen3.5-0.8B
dimensions, HV = 16, Dk = Dv = 128; a tree of T nodes, an accepted path of n nodes; verify +
commit; ``benchmarks/rollback-{cpu,cuda}.txt``). Milliseconds per step, gather / recompute:

=====  ==  ===============  ==============  ======================
T      n   CPU (2 threads)  H200 (CUDA)     state MB moved (g / r)
=====  ==  ===============  ==============  ======================
4      4   1.75 / 2.62      0.72 / 1.35     6.0 / 2.1
16     1   5.20 / 5.71      2.72 / 2.12     18.0 / 2.0
16     16  6.42 / 8.03      2.39 / 5.32     18.0 / 2.3
32     32  27.8 / 35.1      5.29 / 9.36     34.0 / 2.5
=====  ==  ===============  ==============  ======================

Choice: **gather**. In this reference the tree recurrence materialises every node's state to
compute the node outputs anyway, so gather's commit is one state copy while recompute re-runs
``n`` updates: gather is faster in 23 of the 26 measured (T, n, device) cases, by up to 2.2x
(T = n = 16, H200); recompute wins T = n = 1 and T = n = 8 on the CPU (within that machine's
noise) and T = 16, n = 1 on the H200 (2.12 vs 2.72 ms). Recompute moves ``(T + 2) / 2`` times
fewer state bytes; that pays off only once a fused tree kernel stops writing per-node states, so
it stays implemented, tested for exactness (tests/test_qwen35.py) and selectable
(``Qwen35Model(..., rollback="recompute")``). A second H200 run on another machine
(``benchmarks/rollback-cuda-run2.txt``) had gather faster in all 13 cases (e.g. T = n = 16:
1.48 vs 2.54 ms).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.nn.functional as F

from kernels.gated_delta import fla as fla_kernels
from kernels.conv import causal_conv_tree, conv_state_after
from kernels.gated_delta import gdn_gates, gdn_qkv, gdn_update, recurrent_gated_delta_rule, tree_gated_delta_rule
from runtime.gguf_loader import GGUFError, GGUFFile, open_gguf, vocab_size
from target_service.models.kv_cache import KVCache
from kernels.linear import linear
from kernels.quant import embedding
from kernels.norm import add_rms_norm, gated_rms_norm, rms_norm
from target_service.models.layers import mlp_then_norm, rope_cos_sin
from target_service.models.llama import SessionKV
from target_service.models.weights import load_weights, pack_rows, place

log = logging.getLogger(__name__)

#: Rollback strategy used unless a model is built with another: chosen by measurement, see the
#: module docstring (faster in 23 of 26 measured cases on CPU and H200 in this reference).
DEFAULT_ROLLBACK = "gather"
ROLLBACK_STRATEGIES = ("gather", "recompute")


@dataclasses.dataclass
class Qwen35Config:
    """Shapes and constants of a qwen35 model, from GGUF ``qwen35.*`` metadata."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_theta: float
    intermediate_size: int
    rms_eps: float
    full_attention_interval: int
    conv_kernel: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    context_length: int
    tied_embeddings: bool
    mtp_layers: int = 0

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> "Qwen35Config":
        """Read the ``qwen35.*`` keys (see the module docstring).

        Raises:
            GGUFError: a required key is missing or the architecture is not ``qwen35``.
        """
        if g.architecture != "qwen35":
            raise GGUFError(f"expected architecture qwen35, got {g.architecture}")
        mtp = int(g.get("{arch}.nextn_predict_layers", 0) or 0)
        head_dim = int(g.require("{arch}.attention.key_length"))
        hv = int(g.require("{arch}.ssm.time_step_rank"))
        return cls(
            vocab_size=vocab_size(g),
            hidden_size=int(g.require("{arch}.embedding_length")),
            num_layers=int(g.require("{arch}.block_count")) - mtp,
            num_heads=int(g.require("{arch}.attention.head_count")),
            num_kv_heads=int(g.require("{arch}.attention.head_count_kv")),
            head_dim=head_dim,
            rope_dim=int(g.get("{arch}.rope.dimension_count", head_dim)),
            rope_theta=float(g.get("{arch}.rope.freq_base", 10000.0)),
            intermediate_size=int(g.require("{arch}.feed_forward_length")),
            rms_eps=float(g.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            full_attention_interval=int(g.get("{arch}.full_attention_interval", 4)),
            conv_kernel=int(g.require("{arch}.ssm.conv_kernel")),
            linear_key_head_dim=int(g.require("{arch}.ssm.state_size")),
            linear_value_head_dim=int(g.require("{arch}.ssm.inner_size")) // hv,
            linear_num_key_heads=int(g.require("{arch}.ssm.group_count")),
            linear_num_value_heads=hv,
            context_length=int(g.get("{arch}.context_length", 4096)),
            tied_embeddings=not g.has_tensor("output.weight"),
            mtp_layers=mtp,
        )

    def is_attention(self, layer: int) -> bool:
        """Whether ``layer`` is a gated full-attention layer (else Gated DeltaNet)."""
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def conv_channels(self) -> int:
        """Channels of the GDN conv: ``2 * Hk * Dk + HV * Dv`` (``[q | k | v]``)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim


class HybridCache(KVCache):
    """Committed state of one session.

    * per attention layer: K/V rows (:class:`~target_service.models.kv_cache.KVCache`);
    * per GDN layer: recurrent state ``[HV, Dk, Dv]`` float32 and conv state ``[K-1, C]`` (the
      last ``K-1`` pre-conv inputs, oldest first), zero at creation (an empty prefix).
    """

    def __init__(self, cfg: Qwen35Config, max_length: int, device: torch.device, dtype: torch.dtype, stride: int = 256):
        super().__init__([i for i in range(cfg.num_layers) if cfg.is_attention(i)], cfg.num_kv_heads, cfg.head_dim,
                         max_length, device, dtype, stride)
        self.cfg = cfg
        self.gdn_layers = [i for i in range(cfg.num_layers) if not cfg.is_attention(i)]
        self.recurrent = {
            i: torch.zeros(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, device=device, dtype=torch.float32)
            for i in self.gdn_layers
        }
        self.conv = {i: torch.zeros(cfg.conv_kernel - 1, cfg.conv_channels, device=device, dtype=dtype) for i in self.gdn_layers}

    def reset(self) -> None:
        """Forget every row and zero all state (a slot handed to a new session)."""
        super().reset()
        for t in (*self.recurrent.values(), *self.conv.values()):
            t.zero_()


@dataclasses.dataclass
class GDNScratch:
    """Per-GDN-layer values a forward keeps for :meth:`Qwen35Model.commit`.

    Attributes:
        conv_in: ``[T, C]`` pre-conv inputs of the new rows.
        final_state: prefill only: the recurrent state after the last row.
        node_states: verify + "gather": ``[T, HV, Dk, Dv]``.
        kvgb: verify + "recompute": ``(k, v, g, beta)`` per node (``[T, HV, Dk]``, ``[T, HV, Dv]``, ``[T, HV]`` x2).
    """

    conv_in: torch.Tensor
    final_state: torch.Tensor | None = None
    node_states: torch.Tensor | None = None
    kvgb: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclasses.dataclass
class HybridForwardOutput:
    """Result of :meth:`Qwen35Model.forward` for ``T`` new tokens.

    Attributes:
        logits: ``[R, V]`` float32.
        new_k, new_v: attention layer -> ``[Hkv, T, D]``.
        gdn: GDN layer -> :class:`GDNScratch`.
        features: ``[T, N*H]`` or ``None``.
        prefill: whether this was a chain forward (``parents is None``).
    """

    logits: torch.Tensor
    new_k: dict[int, torch.Tensor]
    new_v: dict[int, torch.Tensor]
    gdn: dict[int, GDNScratch]
    features: torch.Tensor | None
    prefill: bool


class SessionHybrid(SessionKV):
    """Reference backend of one qwen35 session (see :meth:`Qwen35Model.layers_forward`): reads the
    session's :class:`HybridCache`, writes nothing, and keeps what :meth:`Qwen35Model.commit`
    needs: new K/V (``new_k``/``new_v``) and per GDN layer a :class:`GDNScratch` (``gdn``).

    Args:
        cache, mask: the session's state and the new tokens' ancestor mask.
        parents: tree parents, or ``None`` for a prefill chain committed whole.
        rollback: ``"gather"`` or ``"recompute"`` (module docstring).
    """

    def __init__(self, cache: HybridCache, mask: torch.Tensor, parents: list[int] | None, rollback: str):
        super().__init__(cache, mask)
        self.parents, self.rollback = parents, rollback
        self.scratch: dict[int, GDNScratch] = {}

    def gdn(self, layer: int, conv_in, a, b, lw, key_heads: int, head_k_dim: int) -> torch.Tensor:
        """A GDN layer's token mixing from its raw projections: causal conv along the tree + SiLU,
        q/k/v split and L2 norms, gates, recurrence -> ``[T, HV, Dv]`` float32."""
        scratch = self.scratch[layer] = GDNScratch(conv_in=conv_in)
        conv_out = F.silu(causal_conv_tree(conv_in, self.cache.conv[layer], lw["conv"], self.parents))
        q, k, v = gdn_qkv(conv_out, key_heads, head_k_dim)
        g, beta = gdn_gates(a, b, lw["a"], lw["dt_bias"])
        reps = v.shape[1] // q.shape[1]
        q, k = q.repeat(1, reps, 1), k.repeat(1, reps, 1)  # tiled value heads: head j reads key head j mod Hk
        state = self.cache.recurrent[layer]
        if self.parents is None:
            # prefill: chunked fla kernel on CUDA when installed, the reference recurrence otherwise
            chunked = fla_kernels.chunk_gated_delta_rule if fla_kernels.available(q.device) else recurrent_gated_delta_rule
            o, scratch.final_state = chunked(q, k, v, g, beta, state)
        else:
            o, node_states = tree_gated_delta_rule(q, k, v, g, beta, state, self.parents)
            if self.rollback == "gather":
                scratch.node_states = node_states
            else:
                scratch.kvgb = (k, v, g, beta)
        return o


def _is_projection(name: str) -> bool:
    """Whether GGUF tensor ``name`` is read by a matmul or the embedding lookup (so it may stay
    block-quantized); norms, the conv kernel, ``ssm_a`` and ``ssm_dt.bias`` are not."""
    return name.endswith(("token_embd.weight", "output.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                          "attn_output.weight", "attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight",
                          "ssm_alpha.weight", "ssm_out.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))


class Qwen35Model:
    """Weights and forward of a qwen35 model (stateless but for the caches it is given).

    Args:
        cfg: the config.
        weights: GGUF tensor name -> tensor (PyTorch order, GGUF values: ``1+w`` norms, tiled heads);
            a projection weight may be a :class:`kernels.quant.QuantizedWeight` (GGUF blocks; the
            packed ``qkv`` / ``in_proj`` / ``gate_up`` are made by
            :func:`~target_service.models.weights.pack_rows`).
        device, dtype: where and in which float type to compute (float32 on CPU is the reference).
        rollback: ``"gather"`` or ``"recompute"`` (module docstring).
    """

    def __init__(self, cfg: Qwen35Config, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, rollback: str = DEFAULT_ROLLBACK):
        if rollback not in ROLLBACK_STRATEGIES:
            raise ValueError(f"rollback must be one of {ROLLBACK_STRATEGIES}")
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.rollback = rollback

        def w(name: str, dt: torch.dtype | None = None) -> torch.Tensor:
            return place(weights[name], self.device, dt or dtype)

        self.embed = w("token_embd.weight")
        self.lm_head = self.embed if cfg.tied_embeddings else w("output.weight")
        self.norm = w("output_norm.weight")
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            lw = {
                "attn_norm": w(p + "attn_norm.weight"),
                "post_norm": w(p + "post_attention_norm.weight"),
                "gate_up": pack_rows([w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")]),
                "down": w(p + "ffn_down.weight"),
            }
            if cfg.is_attention(i):
                lw.update(
                    qkv=pack_rows([w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")]),
                    o=w(p + "attn_output.weight"), q_norm=w(p + "attn_q_norm.weight"), k_norm=w(p + "attn_k_norm.weight"),
                )
            else:
                lw.update(
                    in_proj=pack_rows([w(p + "attn_qkv.weight"), w(p + "attn_gate.weight"), w(p + "ssm_beta.weight"), w(p + "ssm_alpha.weight")]),
                    conv=w(p + "ssm_conv1d.weight"),
                    a=w(p + "ssm_a", torch.float32).reshape(-1),
                    dt_bias=w(p + "ssm_dt.bias", torch.float32).reshape(-1),
                    ssm_norm=w(p + "ssm_norm.weight"),
                    out=w(p + "ssm_out.weight"),
                )
            self.layers.append(lw)

    @staticmethod
    def tensor_names(cfg: Qwen35Config) -> list[str]:
        """GGUF tensors the model reads (MTP blocks ``blk.{num_layers}..`` are not among them)."""
        names = ["token_embd.weight", "output_norm.weight"] + ([] if cfg.tied_embeddings else ["output.weight"])
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            names += [p + n for n in ("attn_norm.weight", "post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")]
            if cfg.is_attention(i):
                names += [p + n for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight")]
            else:
                names += [p + n for n in ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_conv1d.weight",
                                          "ssm_a", "ssm_dt.bias", "ssm_norm.weight", "ssm_out.weight")]
        return names

    @classmethod
    def from_gguf(cls, g: GGUFFile | str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  progress: bool = False, rollback: str = DEFAULT_ROLLBACK, quantized: bool = False) -> "Qwen35Model":
        """Load a qwen35 GGUF (MTP blocks skipped): every tensor dequantized to ``dtype``, or with
        ``quantized`` the projection weights (and the embedding / LM head) of the types of
        :data:`kernels.quant.QTYPES` kept as GGUF blocks on ``device``
        (:func:`~target_service.models.weights.load_weights`).

        Raises:
            GGUFError: wrong architecture, missing key or tensor.
        """
        if not isinstance(g, GGUFFile):
            g = open_gguf(g)
        cfg = Qwen35Config.from_gguf(g)
        weights = load_weights(g, cls.tensor_names(cfg), dtype, device, quantized, keep_quantized=_is_projection,
                               float32=lambda name: name.endswith(("ssm_a", "ssm_dt.bias")), progress=progress)
        return cls(cfg, weights, device, dtype, rollback)

    def new_cache(self, max_length: int) -> HybridCache:
        """An empty :class:`HybridCache` for one session."""
        return HybridCache(self.cfg, max_length, self.device, self.dtype)

    # ------------------------------------------------------------------ layers
    def _attention(self, i: int, lw, h, cos, sin, backend) -> torch.Tensor:
        c = self.cfg
        t = h.shape[0]
        qkv = linear(h, lw["qkv"])                             # [query|gate per head | k | v]
        nq, nkv = 2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qg = qkv[:, :nq].reshape(t, c.num_heads, 2 * c.head_dim)
        q, gate = qg[..., : c.head_dim], qg[..., c.head_dim :].reshape(t, c.num_heads * c.head_dim)
        k = qkv[:, nq : nq + nkv].reshape(t, c.num_kv_heads, c.head_dim)
        v = qkv[:, nq + nkv :].reshape(t, c.num_kv_heads, c.head_dim)
        q, k = rms_norm(q, lw["q_norm"], c.rms_eps), rms_norm(k, lw["k_norm"], c.rms_eps)
        o = backend.attend(i, q, k, v, 1.0 / math.sqrt(c.head_dim), cos, sin) * torch.sigmoid(gate)
        return linear(o, lw["o"])

    def _gdn(self, i: int, lw, h, backend) -> torch.Tensor:
        c = self.cfg
        t = h.shape[0]
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        proj = linear(h, lw["in_proj"])                     # [q|k|v pre-conv | z | b | a]
        cc, vd = c.conv_channels, hv * dv
        conv_in, z = proj[:, :cc], proj[:, cc : cc + vd]
        b, a = proj[:, cc + vd : cc + vd + hv], proj[:, cc + vd + hv :]
        o = backend.gdn(i, conv_in, a, b, lw, c.linear_num_key_heads, c.linear_key_head_dim)
        o = gated_rms_norm(o, z.reshape(t, hv, dv), lw["ssm_norm"], c.rms_eps)
        return linear(o.reshape(t, -1), lw["out"])

    def layers_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend,
                       taps: list[int] | tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers over ``N`` token rows (one sequence or a flattened batch).

        Args:
            x: ``[N, H]`` embeddings; cos, sin: the rotary tables, passed to ``attend`` as they are
                (``[N, rope_dim]`` of the rows, or for ``PoolBackend`` the engine's whole ``[P,
                rope_dim]`` tables, read at the nodes' positions).
            backend: where the state lives. Attention: ``attend(layer, q [N, Hq, D], k, v [N, Hkv, D],
                scale, cos, sin) -> [N, Hq * D]`` (rotary applied by the backend); GDN:
                ``gdn(layer, conv_in [N, C], a [N, HV], b [N, HV], layer_weights, Hk, Dk) -> [N, HV, Dv]``
                float32: conv + SiLU, q/k/v split with L2 norms, gates and the recurrence (value
                head ``j`` reads key head ``j mod Hk``). :class:`SessionHybrid` for one session's cache;
                ``target_service.pooled.PoolBackend`` for the GPU engine's pool.
            taps: layers whose outputs to return.

        Each residual add is fused into the norm that follows it (``kernels.norm.add_rms_norm``).

        Returns:
            ``(h [N, H] normed by output_norm, {layer: [N, H]})``.
        """
        c = self.cfg
        want = set(taps)
        feats = {}
        h = rms_norm(x, self.layers[0]["attn_norm"], c.rms_eps)
        for i, lw in enumerate(self.layers):
            mix = self._attention(i, lw, h, cos, sin, backend) if c.is_attention(i) else self._gdn(i, lw, h, backend)
            x, h = add_rms_norm(x, mix, lw["post_norm"], c.rms_eps)
            x, h = mlp_then_norm(x, h, lw, self.layers[i + 1]["attn_norm"] if i + 1 < len(self.layers) else self.norm, c.rms_eps)
            if i in want:
                feats[i] = x
        return h, feats

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, V]`` of final normed hidden rows ``h`` ``[N, H]``."""
        return linear(h, self.lm_head, torch.float32)

    # ------------------------------------------------------------------ API
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: HybridCache,
                feature_layers: list[int] | tuple[int, ...] = (), logits_rows: torch.Tensor | None = None,
                parents: list[int] | None = None) -> HybridForwardOutput:
        """Run ``T`` new tokens over the committed state (nothing is written to ``cache``).

        Args:
            tokens: ``[T]`` int64; positions: ``[T]`` int64 absolute positions.
            mask: ``[T, T]`` bool ancestor-or-self mask (causal for a chain).
            cache: the session's committed state.
            feature_layers: layers whose outputs to return, concatenated, as ``features``.
            logits_rows: ``[R]`` rows to compute logits for (default all).
            parents: tree parents (``parents[0] == -1``); ``None`` = a chain that will be committed
                whole (prefill: the GDN layers return only the final state).

        Returns:
            :class:`HybridForwardOutput`.
        """
        c = self.cfg
        cos, sin = rope_cos_sin(positions, c.rope_dim, c.rope_theta)
        backend = SessionHybrid(cache, mask, parents, self.rollback)
        x, feats = self.layers_forward(embedding(self.embed, tokens, self.dtype), cos, sin, backend, feature_layers)
        out = HybridForwardOutput(logits=None, new_k=backend.new_k, new_v=backend.new_v, gdn=backend.scratch,
                                  features=None, prefill=parents is None)
        if feature_layers:
            out.features = torch.cat([feats[i] for i in feature_layers], dim=-1)
        out.logits = self.logits(x if logits_rows is None else x[logits_rows])
        return out

    def commit(self, cache: HybridCache, out: HybridForwardOutput, rows: torch.Tensor) -> None:
        """Commit new rows ``rows`` (``[n]`` int64, root-to-leaf path order) to ``cache``.

        KV rows of the path land at ``[L, L + n)``; each GDN layer's recurrent state becomes the
        state after the last path node, its conv state the last ``K-1`` pre-conv inputs along the
        path. A prefill output must be committed whole.

        Raises:
            ValueError: the cache would exceed its maximum length, or a prefill output is
                committed partially.
        """
        n = rows.shape[0]
        cache.ensure(cache.length + n)  # before any state changes: a refusal leaves the cache as it was
        for i, s in out.gdn.items():
            if out.prefill:
                if n != s.conv_in.shape[0]:
                    raise ValueError("a prefill forward is committed whole")
                cache.recurrent[i].copy_(s.final_state)
            elif s.node_states is not None:
                cache.recurrent[i].copy_(s.node_states[rows[-1]])
            else:
                k, v, g, beta = (x.index_select(0, rows) for x in s.kvgb)
                state = cache.recurrent[i]
                for t in range(n):  # the outputs came from the tree forward; only the state is needed
                    state = gdn_update(state, k[t], v[t], g[t], beta[t])
                cache.recurrent[i].copy_(state)
            cache.conv[i].copy_(conv_state_after(cache.conv[i], s.conv_in.index_select(0, rows)))
        cache.append(out.new_k, out.new_v, rows)

"""One batched step of the GPU engine over the state pool: inputs, forward, choice, acceptance,
commit, outputs (docs/ARCHITECTURE.md, "The GPU path").

Everything here is a function of tensors, so the same code runs eagerly (CPU, or CUDA with
``--no-cuda-graphs``) and inside a captured CUDA graph: no host reads, no shapes that depend on
values. The host packs a step into one flat int64 buffer (:class:`StepLayout`); :func:`run_step`
reads it on the device and writes its results into two output tensors.

A step verifies ``B`` token trees padded to ``W`` nodes each (a prefill chunk is a ``B = 1``
chain, an autoregressive step a ``W = 1`` tree):

1. forward of all ``B x W`` nodes (:class:`PoolBackend` writes their K/V into the scratch rows
   ``[L, L + W)`` of each session's slot and attends over ``[0, L)`` plus the node's ancestors);
2. the target's token at every node (device sampler: :mod:`kernels.sampling`);
3. the acceptance walk (:func:`kernels.sampling.accept.accept_trees`);
4. commit: the path's K/V rows move to ``[L, L + k + 1)``, each GDN layer's recurrent state is
   recomputed along the path from the committed state and its conv state set to the path's last
   inputs. A chain committed whole (``W = 1`` steps and prefill chunks) is committed by the
   forward itself.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kernels import attention as attn_ops
from kernels import conv as conv_ops
from kernels.embed import embed_rows
from kernels import gated_delta as gdn_ops
from kernels.gated_delta import fla
from kernels.sampling import filter_thresholds, sample_tokens, step_nodes
from kernels.rope import rope_store
from kernels.sampling.accept import accept_trees


# ----------------------------------------------------------------------------------- step inputs
_NODE_FIELDS = ("tokens", "parents", "depth", "ancestors")
_ROW_FIELDS = ("n_nodes", "slots", "lengths", "seeds", "top_k", "inv_temperature", "top_p")
_FLOAT_FIELDS = ("inv_temperature", "top_p")
#: prefill chunks at least this long run their GDN recurrence through fla-core's chunked kernel
#: (when installed; CUDA) instead of the sequential one
FLA_MIN_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Where each field of a ``(B, W)`` step sits in its flat int64 input buffer.

    Node fields (``[B, W]``): tokens, parents (``-1``: root or padding), depth, ancestors (bit
    masks). Row fields (``[B]``): n_nodes (real nodes; the rest are padding), slots, lengths
    (committed rows ``L``), seeds (uint64 bits), top_k, inv_temperature and top_p (float64 bit
    patterns; ``inv_temperature = 0``: greedy).
    """

    batch: int
    width: int

    @property
    def size(self) -> int:
        return len(_NODE_FIELDS) * self.batch * self.width + len(_ROW_FIELDS) * self.batch

    def offsets(self) -> dict[str, tuple[int, int]]:
        out, at = {}, 0
        for name in _NODE_FIELDS:
            out[name] = (at, self.batch * self.width)
            at += self.batch * self.width
        for name in _ROW_FIELDS:
            out[name] = (at, self.batch)
            at += self.batch
        return out

    def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """numpy views of a host buffer (float fields as float64)."""
        v = {}
        for name, (o, n) in self.offsets().items():
            a = buf[o : o + n]
            if name in _FLOAT_FIELDS:
                a = a.view(np.float64)
            v[name] = a.reshape(self.batch, self.width) if name in _NODE_FIELDS else a
        return v

    def fill_padding(self, buf: np.ndarray, spare_slot: int, first_row: int = 0,
                     views: dict[str, np.ndarray] | None = None) -> None:
        """Make rows ``first_row..`` padding (root-only greedy trees in the spare slot) and every
        node past ``n_nodes`` of the real rows inert (parent -1, depth 0, itself as only ancestor)."""
        v = views if views is not None else self.host_views(buf)   # a runner keeps its views
        self_bit = (np.ones(self.width, dtype=np.uint64) << np.arange(self.width, dtype=np.uint64)).view(np.int64)
        r = slice(first_row, None)
        v["n_nodes"][r] = 1
        v["slots"][r] = spare_slot
        for name in ("lengths", "seeds", "top_k", "inv_temperature", "top_p"):
            v[name][r] = 0
        v["tokens"][r] = 0
        v["parents"][r, 0], v["depth"][r, 0], v["ancestors"][r, 0] = -1, 0, 1
        pad = np.arange(self.width)[None, :] >= v["n_nodes"][:, None]
        v["tokens"][pad] = 0
        v["parents"][pad] = -1
        v["depth"][pad] = 0
        v["ancestors"][pad] = np.broadcast_to(self_bit, pad.shape)[pad]


@dataclasses.dataclass
class StepTensors:
    """Device views of a step's input buffer, plus what is derived from it on the device."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    n_nodes: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    seeds: torch.Tensor
    top_k: torch.Tensor
    inv_temperature: torch.Tensor
    top_p: torch.Tensor
    valid: torch.Tensor = None
    positions: torch.Tensor = None
    next_positions: torch.Tensor = None
    window: torch.Tensor | None = None

    @classmethod
    def from_buffer(cls, layout: StepLayout, buf: torch.Tensor, conv_kernel: int | None) -> "StepTensors":
        """Views of the device buffer and the derived tensors (positions ``L + depth``, the next
        positions, node validity: one launch, :func:`kernels.sampling.step_nodes`; conv windows).
        A node's scratch row is ``L + j``: :meth:`PoolBackend.attend` gives
        :func:`kernels.rope.rope_store` each row's ``L``."""
        b, w = layout.batch, layout.width
        f = {}
        for name, (o, n) in layout.offsets().items():
            t = buf[o : o + n]
            if name in _FLOAT_FIELDS:   # (float64: the sampler kernels round them once as they read them)
                t = t.view(torch.float64)
            f[name] = t.reshape(b, w) if name in _NODE_FIELDS else t
        st = cls(**f)
        st.positions, st.next_positions, st.valid = step_nodes(st.lengths, st.depth, st.n_nodes)
        if conv_kernel:
            st.window = conv_ops.conv_window_index(st.parents, conv_kernel)
        return st


# ----------------------------------------------------------------------------------- the backend
class PoolBackend:
    """The state backend of ``layers_forward`` for a batch in the pool (see the models'
    ``layers_forward``): K/V go to the scratch rows of each row's slot (``attend``), GDN layers
    read the pooled recurrent and conv state (``gdn``: fused conv + SiLU, then the recurrence from
    the raw projections).

    Args:
        pool: :class:`runtime.pool.StatePool`.
        st: the step's tensors.
        commit_chain: the nodes of each row are a chain committed whole (prefill chunk, ``W = 1``
            step): GDN state and conv state are written by the forward; otherwise they are kept
            for :meth:`commit`.
        causal: attention mask of a prefill chunk (rows ``j <= i``) instead of ancestor masks.
        splits: key-range splits of the attention kernel.
        max_splits: the engine's largest split count (sizes the kernel's combine, so that fewer
            splits give the same bits: ``kernels.attention.splits_for``; default ``splits``).
        fla: run long causal chunks' GDN recurrence through fla-core's chunked kernel when it is
            installed (eager prefill only: it is not graph-safe); otherwise ``pool_gdn_tree``.
    """

    def __init__(self, pool, st: StepTensors, commit_chain: bool, causal: bool = False, splits: int = 1, fla: bool = False,
                 max_splits: int | None = None):
        self.pool, self.st = pool, st
        self.commit_chain, self.causal, self.splits, self.fla = commit_chain, causal, splits, fla
        self.max_splits = max_splits
        #: per GDN layer a tree step ran, its ``(key heads, head dim)`` (its commit inputs are in
        #: :attr:`stack`; :meth:`commit` checks every layer ran, with one head shape)
        self.saved: dict[int, tuple[int, int]] = {}
        #: a tree step's commit inputs stacked over the GDN layers (pool order), so that the commit
        #: is one launch for all layers: pre-conv inputs and conv outputs ``[L, B, W, C]``, gates
        #: ``[L, B, W, HV, 2]`` float32 (allocated at the first GDN layer)
        self.stack: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        #: per node the bit mask of its leaf children (the Triton tree walk's order; computed once
        #: per step with the stack)
        self.leaf_kids: torch.Tensor | None = None
        self.b, self.w = st.tokens.shape

    def attend(self, layer: int, q, k, v, scale: float, cos, sin) -> torch.Tensor:
        """RoPE, the K/V write and the attention of one layer's nodes. ``cos`` / ``sin``: the
        engine's whole rotary tables ``[P, r]`` (:func:`forward` passes them as they are), read
        at the nodes' positions inside :func:`kernels.rope.rope_store`'s launch."""
        st, pool = self.st, self.pool
        a = pool.attn_index[layer]
        n, hq, d = q.shape
        kp, vp = pool.k[a], pool.v[a]
        q = rope_store(q, k, v, cos, sin, kp, vp, st.slots, st.lengths, positions=st.positions, table=True)
        o = attn_ops.pool_attention(q.reshape(self.b, self.w, hq, d), kp, vp, st.slots, st.lengths,
                                    None if self.causal else st.ancestors, scale, causal=self.causal, splits=self.splits,
                                    max_splits=self.max_splits)
        return o.reshape(n, hq * d)

    def gdn(self, layer: int, conv_in: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lw, key_heads: int,
            head_k_dim: int) -> torch.Tensor:
        st, pool = self.st, self.pool
        j = pool.gdn_index[layer]
        bw = (self.b, self.w)
        x = conv_in.reshape(*bw, -1)
        a3, b3 = a.reshape(*bw, -1), b.reshape(*bw, -1)
        if self.commit_chain:
            conv_out = conv_ops.pool_conv_silu(x, pool.conv[j], st.slots, st.window, lw["conv"], commit=True)
            if self.fla and self.causal and self.w >= FLA_MIN_CHUNK and fla.available(x.device):
                return self._fla_chunk(j, conv_out, a3, b3, lw, key_heads, head_k_dim)
            o = gdn_ops.pool_gdn_tree(conv_out, a3, b3, lw["a"], lw["dt_bias"], pool.recurrent[j], st.slots,
                                      st.parents, st.ancestors, True, key_heads, head_k_dim)
            return o.reshape(self.b * self.w, *o.shape[2:])
        if self.stack is None:
            n = pool.recurrent.shape[0]
            self.stack = (torch.empty((n, *x.shape), device=x.device, dtype=x.dtype),
                          torch.empty((n, *x.shape), device=x.device, dtype=x.dtype),
                          torch.empty((n, *bw, pool.recurrent.shape[2], 2), device=x.device, dtype=torch.float32))
            self.leaf_kids = gdn_ops.leaf_children(st.parents)
        xs, cs, gs = self.stack
        conv_out = conv_ops.pool_conv_silu(x, pool.conv[j], st.slots, st.window, lw["conv"], out=cs[j], x_save=xs[j])
        o = gdn_ops.pool_gdn_tree(conv_out, a3, b3, lw["a"], lw["dt_bias"], pool.recurrent[j], st.slots, st.parents,
                                  st.ancestors, False, key_heads, head_k_dim, gates_out=gs[j], leaf_kids=self.leaf_kids)
        self.saved[layer] = (key_heads, head_k_dim)
        return o.reshape(self.b * self.w, *o.shape[2:])

    def _fla_chunk(self, j: int, conv_out, a, b, lw, key_heads: int, head_k_dim: int) -> torch.Tensor:
        """A long prefill chunk through fla-core's chunked kernel (eager prefill only, one row):
        the committed state in, the state after the chunk back into the pool."""
        q, k, v = gdn_ops.gdn_qkv(conv_out[0], key_heads, head_k_dim)
        g, beta = gdn_ops.gdn_gates(a[0], b[0], lw["a"], lw["dt_bias"])
        reps = v.shape[1] // q.shape[1]
        state = self.pool.recurrent[j]
        slot = self.st.slots[:1]
        o, final = fla.chunk_gated_delta_rule(q.repeat(1, reps, 1), k.repeat(1, reps, 1), v, g, beta, state[slot][0])
        state[slot] = final[None]
        return o

    def commit(self, path: torch.Tensor, n_accept: torch.Tensor) -> None:
        """Commit each row's accepted path (``path[b, :n_accept[b]]``, root first): K/V rows of
        every attention layer at once, then every GDN layer's recurrent state at once and every
        conv state at once, from the inputs the forward stacked (three launches in all on CUDA).

        Raises:
            RuntimeError: the forward did not run every GDN layer of the pool (its stacked inputs
                would be incomplete).
        """
        st, pool = self.st, self.pool
        if self.stack is not None and (len(self.saved) != pool.recurrent.shape[0] or len(set(self.saved.values())) != 1):
            # (checked before any state is written: a slot's K/V and recurrent state stay together)
            raise RuntimeError(f"the forward ran {len(self.saved)} of {pool.recurrent.shape[0]} GDN layers "
                               "(or layers of different head shapes): cannot commit them together")
        attn_ops.pool_kv_commit(pool.k, pool.v, st.slots, st.lengths, path, n_accept)
        if self.stack is None:
            return
        hk, dk = next(iter(self.saved.values()))
        xs, cs, gs = self.stack
        last = path.gather(1, (n_accept - 1).clamp(min=0)[:, None])[:, 0]
        gdn_ops.pool_gdn_commit_layers(pool.recurrent, st.slots, cs, gs, path, n_accept, hk, dk)
        conv_ops.pool_conv_commit_layers(xs, pool.conv, st.slots, st.window, last)


# ----------------------------------------------------------------------------------- the step
@dataclasses.dataclass
class StepOutputs:
    """Device results of a step: ``ints`` = ``[path (B*W), n_accept (B), bonus (B)]`` int64 and
    ``features`` ``[B, W, F]`` (the tapped layers' outputs of the path nodes in path order) or
    ``None``."""

    ints: torch.Tensor
    features: torch.Tensor | None


def forward(model, pool, st: StepTensors, rope: tuple[torch.Tensor, torch.Tensor], taps: list[int], *,
            commit_chain: bool, causal: bool = False, splits: int = 1, fla: bool = False, max_splits: int | None = None):
    """Embed, run the layers over the pool, and return ``(hidden [B*W, H], taps {layer: [B*W, H]},
    backend)``. ``rope``: the engine's rotary tables ``(cos, sin)`` ``[P, r]``, passed whole to
    the layers (:meth:`PoolBackend.attend` reads them at the nodes' positions)."""
    tokens = st.tokens.reshape(-1)
    backend = PoolBackend(pool, st, commit_chain=commit_chain, causal=causal, splits=splits, fla=fla, max_splits=max_splits)
    x, feats = model.layers_forward(embed_rows(model.embed, tokens, model.dtype), rope[0], rope[1], backend, taps)
    return x, feats, backend


def choose(logits: torch.Tensor, st: StepTensors, positions: torch.Tensor, width: int) -> torch.Tensor:
    """The target's token at each logits row (``[R, V]`` for ``R = B * width`` nodes): device
    thresholds for top-k / top-p, then the Gumbel-max sampler keyed by (seed, position, token).
    ``positions`` ``[R]`` are the positions of the chosen tokens. A request's settings (``[B]``)
    are shared by its ``width`` rows: the kernels read them so (``width``), nothing repeats them
    per node first."""
    thr = filter_thresholds(logits, st.inv_temperature, st.top_k, st.top_p, width)
    return sample_tokens(logits, st.inv_temperature, thr, st.seeds, positions, width)


def prefill_step(model, pool, st: StepTensors, rope, taps: list[int], fla: bool = False) -> StepOutputs:
    """One prefill chunk (``B = 1``, a chain of ``n_nodes`` prompt tokens committed whole, causal
    attention, in a step of ``W >= n_nodes`` rows); graph-safe unless ``fla`` (:class:`PoolBackend`).
    ``ints`` = ``[token chosen after the chunk's last prompt token]`` (row ``n_nodes - 1``;
    meaningful after the prompt's last chunk), ``features`` ``[1, W, F]`` the tapped rows or
    ``None``. Rows past ``n_nodes`` are padding: causal attention keeps them out of the prompt's
    rows, and their K/V land past the committed length, where nothing reads them; a model with
    GDN layers would commit them into its recurrent and conv state, so its chunks are never
    padded (``BatchedEngine.pad_prefill``)."""
    w = st.tokens.shape[1]
    x, feats, _ = forward(model, pool, st, rope, taps, commit_chain=True, causal=True, fla=fla)
    last = (st.n_nodes[:1] - 1).clamp(min=0)                                    # [1]: the chunk's last prompt row
    first = choose(model.logits(x.index_select(0, last)), st, st.next_positions.reshape(-1).index_select(0, last), 1)
    features = torch.cat([feats[i] for i in taps], dim=-1).reshape(1, w, -1) if taps else None
    return StepOutputs(first.reshape(-1), features)


def run_step(model, pool, st: StepTensors, rope, taps: list[int], splits: int = 1,
             max_splits: int | None = None, out_ints: torch.Tensor | None = None,
             out_feats: torch.Tensor | None = None) -> StepOutputs:
    """One verify step of a ``(B, W)`` bucket (module docstring); graph-safe. ``splits`` /
    ``max_splits``: the attention kernel's key-range splits (:class:`PoolBackend`). ``out_ints``
    (``[B*W + 2B]`` int64) and ``out_feats`` (``[B, W, F]``, the model dtype): where to write
    the results (a step graph's output buffers, so that no copy follows), else new tensors."""
    b, w = st.tokens.shape
    x, feats, backend = forward(model, pool, st, rope, taps, commit_chain=w == 1, splits=splits, max_splits=max_splits)
    logits = model.logits(x)
    choice = choose(logits, st, st.next_positions.reshape(-1), w).reshape(b, w)
    path, n_accept, bonus = accept_trees(st.tokens, st.parents, st.ancestors, st.depth, st.valid, choice)
    if w > 1:
        backend.commit(path, n_accept)
    features = None
    if taps:
        f = torch.cat([feats[i] for i in taps], dim=-1).reshape(b, w, -1)
        features = torch.gather(f, 1, path[..., None].expand(b, w, f.shape[-1]), out=out_feats)
    return StepOutputs(torch.cat([path.reshape(-1), n_accept, bonus], out=out_ints), features)

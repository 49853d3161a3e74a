"""Acceptance length τ at temperature 0 by replay: many prompts at once, without the target engine.

At temperature 0 a speculative step is fully determined by the target's greedy continuation
``G`` of the prompt (lossless decoding emits exactly ``G``) and by the drafter's proposal for the
committed prefix:

* the drafter's context after committing ``G[:j]`` is the target features of rows ``0..j-1``,
  which are the rows of one causal forward over ``G`` (a verify computes the same rows, up to
  floating-point rounding);
* the root is ``G[j]``; the drafter proposes a chain or a tree under it; the target accepts the
  longest path whose tokens are ``G[j+1], G[j+2], ...`` and adds the bonus token ``G[j+a+1]``.

So τ can be computed from ``G`` and one forward of the target over it, with the drafter's blocks
of many prompts batched into one forward per round. :func:`replay_tau` follows
:func:`training.train.measure_tau` step for step (same stopping rules, same counts; tested
equal on CPU in ``tests/test_train.py::test_replay_tau_equals_engine_tau``), and ``python -m training.evaluate`` runs both on
a GPU to show the agreement on real prompts. The engine path stays the reference: replay is the
fast way to evaluate all 164 HumanEval problems and 100 ShareGPT conversations, chain and tree.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

import torch

from draft_service.drafter import DFlashDrafter

TreeFn = Callable[[int, torch.Tensor], "tuple[list[int], list[int]]"]


@torch.no_grad()
def hf_greedy_tokens(
    model: Any,
    prompts: Sequence[Sequence[int]],
    num_tokens: int,
    *,
    pad_token_id: int = 0,
    batch_size: int = 64,
) -> list[list[int]]:
    """Exactly ``num_tokens`` greedy tokens after each prompt from a Hugging Face causal LM, end of
    sequence ignored (a speculative step can accept tokens past an EOS, so the replay needs them).

    Prompts run in left-padded batches (longest first) with an explicit KV cache: prefill, then
    one-token decode steps; position ids count the real tokens only (as ``generate`` does).

    Args:
        model: ``transformers`` causal LM (e.g. :func:`training.data.load_hf_target`).
        prompts: token ids per prompt (non-empty).
        num_tokens: tokens to generate per prompt (``>= 1``).
        pad_token_id: id written into padding (masked out, never read).
        batch_size: prompts per batch.

    Returns:
        one list of ``num_tokens`` ids per prompt, in prompt order.

    Raises:
        ValueError: an empty prompt or ``num_tokens < 1``.
    """
    if num_tokens < 1:
        raise ValueError("num_tokens must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), max(1, batch_size)):
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), int(pad_token_id), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.as_tensor(list(prompts[i]), dtype=torch.long)
            mask[r, width - len(prompts[i]) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        past = res.past_key_values
        nxt = res.logits[:, -1].argmax(-1)
        toks = [nxt]
        last = pos[:, -1:]
        for _ in range(num_tokens - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            last = last + 1
            res = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last, past_key_values=past,
                        use_cache=True)
            past = res.past_key_values
            nxt = res.logits[:, -1].argmax(-1)
            toks.append(nxt)
        got = torch.stack(toks, dim=1).tolist()
        for r, i in enumerate(idx):
            out[i] = [int(t) for t in got[r]]
    return out


def accepted_length(tokens: Sequence[int], parents: Sequence[int], continuation: Sequence[int]) -> int:
    """Draft tokens a greedy target accepts from a token tree: the depth of the deepest node whose
    path from the root spells ``continuation[0], continuation[1], ...`` (the target's argmax at each
    accepted node; siblings carry distinct tokens, so the path is unique).

    Args:
        tokens, parents: the tree (node 0 = root, ``parents[i] < i``).
        continuation: the target's greedy tokens after the root (at least the tree's depth).
    """
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(tokens)):
        children.setdefault(parents[i], {})[int(tokens[i])] = i
    node = depth = 0
    while depth < len(continuation):
        nxt = children.get(node, {}).get(int(continuation[depth]))
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


@torch.no_grad()
def replay_tau(
    drafter: DFlashDrafter,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    features: Sequence[torch.Tensor],
    max_new_tokens: int,
    tree: TreeFn | None = None,
    *,
    stop_tokens: Iterable[int] = (),
    group: int = 16,
) -> dict[str, Any]:
    """τ of ``drafter`` at temperature 0, replayed over the target's greedy continuations.

    For prompt ``i``, ``sequences[i]`` = prompt (``prompt_lens[i]`` tokens) + the target's greedy
    tokens, at least ``max_new_tokens + B`` of them (:func:`hf_greedy_tokens`, EOS ignored);
    ``features[i]`` ``[>= len - 1, N*H]`` = the target features of those rows. The steps are those
    of :func:`training.train.measure_tau`: the first greedy token comes from the prefill and
    is the first root; a step drafts a block ``[root, MASK x (B-1)]`` on the committed rows,
    builds a chain (``tree=None``) or ``tree(root, logits)``, accepts ``a`` tokens
    (:func:`accepted_length`) and emits ``a + 1`` (with the bonus); a prompt ends when it has
    ``max_new_tokens`` tokens (the last step may pass it), when the root is a stop token or when
    an accepted token is one. ``group`` prompts share one drafter forward per round (their context
    K/V computed once).

    Returns:
        the keys of ``measure_tau`` (``tau``, ``steps``, ``tokens``, ``prompts``,
        ``per_prompt_tau``, ``per_prompt_steps``, ``accept_hist``, ``seconds``, ``tokens_per_s``, ``mean_nodes``,
        ``outputs``); ``outputs[i]`` are the emitted tokens (first token included).

    Raises:
        ValueError: a continuation is too short for the replay.
    """
    c = drafter.config
    B = c.block_size
    stop = {int(t) for t in stop_tokens}
    was_training = drafter.training
    drafter.eval()
    dev = drafter.device
    n = len(sequences)
    for s, p in zip(sequences, prompt_lens):
        if len(s) < p + max_new_tokens + B - 1:
            raise ValueError(f"continuation too short: {len(s) - p} tokens, need {max_new_tokens + B - 1}")
    steps = [0] * n
    emitted = [0] * n
    outputs: list[list[int]] = [[] for _ in range(n)]
    hist = [0] * (B + 1)
    nodes = 0
    t0 = time.monotonic()
    try:
        for g0 in range(0, n, max(1, group)):
            members = list(range(g0, min(n, g0 + group)))
            rows = [int(prompt_lens[i]) + max_new_tokens + B for i in members]  # rows ever visible, at most
            feats = [features[i][: min(r, features[i].shape[0])] for i, r in zip(members, rows)]
            ctx = drafter.project_context(torch.cat([f.to(dev) for f in feats]))
            pos = torch.cat([torch.arange(f.shape[0], device=dev) for f in feats])
            row_seq = torch.cat([torch.full((f.shape[0],), k, device=dev) for k, f in enumerate(feats)])
            ctx_kv = [drafter._context_kv(layer, ctx, pos) for layer in drafter.layers]
            seqs = [list(map(int, sequences[i])) for i in members]
            root_at = [int(prompt_lens[i]) for i in members]  # index of the root in the sequence
            for k, i in enumerate(members):
                outputs[i] = [seqs[k][root_at[k]]]
            active = [k for k, i in enumerate(members)
                      if seqs[k][root_at[k]] not in stop and len(outputs[i]) < max_new_tokens]
            while active:
                j = torch.tensor([root_at[k] for k in active], device=dev)
                toks = torch.full((len(active), B), c.mask_token_id, dtype=torch.long, device=dev)
                toks[:, 0] = torch.tensor([seqs[k][root_at[k]] for k in active], device=dev)
                blk = torch.tensor(active, device=dev)
                visible = (row_seq[None, :] == blk[:, None]) & (pos[None, :] < j[:, None])
                positions = j[:, None] + torch.arange(B, device=dev)
                hidden = drafter._blocks_hidden(ctx_kv, toks, positions, visible, pos)
                logits = drafter.logits(hidden[:, 1:])  # [len(active), B-1, V]
                picks = logits.argmax(-1).cpu().tolist() if tree is None else None
                still = []
                for r, k in enumerate(active):
                    i = members[k]
                    root, at = seqs[k][root_at[k]], root_at[k]
                    if tree is None:
                        t, par = [root] + picks[r], list(range(-1, B - 1))  # build_chain's tree
                    else:
                        t, par = tree(root, logits[r])
                    a = accepted_length(t, par, seqs[k][at + 1 : at + B])
                    new = seqs[k][at + 1 : at + a + 2]
                    outputs[i].extend(new)
                    steps[i] += 1
                    emitted[i] += len(new)
                    nodes += len(t)
                    hist[min(len(new), B) - 1] += 1
                    root_at[k] = at + a + 1
                    if len(outputs[i]) < max_new_tokens and new[-1] not in stop and not any(x in stop for x in new[:-1]):
                        still.append(k)
                active = still
    finally:
        drafter.train(was_training)
    dt = time.monotonic() - t0
    return tau_summary(emitted, steps, hist, nodes, dt, outputs)


def tau_summary(
    emitted: Sequence[int],
    steps: Sequence[int],
    hist: Sequence[int],
    nodes: int,
    seconds: float,
    outputs: list[list[int]],
) -> dict[str, Any]:
    """The result dict of a τ measurement (:func:`replay_tau`, :func:`training.train.measure_tau`).

    Args:
        emitted, steps: per prompt, tokens emitted by the verifies and number of verifies.
        hist: ``hist[j]`` = verifies that emitted ``j + 1`` tokens (trailing zeros are dropped).
        nodes: draft-tree nodes verified, in all.
        seconds: wall time.
        outputs: per prompt, the emitted tokens (first token included).
    """
    hist = list(hist)
    while len(hist) > 1 and hist[-1] == 0:
        hist.pop()
    total_steps, total_emit = sum(steps), sum(emitted)
    return {
        "tau": total_emit / total_steps if total_steps else float("nan"),
        "steps": total_steps,
        "tokens": total_emit,
        "prompts": len(outputs),
        "per_prompt_tau": [e / s if s else float("nan") for e, s in zip(emitted, steps)],
        "per_prompt_steps": list(steps),
        "accept_hist": hist,
        "seconds": seconds,
        "tokens_per_s": total_emit / seconds if seconds > 0 else float("nan"),
        "mean_nodes": nodes / total_steps if total_steps else float("nan"),
        "outputs": outputs,
    }


def prepare_replay(
    hf_model: Any,
    prompts: Sequence[Sequence[int]],
    num_tokens: int,
    layer_ids: Sequence[int],
    *,
    pad_token_id: int = 0,
    batch_size: int = 64,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The target's side of a replay, computed once per prompt set: ``num_tokens`` greedy tokens
    after each prompt (:func:`hf_greedy_tokens`) and the features of every row of prompt +
    continuation (:func:`training.hf_target.hf_features`).

    Returns:
        ``(sequences, features)``: token ids per prompt, and ``[len, N*H]`` feature rows (the HF
        model's dtype and device) per prompt.
    """
    from training.hf_target import hf_features

    cont = hf_greedy_tokens(hf_model, prompts, num_tokens, pad_token_id=pad_token_id, batch_size=batch_size)
    seqs = [list(p) + c for p, c in zip(prompts, cont)]
    feats: list[torch.Tensor] = []
    for s in range(0, len(seqs), max(1, batch_size)):
        chunk = [torch.tensor(x) for x in seqs[s : s + batch_size]]
        feats += hf_features(hf_model, chunk, layer_ids, pad_token_id)
    return seqs, feats


def replay_prompts(
    drafter: DFlashDrafter,
    hf_model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    trees: dict[str, TreeFn | None],
    *,
    stop_tokens: Iterable[int] = (),
    pad_token_id: int = 0,
    batch_size: int = 64,
    group: int = 16,
    prepared: tuple[list[list[int]], list[torch.Tensor]] | None = None,
) -> dict[str, dict[str, Any]]:
    """:func:`prepare_replay` (unless ``prepared`` is given: its result for these prompts, with at
    least ``max_new_tokens + B`` tokens), then :func:`replay_tau` for each entry of ``trees``
    (name -> tree builder, None = chain).

    Returns:
        name -> the :func:`replay_tau` dict, plus ``"target_s"``: seconds spent in the target
        (generation and features; 0 with ``prepared``), in each dict.
    """
    B = drafter.config.block_size
    t0 = time.monotonic()
    if prepared is None:
        prepared = prepare_replay(hf_model, prompts, max_new_tokens + B, drafter.config.target_layer_ids,
                                  pad_token_id=pad_token_id, batch_size=batch_size)
    seqs, feats = prepared
    feats = [f.to(drafter.device, drafter.dtype) for f in feats]
    target_s = time.monotonic() - t0
    out = {}
    for name, tree in trees.items():
        r = replay_tau(drafter, seqs, [len(p) for p in prompts], feats, max_new_tokens, tree,
                       stop_tokens=stop_tokens, group=group)
        r["target_s"] = target_s
        out[name] = r
    return out

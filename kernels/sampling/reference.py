"""Token selection and the tree acceptance walk, plain PyTorch (CPU or CUDA tensors).

Sampling is made a deterministic function of ``(seed, position, logits)`` with the Gumbel-max
trick: the token at absolute position ``p`` is ``argmax(logprobs + G_p)``, where ``G_p`` is
standard Gumbel noise drawn from a generator keyed by ``(seed, p)``. Drawing
``argmax(log pi + G)`` is an exact sample of ``softmax`` (Gumbel 1954; e.g. Maddison et al.,
"A* Sampling", 2014). Because the noise depends only on the position, the target's choice at
every tree node equals the choice autoregressive decoding would make after the same prefix, so
the speculative walk emits exactly the target-only sample stream for the same seed, and the
output distribution is the target's whatever the drafter proposes (DESIGN.md, step 3).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser (Steele et al., "Fast splittable pseudorandom number generators", 2014)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """63-bit generator seed for absolute ``position`` of a request with ``seed``."""
    return _mix64(_mix64(seed & _MASK64) ^ (position & _MASK64)) >> 1


def gumbel_noise(seed: int, positions: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise, one row per position: ``[len(positions), vocab]`` float32.

    Row ``i`` depends only on ``(seed, positions[i])`` (a CPU ``torch.Generator`` per row), so
    equal positions give equal rows on any device.
    """
    rows = []
    for p in positions:
        g = torch.Generator().manual_seed(position_seed(seed, p))
        u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
        rows.append(-torch.log(-torch.log(u)))
    return torch.stack(rows).to(device=device, dtype=torch.float32)


def filtered_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Log-probabilities of the sampling distribution after temperature, top-k and top-p.

    Args:
        logits: ``[T, V]`` any float dtype.
        temperature: > 0.
        top_k: keep the ``top_k`` most likely tokens (0 = all).
        top_p: keep the smallest set of most likely tokens whose mass reaches ``top_p``
            (0 or >= 1 = all); the token that crosses the threshold is kept (HF ``TopPLogitsWarper``).

    Returns:
        ``[T, V]`` float32 log-softmax of the kept tokens; removed tokens are ``-inf``.
    """
    x = logits.float() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def select_tokens(
    logits: torch.Tensor,
    next_positions: list[int],
    temperature: float,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """The target's token choice at each row: argmax at temperature 0, else a Gumbel-max sample.

    Args:
        logits: ``[T, V]`` logits of ``T`` nodes.
        next_positions: absolute position of the token each row chooses (node position + 1).
        temperature, top_k, top_p: sampling settings (``temperature == 0`` is greedy).
        seed: request seed; with ``next_positions`` it fixes the noise.

    Returns:
        ``[T]`` int64 token ids on ``logits.device``.
    """
    if temperature <= 0.0:
        return torch.argmax(logits, dim=-1)
    lp = filtered_logprobs(logits, temperature, top_k, top_p)
    noise = gumbel_noise(seed, next_positions, lp.shape[-1], lp.device)
    return torch.argmax(lp + noise, dim=-1)


def accept_path(
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    ancestors: torch.Tensor,
    depth: torch.Tensor,
    choice: torch.Tensor,
) -> torch.Tensor:
    """Walk a verified tree from the root and return the accepted path as a node mask.

    A non-root node ``i`` with parent ``p`` *matches* when ``tree_tokens[i] == choice[p]`` (the
    target, at ``p``, chose ``i``'s token). A node is on the accepted path when it and all of its
    ancestors match; the path ends at the deepest such node (the lowest index among equals, i.e.
    the first matching sibling). This is the walk of DESIGN.md step 3 done with tensor ops: no
    host synchronisation.

    Args:
        tree_tokens: ``[T]`` int64 node tokens (node 0 = root).
        parents: ``[T]`` int64 parent indices (``parents[0]`` is ignored).
        ancestors: ``[T, T]`` bool, ``ancestors[i, j]`` = ``j`` is ``i`` or an ancestor of ``i``.
        depth: ``[T]`` int64 node depths (root 0).
        choice: ``[T]`` int64 the target's token choice at each node.

    Returns:
        ``[T]`` bool mask of the path nodes (root included); the path end is its deepest node.
    """
    t = tree_tokens.shape[0]
    match = tree_tokens == choice[parents.clamp(min=0)]
    match[0] = True
    on_path = ~(ancestors & ~match.unsqueeze(0)).any(dim=1)
    order = torch.arange(t, device=depth.device)
    score = torch.where(on_path, depth * (t + 1) + (t - order), torch.full_like(depth, -1))
    return ancestors[torch.argmax(score)]

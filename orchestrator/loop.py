"""The speculative loop of one request (docs/ARCHITECTURE.md, "One speculative step").

    prefill -> root
    repeat: draft a tree from root (drafter, or root-only without one) -> verify on the target
            -> emit accepted tokens + bonus -> send the committed rows' features to the drafter

A drafter failure (an RPC error or an item error) is logged, counted, and the request goes on
with root-only trees, which is plain autoregressive decoding: no token is lost and the client
sees no error.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Iterator

import grpc

from dflash_grpc.v1 import common_pb2, draft_pb2, target_pb2
from orchestrator.peers import DraftPeer, ItemError, StreamCall, TargetPeer, check_item
from orchestrator.stats import AcceptanceStats

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DraftPlan:
    """How to draft for one request: the drafter's Info and the tree request, or no drafting."""

    info: draft_pb2.DrafterInfo | None
    tree: draft_pb2.TreeParams

    @property
    def enabled(self) -> bool:
        return self.info is not None


def trim_tree(tokens: list[int], parents: list[int], max_depth: int) -> tuple[list[int], list[int]]:
    """Drop the nodes deeper than ``max_depth`` (their subtrees too), re-indexing parents.

    Nodes come in topological order, so a kept node's parent is kept and already re-indexed.
    """
    depth = [0] * len(tokens)
    new_index = [-1] * len(tokens)
    out_t, out_p = [], []
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        depth[i] = 0 if i == 0 else depth[par] + 1
        if depth[i] <= max_depth and (i == 0 or new_index[par] >= 0):
            new_index[i] = len(out_t)
            out_t.append(tok)
            out_p.append(-1 if i == 0 else new_index[par])
    return out_t, out_p


def _tree_depth(parents: list[int]) -> int:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return max(depth)


def speculative_tokens(
    target: TargetPeer,
    draft: DraftPeer,
    plan: DraftPlan,
    session_id: str,
    prompt: list[int],
    sampling: common_pb2.SamplingParams,
    max_tokens: int,
    target_info: common_pb2.ModelInfo,
    stats: AcceptanceStats,
    timeout: float | None = None,
) -> Iterator[list[int]]:
    """Generate tokens speculatively; yields the tokens of each step (first: the prefill token).

    The caller stops consuming when it is done (EOS, stop string, max_tokens, cancellation);
    closing the generator releases the sessions on both services.

    Raises:
        grpc.RpcError: the target failed (the caller maps it to the client's status).
        ItemError: the target refused an item (e.g. context full), with its status code.
    """
    max_context = target_info.max_context
    width_cap = target_info.max_tree_width or 1
    depth_cap = target_info.max_tree_depth or 10**9
    use_draft = plan.enabled
    layers = list(plan.info.target_layer_ids) if use_draft else []
    verify: StreamCall | None = None
    propose: StreamCall | None = None
    try:
        res = target.prefill(
            target_pb2.PrefillItem(session_id=session_id, prompt_tokens=prompt, sampling=sampling, feature_layer_ids=layers),
            timeout,
        )
        root, L = res.first_token, res.committed_length
        pending = res.features  # rows the drafter has not seen yet
        emitted = 1
        t_first = time.monotonic()
        yield [root]
        verify = target.verify_stream(timeout)
        block = plan.info.model.block_size if use_draft else 1
        while emitted < max_tokens:
            room = max_context - L - 1  # deepest allowed node: L + depth + 1 <= max_context
            if room < 0:
                raise ItemError(grpc.StatusCode.RESOURCE_EXHAUSTED, "context full")
            max_depth = min(block - 1, room, max_tokens - emitted - 1, depth_cap)
            tokens, parents = [root], [-1]
            if use_draft and max_depth > 0:
                try:
                    if propose is None:
                        propose = draft.propose_stream(timeout)
                    t0 = time.perf_counter()
                    reply = propose.exchange(
                        draft_pb2.ProposeRequest(
                            items=[draft_pb2.ProposeItem(session_id=session_id, features=pending, root_token=root, committed_length=L, tree=plan.tree)]
                        )
                    )
                    stats.draft_time_s += time.perf_counter() - t0
                    stats.draft_compute_s += reply.compute_s
                    item = reply.results[0]
                    check_item(item.status)
                    pending = None
                    tokens, parents = trim_tree(list(item.tree.tokens), list(item.tree.parents), max_depth)
                    tokens, parents = tokens[:width_cap], parents[:width_cap]  # topological: a prefix is a tree
                    if not tokens or tokens[0] != root:
                        raise ItemError(grpc.StatusCode.INTERNAL, "drafter returned a tree with the wrong root")
                except (grpc.RpcError, ItemError) as e:
                    code = e.code() if isinstance(e, grpc.RpcError) else e.code
                    log.warning("draft service failed; continuing without it", extra={"session": session_id, "code": code.name, "error": str(e)[:200]})
                    stats.draft_fallbacks += 1
                    draft.mark_failed(f"failed mid-request: {code.name}")
                    use_draft = False
                    tokens, parents = [root], [-1]
                    if propose is not None:
                        propose.close()
                        propose = None
            t0 = time.perf_counter()
            reply = verify.exchange(
                target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(session_id=session_id, tree=common_pb2.TokenTree(tokens=tokens, parents=parents))])
            )
            stats.verify_time_s += time.perf_counter() - t0
            stats.verify_compute_s += reply.compute_s
            item = reply.results[0]
            check_item(item.status)
            k = len(item.accepted_tokens)
            stats.record_step(_tree_depth(parents), len(tokens) - 1, k)
            out = list(item.accepted_tokens) + [item.bonus_token]
            root, L = item.bonus_token, item.committed_length
            if use_draft:
                pending = _concat_features(pending, item.features)
            emitted += len(out)
            stats.decode_time_s = time.monotonic() - t_first
            yield out
    finally:
        if verify is not None:
            verify.close()
        if propose is not None:
            propose.close()
        target.release(session_id)
        if plan.enabled:
            draft.release(session_id)


def _concat_features(a: common_pb2.Tensor | None, b: common_pb2.Tensor) -> common_pb2.Tensor:
    """Rows of ``a`` followed by rows of ``b`` (same dtype and width), as one wire tensor."""
    if a is None or not a.data:
        return b
    if a.dtype != b.dtype or list(a.shape[1:]) != list(b.shape[1:]):
        raise ItemError(grpc.StatusCode.INTERNAL, "feature tensors of different layouts")
    return common_pb2.Tensor(dtype=a.dtype, shape=[a.shape[0] + b.shape[0], *a.shape[1:]], data=a.data + b.data)

"""The scheduler's Verify and Propose messages, per item or as columns (:mod:`dflash_grpc.columns`;
docs/ARCHITECTURE.md, "The v1 contract").

A tick's batch is gathered as plain lists (one entry per item) and written here as one message:
the columnar form when the peer lists "columnar" in its Info features, else one message per item
(an older peer). Replies, in either form, are read back into one tuple per item, so the
scheduler's per-item work never touches a protobuf object.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from dflash_grpc.columns import (ColumnsError, Rows, fill_features, fill_trees, index_statuses, pack_i32,
                                 read_features, read_trees, unpack_i32)
from dflash_grpc.v1 import common_pb2, draft_pb2, target_pb2


class Verified(NamedTuple):
    """One item of a Verify reply: ``status`` (None: accepted; else the refusal, code != 0),
    the accepted draft tokens, the bonus token, the committed length and the committed rows'
    features (:class:`~dflash_grpc.columns.Rows`, a wire ``Tensor``, or None)."""

    status: common_pb2.ItemStatus | None
    accepted: list[int]
    bonus: int
    length: int
    features: Rows | common_pb2.Tensor | None


class Proposed(NamedTuple):
    """One item of a Propose reply: ``status`` (None: a tree; else the refusal) and the tree."""

    status: common_pb2.ItemStatus | None
    tokens: list[int]
    parents: list[int]


def verify_request(columnar: bool, sids: Sequence[str], sizes: Sequence[int], tokens: Sequence[int],
                   parents: Sequence[int]) -> target_pb2.VerifyRequest:
    """One Verify message: item ``i`` verifies the tree of ``sizes[i]`` nodes (``tokens`` and
    ``parents`` of all trees, in order) for session ``sids[i]``."""
    request = target_pb2.VerifyRequest()
    if columnar:
        cols = request.columns
        cols.session_ids.extend(sids)
        fill_trees(cols.trees, sizes, tokens, parents)
        cols.SetInParent()
        return request
    add, o = request.items.add, 0
    for sid, n in zip(sids, sizes):
        tree = add(session_id=sid).tree
        tree.tokens.extend(tokens[o:o + n])
        tree.parents.extend(parents[o:o + n])
        o += n
    return request


def verify_results(reply: target_pb2.VerifyResponse, count: int) -> list[Verified]:
    """The items of a Verify reply to ``count`` items (a per-item reply may hold fewer).

    Raises:
        ColumnsError: columns that do not fit together.
    """
    if not reply.HasField("columns"):
        out = []
        for res in reply.results:
            status = res.status
            if status.code:
                out.append(Verified(status, [], 0, 0, None))
            else:
                out.append(Verified(None, res.accepted_tokens[:], res.bonus_token, res.committed_length, res.features))
        return out
    cols = reply.columns
    refused = index_statuses(cols.refused, count)
    accepted = unpack_i32(cols.accepted, count, "accepted")
    tokens = unpack_i32(cols.accepted_tokens, what="accepted_tokens")
    bonus = unpack_i32(cols.bonus_tokens, count, "bonus_tokens")
    lengths = unpack_i32(cols.committed_lengths, count, "committed_lengths")
    feats = read_features(cols.features, count)
    if (accepted and min(accepted) < 0) or sum(accepted) != len(tokens):
        raise ColumnsError(f"accepted: counts do not add up to the {len(tokens)} tokens")
    out, o = [], 0
    for i in range(count):
        k = accepted[i]
        status = refused.get(i)
        out.append(Verified(status, tokens[o:o + k], bonus[i], lengths[i], feats[i]) if status is None
                   else Verified(status, [], 0, 0, None))
        o += k
    return out


class ProposeItems:
    """A Propose message being gathered, one item at a time (:meth:`add`), then written
    (:meth:`request`)."""

    __slots__ = ("sids", "roots", "lengths", "budgets", "top_ks", "depths", "features")

    def __init__(self):
        self.sids: list[str] = []
        self.roots: list[int] = []
        self.lengths: list[int] = []
        self.budgets: list[int] = []
        self.top_ks: list[int] = []
        self.depths: list[int] = []
        self.features: list[Rows | None] = []

    def add(self, sid: str, root: int, length: int, budget: int, top_k: int, max_depth: int,
            features: Rows | None) -> None:
        """An item: session ``sid``, its root and committed length, its ``TreeParams`` and the
        rows committed since its last Propose."""
        self.sids.append(sid)
        self.roots.append(root)
        self.lengths.append(length)
        self.budgets.append(budget)
        self.top_ks.append(top_k)
        self.depths.append(max_depth)
        self.features.append(features)

    def __len__(self) -> int:
        return len(self.sids)

    def request(self, columnar: bool) -> draft_pb2.ProposeRequest:
        """The Propose message: columns when ``columnar`` and every item's rows share one dtype
        and width (one tensor holds them), else one message per item."""
        request = draft_pb2.ProposeRequest()
        if columnar:
            cols = request.columns
            if fill_features(cols.features, self.features):
                cols.session_ids.extend(self.sids)
                cols.root_tokens = pack_i32(self.roots)
                cols.committed_lengths = pack_i32(self.lengths)
                cols.budgets = pack_i32(self.budgets)
                cols.top_ks = pack_i32(self.top_ks)
                cols.max_depths = pack_i32(self.depths)
                cols.SetInParent()
                return request
            request = draft_pb2.ProposeRequest()
        add = request.items.add
        for sid, root, length, budget, top_k, depth, rows in zip(self.sids, self.roots, self.lengths, self.budgets,
                                                                 self.top_ks, self.depths, self.features):
            item = add(session_id=sid, root_token=root, committed_length=length)
            if rows is not None:
                f = item.features
                f.dtype = rows.dtype
                f.shape.extend((rows.rows, rows.width))
                f.data = bytes(rows.data)
            tree = item.tree
            tree.top_k = top_k
            tree.max_depth = depth
            tree.budget = budget
            tree.SetInParent()   # present even when every field is 0, as before
        return request


def propose_results(reply: draft_pb2.ProposeResponse, count: int) -> list[Proposed]:
    """The items of a Propose reply to ``count`` items (a per-item reply may hold fewer).

    Raises:
        ColumnsError: columns that do not fit together.
    """
    if not reply.HasField("trees"):
        out = []
        for res in reply.results:
            status = res.status
            if status.code:
                out.append(Proposed(status, [], []))
            else:
                tree = res.tree
                out.append(Proposed(None, tree.tokens[:], tree.parents[:]))
        return out
    refused = index_statuses(reply.refused, count)
    return [Proposed(refused.get(i), tokens, parents) for i, (tokens, parents) in enumerate(read_trees(reply.trees, count))]


def join_rows(parts: Sequence[Rows]) -> Rows | None:
    """The rows of ``parts`` in order, as one entry (None if empty).

    Raises:
        ValueError: parts of different dtypes or widths.
    """
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any(p.dtype != first.dtype or p.width != first.width for p in parts):
        raise ValueError("feature rows of different layouts")
    return Rows(first.dtype, first.width, sum(p.rows for p in parts), b"".join(p.data for p in parts))


__all__ = ["ProposeItems", "Proposed", "Verified", "join_rows", "propose_results", "verify_request", "verify_results"]

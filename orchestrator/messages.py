"""The scheduler's Verify and Propose messages, per item or as columns (:mod:`dflash_grpc.columns`;
docs/ARCHITECTURE.md, "The v1 contract").

A tick's batch is gathered as plain lists (one entry per item) and written here as one message:
the columnar form when the peer lists "columnar" in its Info features, else one message per item
(an older peer). Replies, in either form, are read back into one tuple per item, so the
scheduler's per-item work never touches a protobuf object.
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple, Sequence

from dflash_grpc.columns import (ColumnsError, Rows, varint, feature_parts, features_tail, fill_features, fill_trees,
                                 index_statuses, length_delimited, pack_i32, read_features, read_trees, unpack_i32)
from dflash_grpc.v1 import common_pb2, draft_pb2, target_pb2
from runtime.tree import TreeError, tree_depths


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


class RingRows(NamedTuple):
    """An item's committed rows in the target's feature ring (:mod:`runtime.feature_ring`):
    ``rows`` rows of ring slot ``slot``, at the positions just before the item's committed
    length."""

    slot: int
    rows: int


def verify_request(columnar: bool, sids: Sequence[str], sizes: Sequence[int], tokens: Sequence[int],
                   parents: Sequence[int], trees: common_pb2.TreeColumns | None = None) -> target_pb2.VerifyRequest:
    """One Verify message: item ``i`` verifies the tree of ``sizes[i]`` nodes (``tokens`` and
    ``parents`` of all trees, in order) for session ``sids[i]``; with ``trees`` (columnar only),
    the trees of those columns instead (packed already: a Propose reply's, :class:`CheckedTrees`)."""
    request = target_pb2.VerifyRequest()
    if columnar:
        cols = request.columns
        cols.session_ids.extend(sids)
        if trees is not None:
            cols.trees.CopyFrom(trees)
        else:
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
    refused, accepted, bonus, lengths, feats = verify_columns(reply, count)
    return [Verified(None, *item) if i not in refused else Verified(refused[i], [], 0, 0, None)
            for i, item in enumerate(zip(accepted, bonus, lengths, feats))]


#: the least bytes of a Verify reply that :func:`parse_verify_reply` parses without copying its rows
ZERO_COPY_FROM = 1 << 16


def _field_at(buf, start: int, end: int, number: int) -> tuple[int, int, int] | None:
    """The one length-delimited field ``number`` of the message ``buf[start:end]``: ``(header
    start, payload start, payload end)``; None when it is absent, occurs twice, has another wire
    type, or the message does not walk cleanly (a group, a length past the end)."""
    try:
        found = length_delimited(buf, start, end, number)
    except (ValueError, IndexError):
        return None
    return found[0] if len(found) == 1 else None


class VerifyReply:
    """A columnar Verify reply parsed without copying its feature rows (:func:`parse_verify_reply`):
    the message (its ``rows_data`` tensor without its bytes) and ``rows_data``, those bytes as a
    view of the buffer the reply came in. Reads as the message otherwise (its fields, ``HasField``)."""

    __slots__ = ("message", "rows_data")

    def __init__(self, message: target_pb2.VerifyResponse, rows_data: memoryview):
        self.message = message
        self.rows_data = rows_data

    def __getattr__(self, name):
        return getattr(self.message, name)


def parse_verify_reply(data) -> target_pb2.VerifyResponse | VerifyReply:
    """A Verify reply from its wire bytes (the Verify streams' deserializer). A columnar reply's
    feature rows (about 1.5 MB a tick at 64 streams) are not copied: the message is parsed without
    them (the nested lengths rewritten) and they stay a view of ``data``
    (:class:`VerifyReply`), which the next Propose sends on (a request keeps them until then). Any
    other reply, one laid out otherwise (a field twice, no rows) or one under
    :data:`ZERO_COPY_FROM` bytes (a few items' rows: copying them costs less than the walk) is
    parsed as it is.

    Raises:
        google.protobuf.message.DecodeError: bytes that do not parse (as ``FromString``).
    """
    view = memoryview(data).cast("B")
    if len(view) < ZERO_COPY_FROM:   # (a small reply: its copy costs less than the walk)
        return target_pb2.VerifyResponse.FromString(view)
    try:
        path = []   # (header start, payload start, payload end): columns, features, rows_data, data
        start, end = 0, len(view)
        for number in (6, 7, 2, 3):   # VerifyResponse.columns .features .rows_data .data
            field = _field_at(view, start, end, number)
            if field is None:
                return target_pb2.VerifyResponse.FromString(view)
            path.append(field)
            start, end = field[1], field[2]
    except (IndexError, ValueError):
        return target_pb2.VerifyResponse.FromString(view)
    data_head, data_start, data_end = path[3]
    removed = data_end - data_head                 # the data field, header and all
    pieces, o = [], 0
    headers = []
    for (head, start, end), number in zip(path[2::-1], (2, 7, 6)):   # rows_data, features, columns: inner first
        length = end - start - removed
        header = varint(number << 3 | 2) + varint(length)
        removed += (start - head) - len(header)
        headers.append((head, start, header))
    for head, start, header in reversed(headers):  # outer first
        pieces += [view[o:head], header]
        o = start
    pieces += [view[o:data_head], view[data_end:]]
    message = target_pb2.VerifyResponse.FromString(b"".join(pieces))
    return VerifyReply(message, view[data_start:data_end])


def verify_columns(reply: target_pb2.VerifyResponse, count: int
                   ) -> tuple[dict[int, common_pb2.ItemStatus], list[list[int]], list[int], list[int], list]:
    """A Verify reply to ``count`` items as columns (:func:`verify_results` without a tuple per
    item; a per-item reply may hold fewer): the refused items' statuses by index (their other
    entries mean nothing), then per item its accepted draft tokens, bonus token, committed length
    and committed rows' features (:class:`~dflash_grpc.columns.Rows`, a wire ``Tensor``,
    :class:`RingRows` where they are in the feature ring, or None).

    Raises:
        ColumnsError: columns that do not fit together.
    """
    rows_data = None
    if isinstance(reply, VerifyReply):
        reply, rows_data = reply.message, reply.rows_data
    if not reply.HasField("columns"):
        refused, accepted, bonus, lengths, feats = {}, [], [], [], []
        for i, res in enumerate(reply.results):
            status = res.status
            if status.code:
                refused[i] = status
                accepted.append([])
                bonus.append(0)
                lengths.append(0)
                feats.append(None)
            else:
                accepted.append(res.accepted_tokens[:])
                bonus.append(res.bonus_token)
                lengths.append(res.committed_length)
                feats.append(RingRows(res.ring_slot, res.ring_rows) if res.ring_rows else res.features)
        return refused, accepted, bonus, lengths, feats
    cols = reply.columns
    refused = index_statuses(cols.refused, count)
    counts = unpack_i32(cols.accepted, count, "accepted")
    tokens = unpack_i32(cols.accepted_tokens, what="accepted_tokens")
    bonus = unpack_i32(cols.bonus_tokens, count, "bonus_tokens")
    lengths = unpack_i32(cols.committed_lengths, count, "committed_lengths")
    fc = cols.features
    feats = read_features(fc, count, rows_data)
    if fc.ring_rows:
        ring_rows = unpack_i32(fc.ring_rows, count, "features.ring_rows")
        ring_slots = unpack_i32(fc.ring_slots, count, "features.ring_slots")
        for i, n in enumerate(ring_rows):
            if n:
                if feats[i] is not None:
                    raise ColumnsError(f"item {i}: rows both in the reply and in the feature ring")
                feats[i] = RingRows(ring_slots[i], n)
    if (counts and min(counts) < 0) or sum(counts) != len(tokens):
        raise ColumnsError(f"accepted: counts do not add up to the {len(tokens)} tokens")
    ends = list(accumulate(counts))
    accepted = [tokens[e - k:e] for k, e in zip(counts, ends)]
    return refused, accepted, bonus, lengths, feats


class Serialized:
    """A request as its wire bytes, built here (:meth:`ProposeItems.request`), in ``pieces``
    (buffers, to be sent one after the other): what a stream that sends
    ``request.SerializeToString()`` sends (``DirectStreamCall``); the same-host hop sends the
    pieces as they are (:func:`dflash_grpc.localhop.send_buffers`), not joined."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: list):
        self.pieces = pieces

    def SerializeToString(self) -> bytes:   # noqa: N802 - a protobuf message's name
        """The wire bytes (the pieces joined)."""
        return b"".join(self.pieces)


class ProposeItems:
    """A Propose message being gathered, one item at a time (:meth:`add`), then written
    (:meth:`request`)."""

    __slots__ = ("sids", "roots", "lengths", "budgets", "top_ks", "depths", "features", "rings", "ring")

    def __init__(self):
        self.sids: list[str] = []
        self.roots: list[int] = []
        self.lengths: list[int] = []
        self.budgets: list[int] = []
        self.top_ks: list[int] = []
        self.depths: list[int] = []
        self.features: list[Rows | None] = []
        #: each item's rows in the feature ring (after its ``features``), or None; the ring
        self.rings: list[RingRows | None] = []
        self.ring: common_pb2.FeatureRing | None = None

    def add(self, sid: str, root: int, length: int, budget: int, top_k: int, max_depth: int,
            features: Rows | None, ring: RingRows | None = None) -> None:
        """An item: session ``sid``, its root and committed length, its ``TreeParams`` and the
        rows committed since its last Propose (``features``, then ``ring``'s in the feature ring:
        set :attr:`ring` too)."""
        self.sids.append(sid)
        self.roots.append(root)
        self.lengths.append(length)
        self.budgets.append(budget)
        self.top_ks.append(top_k)
        self.depths.append(max_depth)
        self.features.append(features)
        self.rings.append(ring)

    def __len__(self) -> int:
        return len(self.sids)

    def request(self, columnar: bool, serialized: bool = False) -> draft_pb2.ProposeRequest | Serialized:
        """The Propose message: columns when ``columnar`` and every item's rows share one dtype
        and width (one tensor holds them), else one message per item. ``serialized``: the
        columnar message as its wire bytes (:class:`Serialized`), the rows in them as the buffers
        they are in (:func:`~dflash_grpc.columns.features_tail`: not copied into a message and
        out again)."""
        request = draft_pb2.ProposeRequest()
        ringed = self.ring is not None and any(self.rings)
        if ringed:
            serialized = False   # (the ring's fields follow the rows: the rows cannot end the message)
        if columnar:
            cols = request.columns
            got = feature_parts(self.features)   # (read once for both)
            if got is not None and fill_features(cols.features, self.features, tensor=not serialized, got=got):
                cols.session_ids.extend(self.sids)
                cols.root_tokens = pack_i32(self.roots)
                cols.committed_lengths = pack_i32(self.lengths)
                cols.budgets = pack_i32(self.budgets)
                cols.top_ks = pack_i32(self.top_ks)
                cols.max_depths = pack_i32(self.depths)
                cols.SetInParent()
                if ringed:
                    cols.features.ring_slots = pack_i32([r.slot if r is not None else -1 for r in self.rings])
                    cols.features.ring_rows = pack_i32([r.rows if r is not None else 0 for r in self.rings])
                    request.ring.CopyFrom(self.ring)
                if serialized:
                    return Serialized([request.SerializeToString(), *features_tail((2, 7), self.features, got)])
                return request
            request = draft_pb2.ProposeRequest()
        if ringed:
            request.ring.CopyFrom(self.ring)
        add = request.items.add
        for sid, root, length, budget, top_k, depth, rows, ring in zip(
                self.sids, self.roots, self.lengths, self.budgets, self.top_ks, self.depths, self.features, self.rings):
            item = add(session_id=sid, root_token=root, committed_length=length)
            if rows is not None:
                f = item.features
                f.dtype = rows.dtype
                f.shape.extend((rows.rows, rows.width))
                f.data = bytes(rows.data)
            if ring is not None and ringed:
                item.ring_slot, item.ring_rows = ring.slot, ring.rows
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


class CheckedTrees(NamedTuple):
    """The trees of a columnar Propose reply, every one fit to verify as it came
    (:meth:`TreeChecker.check`): the message's columns (``TreeColumns``), each tree's node count
    and depth (its deepest node's)."""

    columns: common_pb2.TreeColumns
    sizes: list[int]
    depths: list[int]


class TreeChecker:
    """Checks a batch of drafted trees at once, each distinct parent list once: the depth of a
    well-formed parent list (:func:`runtime.tree.tree_depths`) is kept, by its packed bytes, for
    the next tree of the same shape (the drafter's trees come in few shapes). At most ``limit``
    shapes are kept (then the memory starts again)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self._depth: dict[bytes, int] = {}

    def check(self, trees: common_pb2.TreeColumns, roots: Sequence[int], max_depths: Sequence[int],
              width_cap: int) -> CheckedTrees | None:
        """The trees of ``trees`` when every one is fit to verify as it came: ``len(roots)``
        trees, tree ``i`` well formed (:func:`runtime.tree.tree_depths`), rooted at ``roots[i]``,
        no deeper than ``max_depths[i]``, of 1 to ``width_cap`` nodes. None when one is not (or
        the columns do not fit together): the caller then reads the trees one by one
        (:func:`propose_results`), trimming or refusing each as it must."""
        raw_sizes, raw_tokens, raw_parents = trees.sizes, trees.tokens, trees.parents
        count = len(roots)
        if (len(raw_sizes) != 4 * count or len(raw_tokens) % 4 or len(raw_parents) != len(raw_tokens)
                or not count):
            return None
        sizes = unpack_i32(raw_sizes)
        if min(sizes) < 1 or max(sizes) > width_cap or 4 * sum(sizes) != len(raw_tokens):
            return None
        tokens = unpack_i32(raw_tokens)
        known, depths, o = self._depth, [], 0
        for n, root, max_depth in zip(sizes, roots, max_depths):
            if tokens[o] != root:
                return None
            shape = raw_parents[4 * o:4 * (o + n)]
            depth = known.get(shape)
            if depth is None:
                try:
                    depth = max(tree_depths(unpack_i32(shape)))
                except TreeError:
                    return None
                if len(known) >= self.limit:
                    known.clear()
                known[shape] = depth
            if depth > max_depth:
                return None
            depths.append(depth)
            o += n
        return CheckedTrees(trees, sizes, depths)


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


__all__ = ["CheckedTrees", "ProposeItems", "Proposed", "RingRows", "Serialized", "TreeChecker", "Verified", "VerifyReply", "join_rows",
           "parse_verify_reply", "propose_results", "verify_columns", "verify_request", "verify_results"]

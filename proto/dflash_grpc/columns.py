"""The columnar form of the batched stream messages (``common.proto``, "The columnar form"):
packing and checking the int32 columns, token trees and feature rows of a batch. Torch-free
(the orchestrator uses it as well as the services); :class:`ColumnsError` is what a malformed
columnar message raises (a service ends the call with INVALID_ARGUMENT).

Why (issue 23): a batch of 64 items as 64 messages costs each side tens of microseconds per item
to build, serialise, parse and read (per-item protobuf objects, a ``bytes`` field copied per
item); as columns it is a few fields per batch, read and written whole.
"""

from __future__ import annotations

import sys
from array import array
from typing import NamedTuple, Sequence

from dflash_grpc.v1 import common_pb2

#: the ``features`` entry of a service's Info that says it reads and answers the columnar form
COLUMNAR = "columnar"

_ITEMSIZE = {common_pb2.DTYPE_BF16: 2, common_pb2.DTYPE_F16: 2, common_pb2.DTYPE_F32: 4}
_SWAP = sys.byteorder != "little"
assert array("i").itemsize == 4


class ColumnsError(ValueError):
    """A columnar message whose columns do not fit together (lengths, sizes, a shape)."""


def pack_i32(values: Sequence[int]) -> bytes:
    """``values`` as packed little-endian int32 bytes.

    Raises:
        OverflowError: a value outside int32.
    """
    a = array("i", values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def unpack_i32(data: bytes, count: int | None = None, what: str = "column") -> list[int]:
    """The int32 values of packed little-endian bytes (``count`` of them when given).

    Raises:
        ColumnsError: a byte count not a multiple of 4, or not ``count`` values.
    """
    if len(data) % 4:
        raise ColumnsError(f"{what}: {len(data)} bytes is not a whole number of int32 values")
    a = array("i")
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    if count is not None and len(a) != count:
        raise ColumnsError(f"{what}: {len(a)} values for {count} items")
    return a.tolist()


def _sizes(sizes: list[int], total: int, what: str) -> None:
    if sizes and min(sizes) < 0:
        raise ColumnsError(f"{what}: a negative size")
    if sum(sizes) != total:
        raise ColumnsError(f"{what}: sizes add up to {sum(sizes)}, not {total}")


def fill_trees(msg: common_pb2.TreeColumns, sizes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> None:
    """Write trees (``sizes[i]`` nodes each; ``tokens`` and ``parents`` of all, in order) into ``msg``."""
    msg.sizes = pack_i32(sizes)
    msg.tokens = pack_i32(tokens)
    msg.parents = pack_i32(parents)


def read_trees(msg: common_pb2.TreeColumns, count: int) -> list[tuple[list[int], list[int]]]:
    """The ``count`` trees of ``msg``: ``(tokens, parents)`` per item (a tree's own rules, e.g.
    its root and parents, are not checked here).

    Raises:
        ColumnsError: not ``count`` sizes, a negative size, or sizes that do not add up to the
            tokens and parents given.
    """
    sizes = unpack_i32(msg.sizes, count, "trees.sizes")
    tokens = unpack_i32(msg.tokens, what="trees.tokens")
    parents = unpack_i32(msg.parents, len(tokens), "trees.parents")
    _sizes(sizes, len(tokens), "trees.sizes")
    out, o = [], 0
    for n in sizes:
        out.append((tokens[o:o + n], parents[o:o + n]))
        o += n
    return out


class Rows(NamedTuple):
    """Feature rows of one item as bytes: ``rows`` rows of ``width`` values of wire ``dtype``
    (``common_pb2.DType``), row-major in ``data`` (``bytes`` or a ``memoryview``)."""

    dtype: int
    width: int
    rows: int
    data: bytes | memoryview

    @classmethod
    def of_tensor(cls, msg: common_pb2.Tensor) -> "Rows | None":
        """The rows of a ``[rows, width]`` wire tensor (its bytes read once), or None when it has
        no data. A tensor of another rank keeps its bytes, with ``width`` the product of its
        trailing dimensions (0 rows: ``[]`` shape)."""
        data = msg.data   # (each read of the field is a copy: read once)
        if not data:
            return None
        shape = msg.shape[:]
        width = 1
        for d in shape[1:]:
            width *= d
        return cls(msg.dtype, width, shape[0] if shape else 0, data)


def feature_parts(parts: Sequence[Rows | None]) -> tuple[list[int], list, tuple[int, int] | None] | None:
    """Each entry's row count, the buffers of those with rows and their common ``(dtype,
    width)`` (None: no rows at all); None when they do not share one dtype and width. (What
    :func:`fill_features` and :func:`features_tail` read of ``parts``: pass it to both to read
    ``parts`` once.)"""
    rows, data = [], []
    add_rows, add_data = rows.append, data.append
    dtype = width = None
    for p in parts:
        if p is None or not p[2]:   # (Rows.rows; by index: read per item of every tick)
            add_rows(0)
            continue
        if dtype is None:
            dtype, width = p[0], p[1]
        elif p[0] != dtype or p[1] != width:
            return None
        add_rows(p[2])
        add_data(p[3])
    return rows, data, (None if dtype is None else (dtype, width))


_feature_parts = feature_parts


def fill_features(msg: common_pb2.FeatureColumns, parts: Sequence[Rows | None], tensor: bool = True,
                  got: tuple | None = None) -> bool:
    """Write one item's rows per entry of ``parts`` (None: no rows) into ``msg``: the rows
    column and one ``[sum(rows), width]`` tensor (only the rows column when not ``tensor``: the
    tensor is then :func:`features_tail`'s to write). Returns False (``msg`` untouched) when the
    entries do not share one dtype and width, which one tensor cannot hold. ``got``:
    :func:`feature_parts` of ``parts`` when the caller has it (None: read here)."""
    if got is None:
        got = feature_parts(parts)
    if got is None:
        return False
    rows, data, layout = got
    msg.rows = pack_i32(rows)
    if layout is not None and tensor:
        t = msg.rows_data
        t.dtype = layout[0]
        t.shape.extend((sum(rows), layout[1]))
        t.data = b"".join(data)
    return True


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(buf, o: int) -> tuple[int, int]:
    """The protobuf varint at ``buf[o]`` (any indexable of byte values) and the offset after it.

    Raises:
        IndexError: past the end of ``buf``. ValueError: longer than 10 bytes.
    """
    b = buf[o]
    if b < 0x80:   # (one byte: tags and small lengths)
        return b, o + 1
    value = shift = 0
    while True:
        b = buf[o]
        o += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, o
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def length_delimited(buf, start: int, end: int, number: int) -> list[tuple[int, int, int]]:
    """Every occurrence of the length-delimited field ``number`` in the serialised message
    ``buf[start:end]`` (protobuf wire format: tag varints, wire types 0, 1, 2, 5), as ``(header
    start, payload start, payload end)`` offsets: how the services find a message's feature rows in
    the buffer it came in without parsing them.

    Raises:
        ValueError: the message does not walk cleanly (a group, another wire type for ``number``,
            a length past the end). IndexError: a varint past the end of ``buf``.
    """
    found, o = [], start
    while o < end:
        head = o
        tag, o = read_varint(buf, o)
        wire = tag & 7
        if wire == 0:
            _, o = read_varint(buf, o)
        elif wire == 1:
            o += 8
        elif wire == 5:
            o += 4
        elif wire == 2:
            n, o = read_varint(buf, o)
            if tag >> 3 == number:
                found.append((head, o, o + n))
            o += n
        else:
            raise ValueError("a group")
        if tag >> 3 == number and wire != 2:
            raise ValueError(f"field {number} is not length-delimited")
        if o > end:
            raise ValueError("a length past the end")
    return found


def features_tail(path: Sequence[int], parts: Sequence[Rows | None], got: tuple | None = None) -> list:
    """The wire bytes that set the ``rows_data`` tensor of the ``FeatureColumns`` reached by the
    message fields ``path`` (field numbers from the outermost message: ``(2, 7)`` is
    ``ProposeRequest.columns.features``) to the rows of ``parts``, as buffers to send one after
    the other: a header, then each entry's own buffer, not copied. Appended to the serialised
    message whose rows column :func:`fill_features` (``tensor=False``) wrote, they make it the
    message :func:`fill_features` would have written (a parser merges a message field that
    occurs twice), without copying the rows into a message and out again. Empty when no entry
    has rows. Call it only where :func:`fill_features` returned True (one dtype and width).
    ``got``: :func:`feature_parts` of ``parts`` when the caller has it (None: read here)."""
    rows, data, layout = feature_parts(parts) if got is None else got
    if layout is None:
        return []
    n = sum(map(_nbytes, data))
    dtype, width = layout   # the Tensor's dtype (field 1, omitted at 0) and packed shape (field 2), as protobuf writes them
    shape = varint(sum(rows)) + varint(width)
    head = (b"\x08" + varint(dtype) if dtype else b"") + b"\x12" + varint(len(shape)) + shape
    head += b"\x1a" + varint(n)   # Tensor.data (field 3, length-delimited)
    length = len(head) + n
    for field in reversed((*path, 2)):       # path, then FeatureColumns.rows_data (field 2)
        wrap = varint(field << 3 | 2) + varint(length)
        head = wrap + head
        length += len(wrap)
    return [head, *data]


def _nbytes(buf) -> int:
    """Bytes of a bytes-like object."""
    kind = type(buf)
    return len(buf) if kind is bytes else buf.nbytes if kind is memoryview else memoryview(buf).nbytes


def read_features(msg: common_pb2.FeatureColumns, count: int, data=None) -> list[Rows | None]:
    """The ``count`` items' rows of ``msg`` (None for an item of 0 rows; an empty message: no
    rows at all), as slices of one ``memoryview`` of the tensor's bytes (read once), or of
    ``data`` when given: the tensor's bytes held apart from the message (parsed without them).

    Raises:
        ColumnsError: not ``count`` row counts, a negative count, counts that do not add up to the
            tensor's rows, a tensor that is not 2-D, of an unknown dtype or of the wrong byte count.
    """
    raw = msg.rows
    if not raw and not msg.HasField("rows_data"):
        return [None] * count   # no rows at all
    rows = unpack_i32(raw, count, "features.rows")
    total = sum(rows)
    if rows and min(rows) < 0:
        raise ColumnsError("features.rows: a negative row count")
    if not total:
        return [None] * count
    t = msg.rows_data
    shape = t.shape[:]
    if len(shape) != 2 or shape[0] != total or shape[1] < 0:
        raise ColumnsError(f"features: a tensor of shape {shape} for {total} rows")
    size = _ITEMSIZE.get(t.dtype)
    if size is None:
        raise ColumnsError(f"features: unsupported dtype {t.dtype}")
    if data is None:
        data = t.data
    row = shape[1] * size
    if len(data) != total * row:
        raise ColumnsError(f"features: {len(data)} bytes for {total} rows of {row}")
    view, out, o = memoryview(data), [], 0
    add, new, dtype, width = out.append, tuple.__new__, t.dtype, shape[1]   # (a Rows per item per tick: no
    for n in rows:                                                        # NamedTuple.__new__, no field reads)
        if n:
            end = o + n * row
            add(new(Rows, (dtype, width, n, view[o:end])))
            o = end
        else:
            add(None)
    return out


def index_statuses(refused, count: int) -> dict[int, common_pb2.ItemStatus]:
    """The refused items of a columnar reply (``IndexedStatus`` entries) by index.

    Raises:
        ColumnsError: an index outside ``[0, count)`` or listed twice, or a status of code 0.
    """
    out = {}
    for r in refused:
        i = r.index
        if not 0 <= i < count or i in out or not r.status.code:
            raise ColumnsError(f"refused: bad entry for item {i} of {count}")
        out[i] = r.status
    return out


__all__ = ["COLUMNAR", "ColumnsError", "Rows", "feature_parts", "features_tail", "fill_features", "fill_trees", "index_statuses",
           "length_delimited", "pack_i32", "read_varint",
           "read_features", "read_trees", "unpack_i32", "varint"]

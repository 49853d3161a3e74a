"""Conversions between torch tensors / Python values and the v1 wire messages.

Features travel as raw bytes with a dtype and a shape (docs/ARCHITECTURE.md, "The services"), never as
lists of floats. Errors are raised as :class:`WireError` (mapped to INVALID_ARGUMENT by servers).
"""

from __future__ import annotations

import ctypes

import torch

from dflash_grpc.transport import GRPC_OPTIONS, MAX_MESSAGE_BYTES  # noqa: F401  (re-exported)
from dflash_grpc.v1 import common_pb2

_TO_WIRE = {
    torch.bfloat16: common_pb2.DTYPE_BF16,
    torch.float16: common_pb2.DTYPE_F16,
    torch.float32: common_pb2.DTYPE_F32,
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}
_ITEMSIZE = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}   # bytes per element

#: ``MAX_MESSAGE_BYTES`` (256 MiB) and ``GRPC_OPTIONS`` (that limit for sending and receiving) are
#: defined in :mod:`dflash_grpc.transport` (torch-free, shared with the SDK) and re-exported here:
#: every server and channel of the project sets them explicitly; a larger message fails its call
#: with RESOURCE_EXHAUSTED. Prompt features are ``rows * N * hidden * 2`` bytes and pass the
#: 4 MiB gRPC default easily.


class WireError(ValueError):
    """A message field is malformed (wrong dtype, shape / byte-count mismatch, bad tree)."""


def _raw_bytes(t: torch.Tensor, dtype: torch.dtype) -> tuple[bytes, tuple[int, ...]]:
    """The bytes and shape of ``t`` cast to ``dtype`` (row-major, on the CPU)."""
    if t.is_cpu and t.dtype is dtype and t.is_contiguous():
        # the common case (an engine's CPU host buffer, or a slice of one): one copy of its
        # memory, no torch ops (each costs microseconds of dispatch)
        n = t.nbytes
        return (ctypes.string_at(t.data_ptr(), n) if n else b""), tuple(t.shape)
    c = t.detach().to(device="cpu", dtype=dtype).contiguous()
    raw = c.view(torch.uint8) if c.numel() else torch.empty(0, dtype=torch.uint8)
    return raw.numpy().tobytes(), tuple(c.shape)


def tensor_to_proto(t: torch.Tensor, dtype: torch.dtype | None = None) -> common_pb2.Tensor:
    """Encode ``t`` (any shape, on any device) as a :class:`Tensor` message.

    Args:
        t: the tensor; it is cast to ``dtype`` (default: its own, which must be bf16/f16/f32).

    Raises:
        WireError: dtype not one of bf16, f16, f32.
    """
    msg = common_pb2.Tensor()
    fill_tensor(msg, t, dtype)
    return msg


def fill_tensor(msg: common_pb2.Tensor, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Write ``t`` into ``msg``, an empty :class:`Tensor` message (e.g. a field of a reply being
    built: no message is built and copied in), as :func:`tensor_to_proto` encodes it.

    Raises:
        WireError: dtype not one of bf16, f16, f32.
    """
    dtype = dtype or t.dtype
    wire = _TO_WIRE.get(dtype)
    if wire is None:
        raise WireError(f"unsupported tensor dtype {dtype}")
    data, shape = _raw_bytes(t, dtype)
    msg.dtype = wire
    msg.shape.extend(shape)
    msg.data = data


def tensor_from_proto(msg: common_pb2.Tensor) -> torch.Tensor:
    """Decode a :class:`Tensor` message into a CPU tensor of its dtype and shape (its own
    writable memory: one copy of the message's bytes).

    Raises:
        WireError: unknown dtype, negative dimension, a shape whose sizes multiply (zeros
            left out) past int64 bytes, or ``len(data)`` not equal to ``prod(shape) * itemsize``.
    """
    dtype = _FROM_WIRE.get(msg.dtype)
    if dtype is None:
        raise WireError(f"unsupported wire dtype {msg.dtype}")
    shape = msg.shape[:]   # a list (cheaper to read than tuple(msg.shape))
    numel = span = 1
    for d in shape:
        if d < 0:
            raise WireError(f"negative dimension in shape {tuple(shape)}")
        numel *= d
        span *= d or 1
    itemsize = _ITEMSIZE[dtype]
    if span * itemsize >= 1 << 63:  # torch multiplies every size, zeros last: it would overflow
        raise WireError(f"tensor shape {tuple(shape)} is too large")
    data = msg.data   # (each read of the field is a copy: read it once)
    if len(data) != numel * itemsize:
        raise WireError(f"tensor of shape {tuple(shape)} and dtype {dtype} needs {numel * itemsize} bytes, got {len(data)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # a bytearray: the tensor owns writable memory (torch.frombuffer over bytes would share
    # read-only memory and warn); the dtype read directly, one view to the shape
    flat = torch.frombuffer(bytearray(data), dtype=dtype)
    return flat.view(*shape) if shape else flat.view(())


def tree_to_proto(tokens: list[int], parents: list[int]) -> common_pb2.TokenTree:
    """Build a :class:`TokenTree` from parallel lists (node 0 = root, parent -1)."""
    return common_pb2.TokenTree(tokens=list(tokens), parents=list(parents))

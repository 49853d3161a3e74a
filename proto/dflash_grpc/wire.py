"""Conversions between torch tensors / Python values and the v1 wire messages.

Features travel as raw bytes with a dtype and a shape (docs/ARCHITECTURE.md, "The services"), never as
lists of floats. Errors are raised as :class:`WireError` (mapped to INVALID_ARGUMENT by servers).
"""

from __future__ import annotations

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


def tensor_to_proto(t: torch.Tensor, dtype: torch.dtype | None = None) -> common_pb2.Tensor:
    """Encode ``t`` (any shape, on any device) as a :class:`Tensor` message.

    Args:
        t: the tensor; it is cast to ``dtype`` (default: its own, which must be bf16/f16/f32).

    Raises:
        WireError: dtype not one of bf16, f16, f32.
    """
    dtype = dtype or t.dtype
    if dtype not in _TO_WIRE:
        raise WireError(f"unsupported tensor dtype {dtype}")
    c = t.detach().to(device="cpu", dtype=dtype).contiguous()
    raw = c.view(torch.uint8) if c.numel() else torch.empty(0, dtype=torch.uint8)
    return common_pb2.Tensor(dtype=_TO_WIRE[dtype], shape=list(c.shape), data=raw.numpy().tobytes())


def tensor_from_proto(msg: common_pb2.Tensor) -> torch.Tensor:
    """Decode a :class:`Tensor` message into a CPU tensor of its dtype and shape.

    Raises:
        WireError: unknown dtype, negative dimension, a shape whose sizes multiply (zeros
            left out) past int64 bytes, or ``len(data)`` not equal to ``prod(shape) * itemsize``.
    """
    if msg.dtype not in _FROM_WIRE:
        raise WireError(f"unsupported wire dtype {msg.dtype}")
    dtype = _FROM_WIRE[msg.dtype]
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"negative dimension in shape {shape}")
    numel = span = 1
    for d in shape:
        numel *= d
        span *= max(d, 1)
    itemsize = _ITEMSIZE[dtype]
    if span * itemsize >= 1 << 63:  # torch multiplies every size, zeros last: it would overflow
        raise WireError(f"tensor shape {shape} is too large")
    if len(msg.data) != numel * itemsize:
        raise WireError(f"tensor of shape {shape} and dtype {dtype} needs {numel * itemsize} bytes, got {len(msg.data)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    buf = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return buf.view(dtype).reshape(shape)


def tree_to_proto(tokens: list[int], parents: list[int]) -> common_pb2.TokenTree:
    """Build a :class:`TokenTree` from parallel lists (node 0 = root, parent -1)."""
    return common_pb2.TokenTree(tokens=list(tokens), parents=list(parents))

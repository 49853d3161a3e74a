"""Committed K/V of one session for the attention layers of a model (llama: all; qwen35: every
``full_attention_interval``-th).

Per attention layer ``[Hkv, capacity, D]``, rows ``[0, length)`` valid. Capacity grows in steps of
``stride`` rows up to ``max_length``; new storage is zeroed so no uninitialised memory is ever read
(docs/ARCHITECTURE.md, "State and rollback"). Rows are appended through ``index_copy_`` with a
row-index tensor, not through a view whose offset moves every step.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


class KVCache:
    """K/V rows of the layers ``layers`` (``k[i]``, ``v[i]``: ``[Hkv, capacity, D]``)."""

    def __init__(self, layers: Sequence[int], num_kv_heads: int, head_dim: int, max_length: int,
                 device: torch.device, dtype: torch.dtype, stride: int = 256):
        self.attn_layers = list(layers)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.max_length, self.device, self.dtype, self.stride = max_length, device, dtype, stride
        self.length = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self._alloc(0)

    def _alloc(self, capacity: int) -> None:
        for i in self.attn_layers:
            for store in (self.k, self.v):
                new = torch.zeros(self.num_kv_heads, capacity, self.head_dim, device=self.device, dtype=self.dtype)
                if i in store:
                    new[:, : self.length] = store[i][:, : self.length]
                store[i] = new

    @property
    def capacity(self) -> int:
        return next(iter(self.k.values())).shape[1] if self.k else self.max_length

    def ensure(self, length: int) -> None:
        """Make room for ``length`` rows (raises ``ValueError`` beyond ``max_length``)."""
        if length > self.max_length:
            raise ValueError(f"context of {length} tokens exceeds {self.max_length}")
        if length > self.capacity:
            self._alloc(min(self.max_length, -(-length // self.stride) * self.stride))

    def append(self, new_k: Mapping[int, torch.Tensor], new_v: Mapping[int, torch.Tensor], rows: torch.Tensor) -> None:
        """Append rows ``rows`` (``[n]`` int64, in order) of each layer's new K/V (``[Hkv, T, D]``)
        at cache rows ``[length, length + n)``, then advance ``length``.

        Raises:
            ValueError: the cache would exceed ``max_length`` (nothing is written).
        """
        n = rows.shape[0]
        L = self.length
        self.ensure(L + n)
        dst = torch.arange(L, L + n, device=self.device)
        for i in self.attn_layers:
            self.k[i].index_copy_(1, dst, new_k[i].index_select(1, rows))
            self.v[i].index_copy_(1, dst, new_v[i].index_select(1, rows))
        self.length = L + n

    def reset(self) -> None:
        """Forget every row and zero the storage (a slot handed to a new session)."""
        self.length = 0
        for t in (*self.k.values(), *self.v.values()):
            t.zero_()

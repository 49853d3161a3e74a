"""The GPU engine's state pool: every session's committed state in tensors allocated once.

docs/ARCHITECTURE.md, "The GPU path". One slot per session plus one spare slot that absorbs the
padded rows of a batch, so a padded row never touches a live session:

* ``k``, ``v``: ``[attention layers, slots + 1, rows, Hkv, D]`` in the model dtype, ``rows =
  max_context + max_width``: a session's committed K/V at rows ``[0, L)``, a step's new tokens at
  the scratch rows ``[L, L + W)`` past them;
* ``recurrent``: ``[GDN layers, slots + 1, HV, Dk, Dv]`` float32 (qwen35);
* ``conv``: ``[GDN layers, slots + 1, K - 1, C]`` in the model dtype (qwen35).

Addresses never move (CUDA graphs captured over them stay valid); a slot is zeroed when it is
handed to a session (stale state from its previous session must not leak; docs/ARCHITECTURE.md,
"State and rollback").
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """Per-slot shapes of a model's state.

    Attributes:
        attn_layers: indices of the attention layers (their order = the pool's first axis).
        gdn_layers: indices of the Gated DeltaNet layers (empty for llama).
        kv_heads, head_dim: K/V row shape.
        rows: ``max_context + max_width``.
        recurrent: ``(HV, Dk, Dv)`` or ``None``; conv: ``(K - 1, C)`` or ``None``.
    """

    attn_layers: tuple[int, ...]
    gdn_layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    rows: int
    recurrent: tuple[int, int, int] | None = None
    conv: tuple[int, int] | None = None

    @classmethod
    def of(cls, cfg, max_context: int, max_width: int) -> "PoolShape":
        """The shape for a model config (``LlamaConfig`` or ``Qwen35Config``)."""
        rows = max_context + max_width
        if hasattr(cfg, "is_attention"):
            attn = tuple(i for i in range(cfg.num_layers) if cfg.is_attention(i))
            gdn = tuple(i for i in range(cfg.num_layers) if not cfg.is_attention(i))
            return cls(attn, gdn, cfg.num_kv_heads, cfg.head_dim, rows,
                       (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                       (cfg.conv_kernel - 1, cfg.conv_channels))
        return cls(tuple(range(cfg.num_layers)), (), cfg.num_kv_heads, cfg.head_dim, rows)

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one slot (K, V, recurrent and conv state)."""
        item = torch.empty(0, dtype=dtype).element_size()
        n = 2 * len(self.attn_layers) * self.rows * self.kv_heads * self.head_dim * item
        if self.recurrent:
            hv, dk, dv = self.recurrent
            n += len(self.gdn_layers) * hv * dk * dv * 4
        if self.conv:
            n += len(self.gdn_layers) * self.conv[0] * self.conv[1] * item
        return n


class StatePool:
    """The pooled state of ``slots`` sessions (+ the spare slot ``slots``).

    Args:
        shape: :class:`PoolShape`.
        slots: session slots (the spare is extra).
        device, dtype: where and in which float type (K/V and conv; recurrent is float32).

    Raises:
        torch.OutOfMemoryError: the device cannot hold the pool.
    """

    def __init__(self, shape: PoolShape, slots: int, device: torch.device | str, dtype: torch.dtype):
        if slots < 1:
            raise ValueError("a pool needs at least one slot")
        self.shape, self.slots, self.device, self.dtype = shape, slots, torch.device(device), dtype
        n = slots + 1
        s = shape
        self.k = torch.zeros(len(s.attn_layers), n, s.rows, s.kv_heads, s.head_dim, device=self.device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.recurrent = torch.zeros(len(s.gdn_layers), n, *s.recurrent, device=self.device, dtype=torch.float32) if s.recurrent else None
        self.conv = torch.zeros(len(s.gdn_layers), n, *s.conv, device=self.device, dtype=dtype) if s.conv else None
        #: layer index -> position on the pool's first axis
        self.attn_index = {layer: j for j, layer in enumerate(s.attn_layers)}
        self.gdn_index = {layer: j for j, layer in enumerate(s.gdn_layers)}
        self._free = list(range(slots - 1, -1, -1))

    @property
    def spare(self) -> int:
        """The slot padded batch rows use."""
        return self.slots

    @property
    def free(self) -> int:
        """Slots not held by a session."""
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.recurrent, self.conv) if t is not None)

    def acquire(self) -> int | None:
        """A zeroed free slot, or ``None`` when all are held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.zero(slot)
        return slot

    def release(self, slot: int) -> None:
        """Give ``slot`` back (idempotent for the spare; a double release is a bug)."""
        if slot == self.spare:
            return
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)

    def release_sessions(self, sessions: dict, session_ids) -> int:
        """Drop ``session_ids`` from ``sessions`` (id -> an object with ``slot``) and give their slots
        back; unknown ids are ignored. Returns how many were live."""
        n = 0
        for sid in session_ids:
            s = sessions.pop(sid, None)
            if s is not None:
                self.release(s.slot)
                n += 1
        return n

    def zero(self, slot: int) -> None:
        """Zero every tensor of ``slot``."""
        for t in (self.k, self.v, self.recurrent, self.conv):
            if t is not None:
                t[:, slot].zero_()

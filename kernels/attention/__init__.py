"""Attention ops: ``tree_attention`` (reference in ``reference.py``)."""

from kernels.attention.reference import tree_attention

__all__ = ["tree_attention"]

"""The Gated DeltaNet layers' depthwise causal conv along token trees: the single-session form
(``causal_conv_tree``, ``conv_state_after``) and the pooled, batched forms of the GPU engine
(``conv_window_index``; ``pool_conv_tree``, ``pool_conv_silu``, ``pool_conv_commit`` with a
plain-PyTorch reference in ``reference.py`` and Triton in ``triton.py``, picked per call)."""

from kernels._select import impl
from kernels.conv.reference import causal_conv_tree, conv_state_after, conv_window_index


def pool_conv_tree(x, conv_pool, slots, window, weight):
    """:func:`kernels.conv.reference.pool_conv_tree` (Triton on CUDA)."""
    return impl("conv", x).pool_conv_tree(x, conv_pool, slots, window, weight)


def pool_conv_silu(x, conv_pool, slots, window, weight, commit=False, out=None, x_save=None):
    """:func:`kernels.conv.reference.pool_conv_silu` (Triton on CUDA)."""
    return impl("conv", x).pool_conv_silu(x, conv_pool, slots, window, weight, commit, out=out, x_save=x_save)


def pool_conv_commit(x, conv_pool, slots, window, last):
    """:func:`kernels.conv.reference.pool_conv_commit` (Triton on CUDA)."""
    return impl("conv", x).pool_conv_commit(x, conv_pool, slots, window, last)


def pool_conv_commit_layers(xs, conv_pools, slots, window, last):
    """:func:`kernels.conv.reference.pool_conv_commit_layers` (Triton on CUDA)."""
    return impl("conv", xs).pool_conv_commit_layers(xs, conv_pools, slots, window, last)


__all__ = ["causal_conv_tree", "conv_state_after", "conv_window_index", "pool_conv_commit", "pool_conv_commit_layers",
           "pool_conv_silu", "pool_conv_tree"]

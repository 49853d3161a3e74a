"""Gated DeltaNet ops: recurrence (chain and tree) and causal conv (reference in ``reference.py``),
and their pooled, batched forms for the GPU engine (recurrences also in Triton, ``triton.py``)."""

from kernels.dispatch import use_triton
from kernels.gated_delta import reference
from kernels.gated_delta.reference import (
    causal_conv_tree,
    conv_state_after,
    conv_window_index,
    gdn_step,
    gdn_update,
    l2norm,
    pool_conv_commit,
    pool_conv_tree,
    recurrent_gated_delta_rule,
    tree_gated_delta_rule,
)


def _impl(t):
    if use_triton(t):
        from kernels.gated_delta import triton as tri

        return tri
    return reference


def pool_gdn_tree(q, k, v, g, beta, state_pool, slots, parents, ancestors=None, commit=False):
    """:func:`kernels.gated_delta.reference.pool_gdn_tree`, by its Triton version on CUDA."""
    return _impl(q).pool_gdn_tree(q, k, v, g, beta, state_pool, slots, parents, ancestors, commit)


def pool_gdn_commit(state_pool, slots, k, v, g, beta, path, n_accept):
    """:func:`kernels.gated_delta.reference.pool_gdn_commit`, by its Triton version on CUDA."""
    return _impl(k).pool_gdn_commit(state_pool, slots, k, v, g, beta, path, n_accept)


__all__ = [
    "causal_conv_tree",
    "conv_state_after",
    "conv_window_index",
    "gdn_step",
    "gdn_update",
    "l2norm",
    "pool_conv_commit",
    "pool_conv_tree",
    "pool_gdn_commit",
    "pool_gdn_tree",
    "recurrent_gated_delta_rule",
    "tree_gated_delta_rule",
]

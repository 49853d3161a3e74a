"""Gated DeltaNet ops: recurrence (chain and tree; reference in ``reference.py``) and their pooled,
batched forms for the GPU engine (tree recurrence and commit also in Triton, ``triton.py``, picked
per call). The layers' causal conv is the op package ``kernels.conv``."""

from kernels.dispatch import use_triton
from kernels.gated_delta import reference
from kernels.gated_delta.reference import (
    gdn_gates,
    gdn_qkv,
    gdn_step,
    gdn_update,
    l2norm,
    recurrent_gated_delta_rule,
    tree_gated_delta_rule,
)


def _impl(t):
    if use_triton(t):
        from kernels.gated_delta import triton as tri

        return tri
    return reference


def pool_gdn_tree(conv_out, a, b, A, dt_bias, state_pool, slots, parents, ancestors, commit, key_heads, head_k_dim,
                  gates_out=None, leaf_kids=None):
    """:func:`kernels.gated_delta.reference.pool_gdn_tree`, by its Triton version on CUDA."""
    return _impl(conv_out).pool_gdn_tree(conv_out, a, b, A, dt_bias, state_pool, slots, parents, ancestors, commit,
                                         key_heads, head_k_dim, gates_out, leaf_kids)


def leaf_children(parents):
    """Per node of ``[B, W]`` trees the bit mask of its leaf children (``int64 [B, W]``), which
    the Triton tree walk reads (``kernels.gated_delta.triton.leaf_children``); ``None`` where the
    reference runs (it does not use it)."""
    if not use_triton(parents):
        return None
    from kernels.gated_delta import triton as tri

    return tri.leaf_children(parents)


def pool_gdn_commit(state_pool, slots, conv_out, a, b, A, dt_bias, path, n_accept, key_heads, head_k_dim):
    """:func:`kernels.gated_delta.reference.pool_gdn_commit`, by its Triton version on CUDA."""
    return _impl(conv_out).pool_gdn_commit(state_pool, slots, conv_out, a, b, A, dt_bias, path, n_accept, key_heads, head_k_dim)


def pool_gdn_commit_layers(state_pools, slots, conv_outs, gates, path, n_accept, key_heads, head_k_dim):
    """:func:`kernels.gated_delta.reference.pool_gdn_commit_layers`, by its Triton version on CUDA."""
    return _impl(conv_outs).pool_gdn_commit_layers(state_pools, slots, conv_outs, gates, path, n_accept, key_heads,
                                                   head_k_dim)


__all__ = [
    "gdn_gates",
    "gdn_qkv",
    "gdn_step",
    "gdn_update",
    "l2norm",
    "leaf_children",
    "pool_gdn_commit",
    "pool_gdn_commit_layers",
    "pool_gdn_tree",
    "recurrent_gated_delta_rule",
    "tree_gated_delta_rule",
]

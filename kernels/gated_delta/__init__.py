"""Gated DeltaNet ops: recurrence (chain and tree) and causal conv (reference in ``reference.py``)."""

from kernels.gated_delta.reference import (
    causal_conv_tree,
    conv_state_after,
    gdn_step,
    gdn_update,
    l2norm,
    recurrent_gated_delta_rule,
    tree_gated_delta_rule,
)

__all__ = [
    "causal_conv_tree",
    "conv_state_after",
    "gdn_step",
    "gdn_update",
    "l2norm",
    "recurrent_gated_delta_rule",
    "tree_gated_delta_rule",
]

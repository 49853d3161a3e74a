"""Token selection (greedy / Gumbel-max sampling) and the tree acceptance walk."""

from kernels.sampling.reference import accept_path, filtered_logprobs, gumbel_noise, select_tokens

__all__ = ["accept_path", "filtered_logprobs", "gumbel_noise", "select_tokens"]

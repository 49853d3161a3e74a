"""kernels/attention."""

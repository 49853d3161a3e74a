"""kernels/sampling."""

"""GGUF block-quantized weights (kept as the file's bytes) and ``x @ w^T`` on them."""

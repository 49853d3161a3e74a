"""Fingerprints that tie a drafter and an orchestrator to one target model.

* tokenizer fingerprint: sha256 over the GGUF tokenizer definition (``tokenizer.ggml.model``,
  ``.pre``, ``.tokens``, ``.token_type``, ``.merges``, bos/eos/eot ids). Two GGUF files with the
  same fingerprint tokenize identically.
* model fingerprint: sha256 over the tokenizer fingerprint, ``general.architecture`` and the
  shapes a drafter depends on (``{arch}.embedding_length``, ``{arch}.block_count``, vocabulary
  size). A DFlash drafter stores the model fingerprint of its target
  (``dflash.target_fingerprint``); the orchestrator refuses a pair whose fingerprints differ
  (FAILED_PRECONDITION).
"""

from __future__ import annotations

import hashlib
import json

from runtime.gguf_loader import GGUFFile

_TOKENIZER_KEYS = ("model", "pre", "bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id")


def tokenizer_fingerprint(g: GGUFFile) -> str:
    """sha256 hex digest of the tokenizer definition in ``g``'s ``tokenizer.ggml.*`` keys."""
    h = hashlib.sha256()
    scalars = {k: g.get(f"tokenizer.ggml.{k}") for k in _TOKENIZER_KEYS}
    h.update(json.dumps(scalars, sort_keys=True).encode())
    for key in ("tokens", "token_type", "merges"):
        values = g.get(f"tokenizer.ggml.{key}") or []
        h.update(f"\x00{key}:{len(values)}\x00".encode())
        h.update("\x1f".join(str(v) for v in values).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def model_fingerprint(g: GGUFFile) -> str:
    """sha256 hex digest of tokenizer fingerprint + architecture + hidden size, layers, vocab."""
    parts = {
        "tokenizer": tokenizer_fingerprint(g),
        "architecture": g.architecture,
        "hidden": g.get("{arch}.embedding_length"),
        "layers": g.get("{arch}.block_count"),
        "vocab": len(g.get("tokenizer.ggml.tokens") or []),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

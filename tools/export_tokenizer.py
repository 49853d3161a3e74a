"""Write a GGUF file's tokenizer as a Hugging Face tokenizer directory (``tokenizer.json`` and
``tokenizer_config.json``), for tools that count tokens with ``transformers.AutoTokenizer`` (aiperf's
``--tokenizer DIR``) on a machine without access to the Hugging Face hub.

    python tools/export_tokenizer.py [MODEL.gguf] DIR     # default: the default target model

The tokenizer is the one the services build from the GGUF metadata
(:class:`runtime.tokenizer.GGUFTokenizer`, a ``tokenizers`` BPE), saved as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path[:0] = [".", "proto"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", metavar="[MODEL.gguf] DIR")
    args = ap.parse_args(argv)
    from runtime.defaults import default_model_path
    from runtime.tokenizer import GGUFTokenizer

    if len(args.paths) > 2:
        ap.error("at most a model and a directory")
    model, out = (args.paths if len(args.paths) == 2 else (default_model_path(), args.paths[0]))
    tok = GGUFTokenizer.from_gguf(model)
    os.makedirs(out, exist_ok=True)
    tok.backend.save(os.path.join(out, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, tid in (("bos_token", tok.bos_token_id), ("eos_token", tok.eos_token_id), ("pad_token", tok.pad_token_id)):
        if tid is not None:
            config[key] = tok.id_to_token(tid)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(f"wrote {out}/tokenizer.json ({tok.vocab_size} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

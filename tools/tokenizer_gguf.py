"""Write a GGUF file that holds only another GGUF's tokenizer (its ``tokenizer.*`` keys, no
tensors): a ~1 MB stand-in for ``fixtures.synth --vocab-from`` on the GPU machine, where the
98 MB SmolLM2 file would otherwise have to travel in parts.

    python tools/tokenizer_gguf.py OUT.gguf [SOURCE.gguf]     # default source: the default target model
"""

from __future__ import annotations

import argparse
import sys

sys.path[:0] = [".", "proto"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("source", nargs="?", default=None)
    args = ap.parse_args(argv)
    import gguf

    from fixtures.synth import load_tokenizer_kv

    w = gguf.GGUFWriter(args.out, arch="llama")
    for key, value, vtype, sub in load_tokenizer_kv(args.source):
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate the gRPC/protobuf stubs of ``proto/dflash_grpc/v1`` with grpcio-tools.

Usage: ``python tools/gen_stubs.py [--out DIR]``. Writes ``*_pb2.py``, ``*_pb2.pyi`` and
``*_pb2_grpc.py`` next to the ``.proto`` files (or under DIR, mirroring the package layout).
The committed stubs are made with grpcio-tools 1.84.0 so that they import on any
grpcio >= 1.84 (the GPU machines run 1.84); ``tests/test_proto_stubs.py`` regenerates them
and fails on any difference.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[pathlib.Path]:
    """Return the contract's ``.proto`` files, sorted, relative to ``proto/``."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / "dflash_grpc" / "v1").glob("*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    """Run protoc (from grpcio-tools) over every contract file into ``out_dir``.

    Raises:
        RuntimeError: protoc returned a non-zero status.
    """
    from grpc_tools import protoc  # grpcio-tools
    import importlib.resources

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=PROTO_ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())

"""The committed gRPC stubs are exactly what grpcio-tools generates from the .proto files."""

import filecmp
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gen_stubs  # noqa: E402


def test_stubs_are_current(tmp_path):
    gen_stubs.generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert fresh, "protoc produced nothing"
    for rel in fresh:
        committed = ROOT / "proto" / rel
        assert committed.exists(), f"{rel} is generated but not committed: run python tools/gen_stubs.py"
        assert filecmp.cmp(committed, tmp_path / rel, shallow=False), f"{rel} is stale: run python tools/gen_stubs.py"
    stale = {p.relative_to(ROOT / "proto") for p in (ROOT / "proto").rglob("*_pb2*.py*")} - set(fresh)
    assert not stale, f"stubs without a .proto: {stale}"


def test_stubs_import_as_dflash_grpc_v1():
    from dflash_grpc.v1 import common_pb2, draft_pb2_grpc, generation_pb2_grpc, target_pb2_grpc

    assert common_pb2.DESCRIPTOR.package == "dflash_grpc.v1"
    assert hasattr(target_pb2_grpc, "TargetServiceStub")
    assert hasattr(draft_pb2_grpc, "DraftServiceStub")
    assert hasattr(generation_pb2_grpc, "GenerationServiceStub")

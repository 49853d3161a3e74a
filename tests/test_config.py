"""One config dataclass per service holds each default once: the flags are built from it and read
back into it, the engines, scheduler, launcher and ``dflash-grpc serve`` take their defaults from
it, and docs/CONFIG.md is generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import subprocess
import sys

import pytest

from dflash_grpc import defaults
from dflash_grpc.v1 import common_pb2
from draft_service.config import DraftConfig
from orchestrator.config import OrchestratorConfig
from runtime.config import add_flags, flag_table, flags, from_args, ints, show_default
from target_service.config import TargetConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [TargetConfig, DraftConfig, OrchestratorConfig]
# flags of dflash_grpc.serving (add_tls_flags, add_security_flags), not of the config dataclasses
TLS_FLAGS = {"--tls-cert", "--tls-key", "--tls-client-ca", "--insecure", "--peer-tls-ca", "--peer-tls-cert",
             "--peer-tls-key", "--peer-tls-server-name", "--auth-token-file", "--reflection"}


def _parser(cls) -> argparse.ArgumentParser:
    """The real command line of the service whose config is ``cls``."""
    if cls is TargetConfig:
        from target_service.__main__ import build_parser
    elif cls is DraftConfig:
        from draft_service.__main__ import build_parser
    else:
        from orchestrator.__main__ import build_parser
    return build_parser()


def _required(cls) -> list[str]:
    return ["--target", "127.0.0.1:1"] if cls is OrchestratorConfig else []


# --------------------------------------------------------------------------------------------
# the dataclasses


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_configs_are_frozen_and_every_field_has_help(cls):
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
    assert "Units" in cls.__doc__
    cfg = cls(**({"target": "x"} if cls is OrchestratorConfig else {}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


def test_shared_defaults_live_in_the_wire_package():
    assert (TargetConfig.port, DraftConfig.port, OrchestratorConfig.port) == (
        defaults.TARGET_PORT, defaults.DRAFT_PORT, defaults.ORCHESTRATOR_PORT) == (50052, 50053, 50051)
    assert TargetConfig.host == DraftConfig.host == OrchestratorConfig.host == defaults.DEFAULT_HOST
    assert defaults.DEFAULT_ADDRESS == f"{defaults.DEFAULT_HOST}:{defaults.ORCHESTRATOR_PORT}"
    from orchestrator.servicer import LIMITS

    assert LIMITS is defaults.REQUEST_LIMITS


def test_config_modules_import_no_torch():
    code = ("import sys, runtime.config, target_service.config, draft_service.config, orchestrator.config, "
            "dflash_grpc.defaults; sys.path.insert(0, 'tools'); import config_doc; config_doc.render(); "
            "print('torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "proto")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


# --------------------------------------------------------------------------------------------
# flags <-> fields


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_a_flag_and_every_flag_a_field(cls):
    p = _parser(cls)
    options = {o for a in p._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    assert options - TLS_FLAGS == {fl.option for fl in flags(cls)}
    dests = {a.dest for a in p._actions if set(a.option_strings) - TLS_FLAGS - {"-h", "--help"}}
    assert dests == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_no_flags_parse_into_the_defaults(cls):
    args = _parser(cls).parse_args(_required(cls))
    expected = cls(target="127.0.0.1:1") if cls is OrchestratorConfig else cls()
    assert from_args(cls, args) == expected


def test_flags_parse_into_the_dataclass():
    cfg = from_args(TargetConfig, _parser(TargetConfig).parse_args(
        ["--max-sessions", "3", "--no-cuda-graphs", "--batch-buckets", "1,2", "--feature-layers", "1,8,14",
         "--gpu-memory-fraction", "0.5", "--session-idle-timeout", "0", "--dtype", "float32", "--port", "0"]))
    assert cfg == TargetConfig(max_sessions=3, cuda_graphs=False, batch_buckets=(1, 2), feature_layers=(1, 8, 14),
                               gpu_memory_fraction=0.5, session_idle_timeout=0.0, dtype="float32", port=0)
    cfg = from_args(DraftConfig, _parser(DraftConfig).parse_args(
        ["--drafter", "d.gguf", "--max-top-k", "4", "--max-context", "128", "--engine", "batched", "--dtype", "bf16"]))
    assert cfg == DraftConfig(drafter="d.gguf", max_top_k=4, max_context=128, engine="batched", dtype="bf16")
    cfg = from_args(OrchestratorConfig, _parser(OrchestratorConfig).parse_args(
        ["--target", "h:1", "--draft", "h:2", "--step-nodes", "7", "--max-queue", "64", "--draft-history-mib", "0.5"]))
    assert cfg == OrchestratorConfig(target="h:1", draft="h:2", step_nodes=7, max_queue=64, draft_history_mib=0.5)
    assert cfg.history_bytes == 1 << 19
    with pytest.raises(SystemExit):
        _parser(OrchestratorConfig).parse_args([])  # --target is required
    with pytest.raises(SystemExit):
        _parser(TargetConfig).parse_args(["--engine", "fast"])  # choices are kept


def test_flag_plumbing_on_a_toy_config():
    from runtime.config import setting

    @dataclasses.dataclass(frozen=True)
    class Toy:
        name: str = setting(help="required")
        ratio: float | None = setting(None, "a share (100% max)")
        on: bool = setting(True, "a switch")
        off: bool = setting(False, "another")
        sizes: tuple[int, ...] = setting((1, 2), "sizes")

    p = argparse.ArgumentParser()
    add_flags(p, Toy)
    assert from_args(Toy, p.parse_args(["--name", "x", "--no-on", "--off", "--sizes", "4,8,", "--ratio", "0.5"])) == \
        Toy("x", 0.5, False, True, (4, 8))
    assert "100% max" in p.format_help()
    assert flag_table(Toy) == [("--name", "required", "required"), ("--ratio", "none", "a share (100% max)"),
                               ("--no-on", "on", "a switch"), ("--off", "off", "another"), ("--sizes", "1,2", "sizes")]
    assert ints("1, 2,,3") == (1, 2, 3) and show_default(()) == "none"


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_help_shows_the_config_defaults(cls):
    text = " ".join(_parser(cls).format_help().split())
    for fl in flags(cls):
        assert fl.option in text
        assert " ".join(fl.help.split()) in text
        if fl.default not in (None, dataclasses.MISSING):
            assert f"(default: {show_default(fl.default)}" in text, fl.option


def test_help_of_the_orchestrator_command():
    out = subprocess.run([sys.executable, "-m", "orchestrator", "--help"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "proto")])},
                         check=True).stdout
    text = " ".join(out.split())
    assert "--step-nodes STEP_NODES" in text and "(0: 512 on a CUDA target, 64 on a CPU one) (default: 0)" in text
    assert "--max-queue MAX_QUEUE" in text and "(default: 256)" in text and "(default: 50051)" in text


# --------------------------------------------------------------------------------------------
# one source for each default


def test_device_dependent_defaults_are_resolved_once():
    assert TargetConfig().resolved("cuda:0") == TargetConfig(dtype="bfloat16", engine="batched", weights="bf16", max_sessions=64)
    assert TargetConfig().resolved() == TargetConfig(dtype="float32", engine="reference", weights="bf16", max_sessions=8)
    assert TargetConfig(weights="quantized").resolved("cuda").weights == "quantized"
    from target_service.models.weights import WEIGHT_MODES

    assert TargetConfig.WEIGHTS == WEIGHT_MODES
    assert TargetConfig(max_sessions=3, engine="batched").resolved().max_sessions == 3
    assert DraftConfig(device="cuda").resolved() == DraftConfig(device="cuda", dtype="bf16", engine="batched", weights="bf16")
    assert DraftConfig().resolved() == DraftConfig(dtype="f32", engine="reference", weights="bf16")
    assert DraftConfig(weights="quantized").resolved().weights == "quantized"
    cfg = OrchestratorConfig(target="x")
    assert cfg.resolved("cuda:0", 64).step_nodes == OrchestratorConfig.STEP_NODES_CUDA == 512
    assert cfg.resolved("cpu", 8).step_nodes == OrchestratorConfig.STEP_NODES_CPU == 64
    assert OrchestratorConfig(target="x", step_nodes=100).resolved("cuda", 8).step_nodes == 100
    assert [OrchestratorConfig.sessions_for(r, t) for r, t in [(0, 12), (4, 12), (20, 12), (3, 0), (0, 0)]] == [12, 4, 12, 3, 8]


class _FakeTarget:
    def __init__(self, device: str):
        self._info = common_pb2.ModelInfo(device=device, max_sessions=4)

    def info(self):
        return self._info


class _NoDraft:
    address = None


@pytest.mark.parametrize("device,nodes", [("cuda:0", 512), ("cpu", 64)])
def test_step_nodes_has_one_source(device, nodes):
    """The scheduler built without ``step_nodes`` does what ``python -m orchestrator`` does
    (the old 256 in the scheduler vs 512/64 in __main__ is gone)."""
    from orchestrator.scheduler import Scheduler

    assert inspect.signature(Scheduler).parameters["step_nodes"].default == OrchestratorConfig.step_nodes
    sched = Scheduler(_FakeTarget(device), _NoDraft(), max_sessions=2)
    try:
        assert sched.step_nodes == nodes
        assert sched.max_queue == OrchestratorConfig.max_queue
        assert sched.step_timeout == OrchestratorConfig.step_timeout
        assert sched.history_bytes == OrchestratorConfig(target="x").history_bytes
    finally:
        sched.stop()
    for path in ("orchestrator/__main__.py", "orchestrator/scheduler.py", "orchestrator/servicer.py"):
        src = open(os.path.join(ROOT, path)).read()
        assert not re.search(r"\b(512|256)\b", src), path


def _defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}


def test_engine_defaults_come_from_the_configs():
    from draft_service.batched import BatchedDrafter, ReferenceDrafterEngine
    from draft_service.servicer import DraftServiceServicer
    from orchestrator.servicer import GenerationServicer, default_tree
    from target_service.batched_engine import BatchedEngine
    from target_service.engine import TargetEngine

    t = TargetConfig()
    for engine in (TargetEngine, BatchedEngine):
        d = _defaults(engine)
        assert (d["max_context"], d["max_tree_width"], d["max_tree_depth"]) == (t.max_context, t.max_tree_width, t.max_tree_depth)
        assert d["max_sessions"] == TargetConfig.MAX_SESSIONS_CPU
    d = _defaults(BatchedEngine)
    assert (d["batch_buckets"], d["width_buckets"], d["max_step_tokens"], d["prefill_chunk"], d["cuda_graphs"]) == (
        t.batch_buckets, t.width_buckets, t.max_step_tokens, t.prefill_chunk, t.cuda_graphs)
    dc = DraftConfig()
    d = _defaults(BatchedDrafter)
    assert (d["max_sessions"], d["max_context"], d["batch_buckets"], d["max_top_k"], d["prefill_chunk"]) == (
        dc.max_sessions, DraftConfig.BATCHED_CONTEXT_CAP, dc.batch_buckets, dc.max_top_k, dc.prefill_chunk)
    assert _defaults(ReferenceDrafterEngine)["max_sessions"] == dc.max_sessions
    d = _defaults(DraftServiceServicer.from_paths)
    assert (d["device"], d["max_sessions"], d["max_context"], d["engine"], d["prefill_chunk"]) == (
        dc.device, dc.max_sessions, dc.max_context, dc.engine, dc.prefill_chunk)
    assert _defaults(GenerationServicer)["default_max_tokens"] == OrchestratorConfig.max_tokens
    tree = default_tree()
    assert (tree.budget, tree.top_k, tree.max_depth) == (15, 4, 0)


def test_launcher_and_serve_take_the_config_defaults():
    from client.cli import _build_parser
    from client.launcher import dflash_services

    d = _defaults(dflash_services)
    assert tuple(d["ports"]) == (TargetConfig.port, DraftConfig.port, OrchestratorConfig.port)
    assert d["host"] == OrchestratorConfig.host
    args, _ = _build_parser().parse_known_args(["serve"])
    assert (args.host, args.port, args.target_port, args.draft_port) == (
        OrchestratorConfig.host, OrchestratorConfig.port, TargetConfig.port, DraftConfig.port)


# --------------------------------------------------------------------------------------------
# docs


def test_docs_config_md_is_generated():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import config_doc

    with open(os.path.join(ROOT, "docs", "CONFIG.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == config_doc.render(), "docs/CONFIG.md is stale: run python tools/config_doc.py"
    for cls in CONFIGS:
        for fl in flags(cls):
            assert f"`{fl.option}`" in committed

"""The bench command's configuration parsing and statistics merging."""

import pytest

from client import AcceptanceStats
from bench.serving import BenchConfig, _merge, format_table


def test_parse_configs():
    assert BenchConfig.parse("ar").kwargs() == {"speculative": False}
    assert BenchConfig.parse("chain").kwargs() == {"speculative": True, "tree_budget": 0, "top_k_draft": 1}
    assert BenchConfig.parse("tree:32:4").kwargs() == {"speculative": True, "tree_budget": 32, "top_k_draft": 4}
    for bad in ("tree:3", "forest", "tree:a:b"):
        with pytest.raises(ValueError):
            BenchConfig.parse(bad)


def _stats(hist, acc, drafted, gen, secs):
    return AcceptanceStats(**{**{f: 0 for f in AcceptanceStats.__dataclass_fields__}, "acceptance_length_histogram": hist,
                              "accepted_per_position": acc, "drafted_per_position": drafted, "generated_tokens": gen,
                              "decode_time_s": secs, "target_forwards": sum(hist), "drafts": sum(hist), "draft_tokens": 10 * sum(hist),
                              "mean_acceptance_length": 0.0, "tokens_per_second": 0.0})


def test_merge_pools_histograms():
    a = _stats([0, 2, 1], [1], [3, 3], gen=5, secs=1.0)      # tau (2*1 + 1*2) / 3
    b = _stats([0, 0, 0, 1], [1, 1], [1, 1], gen=3, secs=1.0)  # one forward of 3 tokens
    m = _merge([a, b])
    assert m["tau"] == pytest.approx((2 + 2 + 3) / 4)
    assert m["acceptance_per_depth"] == pytest.approx([2 / 4, 1 / 4])
    assert m["tokens_per_second"] == pytest.approx(4.0)
    table = format_table({"prompts": 2, "max_tokens": 8, "configs": {"chain": {**m, "lossless": True}}})
    assert "chain" in table and "1.750" in table


def test_run_bench_warms_each_config_untimed(monkeypatch):
    """run_bench runs ``warmup`` requests of the first prompt under each configuration before its
    timed ones; they are neither counted nor the lossless reference (a warm-up whose tokens differ
    does not make the run lossy), and ``warmup=0`` runs none."""
    import types

    import bench.serving as serving

    calls = []

    class FakeClient:
        def __init__(self, address, timeout=None):
            self.n = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def generate(self, prompt, request):
            self.n += 1
            warm = self.n % 4 == 1     # (1 warm-up + 3 prompts per config)
            calls.append((prompt, request.speculative, warm))
            return types.SimpleNamespace(stats=_stats([0, 1], [], [], gen=2, secs=0.5 if not warm else 9.0),
                                         token_ids=[7] if warm else [len(prompt)])

    monkeypatch.setattr(serving, "Client", FakeClient)
    prompts = ["a", "bb", "ccc"]
    out = serving.run_bench("x", prompts, [BenchConfig.parse("ar"), BenchConfig.parse("chain")], 8)
    assert [c[0] for c in calls] == ["a", "a", "bb", "ccc"] * 2
    assert out["reference_tokens"] == [[1], [2], [3]]
    for name in ("ar", "chain"):
        r = out["configs"][name]
        assert r["generated_tokens"] == 6 and r["decode_time_s"] == pytest.approx(1.5)   # the warm-up not counted
    assert out["configs"]["chain"]["lossless"]
    calls.clear()
    serving.run_bench("x", prompts, [BenchConfig.parse("ar")], 8, warmup=0)
    assert [c[0] for c in calls] == ["a", "bb", "ccc"]


# ------------------------------------------------------------------ tree vs chain (bench_gpu)
def _ms(x):
    return {"median": x, "min": x, "max": x, "n": 1}


def _engine(**extra):
    return {"name": "m", "ar_step_device_ms": _ms(1.0),
            "verify_width": {"1": {"chain": {"device_ms": _ms(1.0), "wall_ms": _ms(1.2)}},
                             "4": {"chain": {"device_ms": _ms(1.1)}, "tree": {"device_ms": _ms(1.2)}},
                             "16": {"chain": {"device_ms": _ms(1.5)}, "tree": {"device_ms": _ms(2.0)}},
                             "32": {"chain": {"device_ms": _ms(2.5)}}},  # an older file: no tree at W=32
            **extra}


_ACCEPTANCE = {"block_size": 16, "all_lossless": True, "prompts": 2, "max_tokens": 8, "prompt_sets": {"humaneval": 2},
               "configs": {"ar": {"tau": 1.0}, "chain": {"tau": 2.0, "max_nodes": 16, "accept_ge": [0.6, 0.3]},
                           "tree:15:4": {"tau": 3.0, "max_nodes": 16}, "tree:16:4": {"tau": 3.1},
                           "tree:32:4": {"tau": 3.5, "max_nodes": 33}}}


def test_tree_vs_chain_estimate():
    from bench.gpu import format_tree_vs_chain, tree_vs_chain

    prop = {"drafter": "d.gguf", "source": "shipped",
            "configs": {c: {"wall_ms": _ms(0.5)} for c in ("chain", "tree:15:4", "tree:16:4")}}
    est = tree_vs_chain(_engine(draft_propose=prop), _ACCEPTANCE)
    rows = est["rows"]
    assert list(rows) == ["ar", "chain", "tree:15:4", "tree:16:4", "tree:32:4"]
    assert rows["ar"]["tok_s"] == pytest.approx(1000.0)                       # tau 1 / 1.0 ms
    assert rows["chain"]["tok_s"] == pytest.approx(2.0 / (0.5 + 1.5) * 1e3)   # chain W=16
    t16 = rows["tree:15:4"]                                                   # 16 nodes: tree W=16
    assert (t16["width"], t16["shape"], t16["verify_ms"]) == (16, "tree", 2.0)
    assert t16["tok_s"] == pytest.approx(1200.0) and t16["vs_chain"] == pytest.approx(1.2) and t16["vs_ar"] == pytest.approx(1.2)
    t17 = rows["tree:16:4"]                # no max_nodes: 17 from the name -> W=32, chain timing where the tree's is missing
    assert (t17["nodes"], t17["width"], t17["shape"]) == (17, 32, "chain")
    assert t17["tok_s"] == pytest.approx(3.1 / 3.0 * 1e3)
    t33 = rows["tree:32:4"]                                                   # wider than any measured width, no draft time
    assert t33["tok_s"] is None and t33["width"] is None and set(t33["missing"]) == {"draft_ms", "verify_ms"}
    assert "d.gguf" in est["draft_source"]
    table = "\n".join(format_tree_vs_chain(est))
    assert "| tree:15:4 | 16 (W=16, tree) | 3.000 |" in table and "1200" in table and "1.20x" in table

    # one draft time for all, and the verify's wall time
    est = tree_vs_chain(_engine(), _ACCEPTANCE, draft_ms=1.0)
    assert est["rows"]["chain"]["tok_s"] == pytest.approx(2.0 / 2.5 * 1e3)
    assert est["rows"]["tree:32:4"]["missing"] == ["verify_ms"]
    wall = tree_vs_chain(_engine(), _ACCEPTANCE, draft_ms={"chain": 1.0}, kind="wall_ms")
    assert wall["rows"]["ar"]["tok_s"] == pytest.approx(1e3 / 1.2)          # no AR wall figure: the chain at W=1
    assert wall["rows"]["chain"]["tok_s"] is None                            # no wall time at W=16

    # older or broken files: no exception, empty figures
    bare = tree_vs_chain({"name": "old"}, {"configs": {"chain": {"tau": 2.0}, "tree:x": {"tau": 1.0}}})
    assert bare["rows"]["ar"]["tok_s"] is None and bare["rows"]["chain"]["tok_s"] is None and "tree:x" not in bare["rows"]
    assert format_tree_vs_chain(bare)


def test_tree_vs_chain_report_section(tmp_path):
    import json

    from bench.gpu import _load_dir, _tree_vs_chain_section

    (tmp_path / "m.json").write_text(json.dumps(_engine()))
    prop = {"source": "shipped", "drafter": "d.gguf", "configs": {"chain": {"wall_ms": _ms(0.5)}}}
    (tmp_path / "m.drafter.json").write_text(json.dumps({"drafter_of": "m", "draft_propose": prop}))
    engines, _, _, _ = _load_dir(str(tmp_path))
    assert engines["m"]["draft_propose"] == prop                              # merged from NAME.drafter.json
    text = "\n".join(_tree_vs_chain_section(engines, None, _ACCEPTANCE))
    assert "## Tree vs chain" in text and "### m" in text and "| chain | 2.000 |" in text
    assert "| m | 1000 | 1000 (1.00x) |" in text
    # without a drafter timing: the draft service's compute of e2e.json (its mean for configs it lacks)
    e2e = {"configs": {"chain": {"step_ms": {"draft_compute": 1.0}}, "tree:16:4": {"step_ms": {"draft_compute": 2.0}}}}
    text = "\n".join(_tree_vs_chain_section({"m": _engine()}, e2e, _ACCEPTANCE))
    assert "e2e.json" in text and "| chain | 16 (W=16, chain) | 2.000 | 1.000 | 1.500 | 2.500 | 800 |" in text
    assert "| tree:15:4 | 16 (W=16, tree) | 3.000 | 1.500 |" in text


def test_drafter_timing_on_cpu(tmp_path):
    """The drafter measurement's code path (eager, float32 on the CPU: wall times only); a target
    without a shipped drafter gets a random one of the shipped drafter's shape."""
    from bench.gpu import drafter_timing
    from fixtures.tiny_models import write_tiny_llama

    target = str(tmp_path / "tiny.gguf")
    write_tiny_llama(target, layers=6)
    r = drafter_timing(target, configs=("chain", "tree:16:4"), steps=2, warmup=0, device="cpu", log=lambda m: None)
    assert r["source"].startswith("random") and not r["trained"]
    assert r["configs"]["chain"]["nodes"] == 16 and r["configs"]["tree:16:4"]["nodes"] == 17
    assert r["configs"]["chain"]["wall_ms"]["n"] == 2 and r["configs"]["chain"]["device_ms"] is None


def test_step_report_tables(tmp_path):
    """bench/step_report.py: repeats of a layout give the median and the spread, ratios to
    llama.cpp and to the same layout's AR, host = service step time minus device time."""
    import json

    from bench.step_report import report

    def e2e(tps_ar, tps_tree):
        step = {"total": 3.0, "draft_compute": 0.9, "verify_compute": 1.6, "grpc_and_queue": 0.3, "orchestrator": 0.2}
        return {"configs": {"ar": {"tokens_per_second": tps_ar, "tau": 1.0, "lossless": True, "step_ms": dict(step, draft_compute=0.0)},
                            "tree:15:4": {"tokens_per_second": tps_tree, "tau": 3.7, "lossless": True, "step_ms": step}}}

    (tmp_path / "e2e-colocated-1.json").write_text(json.dumps(e2e(600, 1000)))
    (tmp_path / "e2e-colocated-2.json").write_text(json.dumps(e2e(700, 1100)))
    engine = {"ar_step_device_ms": {"median": 1.0},
              "draft_propose": {"configs": {"tree:15:4": {"nodes": 16, "device_ms": {"median": 0.35}}}},
              "verify_width": {"16": {"tree": {"device_ms": {"median": 1.1}}, "chain": {"device_ms": {"median": 1.1}}}}}
    (tmp_path / "smollm2-135m-q4_1.json").write_text(json.dumps(engine))
    (tmp_path / "llamacpp.jsonl").write_text(json.dumps({"n_prompt": 0, "n_gen": 128, "avg_ts": 500.0}) + "\n")
    text = report(str(tmp_path))
    row = next(line for line in text.splitlines() if "| tree:15:4 |" in line)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[:4] == ["colocated", "tree:15:4", "3.70", "1050 [1000, 1100], 2"]
    assert cells[4:6] == ["2.10x", "1.62x"]                 # 1050 / 500, 1050 / 650
    assert cells[7:11] == ["0.35", "0.55", "1.10", "0.50"]  # draft device / host, verify device / host
    assert cells[13] == "1.55"                              # GPU idle: 3.0 - 0.35 - 1.1


def test_step_report_prefers_the_services_own_device_times(tmp_path):
    """A run whose replies carried device_s (the services' CUDA events) splits host and device
    with them, not with the engine benchmark's."""
    import json

    from bench.step_report import report

    step = {"total": 3.0, "draft_compute": 0.9, "verify_compute": 1.6, "grpc_and_queue": 0.3, "orchestrator": 0.2,
            "draft_device": 0.5, "verify_device": 1.3}
    run = {"configs": {"tree:15:4": {"tokens_per_second": 1000, "tau": 3.7, "lossless": True, "step_ms": step}}}
    (tmp_path / "e2e-colocated-1.json").write_text(json.dumps(run))
    engine = {"ar_step_device_ms": {"median": 1.0},
              "draft_propose": {"configs": {"tree:15:4": {"nodes": 16, "device_ms": {"median": 0.35}}}},
              "verify_width": {"16": {"tree": {"device_ms": {"median": 1.1}}, "chain": {"device_ms": {"median": 1.1}}}}}
    (tmp_path / "smollm2-135m-q4_1.json").write_text(json.dumps(engine))
    row = next(line for line in report(str(tmp_path)).splitlines() if "| tree:15:4 |" in line)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[7:11] == ["0.50", "0.40", "1.30", "0.30"]  # draft device / host, verify device / host
    assert cells[13:] == ["1.20", "yes"]                    # GPU idle: 3.0 - 0.5 - 1.3


def test_engine_step_timer_takes_what_the_step_takes():
    """bench.gpu's _Timer replaces the target's StepGraph.run while it times replayed steps (CUDA
    events); its stand-in must accept every argument the engine passes (session 18 added ``tail``
    and the engine benchmark failed on the GPU until the timer took it too): the same parameters,
    and the stand-in's signature binds a call with a tail, positional or by name."""
    import inspect

    import bench.gpu as G
    from target_service import batched_engine

    timer = G._Timer(None)
    want = list(inspect.signature(batched_engine._Runner.run).parameters)
    assert list(inspect.signature(timer._run).parameters) == want
    inspect.signature(timer._run).bind(object(), lambda: None)
    inspect.signature(timer._run).bind(object(), tail=None)

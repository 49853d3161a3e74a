"""The bench command's configuration parsing and statistics merging."""

import pytest

from client import AcceptanceStats
from client.bench import BenchConfig, _merge, format_table


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

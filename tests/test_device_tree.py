"""The drafter's trees built on the device (kernels/ddtree, issues 18 and 23): the batched PyTorch
search equals the host's ``draft_service.tree.build_tree`` node for node (ties, -0.0, -inf,
chains, budget past the candidate tree, short depths, D = 1 included); the Triton kernel (run by
Triton's interpreter) equals the reference, in both of its pop reductions and in the packed step
row; and ``BatchedDrafter`` with device trees gives the host-tree engine's outcomes (trees and
tables), DDTrees past ``tree_nodes`` built on the host. CPU; the kernel's compiled checks run on
CUDA (``gpu``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import kernels.ddtree as ddtree
from draft_service.tree import TopK, build_tree
from kernels.ddtree import PackedLayout, reference
from tests.test_draft_batched import batched, drafter, files, lockstep, streams, trees  # noqa: F401 (fixtures)

BUDGETS = [0, 1, 2, 3, 5, 9, 17, 40]
TOP_KS = [0, 1, 2, 3, 8, 50]
#: Engine tree params ``(budget, top_k, max_depth)`` cycled over the items: chains (cut or not, short),
#: DDTrees larger than their candidate tree (short depths), the full 63 nodes, a top_k past K.
ENGINE_TREES = [(0, 0, 0), (4, 1, 0), (10, 3, 0), (6, 4, 3), (20, 8, 0), (12, 2, 5), (40, 2, 2), (30, 8, 1),
                (0, 0, 2), (3, 1, 4), (63, 8, 0), (9, 20, 0)]


def _tables(b: int, D: int, K: int, rnd: random.Random, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, D, K]`` log-prob (rows sorted descending) and token tables. ``kind``: ``float`` (log-softmax
    of random logits), ``ties`` (small integers: many equal scores), ``zeros`` (``0.0`` / ``-0.0`` /
    small integers: equal scores along paths), ``inf`` (some ``-inf``)."""
    g = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    if kind == "float":
        lp = torch.log_softmax(torch.randn(b, D, max(K, 20), generator=g) * 3, -1)[..., :K]
    elif kind == "ties":
        lp = -torch.randint(0, 3, (b, D, K), generator=g).float()
    elif kind == "zeros":
        lp = -torch.randint(0, 2, (b, D, K), generator=g).float() * torch.randint(0, 2, (b, D, K), generator=g).float()
        lp = torch.where(torch.rand(b, D, K, generator=g) < 0.5, lp, -lp * 0.0)   # some -0.0
    else:
        lp = -torch.rand(b, D, K, generator=g) * 4
        lp = torch.where(torch.rand(b, D, K, generator=g) < 0.2, torch.tensor(float("-inf")), lp)
    lp = lp.sort(-1, descending=True).values
    tok = torch.randint(0, 5000, (b, D, K), generator=g)
    return lp.contiguous(), tok


def _params(b: int, D: int, rnd: random.Random) -> tuple[torch.Tensor, ...]:
    roots = torch.tensor([rnd.randrange(5000) for _ in range(b)])
    budget = torch.tensor([rnd.choice(BUDGETS) for _ in range(b)])
    top_k = torch.tensor([rnd.choice(TOP_KS) for _ in range(b)])
    depth = torch.tensor([rnd.randint(0, D + 1) for _ in range(b)])   # past D: clamped
    return roots, budget, top_k, depth


def _host(lp, tok, roots, budget, top_k, depth, r: int) -> tuple[list[int], list[int]]:
    d = min(int(depth[r]), lp.shape[1])
    return build_tree(int(roots[r]), TopK(lp[r, :d].numpy(), tok[r, :d].numpy()), int(budget[r]), int(top_k[r]))


def _engine_items(drafter, sessions: list[str], steps: int, seed: int, first: int = 0) -> dict:
    """``tests.test_draft_batched.streams`` (float32) with the tree params of :data:`ENGINE_TREES`
    (from its entry ``first`` on)."""
    items = streams(drafter, sessions, steps=steps, seed=seed, dtype=torch.float32)
    n = first
    for its in items.values():
        for j, it in enumerate(its):
            budget, top_k, depth = ENGINE_TREES[n % len(ENGINE_TREES)]
            its[j] = it._replace(budget=budget, top_k=top_k, max_depth=depth)
            n += 1
    return items


def _rows(out, r: int) -> tuple[list[int], list[int]]:
    tokens, parents, count = out
    n = int(count[r])
    return tokens[r, :n].tolist(), parents[r, :n].tolist()


@pytest.mark.parametrize("D,K", [(1, 1), (1, 4), (3, 2), (5, 8), (8, 5)])
def test_reference_equals_the_host_tree(D, K):
    """Every row of 4 x 40 tables (float, tied, signed-zero, -inf) is ``build_tree``'s tree, node for
    node and in its order; columns past the tree are -1."""
    rnd = random.Random(D * 100 + K)
    for kind in ("float", "ties", "zeros", "inf"):
        lp, tok = _tables(40, D, K, rnd, kind)
        args = (lp, tok, *_params(40, D, rnd))
        out = reference.build_trees_batched(*args, max_nodes=40)
        assert out[0].shape == out[1].shape == (40, 41) and out[0].dtype == out[1].dtype == out[2].dtype == torch.int32
        for r in range(40):
            assert _rows(out, r) == _host(*args, r), (kind, r)
            n = int(out[2][r])
            assert (out[0][r, n:] == -1).all() and (out[1][r, n:] == -1).all()


def test_reference_rows_past_max_nodes_and_defaults():
    """A DDTree asking more than ``max_nodes`` gets the host tree's first ``max_nodes`` nodes; a chain
    is never cut by it (``max(max_nodes, D)`` columns); ``depth`` and ``max_nodes`` default to ``D``
    and the largest budget."""
    rnd = random.Random(5)
    lp, tok = _tables(6, 6, 4, rnd, "float")
    roots = torch.arange(6)
    budget = torch.tensor([30, 30, 0, 30, 3, 12])
    top_k = torch.tensor([4, 2, 4, 1, 4, 3])
    out = reference.build_trees_batched(lp, tok, roots, budget, top_k, None, max_nodes=4)
    assert out[0].shape == (6, 7)                           # max(4, D = 6) + 1
    for r in range(6):
        want = _host(lp, tok, roots, budget, top_k, torch.full((6,), 6), r)
        got = _rows(out, r)
        if top_k[r] > 1 and budget[r] > 6:
            assert got == (want[0][:7], want[1][:7])        # the best 6 (= max(4, D)) nodes
        else:
            assert got == want
    full = reference.build_trees_batched(lp, tok, roots, budget, top_k)
    assert full[0].shape == (6, 31)
    assert all(_rows(full, r) == _host(lp, tok, roots, budget, top_k, torch.full((6,), 6), r) for r in range(6))


#: where the Triton kernel runs in these tests: the GPU where there is one (compiled), else the CPU
#: (Triton's interpreter, which tests/conftest.py turns on without CUDA)
KDEV = "cuda" if torch.cuda.is_available() else "cpu"


def _on(dev, *ts):
    return tuple(t.to(dev) for t in ts)


def test_kernel_equals_reference():
    """The Triton kernel (plain reductions; the interpreter on a CPU machine) gives the reference's
    arrays bit for bit, ties included; the packed step row (table + trees) equals the reference's."""
    from kernels.ddtree import triton as kt

    rnd = random.Random(11)
    for (D, K), kind in (((4, 3), "ties"), ((6, 8), "float"), ((1, 2), "zeros"), ((5, 4), "inf")):
        lp, tok = _tables(6, D, K, rnd, kind)
        roots, budget, top_k, depth = _params(6, D, rnd)
        budget = budget.clamp(max=9)
        want = reference.build_trees_batched(lp, tok, roots, budget, top_k, depth, max_nodes=9)
        got = kt.build_trees_batched(*_on(KDEV, lp, tok, roots, budget, top_k, depth), max_nodes=9)
        for w, g in zip(want, got):
            assert torch.equal(w, g.cpu()), kind
    layout = PackedLayout(D, K, 9)
    packed = {}
    for name in ("reference", "triton"):
        if name == "triton":
            out = torch.full((6, layout.size), 7, dtype=torch.int32, device=KDEV)
            kt.launch(*_on(KDEV, lp, tok, roots, budget, top_k, depth), layout.nodes, *layout.views(out)[1:],
                      layout.views(out)[0])
            out = out.cpu()
        else:
            out = torch.full((6, layout.size), 7, dtype=torch.int32)
            ddtree.step_output(lp, tok, roots, budget, top_k, depth, layout, out)
        packed[name] = out
    assert torch.equal(packed["triton"], packed["reference"])
    table, tokens, parents, count = layout.views(packed["triton"].numpy())
    assert np.array_equal(table[..., 0].view(np.float32), lp.numpy()) and np.array_equal(table[..., 1], tok.numpy())
    assert np.shares_memory(tokens, packed["triton"].numpy())


def test_kernel_tuple_reduction(monkeypatch):
    """The compiled kernel's pop (one multi-operand reduction; slow under the interpreter, so two
    small rows here) gives the reference's trees."""
    from kernels.ddtree import triton as kt

    monkeypatch.setattr(kt, "TUPLE", True)
    rnd = random.Random(3)
    lp, tok = _tables(2, 3, 3, rnd, "ties")
    args = (lp, tok, torch.tensor([1, 2]), torch.tensor([5, 4]), torch.tensor([3, 2]), torch.tensor([3, 2]))
    for w, g in zip(reference.build_trees_batched(*args, max_nodes=5), kt.build_trees_batched(*_on(KDEV, *args), max_nodes=5)):
        assert torch.equal(w, g.cpu())


def test_kernel_rejects_bad_sizes():
    from kernels.ddtree import triton as kt

    lp, tok = torch.zeros(1, 5, 2), torch.zeros(1, 5, 2, dtype=torch.long)
    one = torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="max_nodes"):
        kt.launch(lp, tok, one, one, one, one, 4, torch.empty(1, 5, dtype=torch.int32),
                  torch.empty(1, 5, dtype=torch.int32), torch.empty(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not fit"):
        ddtree.step_output(lp, tok, one, one, one, one, PackedLayout(4, 2, 5), torch.empty(1, 100, dtype=torch.int32))


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_engine_device_trees_equal_host_trees(drafter, pad):
    """The fused engine with device trees (the default with ``fused``) gives the outcomes of the
    same engine with host trees: trees, tables and lengths, over 4 steps of 5 sessions
    (:data:`ENGINE_TREES`); with ``tree_nodes=8`` the DDTrees asking more are built on the host."""
    items = _engine_items(drafter, ["a", "b", "c", "d", "e"], steps=4, seed=31)
    kw = dict(pad_batches=pad, batch_buckets=(1, 2, 4, 8), fused=True)
    host = batched(drafter, device_trees=False, **kw)
    dev = batched(drafter, **kw)
    small = batched(drafter, tree_nodes=8, **kw)
    assert host.tree_layout is None and dev.tree_layout.nodes == 63 and small.tree_layout.nodes == 8
    assert batched(drafter).tree_layout is None                     # CPU default: reference step, host trees
    for batch in lockstep(items):
        want = host.propose_batch(batch)
        for eng in (dev, small):
            got = eng.propose_batch(batch)
            assert trees(got) == trees(want)
            for w, g in zip(want, got):
                assert g.committed_length == w.committed_length
                assert np.array_equal(g.table.tokens, w.table.tokens) and np.array_equal(g.table.logprobs, w.table.logprobs)
    assert any(i.budget > 8 and i.top_k > 1 for its in items.values() for i in its)   # the host fallback ran
    assert dev.trees == host.trees == 20


def test_engine_device_trees_on_the_kernel(drafter, monkeypatch):
    """The engine's step with the Triton kernel writing the packed rows (interpreter; the rest of the
    step on its references) gives the host trees (short depths, 63 nodes, top_k past K). A CPU
    machine's test: on a GPU machine the engine's own GPU tests (tests/test_draft_batched.py) run
    the compiled kernel in the captured step."""
    from kernels.ddtree import triton as kt

    if torch.cuda.is_available():
        pytest.skip("the interpreter's test (a CPU engine); the GPU engine tests run the compiled kernel")

    launches, real = [], kt.launch

    def counted(*args, **kw):
        launches.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(ddtree, "use_triton", lambda t: True)
    monkeypatch.setattr(kt, "launch", counted)
    items = _engine_items(drafter, ["a", "b", "c"], steps=2, seed=32, first=6)
    host = batched(drafter, pad_batches=True, batch_buckets=(4,), fused=True, device_trees=False)
    dev = batched(drafter, pad_batches=True, batch_buckets=(4,), fused=True)
    for batch in lockstep(items):
        assert trees(dev.propose_batch(batch)) == trees(host.propose_batch(batch))
    assert len(launches) == 2


@pytest.mark.gpu
def test_gpu_kernel_equals_reference():
    """CUDA: the compiled kernel (multi-operand pop) equals the reference run on the CPU, on 64 rows
    of float and tied tables, through ``step_output``'s packed rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rnd = random.Random(7)
    for kind in ("float", "ties"):
        lp, tok = _tables(64, 15, 8, rnd, kind)
        roots, budget, top_k, depth = _params(64, 15, rnd)
        budget = torch.tensor([rnd.choice([0, 1, 15, 40, 63, 100]) for _ in range(64)])
        layout = PackedLayout(15, 8, 63)
        want = torch.zeros(64, layout.size, dtype=torch.int32)
        ddtree.step_output(lp, tok, roots, budget, top_k, depth, layout, want)
        got = torch.zeros(64, layout.size, dtype=torch.int32, device="cuda")
        ddtree.step_output(*(x.cuda() for x in (lp, tok, roots, budget, top_k, depth)), layout, got)
        assert torch.equal(got.cpu(), want), kind

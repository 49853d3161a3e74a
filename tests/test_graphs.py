"""The step scaffold both batched engines stand on (runtime/graphs.py) on the CPU: bucket choice,
memory budget -> slots, the runner registry (built once per shape, captured once, dropped on
reset, one graph pool shared), the eager run path; and the one tree-depth function
(runtime/tree.py ``tree_depths``) against the implementations it replaced."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from runtime import graphs
from runtime.errors import Code, ResourceExhausted
from runtime.graphs import BATCH_BUCKETS, GraphSet, StepGraph, bucket_for, capped_buckets, slots_for_budget
from runtime.tree import TreeError, analyze_tree, tree_depths, tree_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------ buckets
def test_bucket_for_takes_the_smallest_that_holds():
    assert [bucket_for(n, BATCH_BUCKETS) for n in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    assert bucket_for(7, (8,)) == 8
    with pytest.raises(ValueError, match="65 exceeds the largest bucket 64"):
        bucket_for(65, BATCH_BUCKETS)


def test_capped_buckets_stop_at_the_first_that_holds_every_session():
    assert capped_buckets(BATCH_BUCKETS, 5) == [1, 2, 4, 8]
    assert capped_buckets(BATCH_BUCKETS, 8) == [1, 2, 4, 8]
    assert capped_buckets(BATCH_BUCKETS, 1) == [1]
    assert capped_buckets(BATCH_BUCKETS, 500) == list(BATCH_BUCKETS)
    assert capped_buckets((4, 1, 2, 2), 3) == [1, 2, 4]          # sorted, without repeats


# ------------------------------------------------------------------------------------ budget
def test_slots_for_budget_pays_the_spare_slot():
    assert slots_for_budget(None, 100, 8) == 8
    assert slots_for_budget(500, 100, 8) == 4                    # 5 slots' bytes: 4 + the spare
    assert slots_for_budget(599, 100, 8) == 4
    assert slots_for_budget(10**6, 100, 8) == 8                  # never more than asked
    assert slots_for_budget(200, 100, 8) == 1
    with pytest.raises(ResourceExhausted) as e:
        slots_for_budget(199, 100, 8, what="drafter session")
    assert e.value.code is Code.RESOURCE_EXHAUSTED
    assert str(e.value) == "a memory budget of 199 bytes holds no drafter session slot (100 bytes each, plus one spare)"


# ------------------------------------------------------------------------------------ runners
class _Doubler(StepGraph):
    """A toy step: ``out = 2 * inp`` over static buffers (the shape of a real runner)."""

    def __init__(self, n: int):
        super().__init__("cpu")
        self.inp = self.host_buffer(n, dtype=torch.long)
        self.inp_dev = self.device_twin(self.inp)
        self.out = self.host_buffer(n, dtype=torch.long)
        self.bodies = self.idles = 0
        self.captured_into = None

    def body(self) -> None:
        self.bodies += 1
        self.copy(self.inp_dev, self.inp)
        self.out.copy_(self.inp_dev * 2)

    def fill_idle(self) -> None:
        self.idles += 1
        self.inp.fill_(-1)

    def capture(self, pool_handle) -> None:          # no CUDA here: record what would be captured
        self.captured_into = pool_handle
        self.graph = None


def test_step_graph_runs_eagerly_off_cuda():
    r = _Doubler(4)
    assert not r.cuda and r.graph is None
    assert r.inp_dev is r.inp and not r.inp.is_pinned()          # off CUDA the device buffer is the host one
    r.inp.copy_(torch.arange(4))
    r.run()
    assert r.out.tolist() == [0, 2, 4, 6] and r.bodies == 1
    with pytest.raises(NotImplementedError):
        StepGraph("cpu").run()


class _Matmul(StepGraph):
    """A CUDA step of measurable length: ``out = inp @ w`` repeated, copied back to the host."""

    def __init__(self, n: int = 1024, reps: int = 20):
        super().__init__("cuda")
        self.reps = reps
        self.inp = self.host_buffer(n, n, dtype=torch.float32)
        self.inp_dev = self.device_twin(self.inp)
        self.w = torch.randn(n, n, device="cuda")
        self.out = self.host_buffer(n, n, dtype=torch.float32)
        self.out_dev = self.device_twin(self.out)

    def body(self) -> None:
        self.copy(self.inp_dev, self.inp)
        x = self.inp_dev
        for _ in range(self.reps):
            x = x @ self.w
        self.out_dev.copy_(x)
        self.copy(self.out, self.out_dev)

    def fill_idle(self) -> None:
        self.inp.zero_()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_graph_run_counts_its_device_seconds():
    """runtime.device_time: each CUDA run (eager and replayed) adds its CUDA-event time, which is
    positive and within the run's wall time; off CUDA nothing is added."""
    import time

    from runtime.device_time import device_seconds

    before = device_seconds()
    _Doubler(4).run()
    assert device_seconds() == before
    r = _Matmul()
    for captured in (False, True):
        if captured:
            r.capture(torch.cuda.graph_pool_handle())
        r.run()   # warm-up
        d0, t0 = device_seconds(), time.perf_counter()
        r.run()
        wall, dev = time.perf_counter() - t0, device_seconds() - d0
        assert 0 < dev <= wall


def test_copy_skips_a_tensor_onto_itself():
    a, b = torch.zeros(3), torch.ones(3)
    StepGraph.copy(a, b)
    assert a.tolist() == [1.0, 1.0, 1.0]
    StepGraph.copy(a, a)                                         # a no-op, not an error


def test_graph_set_builds_each_shape_once_and_drops_on_reset():
    built = []

    def build(key):
        built.append(key)
        return _Doubler(key[0] * key[1])

    gs = GraphSet(build, cuda_graphs=False)
    a = gs.get((1, 4))
    assert gs.get((1, 4)) is a and built == [(1, 4)] and len(gs) == 1 and (1, 4) in gs
    gs.get((2, 4))
    assert sorted(gs) == [(1, 4), (2, 4)] and dict(gs.items())[(1, 4)] is a
    assert gs.captures == 0 and a.captured_into is None          # eager: nothing captured
    assert gs.reset() is True and len(gs) == 0 and not gs
    assert gs.reset() is False
    assert gs.get((1, 4)) is not a and built == [(1, 4), (2, 4), (1, 4)]


def test_graph_set_capture_eager_runs_every_shape_largest_first():
    order = []

    def build(key):
        order.append(key)
        return _Doubler(key)

    gs = GraphSet(build, cuda_graphs=False)
    assert gs.capture([1, 8, 2, 4], size=lambda k: k) == 4
    assert order == [8, 4, 2, 1]
    for _, r in gs.items():                                       # each warmed once on idle inputs
        assert r.idles == 1 and r.bodies == 1 and r.out.tolist() == [-2] * len(r.out)
    gs.capture([1, 8, 2, 4], size=lambda k: k)
    assert order == [8, 4, 2, 1]                                  # built once; warmed again
    assert all(r.bodies == 2 for _, r in gs.items())


def test_graph_set_capture_keeps_ties_in_order():
    order = []
    gs = GraphSet(lambda k: order.append(k) or _Doubler(1), cuda_graphs=False)
    gs.capture([(2, 4, False), (1, 8, False), (1, 8, True), (4, 1, False)], size=lambda k: k[0] * k[1])
    assert order == [(2, 4, False), (1, 8, False), (1, 8, True), (4, 1, False)]


def test_graph_set_captures_into_one_shared_pool(monkeypatch):
    """With CUDA graphs each new shape is captured once, all into one memory pool; a reset drops
    the pool with the runners, and captures go on counting."""
    handles = []

    def new_handle():
        handles.append(object())
        return handles[-1]

    monkeypatch.setattr(graphs.torch.cuda, "graph_pool_handle", new_handle)
    gs = GraphSet(lambda k: _Doubler(k), cuda_graphs=True)
    assert gs.capture([2, 1, 4], size=lambda k: k) == 3
    assert gs.captures == 3 and len(handles) == 1
    assert all(r.captured_into is handles[0] for _, r in gs.items())
    assert all(r.bodies == 0 for _, r in gs.items())              # the capture warms up, not capture()
    gs.get(2)
    assert gs.captures == 3                                       # no recapture
    gs.reset()
    r = gs.get(2)
    assert gs.captures == 4 and len(handles) == 2 and r.captured_into is handles[1]


# ------------------------------------------------------------------------------------ tree depths
def _old_analyze_depths(parents):
    """runtime/tree.py ``analyze_tree``'s depth loop before ``tree_depths``."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def _old_trim_tree(tokens, parents, max_depth):
    """orchestrator/scheduler.py ``trim_tree`` before ``tree_depths``."""
    depth = [0] * len(tokens)
    new_index = [-1] * len(tokens)
    out_t, out_p = [], []
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        depth[i] = 0 if i == 0 else depth[par] + 1
        if depth[i] <= max_depth and (i == 0 or new_index[par] >= 0):
            new_index[i] = len(out_t)
            out_t.append(tok)
            out_p.append(-1 if i == 0 else new_index[par])
    return out_t, out_p


trees = st.integers(1, 80).flatmap(
    lambda n: st.tuples(*([st.just(-1)] + [st.integers(0, i - 1) for i in range(1, n)])).map(list))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(parents=trees)
def test_tree_depths_property_and_old_implementations(parents):
    d = tree_depths(parents)
    assert d[0] == 0 and all(d[i] == d[parents[i]] + 1 for i in range(1, len(parents)))
    assert d == _old_analyze_depths(parents)
    assert max(d) == max(_old_analyze_depths(parents))            # the scheduler's tree_depth
    tokens = [i % 7 for i in range(len(parents))]
    assert analyze_tree(tokens, parents, 7, 80)[0] == d
    assert tree_tensors(tokens, parents).depth_host == d
    for cut in (0, 1, 3, 100):
        assert _trim(tokens, parents, cut) == _old_trim_tree(tokens, parents, cut)


def _trim(tokens, parents, cut):
    pytest.importorskip("grpc")
    from orchestrator.scheduler import trim_tree

    return trim_tree(tokens, parents, cut)


@pytest.mark.parametrize("parents, msg", [
    ([], "empty tree"),
    ([0], "root's parent must be -1, got 0"),
    ([-1, 1], "node 1: parent 1 is not an earlier node"),
    ([-1, 0, 3, 1], "node 2: parent 3 is not an earlier node"),
    ([-1, -1], "node 1: parent -1 is not an earlier node"),
])
def test_tree_depths_rejects_a_malformed_parent_list(parents, msg):
    with pytest.raises(TreeError, match=msg):
        tree_depths(parents)
    assert issubclass(TreeError, ValueError)


def test_analyze_tree_depth_limit_names_the_first_deep_node():
    with pytest.raises(TreeError, match="node 3: depth 3 exceeds 2"):
        analyze_tree([0] * 5, [-1, 0, 1, 2, 3], 10, 8, max_depth=2)
    assert analyze_tree([0] * 3, [-1, 0, 0], 10, 8, max_depth=1) == ([0, 1, 1], [1, 3, 5])


def test_runtime_tree_imports_no_torch():
    code = "import sys, runtime.tree; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert out.split() == ["False"]

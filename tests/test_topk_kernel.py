"""``kernels.topk``: the drafter step's top-K of the log-softmax. The Triton kernels (compiled on a
GPU machine, Triton's interpreter on a CPU one) against the reference (torch's
``topk(log_softmax)``): values within 1e-5, indices exactly a stable descending sort's (lower
column first among equal logits) and torch's wherever torch's values are not tied; the non-finite
rows, the empty cases and the dispatch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import topk as ops  # noqa: E402
from kernels.topk import reference  # noqa: E402
from kernels.topk import triton as kt  # noqa: E402

#: where the Triton kernels run: the GPU where there is one (compiled), else the CPU (Triton's
#: interpreter, which tests/conftest.py turns on without CUDA)
KDEV = "cuda" if torch.cuda.is_available() else "cpu"


def _stable_top(x: torch.Tensor, k: int) -> torch.Tensor:
    """The kernels' index rule: the first ``k`` of a stable descending sort of the logits (NaN
    first, then larger values, lower column first among equals)."""
    return torch.sort(x.float(), dim=-1, descending=True, stable=True).indices[..., :k]


def _check(x: torch.Tensor, k: int, block: int | None = None, splits: int | None = None) -> None:
    got_v, got_i = kt.topk_log_softmax(x.to(KDEV), k, block=block, splits=splits)
    got_v, got_i = got_v.cpu(), got_i.cpu()
    want_v, want_i = reference.topk_log_softmax(x, k)
    assert got_v.dtype == torch.float32 and got_i.dtype == torch.int64
    assert got_v.shape == want_v.shape == got_i.shape
    torch.testing.assert_close(got_v, want_v, atol=1e-5, rtol=0, equal_nan=True)
    assert torch.equal(got_i, _stable_top(x, k))
    # torch's own indices wherever its value is not tied within the row's top k + 1
    nxt = torch.topk(torch.log_softmax(x.float(), -1), min(k + 1, x.shape[-1]), -1).values
    tied = (want_v[..., :, None] == nxt[..., None, :]).sum(-1) > 1
    assert torch.equal(got_i[~tied], want_i[~tied])


@pytest.mark.parametrize("V,k,block,splits", [(1000, 4, 256, None), (4999, 8, 512, 1), (4999, 8, 512, 3),
                                              (4096, 1, 512, 2), (300, 3, None, None), (5, 5, None, None)])
def test_random_logits(V, k, block, splits):
    """Random logits over several chunks (one program per chunk; one program looping over the
    row's chunks; programs of two and three chunks, the last one short), ``V`` not a multiple of
    the chunk, one chunk, ``k = V``: the reference's values, the stable sort's indices, torch's
    untied indices. Two more rows: ascending logits (every chunk beats the running set) and
    descending (no chunk after the first does)."""
    g = torch.Generator().manual_seed(V + k)
    x = torch.randn(5, V, generator=g) * 4
    x[3] = torch.linspace(-5, 5, V)
    x[4] = torch.linspace(5, -5, V)
    _check(x, k, block, splits)


def test_ties_take_the_lower_column():
    """Integer logits (many equal values, across chunk boundaries) and a tied maximum in two
    chunks: equal logits come out lower column first; ``-0.0`` equals ``0.0``."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 4, (4, 1200), generator=g).float()
    x[1] = 0.0
    x[1, 1100] = -0.0
    x[1, 50] = -0.0
    x[2, 900] = x[2, 100] = 9.0
    _check(x, 8, block=256)
    _check(x, 8, block=256, splits=1)
    _, i = kt.topk_log_softmax(x[2:3].to(KDEV), 2, block=256)
    assert i.tolist() == [[100, 900]]
    _, i = kt.topk_log_softmax(x[1:2].to(KDEV), 3, block=256)
    assert i.tolist() == [[0, 1, 2]]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on -inf - -inf, log(0)
def test_non_finite_rows():
    """An all ``-inf`` row: NaN values (as log_softmax), columns ``0..k-1``; a NaN logit: NaN
    values, the NaN columns first (torch.topk's order), also where the NaN's chunk is otherwise
    ``-inf`` (GPU max reductions skip NaN); fewer finite logits than ``k``: ``-inf``
    values at the lowest ``-inf`` columns; ``+inf``: NaN values (as torch). No exception."""
    ninf = float("-inf")
    x = torch.randn(5, 700, generator=torch.Generator().manual_seed(9))
    x[0] = ninf
    x[1, 600] = float("nan")
    x[1, 3] = float("nan")
    x[2] = ninf
    x[2, 650] = 1.0
    x[2, 300] = 0.5                                      # chunk 0 (of 256) all -inf
    x[3, 400] = float("inf")
    x[4, 512:] = ninf                                     # chunk 2 (of 256): one NaN, the rest -inf
    x[4, 690] = float("nan")
    want_v, _ = reference.topk_log_softmax(x, 4)
    for splits in (None, 1):
        v, i = kt.topk_log_softmax(x.to(KDEV), 4, block=256, splits=splits)
        v, i = v.cpu(), i.cpu()
        torch.testing.assert_close(v, want_v, atol=1e-5, rtol=0, equal_nan=True)
        assert v[0].isnan().all() and i[0].tolist() == [0, 1, 2, 3]
        assert v[1].isnan().all() and i[1, :2].tolist() == [3, 600]
        assert i[2].tolist() == [650, 300, 0, 1] and v[2, 2:].eq(ninf).all() and v[2, :2].isfinite().all()
        assert v[3].isnan().all() and i[3, 0] == 400
        assert v[4].isnan().all() and i[4, 0] == 690
        assert torch.equal(i, _stable_top(x, 4))


def test_shapes_and_limits():
    """Leading dimensions, strided rows, bfloat16 logits, ``R = 0``, ``k = 0``; ``k`` outside
    ``[0, V]`` raises ValueError (the dispatcher too), so do a chunk size that is not a power of
    two and ``splits < 1``; ``k`` above MAX_K runs the reference."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 3, 900, generator=g)
    x = wide[..., :700]                                   # rows 900 apart, last stride 1
    _check(x, 2, block=512)
    _check(torch.randn(3, 640, generator=g).bfloat16(), 4, block=256)
    v, i = kt.topk_log_softmax(torch.empty(0, 50, device=KDEV), 3)
    assert v.shape == i.shape == (0, 3)
    v, i = kt.topk_log_softmax(torch.randn(2, 50, device=KDEV), 0)
    assert v.shape == i.shape == (2, 0)
    for bad in (-1, 51):
        with pytest.raises(ValueError, match="outside"):
            kt.topk_log_softmax(torch.randn(2, 50), bad)
        with pytest.raises(ValueError, match="outside"):
            ops.topk_log_softmax(torch.randn(2, 50), bad)
    with pytest.raises(ValueError, match="power of two"):
        kt.topk_log_softmax(torch.randn(2, 50), 2, block=48)
    with pytest.raises(ValueError, match="splits"):
        kt.topk_log_softmax(torch.randn(2, 50), 2, splits=0)
    y = torch.randn(2, 100, generator=g)
    v, i = kt.topk_log_softmax(y, kt.MAX_K + 1)
    want_v, want_i = reference.topk_log_softmax(y, kt.MAX_K + 1)
    assert torch.equal(v, want_v) and torch.equal(i, want_i)


def test_dispatch_on_the_cpu_is_torch():
    """On CPU tensors the op is torch's ``topk(log_softmax)`` bit for bit (the fused drafter step
    on the CPU equals the reference step)."""
    x = torch.randn(15, 3000, generator=torch.Generator().manual_seed(1))
    v, i = ops.topk_log_softmax(x, 4)
    top = torch.topk(torch.log_softmax(x, dim=-1), 4, dim=-1)
    assert torch.equal(v, top.values) and torch.equal(i, top.indices)

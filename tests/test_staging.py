"""runtime.staging.IndexStaging: index arrays to the device through persistent buffers: the same
values as the array, any shape, past the first capacity, and a put never overwrites indices that
work queued earlier still reads (stream order on the device, an event on the host)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.staging import IndexStaging


def test_off_cuda_the_values_themselves():
    s = IndexStaging("cpu", capacity=4)
    a = np.arange(12).reshape(3, 4)
    t = s.put(a)
    assert t.dtype == torch.int64 and t.shape == (3, 4) and t.tolist() == a.tolist()
    assert s.put([[5, 6]]).tolist() == [[5, 6]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_puts_grow_and_keep_earlier_work_right():
    s = IndexStaging("cuda", capacity=8)
    table = torch.arange(10_000, device="cuda") * 3
    rng = np.random.default_rng(0)
    outs, wants = [], []
    for n in (3, 8, 9, 100, 5000, 7, 2048):   # past the capacity twice, then smaller again
        idx = rng.integers(0, table.numel(), size=(2, n))
        dev = s.put(idx)
        assert dev.device.type == "cuda" and dev.shape == (2, n)
        outs.append(table.index_select(0, dev[0]) + table.index_select(0, dev[1]))   # queued, not synced
        wants.append((idx[0] + idx[1]) * 3)
    torch.cuda.synchronize()
    for got, want in zip(outs, wants):
        assert got.cpu().numpy().tolist() == want.tolist()

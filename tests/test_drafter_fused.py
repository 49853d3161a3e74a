"""The drafter's fused step (draft_service/fused_step.py) against its plain-PyTorch reference
(``draft_service.batched.draft_step``) and the per-session reference engine: the same top-K
tables, trees and context pool, on the CPU in float32 (the fused step's kernels are their PyTorch
references there), and with the Triton kernels run by Triton's interpreter. The CUDA checks of the
fused step are test_draft_batched.py's ``gpu`` tests (the fused step is the default on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draft_service.batched import ReferenceDrafterEngine
from tests.test_draft_batched import batched, drafter, files, lockstep, streams, trees  # noqa: F401 (fixtures)


def _run(eng, items):
    """Propose every lockstep batch; returns the outcomes of each batch."""
    return [eng.propose_batch(batch) for batch in lockstep(items)]


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_fused_step_equals_the_reference_step(drafter, pad):
    """float32 on the CPU: the fused step's tables equal the reference step's within 1e-5 (the
    same math, other rounding order), its trees are the same, and it leaves the same context
    K/V in the pool (rows a later step reads), for every step of five sessions with the first
    rows appended eagerly."""
    items = streams(drafter, ["a", "b", "c", "d", "e"], steps=4, seed=21, dtype=torch.float32)
    ref = batched(drafter, pad_batches=pad, batch_buckets=(1, 2, 4, 8), fused=False)
    fus = batched(drafter, pad_batches=pad, batch_buckets=(1, 2, 4, 8), fused=True)
    assert ref.fused is None and fus.fused is not None
    for want, got in zip(_run(ref, items), _run(fus, items)):
        assert trees(got) == trees(want)
        for w, g in zip(want, got):
            assert np.array_equal(g.table.tokens, w.table.tokens)
            np.testing.assert_allclose(g.table.logprobs, w.table.logprobs, atol=1e-5, rtol=0)
    for sid in items:
        s_ref, s_fus = ref.sessions[sid], fus.sessions[sid]
        n = s_ref.length
        assert s_fus.length == n
        for pool_r, pool_f in ((ref.pool.k, fus.pool.k), (ref.pool.v, fus.pool.v)):
            torch.testing.assert_close(pool_f[:, s_fus.slot, :n], pool_r[:, s_ref.slot, :n], atol=1e-5, rtol=1e-5)


def test_fused_step_defaults(drafter):
    """On the CPU the reference step is the default; ``fused=True`` packs q/k/v, k/v and
    gate/up once (weights shared with the model where not packed)."""
    assert batched(drafter).fused is None
    f = batched(drafter, fused=True).fused
    c = drafter.config
    layer = f.layers[0]
    assert layer.qkv.shape == ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size)
    assert layer.kv.shape == (2 * c.num_kv_heads * c.head_dim, c.hidden_size)
    assert layer.gate_up.shape == (2 * c.intermediate_size, c.hidden_size)
    assert layer.down.data_ptr() == drafter.layers[0].ffn_down.weight.data_ptr()
    assert f.cos.shape[1] == c.head_dim


def test_fused_step_on_triton_kernels(drafter, monkeypatch):
    """Every kernel of the fused step in its Triton version (Triton's interpreter on the CPU,
    float32): the trees of the per-session reference engine, tables within 1e-4."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter check is for CPU machines; the gpu tests cover CUDA")
    monkeypatch.setenv("DFLASH_KERNELS", "triton")
    items = streams(drafter, ["a", "b"], steps=1, seed=22, first_rows=9, dtype=torch.float32)
    ref = ReferenceDrafterEngine(drafter)
    fus = batched(drafter, pad_batches=True, batch_buckets=(2,), fused=True)
    for batch in lockstep(items):
        want, got = ref.propose_batch(batch), fus.propose_batch(batch)
        assert trees(got) == trees(want)

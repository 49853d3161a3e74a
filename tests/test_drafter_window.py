"""Sliding-window drafter layers (``DrafterConfig.layer_types`` / ``sliding_window``) in the
batched drafter: its plain-PyTorch step (``draft_service.batched.draft_step``) and its fused step
(``draft_service.fused_step``, also on the Triton kernels under the interpreter, batches padded)
give the per-session CPU drafter's trees and tables; the window changes them; a windowed drafter
GGUF keeps its windows. The CPU drafter itself is checked against z-lab's reference in
tests/test_dflash_reference.py and the kernel's window in tests/test_kernels.py. The CUDA
checks are marked ``gpu``.

Two windows on the shared tiny drafter (block 8, two layers): 5 on the first layer (shorter than
the block: block rows drop out too) and 12 on the second (``B <= W``: only old context rows drop
out); the sessions' contexts grow past both.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draft_service.batched import ReferenceDrafterEngine
from draft_service.drafter import FULL, SLIDING
from draft_service.gguf_io import load_drafter, read_drafter, read_drafter_config, write_drafter
from draft_service.tree import topk_table
from tests.test_draft_batched import batched, files, lockstep, streams, trees  # noqa: F401 (fixtures)

#: (layer_types, sliding_window) of the windowed drafters
WINDOWS = {"w5-first": ([SLIDING, FULL], 5), "w12-second": ([FULL, SLIDING], 12)}


def _windowed(files, tmp_path_factory, types, window, device="cpu", dtype=torch.float32):
    """The shared tiny drafter's weights with ``types`` / ``window``, written as a drafter GGUF
    (float32) and loaded from it."""
    tiny, path = files
    config, state = read_drafter(path)
    config.layer_types, config.sliding_window = list(types), int(window)
    out = tmp_path_factory.mktemp("windowed") / "drafter.gguf"
    write_drafter(out, config.validate(), state, dtype="f32")
    return load_drafter(str(out), tiny.path, device=device, dtype=dtype)


@pytest.fixture(scope="module", params=list(WINDOWS), ids=list(WINDOWS))
def windowed(request, files, tmp_path_factory):
    return _windowed(files, tmp_path_factory, *WINDOWS[request.param])


def test_windowed_gguf_keeps_the_windows(windowed, files):
    """The GGUF carries the windows (llama.cpp's sliding_window keys); the tiny drafter without
    them has neither key."""
    from runtime.gguf_loader import open_gguf

    c = windowed.config
    assert c.sliding_window in (5, 12) and c.layer_types in ([SLIDING, FULL], [FULL, SLIDING])
    assert c.layer_windows == [c.sliding_window if t == SLIDING else 0 for t in c.layer_types]
    plain = open_gguf(files[1])
    assert plain.get("qwen3.attention.sliding_window") is None and plain.get("qwen3.attention.sliding_window_pattern") is None
    assert read_drafter_config(plain).layer_windows == [0, 0]


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_batched_steps_equal_the_cpu_drafter_with_windows(windowed, pad):
    """float32 on the CPU: the reference step and the fused step give the per-session engine's
    trees, their top-K tables match its logits within 1e-5 at every step, and the windows
    matter (the same stream without them gives other tables)."""
    items = streams(windowed, ["a", "b", "c"], steps=4, seed=31, first_rows=26, dtype=torch.float32)
    ref = ReferenceDrafterEngine(windowed)
    engines = [batched(windowed, pad_batches=pad, batch_buckets=(1, 2, 4), fused=f) for f in (False, True)]
    for batch in lockstep(items):
        want = ref.propose_batch(batch)
        for eng in engines:
            got = eng.propose_batch(batch)
            assert trees(got) == trees(want)
            for item, o in zip(batch, got):
                logits = windowed.block_logits(ref.sessions[item.session_id], item.root_token)
                table = topk_table(logits, o.table.tokens.shape[1])
                depth = len(o.table.tokens)
                assert o.table.tokens.tolist() == table.tokens[:depth]
                np.testing.assert_allclose(o.table.logprobs, np.asarray(table.logprobs[:depth]), atol=1e-5, rtol=0)
    assert max(ref.session_length(s) for s in items) > 2 * windowed.config.sliding_window   # the window bites
    # without the windows: other tables (so the checks above can fail)
    plain_cfg = type(windowed.config)(**{**windowed.config.__dict__, "layer_types": [], "sliding_window": 0})
    plain = ReferenceDrafterEngine(_same_weights(windowed, plain_cfg))
    windowed_ref = ReferenceDrafterEngine(windowed)
    differ = 0.0
    for batch in lockstep(items):
        for item, a, b in zip(batch, windowed_ref.propose_batch(batch), plain.propose_batch(batch)):
            la = windowed.block_logits(windowed_ref.sessions[item.session_id], item.root_token)
            lb = plain.drafter.block_logits(plain.sessions[item.session_id], item.root_token)
            differ = max(differ, float((la - lb).abs().max()))
    assert differ > 1e-2, differ


def _same_weights(model, config):
    """A :class:`DFlashDrafter` of ``config`` with ``model``'s weights and target embedding / head."""
    from draft_service.drafter import DFlashDrafter

    out = DFlashDrafter(config.validate(), model.embed_weight, model.lm_head_weight)
    out.load_state_dict(model.state_dict())
    return out.to(model.device).eval()


def test_fused_step_on_triton_kernels_with_windows(files, tmp_path_factory, monkeypatch):
    """Every kernel of the fused step in its Triton version (the interpreter, float32), the
    attention with the layer's window, a padded batch: the per-session engine's trees, contexts
    longer than the window."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the interpreter check is for CPU machines; the gpu tests cover CUDA")
    d = _windowed(files, tmp_path_factory, [SLIDING, FULL], 5)
    monkeypatch.setenv("DFLASH_KERNELS", "triton")
    items = streams(d, ["a", "b"], steps=1, seed=32, first_rows=10, dtype=torch.float32)
    ref = ReferenceDrafterEngine(d)
    fus = batched(d, pad_batches=True, batch_buckets=(2,), fused=True)
    for batch in lockstep(items):
        assert trees(fus.propose_batch(batch)) == trees(ref.propose_batch(batch))


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(WINDOWS))
def test_gpu_windowed_drafter_equals_the_cpu_reference(files, tmp_path_factory, name):
    """On CUDA, the batched engine (fused step, Triton attention with the windows, CUDA graphs)
    against the per-session CPU drafter: float32 gives its trees at every step; bfloat16 gives
    top-K log-probs within 0.25 nats of the CPU float32 logits at the same tokens (the bound of
    test_draft_batched's bf16 check) and its top-1 wherever the CPU's top-2 gap exceeds 0.5.
    Contexts of 300+ rows: the kernel skips the key split wholly below the window."""
    cpu = _windowed(files, tmp_path_factory, *WINDOWS[name])
    items = streams(cpu, ["a", "b", "c", "d"], steps=5, seed=33, first_rows=300, dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        dev = _windowed(files, tmp_path_factory, *WINDOWS[name], device="cuda", dtype=dtype)
        eng = batched(dev, max_context=600)       # 3 key splits; contexts past the first
        assert eng.fused is not None and eng.capture() == len(eng.buckets()) * len(eng.split_buckets)
        ref = ReferenceDrafterEngine(cpu)
        for batch in lockstep(items):
            want, got = ref.propose_batch(batch), eng.propose_batch(batch)
            if dtype == torch.float32:
                assert trees(got) == trees(want)
                continue
            for item, o in zip(batch, got):
                lp = torch.log_softmax(cpu.block_logits(ref.sessions[item.session_id], item.root_token), -1)
                depth = len(o.table.tokens)
                tok = torch.from_numpy(o.table.tokens.astype("int64"))
                err = (torch.from_numpy(o.table.logprobs) - lp[:depth].gather(1, tok)).abs().max()
                assert err < 0.25, (name, float(err))
                top2 = lp[:depth].topk(2, -1)
                sure = (top2.values[:, 0] - top2.values[:, 1]) > 0.5
                assert torch.equal(tok[:, 0][sure], top2.indices[:, 0][sure])

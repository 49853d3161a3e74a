"""Shared fixtures: the default model (SmolLM2-135M-Instruct Q4_1 GGUF), loaded once per run."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels are tested on CPU machines through Triton's interpreter; the variable must be set
# before any kernel module is imported (triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is present (CI runs on CPU)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def assert_bits_on_gpu(got: torch.Tensor, want: torch.Tensor, tol: float, msg: object = None) -> None:
    """A bit-exactness property of a compiled Triton kernel across shapes (rows of an M-row call vs
    a 1-row call, a tree node vs the width-1 step): bit for bit on a GPU; on the CPU within
    ``max|got - want| <= tol * max|want|``.

    On the CPU the kernels run in Triton's interpreter, where ``tl.dot`` is numpy's matmul on the
    host BLAS: its blocking, and so the float32 summation order of one row, depends on the CPU
    model and on the operands' shapes and positions, so exact equality there holds on some CPUs and
    not on others (a 64-row call's row 40 differed in the last bit from the 1-row call on an AMD
    EPYC). Exactness that holds by construction (integer ops, copies, elementwise ops in a fixed
    order, the same call repeated) is asserted with ``torch.equal`` everywhere instead."""
    if torch.cuda.is_available():
        assert torch.equal(got, want), msg
        return
    got, want = got.double().cpu(), want.double().cpu()
    err = float((got - want).abs().max()) if got.numel() else 0.0
    assert got.shape == want.shape and err <= tol * float(want.abs().max().clamp_min(1e-30)), (msg, err)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from runtime.defaults import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_model(smollm_path):
    from target_service.models.llama import LlamaModel

    return LlamaModel.from_gguf(smollm_path)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path):
    from runtime.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(smollm_path)


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """transformers' LlamaForCausalLM loaded from the same GGUF (the numerical oracle)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path), dtype=torch.float32
    )
    model.eval()
    return model


#: Prompts used by the lossless tests (token ids come from the GGUF tokenizer).
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Once upon a time, in a small village,",
    "import numpy as np\n\ndef softmax(x):",
    "Q: What is 12 times 7?\nA:",
    "The three primary colors are",
    "Write a haiku about the sea.",
    "class Stack:\n    def __init__(self):",
    "The quick brown fox",
    "In machine learning, overfitting means",
    "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is prime.\"\"\"",
    "Translate to French: Good morning, how are you?",
    "The speed of light is",
    "List three fruits:\n1.",
    "SELECT name FROM users WHERE",
    "My favourite book is",
    "for i in range(10):",
    "Photosynthesis is the process by which",
    "The year 2024 was",
    "<|im_start|>user\nWhat is the tallest mountain?<|im_end|>\n<|im_start|>assistant\n",
    "Dear Sir or Madam,",
    "x = [1, 2, 3]\ny = [a * 2 for a in x]\nprint(",
]

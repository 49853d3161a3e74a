"""Shared fixtures and helpers.

* The default model (SmolLM2-135M-Instruct Q4_1 GGUF), loaded once per run: ``smollm_*``, ``hf_smollm``.
* Tiny synthetic models (``fixtures.tiny_models``), written once per run: ``tiny_llama`` (the common
  target), ``tiny_drafter`` (a random drafter for it), ``tiny_llama_factory`` (other variants, each
  written once). The files are read-only for the tests.
* Services for tests: :func:`target_in_process`, :func:`draft_in_process`, :func:`orchestrator_in_process`
  (servicers behind a real gRPC server on a free loopback port, in this process) and
  :func:`module_service` (``python -m`` a service as a process, for ``client.launcher.ServiceGroup``).
* :func:`assert_bits_on_gpu` for bit-exactness across shapes of the Triton kernels.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

# Triton kernels are tested on CPU machines through Triton's interpreter; the variable must be set
# before any kernel module is imported (triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_helpers_once_per_launch() -> None:
    """Triton's interpreter (3.x) patches ``triton.language`` anew at every call of a
    ``@triton.jit`` helper inside a kernel (``InterpretedFunction.__call__`` -> ``_patch_lang``:
    five ``inspect.getmembers`` scans), and ``tl.sum`` / ``tl.max`` / ``tl.cumsum`` are such
    helpers: a quarter of an attention kernel's interpreted time. Within one launch nothing undoes
    those patches (a launch restores its own scope when it ends; a helper's is never restored), so
    patching the same helper again in the same launch changes nothing: here each helper is patched
    at its first call in each launch only. The kernels run the same code on the same values (the
    pool-attention cases give the same bits either way); 26% less CPU for them. Does nothing where
    the interpreter's internals differ."""
    try:
        from triton.runtime import interpreter as it
    except Exception:  # noqa: BLE001 - no (usable) Triton: nothing to speed up
        return
    if not all(hasattr(it, n) for n in ("_patch_lang", "GridExecutor", "_LangPatchScope", "InterpretedFunction")):
        return
    patch_lang, launch = it._patch_lang, it.GridExecutor.__call__
    patched: set = set()

    def patch_lang_once(fn):
        if fn in patched:
            return it._LangPatchScope()  # an empty scope: this launch already patched for fn
        patched.add(fn)
        return patch_lang(fn)

    def launch_afresh(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    it._patch_lang = patch_lang_once
    it.GridExecutor.__call__ = launch_afresh


def _skip_discarded_overflow_checks() -> None:
    """Triton's interpreter (3.x) runs every int32 ``+``/``-``/``*`` of a kernel a second time in
    int64 with two comparisons (``binary_op_sanitize_overflow_impl``: the option
    ``sanitize_overflow``, on by default) and hands the result to ``device_assert``, which does
    nothing unless the kernel runs with ``debug`` (``TRITON_DEBUG``; as compiled code, where the
    check is dead code without it): a fifth of a pool-attention kernel's interpreted time, all of
    it thrown away. Without ``debug`` the option is turned off here; every kernel computes the same
    values (nothing but the discarded check changes). Does nothing where the interpreter's
    internals differ."""
    import dataclasses

    try:
        from triton.runtime import interpreter as it
    except Exception:  # noqa: BLE001 - no (usable) Triton: nothing to speed up
        return
    builder_cls = getattr(it, "InterpreterBuilder", None)
    options = getattr(getattr(it, "interpreter_builder", None), "options", None)
    if builder_cls is None or not dataclasses.is_dataclass(options) or not {"debug", "sanitize_overflow"} <= {
            f.name for f in dataclasses.fields(options)}:
        return

    def quiet(builder):
        if not builder.options.debug:
            builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)

    init = builder_cls.__init__

    def init_quiet(self, *args, **kwargs):
        init(self, *args, **kwargs)
        quiet(self)

    builder_cls.__init__ = init_quiet
    quiet(it.interpreter_builder)


def _memoize_block_types() -> None:
    """Triton's interpreter (3.x) builds the type of every value anew at every op of a kernel:
    ``block_type(element_ty, shape)`` unwraps, validates and formats its shape, and ``tensor``
    turns its type's shape into a ``tl.tuple`` of ``constexpr`` whose ``tuple_type`` formats a
    name: a third of a pool-attention kernel's interpreted time. Both depend on the shape only
    (and the element type, which is kept as given), so here they are computed once per shape and
    reused: a ``block_type`` gets the same ``shape``, ``numel`` and ``name`` as before, a
    ``tensor`` the same ``numel`` and a new ``tl.tuple`` of the same ``constexpr`` values and
    ``tuple_type``. The interpreter computes the same values; error paths (a shape that is not a
    list or ``tl.tuple`` of ints, an invalid shape) run Triton's own code. Does nothing where the
    classes' attributes differ from those listed here."""
    import math

    try:
        import triton.language.core as core
        block = core.block_type(core.float32, [2, 4])
        value = core.tensor(None, block)
    except Exception:  # noqa: BLE001 - no (usable) Triton: nothing to speed up
        return
    if set(vars(block)) != {"element_ty", "shape", "numel", "name"} or set(vars(value)) != {
            "handle", "shape", "numel", "type", "dtype"}:
        return
    block_init, tuple_, constexpr = core.block_type.__init__, core.tuple, core.constexpr
    blocks: dict = {}
    shapes: dict = {}

    def block_type_init(self, element_ty, shape):
        key = None
        if isinstance(shape, (list, tuple_)):
            key = tuple(s.value if isinstance(s, constexpr) else s for s in shape)
            if not all(type(n) is int for n in key):   # anything but ints: Triton's own code decides
                key = None
            known = blocks.get(key) if key is not None else None
            if known is not None:
                self.element_ty = element_ty
                self.shape, self.numel, shape_name = known
                self.name = f"<{shape_name}, {element_ty}>"
                return
        block_init(self, element_ty, shape)
        if key is not None:
            blocks[key] = (self.shape, self.numel, str(self.shape))

    def tensor_init(self, handle, type):  # noqa: A002 - Triton's parameter name
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        shape = type.shape if type.is_block() else ()
        known = shapes.get(shape)
        if known is None:
            t = tuple_([constexpr(s) for s in shape])
            known = shapes[shape] = (constexpr(math.prod(shape)), t.values, t.type)
        self.numel = known[0]
        self.shape = tuple_(known[1], known[2])

    core.block_type.__init__ = block_type_init
    core.tensor.__init__ = tensor_init


def _memoize_np_dtypes() -> None:
    """Triton's interpreter (3.x) maps a Triton type to its numpy dtype (``_get_np_dtype``) by
    building a 19-entry dict of dtypes at every call, several times per op: an eighth of an
    interpreted kernel's time. Here the answer is kept per element type (what it depends on; a
    pointer, or a block of pointers, is uint64 as before) and Triton's function answers each one
    the first time (and raises as before for a type it does not know). Does nothing where the
    interpreter's internals differ."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except Exception:  # noqa: BLE001 - no (usable) Triton: nothing to speed up
        return
    get = getattr(it, "_get_np_dtype", None)
    if get is None or not hasattr(tl, "pointer_type") or not hasattr(tl, "block_type"):
        return
    uint64 = get(tl.pointer_type(tl.float32))
    known: dict = {}

    def np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):
            return uint64
        dtype = known.get(element)
        if dtype is None:
            dtype = known[element] = get(element)
        return dtype

    it._get_np_dtype = np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_helpers_once_per_launch()
    _skip_discarded_overflow_checks()
    _memoize_block_types()
    _memoize_np_dtypes()

# One torch CPU thread for the tests and (through the environment) the services they start as
# processes, unless OMP_NUM_THREADS says otherwise: the tests' ops are small, and on a 2-core box
# shared by the test process and its services, two threads per process oversubscribe the cores and
# make each small op 5-30x slower (a 16-token decode of the default model: 16 s with two threads,
# 2 s with one, at load 3 on 2 cores). Results do not depend on it: references are computed in
# the process (and thread count) that is compared with them, or compared within a tolerance.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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


@contextlib.contextmanager
def shared_gguf_reader():
    """While the block runs, ``gguf.GGUFReader(path)`` (what transformers' GGUF loading calls)
    returns one reader per file, runtime.gguf_loader's: the same fields and tensors as
    ``gguf.GGUFReader`` (tests/test_gguf_loader.py compares the two field by field), built in
    under a second instead of ~10 s for the default model's vocabulary, once instead of once per
    call (transformers parses a file twice: config, then weights). What transformers reads is
    unchanged; its tensors are gguf's own code. ``gguf.get_tensor_name_map(arch, n_blocks)``,
    which transformers calls again for every submodule of the model (a new ``TensorNameMap`` of
    every block each time: ~10 s of the default model's load), is memoized meanwhile: it is a
    pure function of its arguments, and transformers only looks names up in it."""
    import functools

    import gguf

    from runtime.gguf_loader import _Reader

    readers = {}

    def reader(path, *args, **kw):
        key = (os.path.realpath(path), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = _Reader(path, *args, **kw)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """transformers' LlamaForCausalLM loaded from the same GGUF (the numerical oracle)."""
    transformers = pytest.importorskip("transformers")

    with shared_gguf_reader():
        model = transformers.LlamaForCausalLM.from_pretrained(
            os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path), dtype=torch.float32
        )
    model.eval()
    return model


# ------------------------------------------------------------------------------ tiny models


@pytest.fixture(scope="session")
def tiny_llama_factory(tmp_path_factory):
    """``make(**kw)``: ``fixtures.tiny_models.write_tiny_llama(path, **kw)`` (a ``TinyLlama``),
    written once per distinct ``kw`` per run."""
    from fixtures.tiny_models import write_tiny_llama

    cache = {}

    def make(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "target.gguf", **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_factory):
    """The tiny llama target most tests use: ``write_tiny_llama`` defaults (vocab 300), seed 3."""
    return tiny_llama_factory(seed=3)


@pytest.fixture(scope="session")
def tiny_drafter(tiny_llama, tmp_path_factory) -> str:
    """Path of a random float32 drafter for :func:`tiny_llama`: block 8, 3 target layers, std 0.1
    (chains that are not all one token), seed 1."""
    from draft_service.init_random import write_random_drafter

    path = tmp_path_factory.mktemp("tiny-drafter") / "drafter.gguf"
    write_random_drafter(tiny_llama.path, path, block_size=8, num_target_layers=3, std=0.1, dtype="f32", seed=1)
    return str(path)


# ------------------------------------------------------------------------------ services


@contextlib.contextmanager
def target_in_process(model_path: str, *, max_sessions: int, max_context: int, max_workers: int = 4, tls=None,
                      name: str = "test-target", **server_kw):
    """The target service in this process, as ``python -m target_service`` builds it on the CPU
    (``build_engine``: the reference engine; a ``StepLoop``; ``TargetServicer``), served by
    ``make_server`` on a free loopback port (``tls``: a ``TlsConfig``; ``server_kw``: more of
    ``make_server``'s arguments, e.g. ``auth_token``). Yields the port."""
    from dflash_grpc.serving import make_server
    from dflash_grpc.v1 import target_pb2_grpc
    from runtime.step_loop import StepLoop
    from target_service.__main__ import build_engine
    from target_service.servicer import TargetServicer

    engine, info = build_engine(model_path, max_sessions=max_sessions, max_context=max_context)
    loop = StepLoop(engine, name=name)
    servicer = TargetServicer(loop, info)

    def add(server):
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        return ["dflash_grpc.v1.TargetService"]

    try:
        server, _, port = make_server(add, "127.0.0.1:0", max_workers=max_workers, tls=tls, **server_kw)
        try:
            yield port
        finally:
            server.stop(None)
    finally:
        loop.stop()


@contextlib.contextmanager
def draft_in_process(drafter_path: str, target_path: str, *, max_sessions: int, max_context: int, max_workers: int = 4,
                     **server_kw):
    """The draft service in this process (``DraftServiceServicer.from_paths``) behind ``make_server``
    on a free loopback port (``server_kw``: more of ``make_server``'s arguments, e.g.
    ``auth_token``). Yields ``(servicer, port)``; closes the servicer afterwards."""
    from dflash_grpc.serving import make_server
    from dflash_grpc.v1 import draft_pb2_grpc
    from draft_service.servicer import SERVICE_NAME, DraftServiceServicer

    servicer = DraftServiceServicer.from_paths(drafter_path, target_path, max_sessions=max_sessions, max_context=max_context)

    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    try:
        server, _, port = make_server(add, "127.0.0.1:0", max_workers=max_workers, **server_kw)
        try:
            yield servicer, port
        finally:
            server.stop(None)
    finally:
        servicer.close()


@contextlib.contextmanager
def orchestrator_in_process(model_path: str, target_port: int, draft_port: int | None = None, *, max_sessions: int,
                            max_queue: int = 64, max_tokens: int = 8, metadata=(), max_workers: int = 32,
                            server_kind: str = "threads", **scheduler_kw):
    """The orchestrator in this process, as ``python -m orchestrator`` builds it: ``TargetPeer`` and
    ``DraftPeer`` (their channels carry ``metadata``, e.g. the peers' token and the
    ``dflash-owner`` / ``dflash-owner-epoch`` pair; no other channel of the process does), a
    ``Scheduler`` (``max_sessions``, ``max_queue``, ``scheduler_kw``) and ``GenerationServicer``
    with the GGUF tokenizer of ``model_path``, served on a free loopback port by
    ``orchestrator.servicer.serve_generation`` (``server_kind``: its ``--grpc-server``). Yields
    ``(servicer, port)``; stops the scheduler (releasing what it holds) afterwards."""
    from dflash_grpc import serving
    from orchestrator.peers import DraftPeer, TargetPeer
    from orchestrator.scheduler import Scheduler
    from orchestrator.servicer import GenerationServicer, serve_generation
    from runtime.tokenizer import GGUFTokenizer

    before = serving.client_metadata()
    serving.add_client_metadata(metadata)   # the peers' channels take the metadata when they are made
    try:
        target = TargetPeer(f"127.0.0.1:{target_port}")
        draft = DraftPeer(f"127.0.0.1:{draft_port}" if draft_port else None)
    finally:
        serving.set_client_metadata(before)
    try:
        sched = Scheduler(target, draft, max_sessions=max_sessions, max_queue=max_queue, **scheduler_kw)
        try:
            servicer = GenerationServicer(target, draft, GGUFTokenizer.from_gguf(model_path), max_tokens, None, sched)
            server, _, port, close = serve_generation(servicer, "127.0.0.1:0", server_kind, max_streams=max_workers)
            try:
                yield servicer, port
            finally:
                server.stop(None).wait()
                close()
        finally:
            sched.stop()
    finally:
        draft.close()
        target.close()


def module_service(name: str, module: str, port: int, *args: str):
    """``python -m <module> --port <port> <args>`` as a ``client.launcher.Service`` answering on
    ``127.0.0.1:<port>`` (run it with ``ServiceGroup``)."""
    from client.launcher import Service

    return Service(name, [sys.executable, "-m", module, "--port", str(port), *args], f"127.0.0.1:{port}")


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

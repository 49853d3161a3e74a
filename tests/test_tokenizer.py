"""Tests of runtime.tokenizer.GGUFTokenizer.

References:

* transformers' GGUF tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) for ids,
  decoding and chat templates on the default model (SmolLM2-135M-Instruct Q4_1).
* For ``tokenizer.ggml.pre = "smollm"`` transformers and llama.cpp pre-tokenize differently:
  llama.cpp (``llama-vocab.cpp``: LLAMA_VOCAB_PRE_TYPE_SMOLLM) first isolates every ``\\p{N}``
  character, then applies the GPT-2 regex to each piece, exactly like the original SmolLM2
  ``tokenizer.json`` pre-tokenizer ``Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]``.
  transformers' GGUF loader has no entry for ``smollm`` and keeps GPT-2's ``ByteLevel`` regex
  alone. The SmolLM2 vocabulary has no multi-digit tokens, so plain ASCII numbers come out the
  same; they differ where whitespace precedes a numeral (``"count:  123"``, ``"\\n 1"``,
  ``"\\n\\n3"``) or a non-ASCII numeral follows a space (``" ½"``, ``" ①"``, ``" ٣"``). We follow
  llama.cpp / the original tokenizer: :func:`test_smollm_digit_split_differs_from_transformers`
  pins those inputs, and :func:`test_matches_original_smollm2_pretokenizer` checks that we equal
  the original pipeline everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.gguf_loader import GGUFError, GGUFFile, open_gguf, write_gguf
from runtime.tokenizer import PRE_TOKENIZER_TYPES, GGUFTokenizer, UnsupportedTokenizerError
from tests.conftest import shared_gguf_reader
from fixtures.tiny_models import bytes_to_unicode

# --------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------

#: Texts on which we, transformers' GGUF tokenizer and llama.cpp all agree.
CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's a fine day, isn't it? We'll see what they've "
    "done; I'd say you're right.",
    "SHOUTING AND MiXeD CaSe, O'Brien's don'T",
    "def fibonacci(n):\n\tif n < 2:\n\t\treturn n\n\treturn fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class Foo:\n    def __init__(self, x: int = 0) -> None:\n        self.x = x  # comment\n\n\n"
    "    def bar(self):\n        return {'a': [1, 2, 3]}\n",
    'for (int i = 0; i < 10; ++i) {\n    printf("%d\\n", i);\n}\r\n',
    "12345",
    "3.14159",
    "pi is 3.14159 and e is 2.71828; 1,000,000 items cost $12345.67 (≈ 1e6)",
    "year 2024, 10:30am, v1.2.3, 0x1F, 1st 2nd 3rd",
    "mixed 42 words 7 and 99 bottles",
    "x = [1,2,3]\ny = x[0]+x[-1]",
    "  indented 42",
    "Unicode: naïve café résumé Ångström Straße",
    "日本語のテキスト、中文测试，한국어 텍스트",
    "Emoji: 😀👍🏽🇺🇸 ❤️ 🚀",
    "Русский текст и Ελληνικά και العربية",
    "multiple   spaces    here",
    "trailing spaces   ",
    "   leading spaces",
    "tabs\tand\t\ttabs",
    "line1\nline2\n\nline4\r\nline5",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more<|im_start|>",
    "<|im_start|",
    "",
    " ",
    "\n",
    "a",
]

#: Texts where llama.cpp's 'smollm' pre-tokenizer (and ours) differ from transformers' GGUF
#: tokenizer, with our tokens (GGUF spelling). See the module docstring.
SMOLLM_DIGIT_CASES = {
    "count:  123": ["count", ":", "ĠĠ", "1", "2", "3"],  # transformers: "Ġ", "Ġ", "1", ...
    "values:\n 1\n 2": ["values", ":", "ĊĠ", "1", "ĊĠ", "2"],  # transformers: "Ċ", "Ġ", "1", ...
    "a\n\n3": ["a", "ĊĊ", "3"],  # transformers: "Ċ", "Ċ", "3"
    "price: ½ off": ["price", ":", "Ġ", "Â½", "Ġoff"],  # transformers: "ĠÂ", "½"
    "Arabic-Indic ٣٤٥ digits": ["Arabic", "-", "Ind", "ic", "Ġ", "Ù", "£", "Ù", "¤", "Ù", "¥", "Ġdigits"],
    "circled ① and roman Ⅻ": ["cir", "cled", "Ġ", "â", "ĳ", "ł", "Ġand", "Ġroman", "Ġ", "â", "ħ", "«"],
}

#: SmolLM2's vocabulary has no token for these bytes (its BPE was trained on a restricted
#: alphabet); llama.cpp and tokenizers both drop such characters, so they cannot round-trip.
SMOLLM_MISSING_CHARS = "\x04\x06\x13\x14\x16\x1d"

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the gold?"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?\nExplain."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with unicode: ½ café 😀"},
    ],
]


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(smollm_tokenizer) -> GGUFTokenizer:
    return smollm_tokenizer


@pytest.fixture(scope="module")
def hf_tok(smollm_path):
    """transformers' tokenizer built by its own conversion of the same GGUF's vocabulary and
    merges, read through ``shared_gguf_reader`` (gguf.GGUFReader's ~6 s parse is most of the
    load; tests/test_gguf_loader.py shows the fast reader reads this file's arrays exactly)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with shared_gguf_reader():
        return transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path)
        )


@pytest.fixture(scope="module")
def original_smollm2(tok):
    """The original SmolLM2 tokenizer.json pipeline: our vocabulary, merges and added tokens with
    pre-tokenizer ``Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
    trim_offsets=True, use_regex=True)]`` (HuggingFaceTB/SmolLM2-135M tokenizer.json)."""
    from tokenizers import Tokenizer, pre_tokenizers

    t = Tokenizer.from_str(tok.backend.to_str())
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return t


# --------------------------------------------------------------------------------------------
# SmolLM2: round trip and agreement with transformers
# --------------------------------------------------------------------------------------------


def test_build_is_fast(smollm_path):
    """Building the tokenizer from parsed metadata is quick (the GGUF indexing itself is the
    ``gguf`` package's, cached per process by ``open_gguf``)."""
    g = open_gguf(smollm_path)
    t0 = time.perf_counter()
    GGUFTokenizer.from_gguf(g)
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"building the 49k-token SmolLM2 tokenizer took {elapsed:.2f} s"


@pytest.mark.parametrize("text", CORPUS + list(SMOLLM_DIGIT_CASES))
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text,expected", list(SMOLLM_DIGIT_CASES.items()))
def test_smollm_digit_split_differs_from_transformers(tok, hf_tok, original_smollm2, text, expected):
    """llama.cpp's 'smollm' pre-tokenizer isolates \\p{N} first; transformers' GGUF loader does not.

    We pin llama.cpp's result, which is also the original SmolLM2 tokenizer's, and check that
    transformers' GGUF tokenizer really is different here (if it ever changes to agree, move the
    text to CORPUS).
    """
    ids = tok.encode(text)
    assert [tok.id_to_token(i) for i in ids] == expected
    assert ids == original_smollm2.encode(text, add_special_tokens=False).ids
    assert ids != hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_matches_original_smollm2_pretokenizer(tok, original_smollm2):
    texts = CORPUS + list(SMOLLM_DIGIT_CASES) + [
        "  \n123'S ¼",
        "\r\n²\n 1$ 456 ",
        "   456\t 7\u00a08\u30009",
        "e\u0301 \u0301 ₁₂ x²",
    ]
    for text in texts:
        assert tok.encode(text) == original_smollm2.encode(text, add_special_tokens=False).ids, text


#: UTF-8 lead bytes SmolLM2 has no token for: besides the 6 control characters above, 0xF1 and
#: 0xF2 (code points U+40000..U+BFFFF) and bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5..0xFF).
SMOLLM_MISSING_BYTES = frozenset(b"\x04\x06\x13\x14\x16\x1d\xc0\xc1\xf1\xf2\xf5\xf6\xf7\xf8\xf9\xfa\xfb\xfc\xfd\xfe\xff")

_SAFE_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)).filter(
        lambda c: not SMOLLM_MISSING_BYTES.intersection(c.encode("utf-8"))
    ),
    max_size=40,
)
_PIECES = st.sampled_from(
    ["hello", " World", "123", " 4", "  ", "\n", "\t", "3.14", " ½", "①", "'s", "'LL", "é", "日本", "😀",
     "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\r\n", "!!", "e\u0301", "\u00a0", "٣"]
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(_SAFE_TEXT, st.lists(_PIECES, max_size=8).map("".join)))
def test_property_round_trip_and_original_pipeline(tok, original_smollm2, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == original_smollm2.encode(text, add_special_tokens=False).ids


def test_missing_byte_tokens_are_dropped(tok):
    """Like llama.cpp, a byte that has no token is dropped (SmolLM2 lacks 21 byte tokens)."""
    from tokenizers.pre_tokenizers import ByteLevel

    missing = {ord(c) for c in ByteLevel.alphabet() if tok.token_to_id(c) is None}
    table = {v: k for k, v in bytes_to_unicode().items()}
    assert {table[chr(c)] for c in missing} == SMOLLM_MISSING_BYTES
    assert tok.decode(tok.encode("a\x1db")) == "ab"
    for ch in SMOLLM_MISSING_CHARS:
        assert tok.encode(ch) == []
    assert tok.decode(tok.encode("x\U00040000y")) == "x" + "\ufffd" * 3 + "y"  # lead byte 0xF1 dropped


# --------------------------------------------------------------------------------------------
# SmolLM2: special tokens, ids, properties
# --------------------------------------------------------------------------------------------


def test_special_tokens_are_single_ids(tok, smollm_path):
    meta = open_gguf(smollm_path).metadata
    control = [i for i, t in enumerate(meta["tokenizer.ggml.token_type"]) if t == 3]
    assert len(control) == 17
    for i in control:
        text = tok.id_to_token(i)
        assert tok.encode(text) == [i]
        assert tok.encode(f"a {text}b") == tok.encode("a ") + [i] + tok.encode("b")
        assert tok.is_special(i)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.decode([1, 4093, 198, 6004, 2], skip_special_tokens=True) == "user\nhi"


def test_smollm2_ids_and_properties(tok):
    assert tok.vocab_size == 49152
    assert tok.model_type == "gpt2" and tok.pre_type == "smollm"
    assert tok.bos_token_id == 1 and tok.id_to_token(1) == "<|im_start|>"
    assert tok.eos_token_id == 2 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.pad_token_id == 2
    assert tok.unk_token_id == 0
    # eos only: SmolLM2 has no eot/eom id, and <|endoftext|> (0) is neither its eos nor eot.
    assert tok.eos_token_ids == frozenset({2})
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.token_to_id("Ġworld") == 905
    assert tok.token_to_id("no such token") is None
    assert not tok.add_bos_token and not tok.add_eos_token
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # add_bos_token = False
    with pytest.raises(IndexError):
        tok.id_to_token(49152)
    with pytest.raises(ValueError):
        tok.decode([5, 49152])
    with pytest.raises(ValueError):
        tok.decode([-1])


def test_encode_batch(tok):
    assert tok.encode_batch(CORPUS[:5]) == [tok.encode(t) for t in CORPUS[:5]]


def test_fingerprint_of_smollm2(tok, smollm_path):
    assert len(tok.fingerprint) == 64 and int(tok.fingerprint, 16) >= 0
    assert GGUFTokenizer.from_gguf(smollm_path).fingerprint == tok.fingerprint


# --------------------------------------------------------------------------------------------
# Chat template
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok, hf_tok, messages):
    for add_generation_prompt in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours == theirs
    assert tok.chat_template == hf_tok.chat_template


def test_chat_template_default_system_prompt(tok):
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(out)
    assert ids[0] == 1 and ids[-1] == 198 and tok.decode(ids) == out


# --------------------------------------------------------------------------------------------
# Synthetic GGUF tokenizers (tiny byte-level BPE vocabularies)
# --------------------------------------------------------------------------------------------


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2", "12 3", "Ġ Ġ"]
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_metadata(pre: str = "smollm", merges=MERGES, **overrides):
    """``tokenizer.ggml.*`` metadata of a tiny byte-level BPE vocabulary: specials (control),
    the 256 byte characters, one token per merge, and a user-defined ``<think>``."""
    tokens = list(SPECIALS) + list(bytes_to_unicode().values())
    types = [3] * len(SPECIALS) + [1] * 256
    for m in merges:
        a, b = m.split(" ")
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(1)
    tokens.append("<think>")
    types.append(4)
    md = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TEMPLATE,
    }
    md.update(overrides)
    return {k: v for k, v in md.items() if v is not None}


def write_tiny(path, **kw) -> str:
    md = tiny_metadata(**kw)
    write_gguf(path, "llama", {k: v for k, v in md.items() if k != "general.architecture"}, {})
    return os.fspath(path)


def test_tiny_vocab_encodes_with_merges():
    tok = GGUFTokenizer(tiny_metadata())
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["hello", "Ġworld"]
    assert tok.decode(ids) == "hello world"
    # smollm isolates digits, so the "1 2" / "12 3" merges never fire
    assert [tok.id_to_token(i) for i in tok.encode("123")] == ["1", "2", "3"]
    assert [tok.id_to_token(i) for i in GGUFTokenizer(tiny_metadata(pre="gpt-2")).encode("123")] == ["123"]


def test_user_defined_and_control_tokens():
    tok = GGUFTokenizer(tiny_metadata())
    think = tok.token_to_id("<think>")
    ids = tok.encode("<|im_start|>hello<think>world<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and think in ids
    assert tok.decode(ids) == "<|im_start|>hello<think>world<|im_end|>"
    # control tokens are special (skipped), user-defined ones are not (llama.cpp semantics)
    assert tok.decode(ids, skip_special_tokens=True) == "hello<think>world"
    assert not tok.is_special(think) and tok.is_special(1)


def test_add_bos_and_eos_flags():
    tok = GGUFTokenizer(tiny_metadata(**{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}))
    assert tok.encode("hello", add_special_tokens=True) == [1] + tok.encode("hello") + [2]
    assert tok.encode("hello", add_special_tokens=False) == tok.encode("hello")
    # key absent: llama.cpp's default per pre type (true for llama-bpe, false for smollm)
    assert GGUFTokenizer(tiny_metadata(pre="llama-bpe", **{"tokenizer.ggml.add_bos_token": None})).add_bos_token
    assert not GGUFTokenizer(tiny_metadata(**{"tokenizer.ggml.add_bos_token": None})).add_bos_token


def test_eos_token_ids_include_eot_and_eom():
    assert GGUFTokenizer(tiny_metadata()).eos_token_ids == frozenset({2})
    tok = GGUFTokenizer(tiny_metadata(**{"tokenizer.ggml.eot_token_id": 3, "tokenizer.ggml.eom_token_id": 0}))
    assert tok.eos_token_ids == frozenset({0, 2, 3})
    assert tok.eot_token_id == 3
    no_eos = GGUFTokenizer(tiny_metadata(**{"tokenizer.ggml.eos_token_id": None}))
    assert no_eos.eos_token_id is None and no_eos.eos_token_ids == frozenset()


def test_from_gguf_file_and_path_agree(tmp_path):
    p = write_tiny(tmp_path / "t.gguf")
    a = GGUFTokenizer.from_gguf(p)
    b = GGUFTokenizer.from_gguf(GGUFFile(p))
    text = "hello world <|im_end|> 123 <think>"
    assert a.encode(text) == b.encode(text)
    assert a.fingerprint == b.fingerprint


def test_fingerprint_matches_target_service_fingerprint(tmp_path):
    from runtime.fingerprint import tokenizer_fingerprint

    p = write_tiny(tmp_path / "t.gguf")
    assert GGUFTokenizer.from_gguf(p).fingerprint == tokenizer_fingerprint(GGUFFile(p))


def test_fingerprint_stable_across_processes(tmp_path):
    p = write_tiny(tmp_path / "t.gguf")
    code = "import sys; from runtime.tokenizer import GGUFTokenizer; print(GGUFTokenizer.from_gguf(sys.argv[1]).fingerprint)"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, p], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == GGUFTokenizer.from_gguf(p).fingerprint


def test_fingerprint_changes_with_definition(tmp_path):
    base = GGUFTokenizer.from_gguf(write_tiny(tmp_path / "a.gguf")).fingerprint
    assert GGUFTokenizer.from_gguf(write_tiny(tmp_path / "b.gguf")).fingerprint == base
    # same tokens, merges in a different order (a different tokenizer: ranks change)
    swapped = [MERGES[1], MERGES[0]] + MERGES[2:]
    assert GGUFTokenizer.from_gguf(write_tiny(tmp_path / "c.gguf", merges=swapped)).fingerprint != base
    # one merge fewer
    assert GGUFTokenizer.from_gguf(write_tiny(tmp_path / "d.gguf", merges=MERGES[:-1])).fingerprint != base
    md = tiny_metadata()
    variants = [
        {"tokenizer.ggml.pre": "gpt-2"},
        {"tokenizer.ggml.eos_token_id": 3},
        {"tokenizer.ggml.bos_token_id": 2},
        {"tokenizer.ggml.eot_token_id": 3},
        {"tokenizer.ggml.tokens": md["tokenizer.ggml.tokens"][:-1] + ["<thinking>"]},
        {"tokenizer.ggml.token_type": md["tokenizer.ggml.token_type"][:-1] + [3]},
    ]
    fps = {GGUFTokenizer({**md, **v}).fingerprint for v in variants}
    assert base not in fps and len(fps) == len(variants)


def test_chat_template_rendering():
    tok = GGUFTokenizer(tiny_metadata())
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    with pytest.raises(ValueError, match="no chat template"):
        GGUFTokenizer(tiny_metadata(**{"tokenizer.chat_template": None})).apply_chat_template(msgs)


def test_chat_template_environment():
    import jinja2

    tpl = (
        "{{ bos_token }}|{{ eos_token }}|{{ messages[0] | tojson }}|{{ flag }}"
        "{% generation %}G{% endgeneration %}{% for m in messages %}{% break %}{% endfor %}"
        "{% if messages | length > 1 %}{{ raise_exception('too many') }}{% endif %}"
        "|{{ strftime_now('%Y') | length }}"
    )
    tok = GGUFTokenizer(tiny_metadata(**{"tokenizer.chat_template": tpl}))
    out = tok.apply_chat_template([{"role": "user", "content": "<b>&é"}], flag=7)
    # transformers' tojson: no HTML escaping, non-ASCII kept
    assert out == '<|im_start|>|<|im_end|>|{"role": "user", "content": "<b>&é"}|7G|4'
    with pytest.raises(jinja2.TemplateError, match="too many"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    # sandboxed: no access to Python internals
    bad = GGUFTokenizer(tiny_metadata(**{"tokenizer.chat_template": "{{ messages.__class__.__mro__ }}"}))
    with pytest.raises(jinja2.exceptions.SecurityError):
        bad.apply_chat_template([{"role": "user", "content": "x"}])


# --------------------------------------------------------------------------------------------
# Pre-tokenizer types (llama.cpp llama-vocab.cpp regexes)
# --------------------------------------------------------------------------------------------


def _bl(text: str) -> str:
    """GPT-2 byte-level spelling of ``text``."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _pieces(pre: str, text: str) -> list[str]:
    tok = GGUFTokenizer(tiny_metadata(pre=pre))
    return [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    "pre,text,expected",
    [
        ("smollm", "a  12", ["a", "ĠĠ", "1", "2"]),
        ("starcoder", "x=12;", ["x", "=", "1", "2", ";"]),
        ("gpt-2", "a  12 it's", ["a", "Ġ", "Ġ12", "Ġit", "'s"]),
        ("default", "12345+=x", ["123", "45", "+=", "x"]),  # punctuation runs, then 3-digit groups
        ("llama-bpe", "12345 IT'S\n\n x", ["123", "45", "ĠIT", "'S", "ĊĊ", "Ġx"]),
        ("qwen2", "12345 it's", ["1", "2", "3", "4", "5", "Ġit", "'s"]),
        # qwen35 keeps combining marks (\p{M}) in words, qwen2 splits them off
        ("qwen35", "cafe\u0301 12", [_bl("cafe\u0301"), "Ġ", "1", "2"]),
        ("qwen2", "cafe\u0301 12", ["cafe", _bl("\u0301"), "Ġ", "1", "2"]),
        ("gpt-4o", "HelloWorld 12345", ["Hello", "World", "Ġ", "123", "45"]),
    ],
)
def test_pre_tokenizer_splits(pre, text, expected):
    assert _pieces(pre, text) == expected


def test_pre_tokenizers_match_transformers_regexes():
    """Our llama.cpp-derived regexes split like transformers' (tokenizer.json) regexes for the
    pre types transformers' GGUF loader knows (only the case-insensitive contraction group is
    written differently: llama.cpp's ``'[sS]`` for ``(?i:'s)``)."""
    pytest.importorskip("transformers")
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf import gguf_tokenizer_mapping as m

    text = (
        "Hello World! It's 12345 THE'LL don'T\n\n  x\r\n\t y  \u00a0z ½ ① e\u0301 \u0301 ÉCOLE HelloWorld "
        "//comment\n    return a+b; 日本語 😀 ٣٤ Straße"
    )
    for pre in ["qwen2", "qwen35", "llama-bpe", "gpt-4o", "tekken"]:
        ref = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(m.GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        assert _pieces(pre, text) == [p for p, _ in ref.pre_tokenize_str(text)], pre


def test_supported_pre_types_build():
    for pre in sorted(PRE_TOKENIZER_TYPES):
        tok = GGUFTokenizer(tiny_metadata(pre=pre))
        text = "hello world 12345 <|im_end|> ½"
        assert tok.decode(tok.encode(text)) == text, pre
    assert {"default", "gpt-2", "smollm", "llama-bpe", "llama3", "qwen2", "qwen35", "starcoder", "gpt-4o"} <= PRE_TOKENIZER_TYPES


def test_missing_pre_is_default():
    assert GGUFTokenizer(tiny_metadata(**{"tokenizer.ggml.pre": None})).pre_type == "default"


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_unsupported_and_malformed(tmp_path):
    with pytest.raises(UnsupportedTokenizerError, match="llama"):
        GGUFTokenizer(tiny_metadata(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(UnsupportedTokenizerError, match="pre-tokenizer"):
        GGUFTokenizer(tiny_metadata(pre="no-such-pre"))
    with pytest.raises(GGUFError, match="tokenizer.ggml.model"):
        GGUFTokenizer({"tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(GGUFError, match="tokens"):
        GGUFTokenizer(tiny_metadata(**{"tokenizer.ggml.tokens": None}))
    with pytest.raises(GGUFError, match="merges"):
        GGUFTokenizer(tiny_metadata(**{"tokenizer.ggml.merges": None}))
    md = tiny_metadata()
    dup = md["tokenizer.ggml.tokens"][:-1] + ["he"]
    with pytest.raises(GGUFError, match="duplicate"):
        GGUFTokenizer({**md, "tokenizer.ggml.tokens": dup})
    with pytest.raises(GGUFError, match="outside"):
        GGUFTokenizer({**md, "tokenizer.ggml.eos_token_id": 10**6})
    with pytest.raises(FileNotFoundError):
        GGUFTokenizer.from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError):
        GGUFTokenizer.from_gguf(tmp_path / "junk.gguf")
    # isa ValueError, so callers can catch one type
    assert issubclass(UnsupportedTokenizerError, ValueError)


def test_export_tokenizer_writes_a_hf_tokenizer_that_encodes_the_same(tmp_path):
    """tools/export_tokenizer.py: the GGUF tokenizer as a Hugging Face tokenizer directory (what
    aiperf's --tokenizer reads offline): transformers loads it and encodes as the services do."""
    import importlib.util
    import pathlib

    from transformers import AutoTokenizer

    from runtime.defaults import default_model_path
    from runtime.tokenizer import GGUFTokenizer

    spec = importlib.util.spec_from_file_location(
        "export_tokenizer", pathlib.Path(__file__).resolve().parents[1] / "tools" / "export_tokenizer.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([str(tmp_path)]) == 0
    ours, hf = GGUFTokenizer.from_gguf(default_model_path()), AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("def fibonacci(n):\n    return n", "<|im_start|>user\nHi!<|im_end|>", "  spaces\tand tabs "):
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf.eos_token == ours.id_to_token(ours.eos_token_id)

"""Tokenizer built from a GGUF file's ``tokenizer.ggml.*`` metadata with HF ``tokenizers``.

A GGUF file carries no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``),
the token types (``tokenizer.ggml.token_type``), the BPE merges (``tokenizer.ggml.merges``), the
special token ids and a pre-tokenizer *name* (``tokenizer.ggml.pre``). llama.cpp
(``src/llama-vocab.cpp``, ``llm_tokenizer_bpe``) maps that name to a list of regexes that cut the
text into words before the merges run; each regex splits every piece left by the previous one,
keeping both the matches and the text between them. :class:`GGUFTokenizer` rebuilds exactly that
with the ``tokenizers`` library:

* model: ``tokenizers.models.BPE`` over the GGUF vocabulary and merges (``ignore_merges`` for the
  pre-tokenizer types llama.cpp sets it for, e.g. ``llama-bpe``);
* pre-tokenizer: one ``Split(regex, behavior="isolated")`` per llama.cpp regex, then
  ``ByteLevel(use_regex=False)`` (GPT-2 byte-to-unicode mapping);
* decoder: ``decoders.ByteLevel``;
* control (type 3), user-defined (type 4) and unknown (type 2) tokens are added tokens matched
  whole in the raw text, as llama.cpp's ``tokenizer_st_partition`` does (control and unknown ones
  are *special*: ``decode(..., skip_special_tokens=True)`` drops them).

Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) is supported. SentencePiece vocabularies
(``"llama"``) and the others raise :class:`UnsupportedTokenizerError`.

Differences from ``transformers``' GGUF tokenizer (``transformers.integrations.gguf``): it
leaves the GPT-2 pre-tokenizer in place for pre types it does not list (``smollm``,
``starcoder``, ``default``, ...), so it does not isolate digits first for ``smollm``/``starcoder``
as llama.cpp and the original SmolLM2 ``tokenizer.json`` (``Digits(individual_digits=True)``) do.
We follow llama.cpp. See ``tests/test_tokenizer.py`` for the inputs on which this shows.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import threading
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from runtime.gguf_loader import GGUFError, GGUFFile, open_gguf

__all__ = ["GGUFTokenizer", "UnsupportedTokenizerError", "PRE_TOKENIZER_TYPES"]

# llama.cpp token types (gguf.TokenType / llama_token_type)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5


class UnsupportedTokenizerError(GGUFError):
    """The GGUF file describes a tokenizer model or pre-tokenizer type this module does not build."""


# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe constructor and
# llama_vocab::impl::load). llama.cpp rewrites the case-insensitive contraction group
# ``(?i:'s|'t|...)`` of the original tokenizer.json regexes as ``'[sS]|'[tT]|...``; we use its
# form. Oniguruma (used by ``tokenizers``) supports every construct below.
# ---------------------------------------------------------------------------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

#: GPT-2: llama.cpp LLAMA_VOCAB_PRE_TYPE_GPT2 (its custom splitter also ends in ``|\s+``, which
#: an "isolated" split does anyway for unmatched whitespace).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

#: LLAMA_VOCAB_PRE_TYPE_LLAMA3 (also DBRX, SMAUG, CHATGLM4)
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: LLAMA_VOCAB_PRE_TYPE_QWEN2 (also STABLELM2, HUNYUAN, SOLAR_OPEN)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

#: LLAMA_VOCAB_PRE_TYPE_QWEN35: like qwen2, but combining marks (\p{M}) stay in words.
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: LLAMA_VOCAB_PRE_TYPE_GPT4O. llama.cpp's std::regex cannot use Unicode sub-categories, so it
#: approximates ``[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`` with "a letter that is not a-z" and drops the
#: combining marks. Oniguruma can run the original tokenizer.json regex (the one in llama.cpp's
#: comment, and the one the model was trained with), so we use that one.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: LLAMA_VOCAB_PRE_TYPE_TEKKEN (original tokenizer.json regex, same reason as GPT-4o).
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM (also HUNYUAN_DENSE, JOYAI_LLM)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclasses.dataclass(frozen=True)
class _PreSpec:
    """One llama.cpp pre-tokenizer type: its regexes (applied in order) and flags."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # llama.cpp ``ignore_merges``: a word found whole in the vocab is one token
    add_bos: bool = False  # llama.cpp's default when ``tokenizer.ggml.add_bos_token`` is absent


def _table() -> dict[str, _PreSpec]:
    t: dict[str, _PreSpec] = {}

    def put(names: Iterable[str], spec: _PreSpec) -> None:
        for n in names:
            t[n] = spec

    # LLAMA_VOCAB_PRE_TYPE_DEFAULT: also used when tokenizer.ggml.pre is absent.
    put(["default"], _PreSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")))
    put(
        ["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
         "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling", "jina-v1-en",
         "jina-v2-code", "roberta-bpe"],
        _PreSpec((_GPT2,)),
    )
    # STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2: digits isolated first.
    put(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"],
        _PreSpec((r"\p{N}", _GPT2)),
    )
    put(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
        _PreSpec((_LLAMA3,), ignore_merges=True, add_bos=True),
    )
    put(["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], _PreSpec((_LLAMA3,)))
    put(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"],
        _PreSpec((_QWEN2,)),
    )
    put(["qwen35"], _PreSpec((_QWEN35,)))
    put(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _PreSpec((_GPT4O,)))
    put(["tekken"], _PreSpec((_TEKKEN,), ignore_merges=True, add_bos=True))
    put(
        ["falcon"],
        _PreSpec((r"[\p{P}\$\+<=>\^~\|`]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                  r"[0-9][0-9][0-9]")),
    )
    put(["deepseek-coder"], _PreSpec((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")))
    put(["deepseek-v3", "hunyuan-dense", "joyai-llm"], _PreSpec(_DEEPSEEK3))
    return t


_PRE_SPECS = _table()

#: ``tokenizer.ggml.pre`` values this module supports (llama.cpp names).
PRE_TOKENIZER_TYPES: frozenset[str] = frozenset(_PRE_SPECS)


class _MetadataView:
    """The ``get`` interface of :class:`GGUFFile` over a plain metadata dict."""

    def __init__(self, metadata: Mapping[str, Any]):
        self.metadata = metadata
        self.architecture = metadata.get("general.architecture", "")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key.replace("{arch}", self.architecture), default)


# ---------------------------------------------------------------------------------------------
# Chat templates, rendered like transformers.utils.chat_template_utils
# ---------------------------------------------------------------------------------------------


def _compile_chat_template(source: str):
    import json

    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: no HTML escaping, json.dumps options exposed
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


class GGUFTokenizer:
    r"""Byte-level BPE tokenizer of a GGUF model, equivalent to llama.cpp's (``llama-vocab.cpp``).

    Build it with :meth:`from_gguf`. Rules, all from llama.cpp ``src/llama-vocab.cpp``:

    * pre-tokenizer: the regex list of ``tokenizer.ggml.pre`` (``llm_tokenizer_bpe``), each regex
      splitting the pieces of the previous one, matches and gaps kept. E.g. ``"smollm"`` and
      ``"starcoder"``: ``\p{N}`` then the GPT-2 regex; ``"llama-bpe"``/``"llama3"``: the Llama 3
      regex (digits in groups of 3) with ``ignore_merges``; ``"qwen2"``: single digits, letters
      with an optional leading non-letter; ``"qwen35"``: like qwen2, combining marks kept in
      words; ``"gpt-2"``: the GPT-2 regex; ``"default"`` (or no key): punctuation runs, GPT-2
      regex, ``\p{N}+``, 3-digit groups. See :data:`PRE_TOKENIZER_TYPES`.
    * merges: ``tokenizer.ggml.merges`` in rank order, split at the first space after position 0.
    * special tokens: control (3) and unknown (2) types are special, user-defined (4) are not;
      all are matched whole in the input before pre-tokenization, as llama.cpp does with
      ``parse_special=true``: ``"<|im_start|>"`` in the text becomes that one token.
    * a byte without a token in the vocabulary is dropped (llama.cpp's BPE does the same).

    Attributes:
        model_type: ``tokenizer.ggml.model`` (always ``"gpt2"`` here).
        pre_type: ``tokenizer.ggml.pre`` (``"default"`` when absent, as in llama.cpp).
        add_bos_token / add_eos_token: whether ``encode(..., add_special_tokens=True)`` adds them.
    """

    def __init__(self, metadata: Mapping[str, Any], *, source: str = "<metadata>"):
        """Build from a GGUF metadata mapping (``tokenizer.ggml.*`` keys); prefer :meth:`from_gguf`.

        Args:
            metadata: key -> value, as :attr:`GGUFFile.metadata`.
            source: name used in error messages.

        Raises:
            GGUFError: a required key is missing or the vocabulary is malformed (duplicate tokens,
                special token id out of range).
            UnsupportedTokenizerError: ``tokenizer.ggml.model`` is not ``"gpt2"``, or
                ``tokenizer.ggml.pre`` is not in :data:`PRE_TOKENIZER_TYPES`.
        """
        md = metadata
        model_type = md.get("tokenizer.ggml.model")
        if model_type is None:
            raise GGUFError(f"{source}: missing metadata key 'tokenizer.ggml.model'")
        if model_type != "gpt2":
            raise UnsupportedTokenizerError(
                f"{source}: tokenizer.ggml.model={model_type!r} is not supported; only 'gpt2' (byte-level BPE) "
                "is (SentencePiece 'llama', 'bert', 't5', ... vocabularies are not)"
            )
        pre_type = md.get("tokenizer.ggml.pre") or "default"
        spec = _PRE_SPECS.get(pre_type)
        if spec is None:
            raise UnsupportedTokenizerError(
                f"{source}: unknown pre-tokenizer type tokenizer.ggml.pre={pre_type!r}; supported: "
                f"{sorted(PRE_TOKENIZER_TYPES)}"
            )
        tokens = md.get("tokenizer.ggml.tokens")
        merges = md.get("tokenizer.ggml.merges")
        if not tokens:
            raise GGUFError(f"{source}: missing metadata key 'tokenizer.ggml.tokens'")
        if merges is None:
            raise GGUFError(f"{source}: missing metadata key 'tokenizer.ggml.merges'")
        n = len(tokens)
        token_types = md.get("tokenizer.ggml.token_type")
        if token_types is None:
            token_types = [TOKEN_TYPE_NORMAL] * n
        elif len(token_types) < n:
            raise GGUFError(f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {n} tokens")

        self.model_type: str = model_type
        self.pre_type: str = pre_type
        self._source = source

        # llama.cpp: empty tokens become "[EMPTY_<id>]", duplicates are an error.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if t in seen:
                    raise GGUFError(f"{source}: duplicate token in vocabulary: {t!r} has ids {seen[t]} and {i}")
                seen[t] = i
        self._tokens: list[str] = tokens
        self._vocab = vocab
        self._token_types: list[int] = [int(x) for x in token_types[:n]]

        def special_id(key: str) -> int | None:
            v = _opt_int(md.get(f"tokenizer.ggml.{key}"))
            if v is not None and not 0 <= v < n:
                raise GGUFError(f"{source}: tokenizer.ggml.{key}={v} is outside the vocabulary (size {n})")
            return v

        self._bos = special_id("bos_token_id")
        self._eos = special_id("eos_token_id")
        self._eot = special_id("eot_token_id")
        self._eom = special_id("eom_token_id")
        self._unk = special_id("unknown_token_id")
        self._pad = special_id("padding_token_id")
        add_bos = md.get("tokenizer.ggml.add_bos_token")
        self.add_bos_token: bool = spec.add_bos if add_bos is None else bool(add_bos)
        self.add_eos_token: bool = bool(md.get("tokenizer.ggml.add_eos_token", False))
        if self.add_bos_token and self._bos is None:
            raise GGUFError(f"{source}: add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        if self.add_eos_token and self._eos is None:
            raise GGUFError(f"{source}: add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")
        self._chat_template: str | None = md.get("tokenizer.chat_template")
        self._compiled_template = None

        # BPE merges: llama.cpp splits each entry at its first space after position 0. Merges whose
        # parts or result are not in the vocabulary can never fire in llama.cpp; tokenizers would
        # reject them, so they are dropped.
        pairs: list[tuple[str, str]] = []
        for m in merges:
            p = m.find(" ", 1)
            if p < 0:
                continue
            a, b = m[:p], m[p + 1:]
            if a in vocab and b in vocab and a + b in vocab:
                pairs.append((a, b))

        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=spec.ignore_merges)
        tk = Tokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tk.decoder = decoders.ByteLevel()
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, self._token_types)
            if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, self._token_types)
            if ty == TOKEN_TYPE_USER_DEFINED
        ]
        if special:
            tk.add_special_tokens(special)
        if user:
            tk.add_tokens(user)
        if tk.get_vocab_size(with_added_tokens=True) != n:  # pragma: no cover - defensive
            raise GGUFError(f"{source}: added tokens changed the vocabulary size")
        self._tk = tk
        # built on first use: a copy of ``tk`` that encodes special-token text as plain text, and
        # the regex that finds special-token text (:meth:`encode` with ``parse_special=False``,
        # :meth:`encode_chat`)
        self._tk_plain: Tokenizer | None = None
        self._special_re: re.Pattern[str] | None = None
        self._lazy_lock = threading.Lock()

        from runtime.fingerprint import tokenizer_fingerprint

        self._fingerprint: str = tokenizer_fingerprint(_MetadataView(md))

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf: GGUFFile | str | os.PathLike[str]) -> "GGUFTokenizer":
        """Build the tokenizer of a GGUF model.

        Args:
            gguf: an open :class:`GGUFFile`, or a path (opened with :func:`open_gguf`, cached).

        Returns:
            The tokenizer.

        Raises:
            FileNotFoundError: the path does not exist.
            GGUFError: missing or malformed ``tokenizer.ggml.*`` keys.
            UnsupportedTokenizerError: a tokenizer model or pre-tokenizer type not supported.
        """
        if isinstance(gguf, GGUFFile):
            return cls(gguf.metadata, source=gguf.path)
        path = os.fspath(gguf)
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        return cls(open_gguf(path).metadata, source=path)

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize(..., parse_special)``.

        Args:
            text: the text.
            add_special_tokens: prepend BOS if ``tokenizer.ggml.add_bos_token`` is true (and append
                EOS if ``tokenizer.ggml.add_eos_token`` is true).
            parse_special: True (the default): special-token text in ``text`` (``"<|im_end|>"``)
                becomes that one control token. False: it is tokenized as the plain text it is
                (``"<"``, ``"|"``, ``"im"``, ...), so no control (or unknown-type) token comes from
                ``text``; user-defined tokens are still matched whole, as llama.cpp does with
                ``parse_special=false``. Use False for text from a user that must stay text.

        Returns:
            The ids.
        """
        backend = self._tk if parse_special else self._plain_backend()
        ids = backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos_token:
                ids.insert(0, self._bos)
            if self.add_eos_token:
                ids.append(self._eos)
        return ids

    def _plain_backend(self) -> Tokenizer:
        """A copy of the backend whose special (control, unknown) added tokens are not matched
        (``encode_special_tokens``): their text goes through the pre-tokenizer and BPE."""
        if self._tk_plain is None:
            with self._lazy_lock:
                if self._tk_plain is None:
                    plain = Tokenizer.from_str(self._tk.to_str())
                    plain.encode_special_tokens = True
                    self._tk_plain = plain
        return self._tk_plain

    def _special_pattern(self) -> re.Pattern[str] | None:
        """Regex matching the text of any special (control, unknown) token, leftmost-longest as the
        backend's added-token split; None when the vocabulary has none."""
        if self._special_re is None:
            specials = sorted({t for i, t in enumerate(self._tokens) if self.is_special(i)}, key=len, reverse=True)
            if not specials:
                return None
            with self._lazy_lock:
                self._special_re = re.compile("|".join(re.escape(t) for t in specials))
        return self._special_re

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """:meth:`encode` of each text (in parallel in ``tokenizers``' thread pool)."""
        out = [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]
        if add_special_tokens:
            for ids in out:
                if self.add_bos_token:
                    ids.insert(0, self._bos)
                if self.add_eos_token:
                    ids.append(self._eos)
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids (byte-level decoded; invalid UTF-8 becomes U+FFFD).

        Args:
            ids: token ids.
            skip_special_tokens: drop control (and unknown-type) tokens such as ``<|im_end|>``.
                User-defined tokens are always kept, as in llama.cpp.

        Returns:
            The text, without clean-up of tokenization spaces (llama.cpp's ``clean_spaces``), so
            ``decode(encode(x)) == x`` for any ``x`` whose bytes all have tokens.

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``.
        """
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= len(self._tokens)):
            bad = next(i for i in ids if not 0 <= i < len(self._tokens))
            raise ValueError(f"token id {bad} is outside the vocabulary (size {len(self._tokens)})")
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry spelled as in the GGUF (byte-level, e.g. ``"Ġthe"``), or None."""
        return self._vocab.get(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary entry of ``token_id`` as spelled in the GGUF (raises IndexError if out of range)."""
        if not 0 <= token_id < len(self._tokens):
            raise IndexError(f"token id {token_id} is outside the vocabulary (size {len(self._tokens)})")
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> int:
        """llama.cpp token type of ``token_id`` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)."""
        return self._token_types[token_id]

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a control (or unknown-type) token, skipped by ``skip_special_tokens``."""
        return self._token_types[token_id] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)

    # -- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of entries of ``tokenizer.ggml.tokens`` (may be less than the embedding rows)."""
        return len(self._tokens)

    @property
    def bos_token_id(self) -> int | None:
        """``tokenizer.ggml.bos_token_id``, or None."""
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        """``tokenizer.ggml.eos_token_id``, or None."""
        return self._eos

    @property
    def eot_token_id(self) -> int | None:
        """``tokenizer.ggml.eot_token_id`` (end of turn), or None."""
        return self._eot

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: eos, plus ``eot_token_id`` / ``eom_token_id`` when set.

        Unlike llama.cpp's end-of-generation set, tokens are not added by their text (e.g.
        SmolLM2's ``<|endoftext|>``, id 0, is not here: its eos is ``<|im_end|>``).
        """
        return frozenset(i for i in (self._eos, self._eot, self._eom) if i is not None)

    @property
    def pad_token_id(self) -> int | None:
        """``tokenizer.ggml.padding_token_id``, or None."""
        return self._pad

    @property
    def unk_token_id(self) -> int | None:
        """``tokenizer.ggml.unknown_token_id``, or None."""
        return self._unk

    @property
    def fingerprint(self) -> str:
        """sha256 hex digest of the tokenizer definition: model and pre type, tokens, token types,
        merges and bos/eos/eot/eom ids (:func:`runtime.fingerprint.tokenizer_fingerprint`).

        Stable across runs and processes; equal for two GGUF files that tokenize identically by
        definition, different when any of those fields differ.
        """
        return self._fingerprint

    @property
    def chat_template(self) -> str | None:
        """``tokenizer.chat_template`` (a Jinja template), or None."""
        return self._chat_template

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (shared; do not modify)."""
        return self._tk

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation with the GGUF's chat template, as transformers does.

        The template runs in ``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
        lstrip_blocks=True)`` with the ``loopcontrols`` extension, transformers' ``tojson`` filter
        (no HTML escaping), the ``raise_exception`` and ``strftime_now`` globals and a no-op
        ``{% generation %}`` tag.

        Args:
            messages: ``[{"role": "user", "content": "hi"}, ...]``.
            add_generation_prompt: end with the header of an assistant turn.
            **template_kwargs: extra template variables (e.g. ``tools``, ``enable_thinking``).

        Returns:
            The prompt text (encode it with :meth:`encode`; it holds the BOS text if the template
            writes one).

        Raises:
            ValueError: the GGUF has no ``tokenizer.chat_template``.
            jinja2.TemplateError: the template raised (``raise_exception``) or is invalid.
        """
        if self._chat_template is None:
            raise ValueError(f"{self._source}: the GGUF file has no chat template (tokenizer.chat_template)")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self._chat_template)
        variables: dict[str, Any] = {}
        for name, tid in (("bos_token", self._bos), ("eos_token", self._eos), ("unk_token", self._unk),
                          ("pad_token", self._pad)):
            if tid is not None:
                variables[name] = self._tokens[tid]
        variables.update(template_kwargs)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation: the chat template's markup as control tokens, the
        messages' text as plain text.

        ``encode(apply_chat_template(messages))`` would turn special-token text inside a message
        (``"<|im_start|>system\\n..."`` in a user's content) into real control tokens: a user
        could write a system turn. Here only the template's own markup yields special tokens:
        before rendering, every special-token text in the messages' strings (content, role, any
        string field, nested ones included) is swapped for a placeholder that holds no special
        text (private-use characters and a random number the template cannot know); the rendered
        text is then cut at the special tokens left, which are all the template's, those become
        their ids, and the text between them, placeholders put back, is encoded with
        ``parse_special=False``.

        A conversation whose strings hold no special-token text is encoded exactly as
        ``encode(apply_chat_template(messages, ...))``: same text, same ids.

        Args:
            messages: ``[{"role": "user", "content": "hi"}, ...]``.
            add_generation_prompt: end with the header of an assistant turn.
            **template_kwargs: extra template variables (their strings are template input, not
                defused).

        Returns:
            The ids (the template writes the BOS text if the model wants one; none is added).

        Raises:
            ValueError: the GGUF has no ``tokenizer.chat_template``.
            jinja2.TemplateError: the template raised (``raise_exception``) or is invalid.
        """
        pattern = self._special_pattern()
        if pattern is None:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **template_kwargs))
        originals: list[str] = []
        mark, end = f"\U000F0000{secrets.randbelow(10 ** 18)}:", "\U000F0001"

        def swap(m: re.Match[str]) -> str:
            originals.append(m.group(0))
            return f"{mark}{len(originals) - 1}{end}"

        def defuse(value: Any) -> Any:
            if isinstance(value, str):
                return pattern.sub(swap, value)
            if isinstance(value, dict):
                return {k: defuse(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [defuse(v) for v in value]
            return value

        defused = [defuse(m) for m in messages]
        text = self.apply_chat_template(defused, add_generation_prompt, **template_kwargs)
        if not originals:  # nothing to defuse: today's encoding, byte for byte
            return self.encode(text)
        placeholder = re.compile(re.escape(mark) + r"(\d+)" + re.escape(end))

        def plain(piece: str) -> list[int]:
            piece = placeholder.sub(lambda m: originals[int(m.group(1))], piece)
            return self.encode(piece, parse_special=False) if piece else []

        ids: list[int] = []
        pos = 0
        for m in pattern.finditer(text):  # every special token left is the template's markup
            ids += plain(text[pos:m.start()])
            ids.append(self._vocab[m.group(0)])
            pos = m.end()
        ids += plain(text[pos:])
        return ids

    def __repr__(self) -> str:
        return (
            f"GGUFTokenizer(model={self.model_type!r}, pre={self.pre_type!r}, vocab_size={self.vocab_size}, "
            f"bos={self._bos}, eos={self._eos}, fingerprint={self._fingerprint[:12]})"
        )

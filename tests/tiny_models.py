"""Tiny synthetic GGUF models for tests (no download, a few hundred KiB, written in milliseconds).

:func:`write_tiny_llama` writes a complete ``llama`` GGUF target, laid out exactly like a
llama.cpp conversion of a Hugging Face ``LlamaForCausalLM`` (SmolLM2 style):

* metadata ``llama.*`` (block_count, embedding_length, feed_forward_length, attention.head_count,
  attention.head_count_kv, attention.layer_norm_rms_epsilon, rope.freq_base, rope.dimension_count,
  context_length, vocab_size) and ``general.*``;
* a GPT-2 byte-level BPE tokenizer: ``tokenizer.ggml.model = "gpt2"``, ``pre = "default"``;
  tokens = special tokens (ids ``0..S-1``, token_type 3 = CONTROL), then the 256 byte-level
  characters of GPT-2's ``bytes_to_unicode`` (in GPT-2's order, ``"!"`` first, token_type 1), then
  one token per merge; the merges are learned by a small deterministic BPE trainer over
  :data:`CORPUS` (so every merge ``"a b"`` has both parts, and ``a+b``, in the vocabulary);
  ``bos/eos/unknown/padding`` ids, ``add_bos_token = False`` and a ChatML ``chat_template``;
* tensors ``token_embd``, ``output_norm``, ``output`` (absent when ``tied``: the LM head is then
  ``token_embd``), ``blk.{i}.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate,
  ffn_up, ffn_down}.weight``.

Like llama.cpp's converter (``LlamaModel.permute``), the rows of ``attn_q`` / ``attn_k`` are
**permuted** for its interleaved (GPT-J style) rotary: the returned :class:`TinyLlama` holds both
the tensors as stored (``gguf_tensors``) and the Hugging Face originals (``hf_state_dict``, names of
``transformers.LlamaForCausalLM``) so a test can build the transformers oracle with
``LlamaForCausalLM(LlamaConfig(**tiny.hf_config()))`` + ``load_state_dict(tiny.hf_state_dict)``.

Weights are ``N(0, std)`` (default 0.1: large enough that attention is far from uniform, so a
wrong mask or position shows up in the outputs); norm weights are ``1 + N(0, 0.1)`` so a missing
norm weight shows up too. Everything is a deterministic function of ``seed``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Any, Sequence

import torch
from gguf import GGMLQuantizationType

from target_service.gguf_loader import write_gguf

#: Training text of the tiny BPE tokenizer (ASCII; a few hundred merges at most).
CORPUS = """\
The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens with a
small model and verifies them with the large target model in one forward pass. The draft model
proposes a tree of tokens; the target accepts the longest prefix that matches its own choice and
adds one bonus token. When the drafter is good, the target runs far fewer times than tokens are
generated, and the output is exactly the same as greedy decoding with the target alone.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is
the capital of France. Write a Python function that returns the sum of two numbers:
def add(a, b):
    return a + b
print(add(2, 3))  # 5
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 2024 3.14159. Lists, tuples, dictionaries and sets are
the basic containers of the language. Once upon a time there was a little robot who wanted to
learn how to read. Every morning it opened a book, looked at the letters and tried again.
"""

#: Regex of the GPT-2 pre-tokenizer, restricted to ASCII (the ``regex`` module is not needed).
PRETOKENIZE = re.compile(r"""'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")

DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character map, in GPT-2's vocabulary order
    (printable bytes ``!``..``~``, ``¡``..``¬``, ``®``..``ÿ`` first, then the others as U+0100...)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def train_bpe(text: str, num_merges: int) -> list[tuple[str, str]]:
    """Learn ``num_merges`` byte-level BPE merges from ``text`` (deterministic).

    Words come from :data:`PRETOKENIZE`, mapped through :func:`bytes_to_unicode`; at each step the
    most frequent adjacent pair is merged (ties: the lexicographically smallest pair).

    Raises:
        ValueError: ``text`` cannot give that many merges (every word is already one token).
    """
    b2u = bytes_to_unicode()
    words = collections.Counter(
        tuple(b2u[b] for b in w.encode("utf-8")) for w in PRETOKENIZE.findall(text)
    )
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += count
        if not pairs:
            raise ValueError(f"the corpus gives only {len(merges)} merges, {num_merges} asked")
        best_count = max(pairs.values())
        best = min(p for p, c in pairs.items() if c == best_count)
        merges.append(best)
        new_words: collections.Counter[tuple[str, ...]] = collections.Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return merges


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Row permutation llama.cpp's converter applies to ``q_proj`` / ``k_proj`` (HF NeoX halves ->
    interleaved pairs). ``n_head``: query heads for q, kv heads for k."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of :func:`llama_cpp_permute` (what a loader does to get HF-order rows back)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclasses.dataclass
class TinyLlama:
    """What :func:`write_tiny_llama` wrote.

    Attributes:
        path: the GGUF file.
        vocab, hidden, layers, heads, kv_heads, head_dim, ffn, rope_theta, rms_eps, context_length:
            the hyperparameters.
        tied: no ``output.weight``; the LM head is ``token_embd.weight``.
        tokens, token_types, merges: the tokenizer as written (merges as ``"a b"`` strings).
        bos_id, eos_id, unk_id, pad_id: special ids.
        gguf_tensors: name -> float32 tensor as stored in the file (q/k rows permuted, PyTorch
            order ``[out, in]``; before any quantization of ``tensor_type``).
        hf_state_dict: the same weights under ``transformers.LlamaForCausalLM`` names, HF row order.
    """

    path: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float
    rms_eps: float
    context_length: int
    tied: bool
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int
    gguf_tensors: dict[str, torch.Tensor]
    hf_state_dict: dict[str, torch.Tensor]

    def hf_config(self) -> dict[str, Any]:
        """Keyword arguments of ``transformers.LlamaConfig`` for the same model."""
        return dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.ffn,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.context_length,
            rms_norm_eps=self.rms_eps,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tied,
            attention_bias=False,
            mlp_bias=False,
            hidden_act="silu",
            bos_token_id=self.bos_id,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
        )


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    vocab: int = 300,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    rope_theta: float = 10000.0,
    rms_eps: float = 1e-5,
    context_length: int = 2048,
    tied: bool = False,
    seed: int = 0,
    std: float = 0.1,
    tensor_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    bos_id: int = 1,
    eos_id: int = 2,
    unk_id: int = 0,
    pad_id: int = 2,
    name: str = "tiny-llama",
) -> TinyLlama:
    """Write a tiny random ``llama`` target GGUF (see the module docstring for the layout).

    Args:
        path: output ``.gguf`` file.
        vocab: total vocabulary size = ``len(special_tokens) + 256 + merges``; at least
            ``len(special_tokens) + 256``, at most 367 merges more (what :data:`CORPUS` gives;
            626 with the default special tokens).
        hidden, layers, heads, kv_heads, ffn: model shape; ``head_dim = hidden // heads`` (even).
        rope_theta, rms_eps, context_length: the matching metadata values.
        tied: omit ``output.weight`` (LM head = ``token_embd.weight``).
        seed, std: weights ``N(0, std)``, norm weights ``1 + N(0, 0.1)``, from ``torch.Generator(seed)``.
        tensor_type: storage type of the 2-D tensors (F32 default; F16, Q8_0, Q4_0, ... need
            ``hidden`` and ``ffn`` multiples of 32, the K-quants multiples of 256). Norms stay F32.
        special_tokens: control tokens at ids ``0..len-1`` (SmolLM2 layout).
        bos_id, eos_id, unk_id, pad_id: special ids (SmolLM2's by default: 1, 2, 0, 2).

    Returns:
        :class:`TinyLlama` describing the file.
    """
    path = os.fspath(path)
    if hidden % heads or (hidden // heads) % 2 or heads % kv_heads:
        raise ValueError("need hidden % heads == 0, an even head_dim and heads % kv_heads == 0")
    head_dim = hidden // heads
    n_special = len(special_tokens)
    num_merges = vocab - n_special - 256
    if num_merges < 0:
        raise ValueError(f"vocab must be at least {n_special + 256}")
    merge_pairs = train_bpe(CORPUS, num_merges)
    tokens = list(special_tokens) + list(bytes_to_unicode().values()) + [a + b for a, b in merge_pairs]
    if len(set(tokens)) != len(tokens):  # pragma: no cover - BPE never re-creates a token
        raise AssertionError("duplicate tokens")
    token_types = [TOKEN_TYPE_CONTROL] * n_special + [TOKEN_TYPE_NORMAL] * (vocab - n_special)
    merges = [f"{a} {b}" for a, b in merge_pairs]

    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = norm(hidden)
        hf[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        hf[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        hf[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        hf[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        hf[p + "post_attention_layernorm.weight"] = norm(hidden)
        hf[p + "mlp.gate_proj.weight"] = w(ffn, hidden)
        hf[p + "mlp.up_proj.weight"] = w(ffn, hidden)
        hf[p + "mlp.down_proj.weight"] = w(hidden, ffn)
    hf["model.norm.weight"] = norm(hidden)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"] if tied else w(vocab, hidden)

    t: dict[str, torch.Tensor] = {"token_embd.weight": hf["model.embed_tokens.weight"]}
    for i in range(layers):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = hf[p + "input_layernorm.weight"]
        t[b + "attn_q.weight"] = llama_cpp_permute(hf[p + "self_attn.q_proj.weight"], heads)
        t[b + "attn_k.weight"] = llama_cpp_permute(hf[p + "self_attn.k_proj.weight"], kv_heads)
        t[b + "attn_v.weight"] = hf[p + "self_attn.v_proj.weight"]
        t[b + "attn_output.weight"] = hf[p + "self_attn.o_proj.weight"]
        t[b + "ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        t[b + "ffn_gate.weight"] = hf[p + "mlp.gate_proj.weight"]
        t[b + "ffn_up.weight"] = hf[p + "mlp.up_proj.weight"]
        t[b + "ffn_down.weight"] = hf[p + "mlp.down_proj.weight"]
    t["output_norm.weight"] = hf["model.norm.weight"]
    if not tied:
        t["output.weight"] = hf["lm_head.weight"]

    metadata: dict[str, Any] = {
        "general.name": name,
        "general.type": "model",
        "{arch}.block_count": layers,
        "{arch}.context_length": context_length,
        "{arch}.embedding_length": hidden,
        "{arch}.feed_forward_length": ffn,
        "{arch}.attention.head_count": heads,
        "{arch}.attention.head_count_kv": kv_heads,
        "{arch}.rope.freq_base": float(rope_theta),
        "{arch}.attention.layer_norm_rms_epsilon": float(rms_eps),
        "{arch}.vocab_size": vocab,
        "{arch}.rope.dimension_count": head_dim,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": bos_id,
        "tokenizer.ggml.eos_token_id": eos_id,
        "tokenizer.ggml.unknown_token_id": unk_id,
        "tokenizer.ggml.padding_token_id": pad_id,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }
    write_gguf(path, "llama", metadata, t, default_type=tensor_type)
    return TinyLlama(
        path=path, vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, ffn=ffn, rope_theta=float(rope_theta), rms_eps=float(rms_eps),
        context_length=context_length, tied=tied, tokens=tokens, token_types=token_types,
        merges=merges, bos_id=bos_id, eos_id=eos_id, unk_id=unk_id, pad_id=pad_id,
        gguf_tensors={k: v.clone() for k, v in t.items()},
        hf_state_dict={k: v.clone() for k, v in hf.items()},
    )

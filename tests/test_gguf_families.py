"""GGUF families in the converter, checked on small synthetic models against references.

Real weights of Llama 3, Mistral, Qwen3, Gemma 3 and Phi-3 do not install
offline here, so each test writes a tiny model of the family with the
``gguf`` package: random weights in the family's tensor layout and metadata,
and a real vocabulary trained on a few lines (SentencePiece for the
SentencePiece families, ``tokenizers`` byte-level BPE for the others), stored
as llama.cpp's converter stores them. Then it checks:

- the logits of the CTranslate2 model the converter makes against a forward
  pass in numpy that follows llama.cpp's semantics for the architecture
  (rotary layout, norms, biases, fused tensors, sliding windows, scaling);
  that numpy pass is itself checked against llama.cpp's logits for the same
  file, when llama.cpp's Python binding is installed (``make llama-server``);
- the rebuilt tokenizer's ids against the trained tokenizer's, and against
  llama.cpp's own tokenisation of the GGUF vocabulary.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from llama_server import LLAMA_PYTHON, require_llama_cpp

from s2s_rt.models.gguf_file import GGUFFile
from s2s_rt.models.gguf_to_ct2 import convert_gguf
from s2s_rt.models.gguf_tokenizer import GGUFVocabulary, build_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, how are you today? I am fine, thank you.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers like 12345 and 2026 appear in text, as do dates and times.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "A voice assistant answers questions in short, clear sentences.",
]
#: Text the tokenizers are compared on: seen and unseen words, digits, spacing,
#: punctuation, and characters outside the training alphabet (byte fallback).
SAMPLES = [
    "Hello world",
    "The capital of France is Paris.",
    " leading space and  double  spaces",
    "digits 1234567890 and 3.14159",
    "new\nlines\n\nand\ttabs",
    "naïve café — résumé 😀 日本",
    "brownfoxjumps",
]
TOKENS = [1, 17, 42, 5, 99, 23, 64, 8, 31, 77]
TINY = {"d_model": 64, "n_heads": 4, "n_heads_kv": 2, "head_dim": 16, "ffn": 96, "n_layers": 2, "eps": 1e-5}


@dataclass(frozen=True)
class Family:
    """One architecture as llama.cpp's converter writes it."""

    arch: str
    #: "spm" (SentencePiece, tokenizer.ggml.model "llama") or a byte-level BPE pre-tokenizer name.
    tokenizer: str
    specials: tuple[str, ...]
    eos: str
    #: The family's chat template (its upstream one, cut to what a plain conversation uses).
    template: str = ""
    add_bos: bool = True
    #: Added tokens matched in text (Qwen3's <think>), unlike the control tokens.
    user_defined: tuple[str, ...] = ()
    sizes: dict[str, Any] = field(default_factory=dict)
    untied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False
    gemma: bool = False
    add_space_prefix: bool = True
    #: Llama 3.1's RoPE scaling, stored as per-pair frequency factors.
    llama3_rope: bool = False
    linear_rope: float | None = None


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN3 = CHATML.replace(
    "{% endif %}",
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}",
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}"
    "{% endif %}{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
PHI3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
#: Mistral's, without the space after [INST]: llama.cpp adds SentencePiece's space itself.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% if loop.index == 2 and messages[0]['role'] == 'system' %}{{ '[INST]' + messages[0]['content'] + '\\n\\n'"
    " + message['content'] + '[/INST]' }}{% else %}{{ '[INST]' + message['content'] + '[/INST]' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

FAMILIES = {
    "llama3": Family(
        "llama", "llama-bpe", ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"),
        "<|eot_id|>", LLAMA3, untied=True, llama3_rope=True, sizes={"head_dim": 32},
    ),
    "mistral": Family("llama", "spm", ("[INST]", "[/INST]"), "</s>", MISTRAL, untied=True, linear_rope=2.0),
    "qwen2": Family(
        "qwen2", "qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", CHATML, add_bos=False,
        qkv_bias=True,
    ),
    "qwen3": Family(
        "qwen3", "qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>",
        QWEN3, add_bos=False,
        user_defined=("<think>", "</think>"), qk_norm=True, sizes={"head_dim": 24},
    ),
    "gemma3": Family(
        "gemma3", "spm", ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>", GEMMA, qk_norm=True, gemma=True,
        add_space_prefix=False, sizes={"head_dim": 32, "n_layers": 3, "n_heads_kv": 1, "eps": 1e-6},
    ),
    "phi3": Family(
        "phi3", "spm", ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<|end|>", PHI3,
        untied=True, fused=True,
    ),
}  # fmt: skip

#: Gemma 3's sliding window here: CTranslate2's forward pass cannot take more tokens than it at once.
GEMMA_WINDOW = 16
GEMMA_GLOBAL_EVERY = 3


# --- vocabularies ------------------------------------------------------------------


@dataclass
class Vocabulary:
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    #: The trained tokenizer's ids for ``text`` (the reference the GGUF came from).
    encode: Callable[[str], list[int]]


def _spm_vocabulary(family: Family) -> Vocabulary:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 10),
        model_writer=model,
        model_type="bpe",
        vocab_size=420,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        control_symbols=list(family.specials),
        user_defined_symbols=list(family.user_defined),
        add_dummy_prefix=family.add_space_prefix,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        split_digits=True,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    # Token types as llama.cpp's converter derives them from the processor.
    types = []
    for i in range(sp.vocab_size()):
        kind = 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i) else 1
        types.append(kind)
    return Vocabulary(
        tokens=[sp.id_to_piece(i) for i in range(sp.vocab_size())],
        types=types,
        scores=[sp.get_score(i) for i in range(sp.vocab_size())],
        merges=None,
        encode=lambda text: list(sp.encode(text)),
    )


def _bpe_vocabulary(family: Family) -> Vocabulary:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from s2s_rt.models.gguf_tokenizer import _pre_tokenizer

    normalizer, pre_tokenizer = _pre_tokenizer(family.tokenizer)
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=[*family.specials, *family.user_defined],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    state = json.loads(tokenizer.to_str())["model"]
    vocab: dict[str, int] = state["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    assert Regex  # imported for the type of the pre-tokenizer above
    return Vocabulary(
        tokens=tokens,
        types=[3 if t in family.specials else 4 if t in family.user_defined else 1 for t in tokens],
        scores=None,
        merges=merges,
        encode=lambda text: list(tokenizer.encode(text, add_special_tokens=False).ids),
    )


def vocabulary(family: Family) -> Vocabulary:
    return _spm_vocabulary(family) if family.tokenizer == "spm" else _bpe_vocabulary(family)


# --- a synthetic model ------------------------------------------------------------------


def write_model(path: Path, family: Family, vocab: Vocabulary, seed: int = 0) -> None:
    """Write a tiny random model of ``family`` as llama.cpp's converter lays it out."""
    size = TINY | family.sizes
    d, heads, kv, hd, ffn = size["d_model"], size["n_heads"], size["n_heads_kv"], size["head_dim"], size["ffn"]
    n_vocab = len(vocab.tokens)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), family.arch)
    writer.add_name(f"tiny {family.arch}")
    writer.add_context_length(256)
    writer.add_embedding_length(d)
    writer.add_block_count(size["n_layers"])
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_dimension_count(hd)
    writer.add_layer_norm_rms_eps(size["eps"])
    writer.add_rope_freq_base(10_000.0 if not family.gemma else 1_000_000.0)
    if family.gemma:
        writer.add_sliding_window(GEMMA_WINDOW)
        writer.add_sliding_window_pattern(GEMMA_GLOBAL_EVERY)
    if family.linear_rope:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(family.linear_rope)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("llama" if family.tokenizer == "spm" else "gpt2")
    if family.tokenizer != "spm":
        writer.add_tokenizer_pre(family.tokenizer)
        writer.add_token_merges(vocab.merges or [])
    else:
        writer.add_token_scores(vocab.scores or [])
        writer.add_add_space_prefix(family.add_space_prefix)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    eos = vocab.tokens.index(family.eos) if family.eos in vocab.tokens else 2
    writer.add_bos_token_id(1 if family.tokenizer == "spm" else 0)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(family.add_bos)
    writer.add_chat_template(family.template)
    if family.tokenizer == "spm":
        writer.add_unk_token_id(0)

    tensors: dict[str, np.ndarray] = {"token_embd.weight": matrix(n_vocab, d), "output_norm.weight": norm(d)}
    if family.untied:
        tensors["output.weight"] = matrix(n_vocab, d)
    if family.llama3_rope:
        tensors["rope_freqs.weight"] = _llama3_rope_factors(hd, base=10_000.0)
    for i in range(size["n_layers"]):
        blk = f"blk.{i}."
        tensors[blk + "attn_norm.weight"] = norm(d)
        tensors[blk + "ffn_norm.weight"] = norm(d)
        if family.fused:
            tensors[blk + "attn_qkv.weight"] = matrix((heads + 2 * kv) * hd, d)
            tensors[blk + "ffn_up.weight"] = matrix(2 * ffn, d)
        else:
            tensors[blk + "attn_q.weight"] = matrix(heads * hd, d)
            tensors[blk + "attn_k.weight"] = matrix(kv * hd, d)
            tensors[blk + "attn_v.weight"] = matrix(kv * hd, d)
            tensors[blk + "ffn_gate.weight"] = matrix(ffn, d)
            tensors[blk + "ffn_up.weight"] = matrix(ffn, d)
        if family.qkv_bias:
            for p, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
                tensors[blk + f"attn_{p}.bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
        if family.qk_norm:
            tensors[blk + "attn_q_norm.weight"] = norm(hd)
            tensors[blk + "attn_k_norm.weight"] = norm(hd)
        if family.gemma:
            tensors[blk + "post_attention_norm.weight"] = norm(d)
            tensors[blk + "post_ffw_norm.weight"] = norm(d)
        tensors[blk + "attn_output.weight"] = matrix(d, heads * hd)
        tensors[blk + "ffn_down.weight"] = matrix(d, ffn)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama3_rope_factors(head_dim: int, base: float) -> np.ndarray:
    """Llama 3.1's per-pair frequency factors (factor 8, low 1, high 4, context 8192), as llama.cpp stores them.

    The tiny head makes few pairs, so the original context is scaled down to
    put some of them in each of the three regions.
    """
    factor, low, high, context = 8.0, 1.0, 4.0, 64.0
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * np.pi * base ** (i / head_dim)
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# --- the reference forward pass --------------------------------------------------------


def reference_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """Logits for ``tokens`` by llama.cpp's semantics, in float64 numpy, read with ``gguf.GGUFReader``."""
    reader = gguf.GGUFReader(str(path))
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tokenizer.ggml.")}
    w = {
        t.name: np.asarray(t.data, dtype=np.float64).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors
    }
    arch = meta["general.architecture"]

    def m(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    d, n_layers = m("embedding_length"), m("block_count")
    heads, kv, hd = m("attention.head_count"), m("attention.head_count_kv"), m("attention.key_length")
    eps, base = m("attention.layer_norm_rms_epsilon"), m("rope.freq_base")
    gemma, fused = arch == "gemma3", arch == "phi3"
    # llama.cpp's rope: interleaved pairs for llama (its converter permuted Q/K), halves for the rest.
    neox = arch != "llama"
    freq_scale = 1.0 / m("rope.scaling.factor", 1.0) if m("rope.scaling.type") == "linear" else 1.0
    freq_factors = w.get("rope_freqs.weight")

    def rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    def rope(x: np.ndarray, layer_base: float) -> np.ndarray:  # x: (T, H, hd)
        inv = layer_base ** (-np.arange(0, hd, 2) / hd)
        if freq_factors is not None:
            inv = inv / freq_factors
        angle = (np.arange(x.shape[0]) * freq_scale)[:, None, None] * inv[None, None, :]
        cos, sin = np.cos(angle), np.sin(angle)
        out = x.copy()
        a, b = (x[..., : hd // 2], x[..., hd // 2 :]) if neox else (x[..., 0::2], x[..., 1::2])
        first, second = a * cos - b * sin, a * sin + b * cos
        if neox:
            out[..., : hd // 2], out[..., hd // 2 :] = first, second
        else:
            out[..., 0::2], out[..., 1::2] = first, second
        return out

    t = len(tokens)
    x = w["token_embd.weight"][tokens]
    if gemma:
        x = x * np.sqrt(d)
    pattern = m("attention.sliding_window_pattern", 6)
    for i in range(n_layers):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        if fused:
            q, k, v = np.split(h @ w[p + "attn_qkv.weight"].T, [heads * hd, (heads + kv) * hd], axis=-1)
        else:
            q, k, v = (h @ w[p + f"attn_{n}.weight"].T for n in "qkv")
        if p + "attn_q.bias" in w:
            q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
        q, k, v = q.reshape(t, heads, hd), k.reshape(t, kv, hd), v.reshape(t, kv, hd)
        if p + "attn_q_norm.weight" in w:
            q, k = rms(q, w[p + "attn_q_norm.weight"]), rms(k, w[p + "attn_k_norm.weight"])
        local = gemma and i % pattern < pattern - 1
        layer_base = m("rope.freq_base_swa", 10_000.0) if local else base
        q, k = rope(q, layer_base), rope(k, layer_base)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        qpos, kpos = np.arange(t)[:, None], np.arange(t)[None, :]
        masked = kpos > qpos
        if local:
            masked |= qpos - kpos >= m("attention.sliding_window")
        scores = np.where(masked[None], -np.inf, scores)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attended = np.einsum("hqk,khd->qhd", weights, v).reshape(t, heads * hd) @ w[p + "attn_output.weight"].T
        if gemma:
            attended = rms(attended, w[p + "post_attention_norm.weight"])
        x = x + attended
        h = rms(x, w[p + "ffn_norm.weight"])
        if fused:
            gate, up = np.split(h @ w[p + "ffn_up.weight"].T, 2, axis=-1)
        else:
            gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        if gemma:
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        else:
            act = gate / (1 + np.exp(-gate))
        out = (act * up) @ w[p + "ffn_down.weight"].T
        if gemma:
            out = rms(out, w[p + "post_ffw_norm.weight"])
        x = x + out
    x = rms(x, w["output_norm.weight"])
    return np.asarray(x @ w.get("output.weight", w["token_embd.weight"]).T)


def ct2_logits(model_dir: Path, tokens: list[int]) -> np.ndarray:
    import ctranslate2

    generator = ctranslate2.Generator(str(model_dir), device="cpu", compute_type="float32")
    return np.asarray(generator.forward_batch([tokens]))[0].astype(np.float64)


_LLAMA_CPP_SCRIPT = """
import json, sys
from jinja2.sandbox import ImmutableSandboxedEnvironment
from llama_cpp import Llama
request = json.load(sys.stdin)
llm = Llama(model_path=request["model"], vocab_only=not request["tokens"], n_ctx=64, logits_all=True, verbose=False)
out = {"ids": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in request["texts"]]}
if request["tokens"]:
    llm.eval(request["tokens"])
    out["logits"] = [list(map(float, row)) for row in llm.scores[: len(request["tokens"])]]
if request["chat"]:
    meta = llm.metadata
    text = lambda key: llm.detokenize([int(meta[key])], special=True).decode()
    prompt = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        meta["tokenizer.chat_template"]
    ).render(
        messages=request["chat"], add_generation_prompt=True, enable_thinking=False,
        bos_token=text("tokenizer.ggml.bos_token_id"), eos_token=text("tokenizer.ggml.eos_token_id"),
    )
    out["chat"] = llm.tokenize(prompt.encode(), add_bos=False, special=True)
print(json.dumps(out))
"""


def llama_cpp(
    path: Path, texts: list[str], tokens: list[int] | None = None, chat: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    """llama.cpp's view of the GGUF at ``path``.

    Returns its tokenisation of ``texts``; with ``tokens``, its logits; with
    ``chat``, the prompt ids of that conversation in the GGUF's own chat
    template (rendered with Jinja as llama-cpp-python does, tokenised by
    llama.cpp with markup read as tokens).
    """
    require_llama_cpp()
    request = json.dumps({"model": str(path), "texts": texts, "tokens": tokens or [], "chat": chat or []})
    done = subprocess.run(
        [str(LLAMA_PYTHON), "-c", _LLAMA_CPP_SCRIPT],
        input=request,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"OMP_WAIT_POLICY": "passive"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout.splitlines()[-1]))


# --- the tests ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny model of one family: its GGUF, its vocabulary, and its conversion."""
    family = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    vocab = vocabulary(family)
    path = directory / f"tiny-{request.param}.gguf"
    write_model(path, family, vocab)
    converted = directory / "ct2"
    converted.mkdir()
    lines: list[str] = []
    convert_gguf(path, converted, progress=lines.append)
    return {"name": request.param, "family": family, "vocab": vocab, "path": path, "ct2": converted, "log": lines}


def _difference(actual: np.ndarray, expected: np.ndarray) -> float:
    """Largest difference relative to the largest logit."""
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def test_converted_logits_match_the_numpy_reference(model: dict[str, Any]) -> None:
    expected = reference_logits(model["path"], TOKENS)
    actual = ct2_logits(model["ct2"], TOKENS)
    assert actual.shape == expected.shape
    # The converter stores int8 weights (one scale per row): a few percent on a tiny random
    # model; a wrong rotary layout, norm or scaling is 10-20 % and more.
    assert _difference(actual, expected) < 0.05, model["name"]
    assert (actual.argmax(-1) == expected.argmax(-1)).mean() >= 0.8, model["name"]


def test_the_numpy_reference_is_llama_cpps_forward_pass(model: dict[str, Any]) -> None:
    logits = np.array(llama_cpp(model["path"], [], TOKENS)["logits"])
    assert _difference(reference_logits(model["path"], TOKENS), logits) < 0.005, model["name"]


def test_rebuilt_tokenizer_splits_text_as_the_gguf_vocabulary_does(model: dict[str, Any]) -> None:
    tokenizer = build_tokenizer(GGUFVocabulary.from_gguf(GGUFFile(model["path"])))
    ours = [tokenizer.encode(text, add_special_tokens=False).ids for text in SAMPLES]
    assert ours == [model["vocab"].encode(text) for text in SAMPLES], model["name"]
    assert ours == llama_cpp(model["path"], SAMPLES)["ids"], model["name"]
    for text, ids in zip(SAMPLES, ours, strict=True):
        assert tokenizer.decode(ids) == text


def test_converted_directory_names_the_end_of_turn_token(model: dict[str, Any]) -> None:
    config = json.loads((model["ct2"] / "tokenizer_config.json").read_text())
    assert config["eos_token"] == model["family"].eos


CONVERSATION = [
    ("system", "Be brief."),
    ("user", "Hello there!"),
    ("assistant", "Hi. How can I help?"),
    ("user", "What is the capital of France?"),
]


def test_chat_prompt_is_the_familys_template_as_llama_cpp_reads_it(model: dict[str, Any]) -> None:
    from s2s_rt.engines.base import ChatMessage
    from s2s_rt.engines.llm import CT2ChatLLM

    llm = CT2ChatLLM(model["ct2"])
    try:
        ours = [
            token for turn in llm._chat.encode([ChatMessage(r, c) for r, c in CONVERSATION]).turns for token in turn
        ]
    finally:
        llm.close()
    theirs = llama_cpp(model["path"], [], chat=[{"role": r, "content": c} for r, c in CONVERSATION])["chat"]
    assert ours == theirs, model["name"]


def test_models_prepare_gguf_converts_a_users_file_into_the_cache_once(
    model: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from s2s_rt.engines.base import ChatMessage, LLMRequest, LLMUsage
    from s2s_rt.engines.llm import CT2ChatLLM
    from s2s_rt.models.cli import main as models_cli

    assert models_cli(["prepare", "--gguf", str(model["path"]), "--dir", str(tmp_path)]) == 0
    target = tmp_path / f"llm-gguf-tiny-{model['name']}"
    assert f"--llm {target}" in capsys.readouterr().out
    llm = CT2ChatLLM(target)
    try:
        usage = LLMUsage()
        pieces = list(
            llm.stream(
                LLMRequest.of([ChatMessage("user", "Hello there!")], max_tokens=4, temperature=0.0),
                should_stop=lambda: False,
                usage=usage,
            )
        )
        assert usage.output_tokens > 0 and all(isinstance(piece, str) for piece in pieces)
    finally:
        llm.close()
    assert models_cli(["prepare", "--gguf", str(model["path"]), "--dir", str(tmp_path)]) == 0
    assert "up to date" in capsys.readouterr().out


def test_models_prepare_gguf_names_what_is_wrong_with_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from s2s_rt.models.cli import main as models_cli

    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    assert models_cli(["prepare", "--gguf", str(not_gguf), "--dir", str(tmp_path / "cache")]) == 1
    assert "not a readable GGUF file" in capsys.readouterr().err
    assert not list((tmp_path / "cache").glob("llm-gguf-*"))

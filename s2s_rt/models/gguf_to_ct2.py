"""Convert a llama.cpp GGUF chat model into a CTranslate2 decoder directory.

The output directory looks like one made by CTranslate2's own Hugging Face
converter, so :class:`s2s_rt.engines.llm.CT2ChatLLM` loads either kind:

- ``model.bin``, ``config.json``, ``vocabulary.json``: the CTranslate2 model,
  weights in int8 (one scale per output row, CTranslate2's own scheme);
- ``tokenizer.json``: the tokenizer rebuilt from the GGUF vocabulary,
  byte-level BPE or SentencePiece (token ids unchanged);
- ``tokenizer_config.json``: the chat template from the GGUF metadata, the
  bos/eos tokens, the context length;
- ``generation_config.json``: the token ids that end the assistant's turn.

Supported architectures are the ones built on Llama's block (RMS norm, gated
feed-forward, rotary embeddings, grouped-query attention), each with its own
details (:data:`_ARCHITECTURES`): ``llama`` (Llama 1–3.x, Mistral, SmolLM),
``qwen2``, ``qwen3``, ``gemma3`` and ``phi3``. Each is checked against a numpy
forward pass of llama.cpp's semantics in ``tests/test_gguf_families.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from s2s_rt.models.errors import ModelError
from s2s_rt.models.gguf_file import GGUFFile
from s2s_rt.models.gguf_tokenizer import GGUFVocabulary, build_tokenizer

Progress = Callable[[str], None]
Int8Weight = tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]

#: Two stored embedding matrices closer than this (relative Frobenius
#: distance) are two quantisations of one tied matrix, and one copy is kept.
#: Qwen2.5-0.5B's Q5_0 and Q8_0 copies differ by 0.044; unrelated matrices by
#: about 1.4.
_TIED_EMBEDDING_TOLERANCE = 0.1

#: Rows dequantized at a time when converting a large matrix.
_ROWS_PER_BLOCK = 8192

#: Tokens that end an assistant turn in the chat formats we know.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


@dataclass(frozen=True, slots=True)
class _Architecture:
    #: llama.cpp permutes Q/K rows of ``llama`` models to interleaved-pair
    #: rotary order; CTranslate2 (like Hugging Face) wants the halves order.
    permuted_qk: bool = False
    #: Qwen2 has biases on the Q, K and V projections.
    qkv_bias: bool = False
    #: Qwen3 and Gemma 3 RMS-normalise each head of Q and K (``attn_q_norm``).
    qk_norm: bool = False
    #: Phi-3 stores Q, K and V as one tensor (``attn_qkv``), and the FFN's gate
    #: and up projections as one (``ffn_up``, gate first).
    fused: bool = False
    #: Gemma 3: a GELU (tanh) gated FFN; norms after attention and after the
    #: FFN too; embeddings scaled by sqrt(d_model); local layers attend to a
    #: sliding window with their own rotary base, every N-th layer to all.
    gemma: bool = False


_ARCHITECTURES = {
    "llama": _Architecture(permuted_qk=True),
    "qwen2": _Architecture(qkv_bias=True),
    "qwen3": _Architecture(qk_norm=True),
    "gemma3": _Architecture(qk_norm=True, gemma=True),
    "phi3": _Architecture(fused=True),
}

#: Gemma 3's local layers: rotary base and global-layer period when the GGUF
#: does not state them (``rope.freq_base_swa``, ``attention.sliding_window_pattern``),
#: as llama.cpp assumes.
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_27B_LAYERS = 62


def convert_gguf(gguf_path: Path, output_dir: Path, *, latin_only: bool = False, progress: Progress = print) -> None:
    """Convert a GGUF chat model into a CTranslate2 int8 decoder directory.

    Args:
        gguf_path: the ``.gguf`` file (one file: join split parts first).
        output_dir: an existing, empty directory to write the model into.
        latin_only: keep only the Latin-script tokens of the vocabulary (see
            :mod:`s2s_rt.models.latin_vocabulary`); token ids are renumbered
            in the model and its tokenizer alike.
        progress: called with one human-readable line per step.

    Raises:
        ModelError: for an unsupported architecture, tokenizer or layout.
    """
    gguf = GGUFFile(gguf_path)
    hparams = _HParams(gguf)
    spec = hparams.decoder_spec()
    progress(
        f"  {hparams.arch_name}: {hparams.n_layers} layers, d_model {hparams.d_model}, "
        f"heads {hparams.n_heads}/{hparams.n_heads_kv}"
    )

    vocab = GGUFVocabulary.from_gguf(gguf)
    embedding, projection = _embeddings(gguf, progress)
    if latin_only:
        from s2s_rt.models.latin_vocabulary import latin_token_ids

        keep = latin_token_ids(vocab)
        progress(f"  keeping {len(keep)} Latin-script tokens of {len(vocab.tokens)}")
        vocab = vocab.subset(keep)
        tied = projection is embedding
        embedding = (embedding[0][keep], embedding[1][keep])
        projection = embedding if tied else (projection[0][keep], projection[1][keep])
    decoder = spec.decoder
    decoder.embeddings.weight, decoder.embeddings.weight_scale = embedding
    # Tied: the very same arrays, which CTranslate2 stores once and aliases.
    decoder.projection.weight, decoder.projection.weight_scale = projection
    decoder.layer_norm.gamma = gguf.dequantize("output_norm.weight")
    _set_layers(decoder.layer, gguf, hparams)

    stops = _StopTokens.of(vocab, gguf_path)
    spec.register_vocabulary(vocab.tokens)
    spec.config.bos_token = vocab.tokens[stops.bos_id]
    spec.config.eos_token = vocab.tokens[stops.eos_id]
    spec.config.unk_token = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else ""
    spec.config.layer_norm_epsilon = hparams.rms_epsilon
    spec.validate()
    spec.optimize(quantization=None)  # weights are int8 already; this only aliases
    progress("  writing model.bin")
    spec.save(str(output_dir))

    progress("  writing tokenizer.json")
    build_tokenizer(vocab).save(str(output_dir / "tokenizer.json"))
    tokenizer_config = {
        "chat_template": gguf.get("tokenizer.chat_template"),
        "bos_token": vocab.tokens[stops.bos_id],
        "eos_token": vocab.tokens[stops.eos_id],
        # llama.cpp's default when the GGUF does not say: SentencePiece models start with BOS.
        "add_bos_token": bool(gguf.get("tokenizer.ggml.add_bos_token", vocab.model == "llama")),
        "model_max_length": hparams.context_length,
        "source": {"gguf": gguf_path.name, "name": gguf.get("general.name"), "latin_only": latin_only},
    }
    _write_json(output_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        output_dir / "generation_config.json",
        {"bos_token_id": stops.bos_id, "eos_token_id": stops.stop_ids},
    )


class _HParams:
    """The architecture's hyper-parameters, read from the GGUF metadata.

    Raises:
        ModelError: for an unsupported architecture or RoPE scaling.
    """

    def __init__(self, gguf: GGUFFile) -> None:
        self._gguf = gguf
        self.arch_name = str(gguf.require("general.architecture"))
        arch = _ARCHITECTURES.get(self.arch_name)
        if arch is None:
            raise ModelError(
                f"{gguf.path}: GGUF architecture {self.arch_name!r} is not supported "
                f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
            )
        self.arch = arch
        self.n_layers = int(self._get("block_count"))
        self.d_model = int(self._get("embedding_length"))
        self.n_heads = int(self._get("attention.head_count"))
        self.n_heads_kv = int(self._get("attention.head_count_kv", self.n_heads))
        self.head_dim = int(self._get("attention.key_length", self.d_model // self.n_heads))
        self.rotary_dim = int(self._get("rope.dimension_count", self.head_dim))
        self.rope_base = float(self._get("rope.freq_base", 10_000.0))
        self.rms_epsilon = float(self._get("attention.layer_norm_rms_epsilon"))
        self.context_length = int(self._get("context_length", 2048))
        self.sliding_window = int(self._get("attention.sliding_window", 0)) if arch.gemma else 0
        if arch.gemma and self.n_layers == _GEMMA3_27B_LAYERS:
            # llama.cpp scales 27B's queries by 1/sqrt(d_model / heads), not 1/sqrt(head_dim).
            raise ModelError(f"{gguf.path}: Gemma 3 27B's attention scale is not supported")
        self.rope_scaling = _rope_scaling(gguf, self)

    def _get(self, key: str, default: Any = None) -> Any:
        value = self._gguf.get(f"{self.arch_name}.{key}", default)
        if value is None:
            raise ModelError(f"{self._gguf.path} lacks the GGUF metadata key {self.arch_name}.{key}")
        return value

    def decoder_spec(self) -> Any:
        """Return an empty CTranslate2 spec of Llama's block with these sizes."""
        import ctranslate2.specs as specs  # heavy import, only when converting

        gemma = self.arch.gemma
        spec = specs.TransformerDecoderModelSpec.from_config(
            self.n_layers,
            self.n_heads,
            pre_norm=True,
            activation=specs.Activation.GELUTanh if gemma else specs.Activation.SWISH,
            ffn_glu=True,
            rms_norm=True,
            rotary_dim=0 if self.rotary_dim == self.head_dim else self.rotary_dim,
            rotary_interleave=False,
            rotary_base=self.rope_base,
            num_heads_kv=None if self.n_heads_kv == self.n_heads else self.n_heads_kv,
            head_dim=None if self.head_dim == self.d_model // self.n_heads else self.head_dim,
            pre_post_layer_norm=gemma,
            qk_norm=self.arch.qk_norm,
            # Gemma: set again per layer below (0 on global layers).
            sliding_window=self.sliding_window if gemma else None,
            **self.rope_scaling.spec_options(),
        )
        self.rope_scaling.set(spec.decoder.layer)
        # llama.cpp stores Gemma's norm weights with the 1 already added
        # (x * (1 + w) is x * w' there): plain RMS norms, no residual form.
        spec.decoder.scale_embeddings = gemma
        if gemma:
            for i, layer in enumerate(spec.decoder.layer):
                attention = layer.self_attention
                if self.is_global_layer(i):
                    attention.sliding_window = np.int32(0)
                else:
                    attention.sliding_window = np.int32(self.sliding_window)
                    attention.rotary_base = np.float32(self._get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE))
        return spec

    def is_global_layer(self, index: int) -> bool:
        """Gemma 3: whether layer ``index`` attends to the whole context (llama.cpp's rule).

        The pattern is either one flag per layer (true: sliding window) or a
        period N: the last layer of every N is global (0: none is).
        """
        pattern = self._gguf.get(f"{self.arch_name}.attention.sliding_window_pattern", _GEMMA3_GLOBAL_EVERY)
        if isinstance(pattern, list):
            return not pattern[index]
        every = int(pattern)
        return every > 0 and index % every == every - 1


def _set_layers(layers: Any, gguf: GGUFFile, hparams: _HParams) -> None:
    """Fill each transformer block's spec from the GGUF tensors ``blk.N.*``."""
    arch = hparams.arch
    for i, layer in enumerate(layers):
        tensor = f"blk.{i}.{{}}".format
        attention = layer.self_attention
        if arch.gemma:
            layer.input_layer_norm.gamma = gguf.dequantize(tensor("attn_norm.weight"))
            layer.post_attention_layer_norm.gamma = gguf.dequantize(tensor("post_attention_norm.weight"))
            layer.pre_feedforward_layer_norm.gamma = gguf.dequantize(tensor("ffn_norm.weight"))
            layer.post_feedforward_layer_norm.gamma = gguf.dequantize(tensor("post_ffw_norm.weight"))
        else:
            attention.layer_norm.gamma = gguf.dequantize(tensor("attn_norm.weight"))
            layer.ffn.layer_norm.gamma = gguf.dequantize(tensor("ffn_norm.weight"))
        if arch.qk_norm:
            attention.q_norm.gamma = gguf.dequantize(tensor("attn_q_norm.weight"))
            attention.k_norm.gamma = gguf.dequantize(tensor("attn_k_norm.weight"))

        if arch.fused:
            qkv = gguf.dequantize(tensor("attn_qkv.weight"))
        else:
            q = gguf.dequantize(tensor("attn_q.weight"))
            k = gguf.dequantize(tensor("attn_k.weight"))
            if arch.permuted_qk:
                q = _unpermute_rows(q, hparams.n_heads)
                k = _unpermute_rows(k, hparams.n_heads_kv)
            qkv = np.concatenate([q, k, gguf.dequantize(tensor("attn_v.weight"))])
        _set_linear(attention.linear[0], _int8_rows(qkv))
        if arch.qkv_bias:
            attention.linear[0].bias = np.concatenate([gguf.dequantize(tensor(f"attn_{p}.bias")) for p in "qkv"])
        _set_linear(attention.linear[1], _int8_tensor(gguf, tensor("attn_output.weight")))
        if arch.fused:
            gate_up = _int8_tensor(gguf, tensor("ffn_up.weight"))
            half = gate_up[0].shape[0] // 2
            _set_linear(layer.ffn.linear_0, (gate_up[0][:half], gate_up[1][:half]))
            _set_linear(layer.ffn.linear_0_noact, (gate_up[0][half:], gate_up[1][half:]))
        else:
            _set_linear(layer.ffn.linear_0, _int8_tensor(gguf, tensor("ffn_gate.weight")))
            _set_linear(layer.ffn.linear_0_noact, _int8_tensor(gguf, tensor("ffn_up.weight")))
        _set_linear(layer.ffn.linear_1, _int8_tensor(gguf, tensor("ffn_down.weight")))


@dataclass(frozen=True, slots=True)
class _RopeScaling:
    """How a GGUF stretches its rotary embeddings, as CTranslate2 options."""

    #: ``None``, ``"linear"`` or ``"llama3"``.
    kind: str | None = None
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def spec_options(self) -> dict[str, Any]:
        import ctranslate2.specs as specs

        if self.kind == "linear":
            return {"rotary_scaling_type": specs.RotaryScalingType.Linear, "rotary_scaling_factor": self.factor}
        if self.kind == "llama3":
            return {
                "rotary_scaling_type": specs.RotaryScalingType.Llama3,
                "rotary_scaling_factor": self.factor,
                "original_max_position_embeddings": self.original_context,
            }
        return {}

    def set(self, layers: Any) -> None:
        if self.kind == "llama3":
            for layer in layers:
                attention = layer.self_attention
                attention.rotary_low_freq_factor = np.float32(self.low_freq_factor)
                attention.rotary_high_freq_factor = np.float32(self.high_freq_factor)
                # CTranslate2's spec declares the factor for linear scaling only, yet its
                # Llama 3 rotary reads it (default 1: no scaling at all); its own Hugging Face
                # converter leaves it out. Set it past the spec's frozen attribute list.
                object.__setattr__(attention, "rotary_scaling_factor", np.float32(self.factor))


def _rope_scaling(gguf: GGUFFile, hparams: _HParams) -> _RopeScaling:
    """Read the RoPE scaling of a GGUF.

    Linear scaling is in the metadata. Llama 3.1's scaling is stored as one
    frequency factor per rotary pair (``rope_freqs.weight``); its parameters
    are recovered from those factors (the original context length can be
    taken as 8192: only its ratios to the two frequency factors matter).

    Raises:
        ModelError: for scalings CTranslate2 cannot run (YaRN, LongRoPE).
    """
    kind = gguf.get(f"{hparams.arch_name}.rope.scaling.type", "none")
    if kind == "linear":
        return _RopeScaling("linear", float(gguf.require(f"{hparams.arch_name}.rope.scaling.factor")))
    if kind not in ("none", None):
        raise ModelError(f"{gguf.path}: RoPE scaling {kind!r} is not supported")
    if any(name.startswith("rope_factors_") for name in gguf.tensors):
        raise ModelError(f"{gguf.path}: LongRoPE (rope_factors_long/short) is not supported")
    if "rope_freqs.weight" not in gguf.tensors:
        return _RopeScaling()
    factors = gguf.dequantize("rope_freqs.weight").astype(np.float64)
    return _llama3_scaling(factors, hparams.rope_base, hparams.rotary_dim, gguf.path)


def _llama3_scaling(factors: npt.NDArray[np.float64], base: float, rotary_dim: int, where: Path) -> _RopeScaling:
    """Recover Llama 3.1's scaling parameters from its per-pair frequency factors.

    Llama 3.1 divides each rotary frequency by 1 (short wavelengths), by
    ``factor`` (long ones), or in between by ``1 / ((1 - s) / factor + s)``
    with ``s`` linear in ``context / wavelength``.
    """
    scaling = _RopeScaling("llama3")
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return _RopeScaling()
    wavelengths = 2 * np.pi * base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    x = scaling.original_context / wavelengths
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    middle = (smooth > 1e-6) & (smooth < 1 - 1e-6)
    if middle.sum() >= 2:
        slope, intercept = np.polyfit(x[middle], smooth[middle], 1)
        low, high = -intercept / slope, (1 - intercept) / slope
    else:  # no pair in between: any boundary between the two plateaus will do
        low = float(x[factors > 1 + 1e-6].max()) * 1.0001
        high = float(x[factors <= 1 + 1e-6].min()) * 0.9999
    scaling = _RopeScaling("llama3", factor, float(low), float(high))
    if not np.allclose(_llama3_factors(scaling, x), factors, rtol=1e-3, atol=1e-4):
        raise ModelError(f"{where}: rope_freqs.weight is not a Llama 3.1 RoPE scaling; it is not supported")
    return scaling


def _llama3_factors(scaling: _RopeScaling, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """The frequency factors of ``scaling`` at ``x = original_context / wavelength``."""
    smooth = np.clip((x - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor), 0, 1)
    return np.asarray(1 / ((1 - smooth) / scaling.factor + smooth), dtype=np.float64)


@dataclass(frozen=True, slots=True)
class _StopTokens:
    bos_id: int
    #: The end of an assistant turn (``<|im_end|>``), else the GGUF's eos.
    eos_id: int
    #: Every id that ends generation.
    stop_ids: list[int]

    @classmethod
    def of(cls, vocab: GGUFVocabulary, where: Path) -> _StopTokens:
        ids = (vocab.token_id(token) for token in _END_OF_TURN_TOKENS)
        end_of_turn = [i for i in ids if i is not None]
        eos_id = end_of_turn[0] if end_of_turn else vocab.eos_id
        if eos_id is None:
            raise ModelError(f"{where} names no end-of-sequence token")
        bos_id = vocab.bos_id if vocab.bos_id is not None else eos_id
        stop_ids = list(dict.fromkeys([*end_of_turn, *([vocab.eos_id] if vocab.eos_id is not None else [])]))
        return cls(bos_id, eos_id, stop_ids)


def _embeddings(gguf: GGUFFile, progress: Progress) -> tuple[Int8Weight, Int8Weight]:
    """Return the int8 input embedding and output projection (the same object when tied).

    Upstream models with tied embeddings (Qwen2.5-0.5B, SmolLM2) may still
    store two copies in a GGUF, quantised differently; the more precise one is
    kept for both roles (saves 136 MB on Qwen2.5-0.5B). Untied models
    (Llama 3 8B, Mistral, Phi-3) keep both.
    """
    if "output.weight" not in gguf.tensors:
        tied = _int8_tensor(gguf, "token_embd.weight")
        return tied, tied
    names = ["output.weight", "token_embd.weight"]
    # Fewer stored bytes per row means coarser quantisation.
    precise, coarse = sorted(names, key=lambda n: -gguf.tensors[n].n_bytes)
    # Every 16th row is plenty to tell one matrix from two.
    sample = slice(None, None, 16)
    a, b = gguf.dequantize(precise, rows=sample), gguf.dequantize(coarse, rows=sample)
    distance = float(np.linalg.norm(a - b) / max(float(np.linalg.norm(a)), 1e-12))
    if distance > _TIED_EMBEDDING_TOLERANCE:
        progress("  separate input and output embeddings")
        return _int8_tensor(gguf, "token_embd.weight"), _int8_tensor(gguf, "output.weight")
    progress(f"  tied embeddings: keeping {precise} (copies differ by {distance:.3f})")
    tied = _int8_tensor(gguf, precise)
    return tied, tied


def _int8_tensor(gguf: GGUFFile, name: str) -> Int8Weight:
    """Dequantize and requantize a large matrix a block of rows at a time.

    The float32 form of a 152k-token embedding is 545 MB; by blocks, the
    conversion's peak memory stays near the size of the int8 result.
    """
    n_rows, n_cols = gguf.tensors[name].shape
    quantized = np.empty((n_rows, n_cols), dtype=np.int8)
    scale = np.empty(n_rows, dtype=np.float32)
    for start in range(0, n_rows, _ROWS_PER_BLOCK):
        block = slice(start, start + _ROWS_PER_BLOCK)
        quantized[block], scale[block] = _int8_rows(gguf.dequantize(name, rows=block))
    return quantized, scale


def _set_linear(linear: Any, weight: Int8Weight) -> None:
    linear.weight, linear.weight_scale = weight


def _int8_rows(weight: npt.NDArray[np.float32]) -> Int8Weight:
    """Quantise like CTranslate2's converter does: one scale per output row.

    Quantising here, tensor by tensor, keeps the peak memory of a conversion
    near the size of the int8 model instead of the float32 one.
    """
    amax = np.abs(weight).max(axis=1)
    amax[amax == 0] = 127.0
    scale = (127.0 / amax).astype(np.float32)
    quantized = np.rint(weight * scale[:, None]).astype(np.int8)
    return quantized, scale


def _unpermute_rows(weight: npt.NDArray[np.float32], n_heads: int) -> npt.NDArray[np.float32]:
    """Undo llama.cpp's ``permute()`` of Q/K rows (interleaved -> halves)."""
    rows = weight.shape[0]
    return np.ascontiguousarray(
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

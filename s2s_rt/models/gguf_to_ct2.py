"""Convert a llama.cpp GGUF chat model into a CTranslate2 decoder directory.

The output directory looks like one made by CTranslate2's own Hugging Face
converter, so :class:`s2s_rt.engines.llm.CT2ChatLLM` loads either kind:

- ``model.bin``, ``config.json``, ``vocabulary.json``: the CTranslate2 model,
  weights in int8 (one scale per output row, CTranslate2's own scheme);
- ``tokenizer.json``: the byte-level BPE tokenizer rebuilt from the GGUF
  vocabulary (token ids unchanged);
- ``tokenizer_config.json``: the chat template from the GGUF metadata, the
  bos/eos tokens, the context length;
- ``generation_config.json``: the token ids that end the assistant's turn.

Supported architectures are the ones with Llama's block (RMS norm, gated SiLU
feed-forward, rotary embeddings, grouped-query attention): ``llama`` and
``qwen2``.
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
    permuted_qk: bool
    #: Qwen2 has biases on the Q, K and V projections.
    qkv_bias: bool


_ARCHITECTURES = {
    "llama": _Architecture(permuted_qk=True, qkv_bias=False),
    "qwen2": _Architecture(permuted_qk=False, qkv_bias=True),
}


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
    embedding = _embedding(gguf, progress)
    if latin_only:
        from s2s_rt.models.latin_vocabulary import latin_token_ids

        keep = latin_token_ids(vocab)
        progress(f"  keeping {len(keep)} Latin-script tokens of {len(vocab.tokens)}")
        vocab = vocab.subset(keep)
        embedding = (embedding[0][keep], embedding[1][keep])
    decoder = spec.decoder
    decoder.embeddings.weight, decoder.embeddings.weight_scale = embedding
    # The very same arrays: CTranslate2 stores them once and aliases the other.
    decoder.projection.weight, decoder.projection.weight_scale = embedding
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
        "add_bos_token": bool(gguf.get("tokenizer.ggml.add_bos_token", False)),
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
        scaling = gguf.get(f"{self.arch_name}.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ModelError(f"{gguf.path}: RoPE scaling {scaling!r} is not supported")

    def _get(self, key: str, default: Any = None) -> Any:
        value = self._gguf.get(f"{self.arch_name}.{key}", default)
        if value is None:
            raise ModelError(f"{self._gguf.path} lacks the GGUF metadata key {self.arch_name}.{key}")
        return value

    def decoder_spec(self) -> Any:
        """Return an empty CTranslate2 spec of Llama's block with these sizes."""
        import ctranslate2.specs as specs  # heavy import, only when converting

        spec = specs.TransformerDecoderModelSpec.from_config(
            self.n_layers,
            self.n_heads,
            pre_norm=True,
            activation=specs.Activation.SWISH,
            ffn_glu=True,
            rms_norm=True,
            rotary_dim=0 if self.rotary_dim == self.head_dim else self.rotary_dim,
            rotary_interleave=False,
            rotary_base=self.rope_base,
            num_heads_kv=None if self.n_heads_kv == self.n_heads else self.n_heads_kv,
            head_dim=None if self.head_dim == self.d_model // self.n_heads else self.head_dim,
        )
        spec.decoder.scale_embeddings = False
        return spec


def _set_layers(layers: Any, gguf: GGUFFile, hparams: _HParams) -> None:
    """Fill each transformer block's spec from the GGUF tensors ``blk.N.*``."""
    for i, layer in enumerate(layers):
        tensor = f"blk.{i}.{{}}".format
        layer.self_attention.layer_norm.gamma = gguf.dequantize(tensor("attn_norm.weight"))
        layer.ffn.layer_norm.gamma = gguf.dequantize(tensor("ffn_norm.weight"))

        q = gguf.dequantize(tensor("attn_q.weight"))
        k = gguf.dequantize(tensor("attn_k.weight"))
        if hparams.arch.permuted_qk:
            q = _unpermute_rows(q, hparams.n_heads)
            k = _unpermute_rows(k, hparams.n_heads_kv)
        qkv = np.concatenate([q, k, gguf.dequantize(tensor("attn_v.weight"))])
        _set_linear(layer.self_attention.linear[0], _int8_rows(qkv))
        if hparams.arch.qkv_bias:
            layer.self_attention.linear[0].bias = np.concatenate(
                [gguf.dequantize(tensor(f"attn_{p}.bias")) for p in "qkv"]
            )
        _set_linear(layer.self_attention.linear[1], _int8_tensor(gguf, tensor("attn_output.weight")))
        _set_linear(layer.ffn.linear_0, _int8_tensor(gguf, tensor("ffn_gate.weight")))
        _set_linear(layer.ffn.linear_0_noact, _int8_tensor(gguf, tensor("ffn_up.weight")))
        _set_linear(layer.ffn.linear_1, _int8_tensor(gguf, tensor("ffn_down.weight")))


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


def _embedding(gguf: GGUFFile, progress: Progress) -> Int8Weight:
    """Return the one int8 matrix used as input embedding and output projection.

    Upstream models with tied embeddings (Qwen2.5-0.5B, SmolLM2) may still
    store two copies in a GGUF, quantised differently; the more precise one is
    kept for both roles (saves 136 MB on Qwen2.5-0.5B).
    """
    names = [n for n in ("output.weight", "token_embd.weight") if n in gguf.tensors]
    if len(names) == 1:
        return _int8_tensor(gguf, names[0])
    # Fewer stored bytes per row means coarser quantisation.
    precise, coarse = sorted(names, key=lambda n: -gguf.tensors[n].n_bytes)
    # Every 16th row is plenty to tell one matrix from two.
    sample = slice(None, None, 16)
    a, b = gguf.dequantize(precise, rows=sample), gguf.dequantize(coarse, rows=sample)
    distance = float(np.linalg.norm(a - b) / max(float(np.linalg.norm(a)), 1e-12))
    if distance > _TIED_EMBEDDING_TOLERANCE:
        raise ModelError(
            f"{gguf.path}: separate input and output embeddings are not supported (they differ by {distance:.2f})"
        )
    progress(f"  tied embeddings: keeping {precise} (copies differ by {distance:.3f})")
    return _int8_tensor(gguf, precise)


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

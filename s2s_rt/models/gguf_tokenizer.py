"""Rebuild a Hugging Face ``tokenizer.json`` from a GGUF file's vocabulary.

GGUF files hold one of two kinds of tokenizer (``tokenizer.ggml.model``):

- ``gpt2``, byte-level BPE (Qwen, Llama 3, SmolLM): three arrays (tokens,
  token types, merges) plus the *name* of the pre-tokenizer
  (``tokenizer.ggml.pre``); the regular expression itself lives in
  llama.cpp's C++ source. So the pre-tokenizers of the supported families
  are written down here, copied from the ``tokenizer.json`` each family
  publishes.
- ``llama``, SentencePiece BPE (Gemma, Mistral, Phi-3): tokens with scores
  and byte-fallback tokens ``<0x00>`` … ``<0xFF>``, no merges. SentencePiece
  joins the adjacent pair whose joined piece scores highest, so the merges
  are derived from the scores, the way Hugging Face converts these
  tokenizers, and unknown characters fall back to their UTF-8 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from s2s_rt.models.errors import ModelError

if TYPE_CHECKING:
    from s2s_rt.models.gguf_file import GGUFFile

# Token types in tokenizer.ggml.token_type (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> tuple[Any, Any]:
    """Return ``(normalizer, pre_tokenizer)`` for a ``tokenizer.ggml.pre`` name.

    Raises:
        ModelError: for a family whose splitting rules are not written here;
            guessing would silently produce token ids the model never saw.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        return normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level])
    if pre == "llama-bpe":
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        return None, pre_tokenizers.Sequence([split, byte_level])
    if pre in ("smollm", "starcoder", "refact"):
        # StarCoder-style: every digit on its own, then GPT-2's byte-level split.
        return None, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("gpt2", "gpt-2", "default"):
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise ModelError(
        f"unsupported GGUF pre-tokenizer {pre!r}: supported are qwen2, llama-bpe, "
        "smollm, starcoder, gpt2; convert this model with CTranslate2's own converter "
        "and pass its directory instead"
    )


@dataclass(frozen=True, slots=True)
class GGUFVocabulary:
    """The tokenizer fields of a GGUF file, read once."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    #: ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece).
    model: str = "gpt2"
    #: SentencePiece: each token's score (higher merges first).
    scores: list[float] | None = None
    #: SentencePiece: text starts with a space (``▁``) as if a word began there.
    add_space_prefix: bool = True

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> GGUFVocabulary:
        """Read the vocabulary of an opened GGUF file.

        Raises:
            ModelError: if the GGUF tokenizer is neither byte-level BPE nor
                SentencePiece.
        """
        kind = gguf.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelError(
                f"{gguf.path}: unsupported GGUF tokenizer model {kind!r} "
                "(supported: 'gpt2', byte-level BPE, and 'llama', SentencePiece)"
            )
        tokens = gguf.require("tokenizer.ggml.tokens")
        return cls(
            tokens=tokens,
            token_types=gguf.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens),
            merges=gguf.require("tokenizer.ggml.merges") if kind == "gpt2" else [],
            pre=gguf.get("tokenizer.ggml.pre", "default"),
            bos_id=gguf.get("tokenizer.ggml.bos_token_id"),
            eos_id=gguf.get("tokenizer.ggml.eos_token_id"),
            unk_id=gguf.get("tokenizer.ggml.unknown_token_id"),
            model=kind,
            scores=gguf.require("tokenizer.ggml.scores") if kind == "llama" else None,
            add_space_prefix=bool(gguf.get("tokenizer.ggml.add_space_prefix", True)),
        )

    def subset(self, keep: list[int]) -> GGUFVocabulary:
        """Return the vocabulary of tokens ``keep`` (ascending old ids), renumbered.

        Token ``keep[i]`` becomes token ``i``; merge rules survive when both
        parts and their result are kept, so text made only of kept tokens is
        split exactly as before.
        """
        tokens = [self.tokens[i] for i in keep]
        kept = set(tokens)
        merges = [rule for rule in self.merges if rule.replace(" ", "", 1) in kept and set(_merge_pair(rule)) <= kept]
        new_id = {old: new for new, old in enumerate(keep)}

        def renumber(token_id: int | None) -> int | None:
            return None if token_id is None else new_id.get(token_id)

        return GGUFVocabulary(
            tokens=tokens,
            token_types=[self.token_types[i] for i in keep],
            merges=merges,
            pre=self.pre,
            bos_id=renumber(self.bos_id),
            eos_id=renumber(self.eos_id),
            unk_id=renumber(self.unk_id),
            model=self.model,
            scores=None if self.scores is None else [self.scores[i] for i in keep],
            add_space_prefix=self.add_space_prefix,
        )

    def token_id(self, token: str) -> int | None:
        """Return the id of ``token``, or None when the vocabulary lacks it."""
        try:
            return self.tokens.index(token)
        except ValueError:
            return None


def _merge_pair(rule: str) -> tuple[str, str]:
    left, right = rule.split(" ", 1)
    return left, right


def build_tokenizer(vocab: GGUFVocabulary) -> Tokenizer:
    """Build the tokenizer a GGUF vocabulary describes (byte-level BPE or SentencePiece).

    Control tokens (``<|im_start|>``…) become special added tokens, so they
    are matched whole in prompts and skipped when decoding with
    ``skip_special_tokens``; user-defined ones (``<tool_call>``) become
    plain added tokens.

    Args:
        vocab: the tokenizer fields of the GGUF file.

    Returns:
        A tokenizer whose ids equal the model's token ids.

    Raises:
        ModelError: for an unsupported pre-tokenizer.
    """
    if vocab.model == "llama":
        tokenizer = _sentencepiece_tokenizer(vocab)
    else:
        normalizer, pre_tokenizer = _pre_tokenizer(vocab.pre)
        ids = {token: i for i, token in enumerate(vocab.tokens)}
        # Byte-level tokens never contain a space (it is mapped to "Ġ"), so the
        # single space in a merge rule is the separator.
        merges = [_merge_pair(rule) for rule in vocab.merges]
        tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges, fuse_unk=False))
        if normalizer is not None:
            tokenizer.normalizer = normalizer
        tokenizer.pre_tokenizer = pre_tokenizer
        tokenizer.decoder = decoders.ByteLevel()

    control = [t for t, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind == _CONTROL]
    user = [t for t, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tokenizer


def _sentencepiece_tokenizer(vocab: GGUFVocabulary) -> Tokenizer:
    """A SentencePiece BPE vocabulary as a Hugging Face BPE with byte fallback.

    SentencePiece joins, among adjacent pieces, the pair whose joined piece
    has the highest score; the same ranking as merge rules (score first, then
    token id, as Hugging Face's converter orders them) makes ``tokenizers``
    split text identically. Spaces are ``▁``; with ``add_space_prefix`` each
    text starts with one, as llama.cpp tokenises.
    """
    assert vocab.scores is not None
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    pieces = {t for t, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind in (_NORMAL, _USER_DEFINED)}
    ranked = []
    for token_id, (token, score) in enumerate(zip(vocab.tokens, vocab.scores, strict=True)):
        if token not in pieces:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in pieces and right in pieces:
                ranked.append((-score, token_id, ids[left], ids[right], left, right))
    ranked.sort()
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tokenizer = Tokenizer(
        models.BPE(
            vocab=ids,
            merges=[(left, right) for *_, left, right in ranked],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    space = [normalizers.Prepend("\u2581")] if vocab.add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*space, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(content=" ", left=1, right=0)] if vocab.add_space_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer

"""Tokenizers of a model directory, and turning streamed token ids back into text."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from s2s_rt.models.errors import PREPARE_COMMAND, ModelError

_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def encode_text(self, text: str) -> list[int]:
        """Encode plain text: control-token strings in it stay plain text."""
        ...

    def control_id(self, token: str) -> int | None:
        """Return the id of a control token (``<|im_start|>``), if it exists."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text, dropping control tokens."""
        ...


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``."""

    def __init__(self, path: Path) -> None:
        import tokenizers

        self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        # Text of the conversation is never read as markup: a user typing
        # "<|im_end|>" must not close their own turn and forge the next one.
        # Markup tokens are inserted by id (control_id) instead.
        self._tokenizer.encode_special_tokens = True

    def encode_text(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def control_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))


class SentencePieceTokenizer:
    """A SentencePiece ``tokenizer.model`` (never reads control symbols in text)."""

    def __init__(self, path: Path) -> None:
        import sentencepiece

        self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))

    def encode_text(self, text: str) -> list[int]:
        return list(self._processor.encode(text, out_type=int))

    def control_id(self, token: str) -> int | None:
        token_id = int(self._processor.piece_to_id(token))
        return None if token_id == self._processor.unk_id() and token != "<unk>" else token_id

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._processor.decode(list(ids)))


def load_tokenizer(model_dir: Path) -> Tokenizer:
    if (model_dir / "tokenizer.json").is_file():
        return HFTokenizer(model_dir / "tokenizer.json")
    if (model_dir / "tokenizer.model").is_file():
        return SentencePieceTokenizer(model_dir / "tokenizer.model")
    raise ModelError(
        f"{model_dir / 'tokenizer.json'} is missing (an LLM directory needs tokenizer.json "
        f"or a SentencePiece tokenizer.model); for the presets, fix: {PREPARE_COMMAND}"
    )


class TextStream:
    """Turns token ids, one at a time, into complete pieces of text.

    A byte-level token can end in the middle of a UTF-8 character, and
    SentencePiece drops a word's leading space when it starts the decoded
    text; so each new token is decoded together with the previous few and
    only the text that is complete is released.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # end of what has been released

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while incomplete)."""
        self._ids.append(token_id)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


def begin_ids(tokenizer_config: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """The BOS token, for models that start every prompt with it (Gemma, Llama 3)."""
    token = tokenizer_config.get("bos_token")
    if isinstance(token, dict):  # tokenizer_config's AddedToken form
        token = token.get("content")
    if not tokenizer_config.get("add_bos_token") or not isinstance(token, str):
        return []
    token_id = tokenizer.control_id(token)
    return [] if token_id is None else [token_id]


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path} is unreadable ({exc}); fix: {PREPARE_COMMAND} --force") from exc
    return value if isinstance(value, dict) else {}


def read_vocabulary(model_dir: Path) -> list[str]:
    """Return CTranslate2's vocabulary: the prompt is given to it as token strings."""
    json_path, text_path = model_dir / "vocabulary.json", model_dir / "vocabulary.txt"
    try:
        if json_path.is_file():
            tokens = json.loads(json_path.read_text(encoding="utf-8"))
            if isinstance(tokens, list):
                return [str(t) for t in tokens]
        elif text_path.is_file():
            # Tokens may hold "\r" or U+2028, which splitlines() would split on.
            lines = text_path.read_text(encoding="utf-8").split("\n")
            return lines[:-1] if lines and not lines[-1] else lines
    except (OSError, ValueError) as exc:
        raise ModelError(f"{json_path} is unreadable ({exc}); fix: {PREPARE_COMMAND} --force") from exc
    raise ModelError(f"{json_path} is missing; fix: {PREPARE_COMMAND} --force")

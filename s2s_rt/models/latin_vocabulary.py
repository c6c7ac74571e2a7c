"""Choose the Latin-script part of a byte-level BPE vocabulary.

Qwen2's 152k tokens are a third Chinese, Japanese, Korean, Cyrillic, Arabic…
An English voice assistant never needs them, and they cost twice: every
generated token multiplies the hidden state by the whole output matrix
(896 x 152k), and a small model drifts into Chinese mid-answer that the TTS
voice cannot speak. Keeping the Latin-script tokens (104k of 152k) tokenises
English and code exactly as before (checked on 40k lines of prose and Python),
while text in other scripts falls back to byte tokens.
"""

from __future__ import annotations

from s2s_rt.models.gguf_tokenizer import GGUFVocabulary

_NORMAL_TOKEN = 1

#: Code points kept: Latin, IPA, combining marks, Greek (maths), Latin
#: Extended Additional, punctuation, symbols, arrows, maths, shapes,
#: variation selectors, the replacement character, emoji.
_KEPT_CODE_POINTS = (
    (0x0000, 0x03FF),
    (0x1E00, 0x1EFF),
    (0x2000, 0x2BFF),
    (0xFE00, 0xFE0F),
    (0xFFFD, 0xFFFD),
    (0x1F000, 0x1FAFF),
)

#: First bytes of a UTF-8 sequence that may begin a kept character (a token
#: can end half-way through one): ASCII, U+0080-U+03FF, U+1xxx (Latin
#: Extended Additional), U+2xxx (punctuation, symbols), U+Fxxx (variation
#: selectors), U+1Fxxx (emoji).
_KEPT_LEAD_BYTES = frozenset([*range(0x00, 0x80), *range(0xC2, 0xD0), 0xE1, 0xE2, 0xEF, 0xF0])


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from the printable stand-ins of byte-level BPE to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = dict(zip(printable, printable, strict=True))
    extra = 0
    for byte in range(256):
        if byte not in stand_ins:
            stand_ins[byte] = 256 + extra
            extra += 1
    return {chr(char): byte for byte, char in stand_ins.items()}


_ALPHABET = _byte_level_alphabet()


def _is_kept_char(char: str) -> bool:
    code = ord(char)
    return any(low <= code <= high for low, high in _KEPT_CODE_POINTS)


def _is_latin(token_bytes: bytes) -> bool:
    """Whether a token's bytes can only be part of Latin-script text.

    A token may start with the tail of a character (continuation bytes, which
    say nothing of the script: kept) and end with the head of one (kept when
    its lead byte can start a kept character).
    """
    start = 0
    while start < len(token_bytes) and 0x80 <= token_bytes[start] <= 0xBF:
        start += 1
    body = token_bytes[start:]
    try:
        text, head = body.decode("utf-8"), b""
    except UnicodeDecodeError as error:
        if error.reason != "unexpected end of data":
            return False
        text, head = body[: error.start].decode("utf-8", errors="replace"), body[error.start :]
        if "\ufffd" in text:
            return False
    return all(_is_kept_char(c) for c in text) and (not head or head[0] in _KEPT_LEAD_BYTES)


def latin_token_ids(vocab: GGUFVocabulary) -> list[int]:
    """Return the ids (ascending) of the tokens to keep for Latin-script text.

    Keeps every control and user-defined token, the 256 single bytes, every
    token whose text is Latin script (see :data:`_KEPT_CODE_POINTS`), and the
    parts of every merge rule that builds a kept token, so that the BPE path
    to each kept token survives.
    """
    keep: set[int] = set()
    for token_id, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if kind != _NORMAL_TOKEN or len(token) == 1:
            keep.add(token_id)
        elif all(c in _ALPHABET for c in token) and _is_latin(bytes(_ALPHABET[c] for c in token)):
            keep.add(token_id)
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    rules = [(ids.get(left + right), ids[left], ids[right]) for left, right in (r.split(" ", 1) for r in vocab.merges)]
    grown = True
    while grown:  # a kept token's parts may themselves need their parts
        grown = False
        for result, left, right in rules:
            if result in keep and not (left in keep and right in keep):
                keep.update((left, right))
                grown = True
    return sorted(keep)

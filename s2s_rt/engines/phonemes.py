"""Text -> IPA phonemes with espeak-ng, the way Piper voices were trained.

espeak-ng comes from the ``espeakng-loader`` package (its shared library and
data) and is called through ctypes, so no compiler and no system package is
needed. The library is one global C state machine that is not re-entrant: one
process-wide lock guards every call, and the selected voice is part of what
it guards.

Piper's phonemizer uses a fork of espeak-ng that reports each clause's
terminator. The stock library here does not, so the terminator is read from
the text espeak-ng consumed for that clause: it stops right after the
punctuation that ended the clause.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import threading
import unicodedata
from pathlib import Path
from typing import ClassVar

#: espeak_AUDIO_OUTPUT: synchronous, no audio device is opened.
_AUDIO_OUTPUT_SYNCHRONOUS = 0x02
#: Input text encoding: let espeak-ng detect UTF-8.
_ESPEAK_CHARS_AUTO = 0
#: Phoneme output: IPA, no separators (what Piper uses).
_ESPEAK_PHONEMES_IPA = 0x02

#: Clause punctuation as Piper's espeak-ng fork reports it: the mark Piper
#: writes (empty for none) and whether it ends a sentence. An ellipsis ends a
#: clause but gets no mark; a dash is a semicolon.
_TERMINATORS = {
    ".": (".", True),
    "?": ("?", True),
    "!": ("!", True),
    ",": (",", False),
    ":": (":", False),
    ";": (";", False),
    "…": ("", False),
    "—": (";", False),
    "。": (".", True),
    "？": ("?", True),
    "！": ("!", True),
    "，": (",", False),
    "、": (",", False),
    "：": (":", False),
    "；": (";", False),
}
#: Closing quotes and brackets may follow the punctuation that ends a clause.
_CLOSERS = "\"'”’»)]}"
#: espeak-ng marks words in another language with "(lang)" flags; Piper drops them.
_LANGUAGE_FLAG = re.compile(r"\([^)]+\)")

Sentence = list[str]


class EspeakError(RuntimeError):
    """espeak-ng could not be loaded, initialised, or given a voice."""


def espeak_paths() -> tuple[Path, Path]:
    """The shared library and data directory shipped by ``espeakng-loader``.

    Found without importing the package, whose import has side effects on
    ``LD_LIBRARY_PATH``.

    Raises:
        EspeakError: the package is not installed.
    """
    spec = importlib.util.find_spec("espeakng_loader")
    if spec is None or not spec.submodule_search_locations:
        raise EspeakError("the espeakng-loader package is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / "libespeak-ng.so", root / "espeak-ng-data"


class EspeakPhonemizer:
    """Phonemize text into sentences of IPA symbols, as Piper does.

    Each sentence is a list of phonemes: Unicode code points of the IPA
    after NFD decomposition (so a diacritic is its own phoneme), with the
    clause punctuation kept (``, : ;`` followed by a space), ready for a
    voice's ``phoneme_id_map``.

    Use :func:`espeak_phonemizer` for the process-wide instance.

    Args:
        library: path of ``libespeak-ng.so``.
        data_dir: espeak-ng's ``espeak-ng-data`` directory.

    Raises:
        EspeakError: the library cannot be loaded or initialised.
    """

    # The C library's state is per process, not per instance: every
    # instance shares one lock and one record of the selected voice.
    _lock: ClassVar[threading.Lock] = threading.Lock()
    _voice: ClassVar[str | None] = None

    def __init__(self, library: Path, data_dir: Path) -> None:
        try:
            lib = ctypes.CDLL(str(library))
        except OSError as exc:
            raise EspeakError(f"cannot load {library}: {exc}") from exc
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        self._lib = lib
        with self._lock:
            sample_rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, str(data_dir).encode(), 0)
            EspeakPhonemizer._voice = None
        if sample_rate <= 0:
            raise EspeakError(f"espeak_Initialize failed with data at {data_dir}")
        self.library = library
        self.data_dir = data_dir

    def phonemize(self, text: str, voice: str) -> list[Sentence]:
        """Convert text to phonemes, one list per sentence.

        Args:
            text: plain text in the voice's language.
            voice: an espeak-ng voice name such as ``en-us`` (a Piper
                voice's ``espeak.voice``).

        Returns:
            The sentences' phonemes; empty when the text has nothing to say.

        Raises:
            EspeakError: espeak-ng does not know the voice.
        """
        # A NUL would end the C string early and drop the rest of the text.
        data = text.replace("\0", " ").encode("utf-8")
        if not data.strip():
            return []
        with self._lock:
            self._set_voice(voice)
            clauses = self._clauses(data)
        sentences: list[Sentence] = []
        current: Sentence = []
        for phonemes, terminator, ends_sentence in clauses:
            phonemes = _LANGUAGE_FLAG.sub("", phonemes) + terminator
            if terminator in (",", ":", ";"):
                phonemes += " "
            current.extend(unicodedata.normalize("NFD", phonemes))
            if ends_sentence and current:
                sentences.append(current)
                current = []
        if current:
            sentences.append(current)
        return sentences

    def _set_voice(self, voice: str) -> None:
        if voice == self._voice:
            return
        if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
            EspeakPhonemizer._voice = None
            raise EspeakError(f"espeak-ng has no voice {voice!r}")
        EspeakPhonemizer._voice = voice

    def _clauses(self, data: bytes) -> list[tuple[str, str, bool]]:
        """(phonemes, terminator, ends sentence) of each clause, in order."""
        buffer = ctypes.create_string_buffer(data)
        start = ctypes.addressof(buffer)
        cursor = ctypes.c_void_p(start)
        clauses: list[tuple[str, str, bool]] = []
        while cursor.value:
            before = cursor.value - start
            result = self._lib.espeak_TextToPhonemes(ctypes.byref(cursor), _ESPEAK_CHARS_AUTO, _ESPEAK_PHONEMES_IPA)
            phonemes = (result or b"").decode("utf-8", errors="replace")
            at_end = not cursor.value
            after = len(data) if at_end else cursor.value - start
            if not at_end and after <= before:
                break  # no progress: never loop forever on odd input
            consumed = data[before:after].decode("utf-8", errors="replace")
            if not at_end:
                # espeak-ng has read one character past the clause to decide
                # that it ended; it keeps that character for the next clause.
                consumed = consumed[:-1]
            clauses.append((phonemes, *_terminator(consumed, at_end)))
        return clauses


def _terminator(clause_text: str, at_end: bool) -> tuple[str, bool]:
    """The mark Piper appends after a clause, and whether the sentence ends there.

    Args:
        clause_text: the text espeak-ng consumed for the clause.
        at_end: the clause is the last of the text.
    """
    tail = clause_text.rstrip().rstrip(_CLOSERS).rstrip()
    run_start = len(tail)
    while run_start > 0 and tail[run_start - 1] in _TERMINATORS:
        run_start -= 1
    run = tail[run_start:]
    if run.startswith("..."):
        run = "…"
    if run:
        # Of "?!" or "!!", espeak-ng reports the first mark.
        return _TERMINATORS[run[0]]
    # No punctuation: the end of the text or a paragraph break ends a
    # sentence; an over-long clause cut by espeak-ng does not.
    return "", at_end or "\n" in clause_text


_instance: EspeakPhonemizer | None = None
_instance_lock = threading.Lock()


def espeak_phonemizer() -> EspeakPhonemizer:
    """The process-wide phonemizer (espeak-ng can be initialised only once).

    Raises:
        EspeakError: espeak-ng cannot be loaded or initialised.
    """
    global _instance
    with _instance_lock:
        if _instance is None:
            library, data_dir = espeak_paths()
            _instance = EspeakPhonemizer(library, data_dir)
        return _instance

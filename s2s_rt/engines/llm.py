"""The chat LLM engine: a CTranslate2 decoder that streams its answer.

One :class:`CT2ChatLLM` is loaded per process and shared by every slot:
``ctranslate2.Generator`` queues concurrent requests onto its
``inter_threads`` workers, and the tokenizer is read-only after loading.

A model directory holds the CTranslate2 model (``model.bin``,
``config.json``, ``vocabulary.json|txt``), a tokenizer (``tokenizer.json`` or
a SentencePiece ``tokenizer.model``), and, as Hugging Face lays it out, the
chat template in ``tokenizer_config.json`` and the end-of-turn ids in
``generation_config.json``. ``s2s-rt models prepare`` writes such directories;
so does CTranslate2's own converter with ``--copy_files``.
"""

from __future__ import annotations

import abc
import atexit
import functools
import json
import logging
import re
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from s2s_rt.engines.base import ChatMessage, LLMUsage, StopCheck
from s2s_rt.engines.prompt_cache import ConversationPrefixes, StaticPrefixes
from s2s_rt.memory import release_freed_memory
from s2s_rt.models.errors import PREPARE_COMMAND, ModelError
from s2s_rt.toolcalls import chat_tool

#: At or below this temperature, decoding is greedy (deterministic).
GREEDY_TEMPERATURE = 0.01
#: Sampling keeps the most likely 40 tokens, then the top 95 % of probability.
SAMPLING_TOP_K = 40
SAMPLING_TOP_P = 0.95
#: Context budget when the model directory does not state one.
DEFAULT_CONTEXT_TOKENS = 4096

_REPLACEMENT_CHAR = "\ufffd"
#: A user turn after a system prompt, to find where the system prompt's tokens end.
_ANY_USER = ChatMessage("user", "Hello")

#: A kept model state is used only when it, and what is read after it, are at least this many tokens.
#: CTranslate2's int8 matrix products on the CPU compute a block of one to three rows differently from a
#: taller one: on an AVX-512 VNNI Xeon a kept prefix of 2-3 tokens, or 1-2 tokens read after one, moved
#: the next token's logits by 0.7-3, where longer pieces matched a whole reading exactly.
MIN_KEPT_TOKENS = 8
#: How far a kept state's next-token logits may be from a whole reading's, as a fraction of the largest
#: logit: float rounding only. Measured on the CPU: 2e-7 of it (int8 with VNNI, or float32); int8 on AVX2
#: without VNNI, 3-10 %. On a GPU, 16-bit rounding may exceed it; the cache is then off, which costs
#: little there, where reading a prompt is fast.
KEPT_STATE_TOLERANCE = 1e-3
#: The start-up check's prompt: about 40 tokens, long enough for three splits with
#: :data:`MIN_KEPT_TOKENS` on either side, short enough to cost about 0.2 s on two cores.
_PROBE = (
    ChatMessage("system", "You are a helpful voice assistant. Answer in one short, friendly sentence."),
    ChatMessage("user", "How many legs does a spider have, and why?"),
)

log = logging.getLogger(__name__)


# --- tokenizers ----------------------------------------------------------------


class _Tokenizer(Protocol):
    def encode_text(self, text: str) -> list[int]:
        """Encode plain text: control-token strings in it stay plain text."""
        ...

    def control_id(self, token: str) -> int | None:
        """Return the id of a control token (``<|im_start|>``), if it exists."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text, dropping control tokens."""
        ...


class _HFTokenizer:
    """A Hugging Face ``tokenizer.json``."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))
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


class _SentencePieceTokenizer:
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


def _load_tokenizer(model_dir: Path) -> _Tokenizer:
    if (model_dir / "tokenizer.json").is_file():
        return _HFTokenizer(model_dir / "tokenizer.json")
    if (model_dir / "tokenizer.model").is_file():
        return _SentencePieceTokenizer(model_dir / "tokenizer.model")
    raise ModelError(
        f"{model_dir / 'tokenizer.json'} is missing (an LLM directory needs tokenizer.json "
        f"or a SentencePiece tokenizer.model); for the presets, fix: {PREPARE_COMMAND}"
    )


# --- chat format ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation in a model's chat format, as token ids."""

    #: One list of ids per turn, the answer's opening last; kept apart so
    #: that the oldest turns can be dropped to fit the context.
    turns: list[list[int]]
    #: Leading turns never dropped (the system turn).
    pinned: int


class ChatFormat(abc.ABC):
    """A chat model's turn markup, rendering a conversation as token ids.

    What every format shares, as Qwen2.5's template does it:

    - without a system message, the template's own default one (if any)
      comes first; a format without a system role opens the first user
      turn with the system text instead;
    - offered tools are described in the system text in Qwen2.5's words
      (the "Hermes" convention), for templates without a tools section too;
      the model calls one by writing ``<tool_call>{json}</tool_call>``;
    - consecutive ``tool`` messages (function results) form one user turn of
      ``<tool_response>`` blocks;
    - a required call is begun in the prompt: the answer opens with
      ``<tool_call>``, so the model can only continue with a call.

    Markup tokens are inserted by id, never read from text; a subclass says
    how one turn and the answer's opening are written.

    Args:
        tokenizer: the model's tokenizer.
        default_system: the template's own system prompt, if any.
        begin: ids that start every prompt (the BOS token, for models that
            want it).
    """

    #: Name, for messages.
    NAME = ""
    #: Strings of a Jinja chat template that identify the format.
    MARKERS: tuple[str, ...] = ()
    #: Control tokens the vocabulary must have.
    REQUIRED: tuple[str, ...] = ()
    #: The token that ends a turn.
    END = ""
    #: False: the format has no system role (Gemma, Mistral).
    SYSTEM_ROLE = True

    def __init__(self, tokenizer: _Tokenizer, default_system: str | None = None, begin: Sequence[int] = ()) -> None:
        missing = [token for token in self.REQUIRED if tokenizer.control_id(token) is None]
        if missing:
            known = ", ".join(chat.NAME for chat in _CHAT_FORMATS)
            raise ModelError(
                f"the tokenizer lacks the {self.NAME} tokens {', '.join(missing)} "
                f"(s2s-rt supports these chat formats: {known})"
            )
        self._tokenizer = tokenizer
        end = tokenizer.control_id(self.END)
        assert end is not None, self.END  # END is one of REQUIRED
        self.end_id = end
        self.default_system = default_system
        self._begin = list(begin)

    @staticmethod
    def from_template(
        template: str | None, tokenizer: _Tokenizer, where: Path, begin: Sequence[int] = ()
    ) -> ChatFormat:
        """Recognise the chat format of a Jinja chat template, or else of a vocabulary.

        Raises:
            ModelError: if the template is of no known format and the
                vocabulary has no known format's markers either.
        """
        for chat in _CHAT_FORMATS:
            if template and any(marker in template for marker in chat.MARKERS):
                return chat.for_template(template, tokenizer, begin)
        for chat in _CHAT_FORMATS:
            if all(tokenizer.control_id(token) is not None for token in chat.REQUIRED):
                return chat(tokenizer, None, begin)
        described = "has no chat template" if not template else "uses a chat format s2s-rt does not know"
        known = ", ".join(chat.NAME for chat in _CHAT_FORMATS)
        raise ModelError(f"{where} {described}; s2s-rt supports these chat formats: {known}")

    @classmethod
    def for_template(cls, template: str, tokenizer: _Tokenizer, begin: Sequence[int]) -> ChatFormat:
        return cls(tokenizer, None, begin)

    def encode(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]] = (),
        require_tool: bool = False,
    ) -> ChatPrompt:
        """Render ``messages`` (and the offered ``tools``) as token ids.

        Args:
            messages: the conversation, oldest first.
            tools: Realtime function definitions (name, description,
                parameters).
            require_tool: the answer must be a call (only with ``tools``).
        """
        system = None
        if messages and messages[0].role == "system":
            system, messages = messages[0].content, messages[1:]
        elif self.default_system is not None:
            system = self.default_system
        if tools:
            system = (system or "") + _tools_section(tools)
        pinned: list[list[int]] = [self._begin] if self._begin else []
        if system is not None and self.SYSTEM_ROLE:
            pinned.append(self.turn("system", system))
        turns: list[list[int]] = []
        i = 0
        while i < len(messages):
            role, content = messages[i].role, messages[i].content
            i += 1
            if role == "tool":
                results = [content]
                while i < len(messages) and messages[i].role == "tool":
                    results.append(messages[i].content)
                    i += 1
                role, content = "user", "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
            if system is not None and not self.SYSTEM_ROLE and role == "user" and not turns:
                content = f"{system}\n\n{content}"
            turns.append(self.turn(role, content))
        turns.append(self.opening(TOOL_CALL_OPEN + "\n" if tools and require_tool else ""))
        return ChatPrompt([*pinned, *turns], pinned=len(pinned))

    @abc.abstractmethod
    def turn(self, role: str, content: str) -> list[int]:
        """One message as ids."""

    @abc.abstractmethod
    def opening(self, then: str) -> list[int]:
        """The start of the answer, followed by the text ``then``."""

    def _mark(self, token: str) -> list[int]:
        """A markup token by id (as text where the vocabulary lacks it: Mistral v0.1's [INST])."""
        token_id = self._tokenizer.control_id(token)
        return [token_id] if token_id is not None else self._tokenizer.encode_text(token)

    def _text(self, text: str) -> list[int]:
        return self._tokenizer.encode_text(text) if text else []


class ChatML(ChatFormat):
    """ChatML (Qwen2/3, SmolLM2 and many others): ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.

    Qwen3 thinks aloud unless told not to; its answer opens with an empty
    ``<think></think>`` block, as its template does for ``enable_thinking=False``:
    a voice must not read its reasoning out.
    """

    NAME = "ChatML"
    MARKERS = ("<|im_start|>",)
    REQUIRED = ("<|im_start|>", "<|im_end|>")
    END = "<|im_end|>"

    def __init__(
        self,
        tokenizer: _Tokenizer,
        default_system: str | None = None,
        begin: Sequence[int] = (),
        *,
        no_thinking: bool = False,
    ) -> None:
        super().__init__(tokenizer, default_system, begin)
        self._start = self._mark("<|im_start|>")
        self._newline = tokenizer.encode_text("\n")
        self._answer = "assistant\n" + ("<think>\n\n</think>\n\n" if no_thinking else "")

    @classmethod
    def for_template(cls, template: str, tokenizer: _Tokenizer, begin: Sequence[int]) -> ChatFormat:
        return cls(tokenizer, _default_system_prompt(template), begin, no_thinking="enable_thinking" in template)

    def turn(self, role: str, content: str) -> list[int]:
        return [*self._start, *self._text(f"{role}\n{content}"), self.end_id, *self._newline]

    def opening(self, then: str) -> list[int]:
        return [*self._start, *self._text(self._answer + then)]


class Llama3Chat(ChatFormat):
    """Llama 3.x: ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>``."""

    NAME = "Llama 3"
    MARKERS = ("<|start_header_id|>",)
    REQUIRED = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    END = "<|eot_id|>"

    def turn(self, role: str, content: str) -> list[int]:
        return [*self._header(role, content.strip()), self.end_id]

    def opening(self, then: str) -> list[int]:
        return self._header("assistant", then)

    def _header(self, role: str, then: str) -> list[int]:
        start, end = self._mark("<|start_header_id|>"), self._mark("<|end_header_id|>")
        return [*start, *self._text(role), *end, *self._text("\n\n" + then)]


class GemmaChat(ChatFormat):
    """Gemma: ``<start_of_turn>{user|model}\\n{content}<end_of_turn>\\n``, no system role."""

    NAME = "Gemma"
    MARKERS = ("<start_of_turn>",)
    REQUIRED = ("<start_of_turn>", "<end_of_turn>")
    END = "<end_of_turn>"
    SYSTEM_ROLE = False

    def turn(self, role: str, content: str) -> list[int]:
        role = "model" if role == "assistant" else role
        return [
            *self._mark("<start_of_turn>"),
            *self._text(f"{role}\n{content.strip()}"),
            self.end_id,
            *self._text("\n"),
        ]

    def opening(self, then: str) -> list[int]:
        return [*self._mark("<start_of_turn>"), *self._text("model\n" + then)]


class Phi3Chat(ChatFormat):
    """Phi-3: ``<|{role}|>\\n{content}<|end|>\\n``.

    Phi-3's markup tokens swallow the whitespace after them (``rstrip`` in
    its tokenizer, and in llama.cpp's), so the newlines never reach the model.
    """

    NAME = "Phi-3"
    MARKERS = ("<|assistant|>",)
    REQUIRED = ("<|user|>", "<|assistant|>", "<|end|>")
    END = "<|end|>"

    def turn(self, role: str, content: str) -> list[int]:
        return [*self._mark(f"<|{role}|>"), *self._text(content.strip()), self.end_id]

    def opening(self, then: str) -> list[int]:
        return [*self._mark("<|assistant|>"), *self._text(then)]


class MistralChat(ChatFormat):
    """Mistral: ``[INST] {user}[/INST] {answer}</s>``, no system role."""

    NAME = "Mistral"
    MARKERS = ("[INST]",)
    REQUIRED = ("</s>",)
    END = "</s>"
    SYSTEM_ROLE = False

    def turn(self, role: str, content: str) -> list[int]:
        if role == "assistant":
            return [*self._text(content.strip()), self.end_id]
        return [*self._mark("[INST]"), *self._text(content.strip()), *self._mark("[/INST]")]

    def opening(self, then: str) -> list[int]:
        return self._text(then)


#: Tried in this order, by template and then by vocabulary.
_CHAT_FORMATS: tuple[type[ChatFormat], ...] = (ChatML, Llama3Chat, GemmaChat, Phi3Chat, MistralChat)


def _tools_section(tools: Sequence[dict[str, Any]]) -> str:
    """Qwen2.5's description of the offered functions, word for word."""
    signatures = "".join(f"\n{json.dumps(chat_tool(tool), ensure_ascii=False)}" for tool in tools)
    return (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _default_system_prompt(template: str) -> str | None:
    # The default is the literal system turn the template writes when the
    # conversation has none: '<|im_start|>system\nYou are …<|im_end|>'. In the
    # template source the newline is either a real one or the escape "\n".
    match = re.search(r"<\|im_start\|>system(?:\\n|\n)([^'\"{}<>]+?)<\|im_end\|>", template)
    return match.group(1) if match else None


# --- function calls ------------------------------------------------------------

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class _CallFraming:
    """Puts ``<tool_call>`` tags around a call the model wrote without them.

    Small models offered tools often answer a call as bare JSON
    (``{"name": "get_weather", "arguments": {…}}``), in a code fence, in
    bold, or in tags of their own (``<tools>``); the server finds calls by
    their tags. An answer that starts like JSON or markup (or is a required
    call, begun in the prompt) is held back to its end and, if it holds a
    JSON object with a ``name`` (closing braces the model forgot are
    added), sent as one tagged call; any other answer streams through
    untouched.
    """

    def __init__(self, required: bool) -> None:
        self._required = required
        self._held: list[str] = []
        self._holding = required
        self._passing = False

    def feed(self, piece: str) -> str:
        """Take one piece of the answer; return what may be sent now."""
        if self._passing:
            return piece
        self._held.append(piece)
        if self._holding:
            return ""
        start = "".join(self._held).lstrip()
        if not start:
            return ""
        if start[0] in "{`<":
            self._holding = True
            return ""
        self._passing = True
        return self._release()

    def finish(self) -> str:
        """The answer ended: return what is still held, framed if a call."""
        if not self._holding:
            return self._release()
        text = self._release()
        if TOOL_CALL_OPEN in text:
            return text  # tagged already
        call = _json_object(text)
        if call is not None and "name" in call[0]:
            return f"{TOOL_CALL_OPEN}\n{call[1]}\n{TOOL_CALL_CLOSE}"
        # Not a call after all; a required one is still reported as a call, so
        # the server can tell the model what is wrong with it.
        return f"{TOOL_CALL_OPEN}\n{text}" if self._required else text

    def _release(self) -> str:
        text, self._held = "".join(self._held), []
        return text


def _json_object(text: str) -> tuple[dict[str, Any], str] | None:
    """Return the first JSON object in ``text`` and its source, if any.

    An object the text leaves open (a small model's call often lacks its
    last brace, or ends it with a stray character) is closed.
    """
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            source = _closed(re.sub(r"[^\w\]}\"]+$", "", text[start:].rstrip().removesuffix("```")))
            try:
                value = json.loads(source)
            except ValueError:
                start = text.find("{", start + 1)
                continue
            return (value, source) if isinstance(value, dict) else None
        if isinstance(value, dict):
            return value, text[start:end]
        start = text.find("{", end)
    return None


def _closed(text: str) -> str:
    """``text`` with the brackets it leaves open closed (strings are skipped)."""
    opened: list[str] = []
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            opened.append("}" if char == "{" else "]")
        elif char in "}]" and opened:
            opened.pop()
    return text + ('"' if in_string else "") + "".join(reversed(opened))


# --- incremental detokenisation ------------------------------------------------


class _TextStream:
    """Turns token ids, one at a time, into complete pieces of text.

    A byte-level token can end in the middle of a UTF-8 character, and
    SentencePiece drops a word's leading space when it starts the decoded
    text; so each new token is decoded together with the previous few and
    only the text that is complete is released.
    """

    def __init__(self, tokenizer: _Tokenizer) -> None:
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


# --- the kept state's start-up check ------------------------------------------


@dataclass(frozen=True, slots=True)
class KeptStateCheck:
    """Whether a prompt read after a kept model state is read as the whole prompt read at once.

    CTranslate2 computes a token's state in one matrix product with the
    other tokens read in the same pass. Where its int8 kernels give a row a
    result that depends on how many rows are multiplied with it (int8 on
    AVX2 without VNNI: oneDNN, CTranslate2's choice on AMD CPUs, and Intel
    MKL limited to AVX2 both do), a prompt read in two parts, as from a kept
    state, gets other logits than the same prompt read whole, and greedy
    answers differ: the cache would change what a user hears.
    """

    #: Every probe matched within float rounding: the kept state may be used.
    trusted: bool
    #: The largest difference of a next-token logit between the two readings.
    max_difference: float
    #: The largest difference allowed (float rounding).
    tolerance: float
    #: Tokens of the probe kept before the rest was read, one probe each.
    splits: tuple[int, ...]

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.trusted:
            return f"kept model state checked (next-token logits {self.max_difference:.1g} from a whole reading's)"
        return (
            f"kept model state off: a prompt read after a kept state got next-token logits "
            f"{self.max_difference:.2f} away from reading it whole (float rounding: at most {self.tolerance:.2g}; "
            f"CTranslate2's int8 kernels on this CPU depend on how many tokens are read together); "
            f"every answer reads its whole prompt"
        )


def check_kept_state(
    next_logits: Callable[[Sequence[int], Sequence[int]], np.ndarray], probe: Sequence[int]
) -> KeptStateCheck:
    """Compare a probe prompt read after kept states of its first tokens with the probe read whole.

    Args:
        next_logits: the logits of the token that follows ``kept + rest``,
            reading ``kept`` first as a kept state (nothing kept when empty),
            then ``rest``.
        probe: a prompt's token ids; at least ``2 * MIN_KEPT_TOKENS + 1``.

    Returns:
        the verdict, after up to three splits (it stops at the first that
        differs beyond float rounding).
    """
    whole = np.asarray(next_logits([], probe), dtype=np.float64)
    n = len(probe)
    splits = tuple(sorted({min(max(MIN_KEPT_TOKENS, n * i // 4), n - MIN_KEPT_TOKENS) for i in (1, 2, 3)}))
    tolerance = KEPT_STATE_TOLERANCE * max(1.0, float(np.abs(whole).max()))
    difference = 0.0
    for tried, k in enumerate(splits, 1):
        kept = np.asarray(next_logits(probe[:k], probe[k:]), dtype=np.float64)
        split_difference = float(np.abs(kept - whole).max())
        if not split_difference <= tolerance:  # NaN too
            return KeptStateCheck(False, split_difference, tolerance, splits[:tried])
        difference = max(difference, split_difference)
    return KeptStateCheck(True, difference, tolerance, splits)


# --- the engine ----------------------------------------------------------------


class CT2ChatLLM:
    """A chat LLM in CTranslate2, streaming its answers (implements ``base.LLM``).

    Args:
        model_dir: a CTranslate2 decoder directory with a tokenizer (see the
            module docstring); :func:`s2s_rt.models.resolve_llm_dir` turns a
            preset name into one.
        device: ``"cpu"`` or ``"cuda"``.
        device_index: which GPU, for ``"cuda"``.
        compute_type: CTranslate2 compute type; None picks ``int8`` on CPU
            and ``int8_float16`` on CUDA.
        inter_threads: generations that run at once (each on its own
            workers); more requests wait in CTranslate2's queue.
        intra_threads: threads per generation. On small CPUs one thread
            decodes a model of 0.5B parameters or less fastest.
        max_context_tokens: prompt plus answer budget; None takes the
            model's ``model_max_length``, at most 4096.
        repetition_penalty: > 1 discourages repeating tokens.
        temperature_scale: multiplies the temperature each answer asks for.
            Small models answer worse the more they sample: Qwen2.5-Coder-0.5B
            got 32 of the evaluation's 52 questions right at the Realtime
            API's default 0.8 and 34 greedily (BENCHMARKS.md, "Answers");
            0.25 turns 0.8 into 0.2, where it answers as well as greedily
            and still varies.
        cached_system_prompts: system prompts whose model state is kept after
            their first answer, so later answers skip reading them again (see
            :mod:`s2s_rt.engines.prompt_cache`); the server's default
            instructions, never a client's.
        prefix_cache_tokens: tokens of conversation-prefix state kept between
            answers (:meth:`prime`; 0: none); past it the model is reloaded,
            which forgets them all.
        prefix_session_tokens: the longest prefix kept for one conversation.

    Both kinds of kept state are checked once after loading
    (:func:`check_kept_state`) and turned off, with a warning, where a
    prompt read after a kept state would not be read as the whole prompt.

    Raises:
        ModelError: if a model file is missing, corrupt, or of an
            unsupported chat format.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        device_index: int = 0,
        compute_type: str | None = None,
        inter_threads: int = 1,
        intra_threads: int = 1,
        max_context_tokens: int | None = None,
        repetition_penalty: float = 1.0,
        temperature_scale: float = 1.0,
        cached_system_prompts: Sequence[str] = (),
        prefix_cache_tokens: int = 0,
        prefix_session_tokens: int = 2048,
    ) -> None:
        import ctranslate2

        self.model_dir = model_dir = Path(model_dir)
        for name in ("model.bin", "config.json"):
            if not (model_dir / name).is_file():
                raise ModelError(f"{model_dir / name} is missing; for the presets, fix: {PREPARE_COMMAND}")
        self.compute_type = compute_type or _default_compute_type(ctranslate2, device)
        self.device = device
        self._tokenizer = _load_tokenizer(model_dir)
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        self._chat = ChatFormat.from_template(
            tokenizer_config.get("chat_template"),
            self._tokenizer,
            model_dir,
            _begin_ids(tokenizer_config, self._tokenizer),
        )
        self._vocabulary = _read_vocabulary(model_dir)
        self._end_ids = self._stop_ids(tokenizer_config)
        model_max = int(tokenizer_config.get("model_max_length") or DEFAULT_CONTEXT_TOKENS)
        self.max_context_tokens = max_context_tokens or min(model_max, DEFAULT_CONTEXT_TOKENS)
        self._repetition_penalty = repetition_penalty
        self.temperature_scale = temperature_scale
        self._static = StaticPrefixes(
            lambda text: [
                i for turn in self._chat.encode([ChatMessage("system", text), _ANY_USER]).turns for i in turn
            ],
            cached_system_prompts,
        )
        self._load = functools.partial(
            ctranslate2.Generator,
            str(model_dir),
            device=device,
            device_index=device_index,
            compute_type=self.compute_type,
            inter_threads=inter_threads,
            intra_threads=intra_threads,
        )
        #: The conversation prefixes CTranslate2 holds (guarded by ``_lock``).
        self.prefixes = ConversationPrefixes(prefix_cache_tokens, prefix_session_tokens)
        self._lock = threading.Lock()
        #: Times the model was reloaded to forget held prefixes.
        self.reloads = 0
        #: Answers waiting for their first words go first.
        self.turns = Turns()
        #: Token ids that end a sentence (``turn_end_probability``).
        self._sentence_ends = [i for i, token in enumerate(self._vocabulary) if _SENTENCE_END.fullmatch(token)]
        try:
            self._generator: ctranslate2.Generator | None = self._load()
        except (RuntimeError, ValueError) as exc:
            raise ModelError(
                f"cannot load the LLM in {model_dir} ({exc}); check it with `s2s-rt models verify`, "
                f"fix: {PREPARE_COMMAND} --force"
            ) from exc
        self.threads = (inter_threads, intra_threads)
        #: The start-up check of the kept state; None when none is kept.
        self.kept_state: KeptStateCheck | None = None
        if self._static.prefixes or self.prefixes.budget_tokens:
            probe = [i for turn in self._chat.encode(_PROBE).turns for i in turn]
            self.kept_state = check_kept_state(self._next_logits, probe)
            if not self.kept_state.trusted:
                log.warning("LLM %s: %s", model_dir, self.kept_state.describe())
                self._static.prefixes = []
                self.prefixes = ConversationPrefixes(0, prefix_session_tokens)
        # Loading read each weight through temporary buffers that glibc keeps mapped: ~340 MB for the 0.5B model.
        release_freed_memory(min_interval_s=0.0)
        _LOADED.add(self)

    def close(self) -> None:
        """Release the model (streams already running finish first).

        Called for every engine still loaded when the interpreter exits.
        """
        self._generator = None

    def describe(self) -> str:
        """One line for the start-up log."""
        inter, intra = self.threads
        kept = f"; {self.kept_state.describe()}" if self.kept_state is not None else ""
        return (
            f"LLM {self.model_dir} (CTranslate2 {self.compute_type} on {self.device}, "
            f"{inter} concurrent x {intra} threads, context {self.max_context_tokens}){kept}"
        )

    def _next_logits(self, kept: Sequence[int], rest: Sequence[int]) -> np.ndarray:
        """The logits of the token after ``kept + rest``, read as :meth:`stream` reads a prompt after a kept state."""
        assert self._generator is not None
        result = self._generator.generate_batch(
            [[self._vocabulary[i] for i in rest]],
            static_prompt=[self._vocabulary[i] for i in kept] or None,
            # CTranslate2 never forgets a cached state: the probe's must not stay.
            cache_static_prompt=False,
            max_length=1,
            sampling_topk=1,
            return_logits_vocab=True,
            include_prompt_in_result=False,
        )[0]
        return np.asarray(result.logits[0][0], dtype=np.float64)

    def stream(
        self,
        messages: Sequence[ChatMessage],
        *,
        max_tokens: int,
        temperature: float,
        should_stop: StopCheck,
        usage: LLMUsage,
        tools: Sequence[dict[str, Any]] = (),
        require_tool: bool = False,
        urgent: Callable[[], bool] | None = None,
    ) -> Generator[str, None, None]:
        """Yield the assistant's answer to ``messages`` as pieces of text.

        Args:
            messages: the conversation, oldest first; the oldest non-system
                turns are left out when it does not fit the context.
            max_tokens: most tokens to generate.
            temperature: scaled by ``temperature_scale``, then <= 0.01 decodes
                greedily; above, samples.
            should_stop: checked between tokens; True ends the answer within
                one token (generation stops in CTranslate2 too).
            usage: receives input tokens before the first piece, and output
                tokens as they come.
            tools: Realtime function definitions to offer the model; it calls
                one by writing ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``.
            require_tool: the answer must be a call: it starts with
                ``<tool_call>`` already written.
            urgent: True while the answer has not been heard yet (its first
                clause not spoken). CTranslate2 decodes one answer at a time;
                answers that are not urgent stop between tokens while another
                is, and resume (reading what they said so far again) once
                none is (:class:`Turns`).
        """
        generator = self._generator
        if generator is None:
            raise RuntimeError(f"the LLM engine for {self.model_dir} is closed")
        chat = self._chat.encode(messages, tools, require_tool)
        prompt, max_tokens = self._fit(chat, max_tokens)
        usage.input_tokens = len(prompt)
        usage.output_tokens = 0
        if max_tokens <= 0 or should_stop():
            return
        temperature *= self.temperature_scale
        greedy = temperature <= GREEDY_TEMPERATURE
        static, prompt, usage.cached_tokens = self._split(prompt)
        static_tokens = [self._vocabulary[i] for i in static] or None
        said: list[int] = []  # the answer's tokens so far, read again when it resumes after giving way
        text = _TextStream(self._tokenizer)
        framing = _CallFraming(required=require_tool) if tools else None
        turns = self.turns
        waiting = urgent is not None and urgent()
        if waiting:
            turns.enter()

        def give_way() -> bool:
            # Runs in CTranslate2's worker after each token: stops the decoding itself, not only our reading of it.
            return should_stop() or (not waiting and turns.urgent > 0)

        try:
            while True:
                steps = generator.generate_tokens(
                    [self._vocabulary[i] for i in prompt + said],
                    static_prompt=static_tokens,
                    max_length=max_tokens - len(said),
                    sampling_topk=1 if greedy else SAMPLING_TOP_K,
                    sampling_topp=1.0 if greedy else SAMPLING_TOP_P,
                    sampling_temperature=1.0 if greedy else temperature,
                    repetition_penalty=self._repetition_penalty,
                    end_token=self._end_ids,
                    callback=lambda _step: give_way(),
                )
                ended = False
                try:
                    for step in steps:
                        if should_stop():
                            return
                        if step.token_id in self._end_ids:
                            ended = True
                            break
                        said.append(step.token_id)
                        usage.output_tokens += 1
                        piece = text.push(step.token_id)
                        if framing is not None:
                            piece = framing.feed(piece)
                        if piece:
                            yield piece
                        if waiting and (len(said) >= URGENT_TOKENS or (urgent is not None and not urgent())):
                            # It has spoken, or had its share: from now on it gives way to answers that have not.
                            # (An answer whose words are held back, a tool call, would otherwise stay urgent for
                            # its whole length and hold every other session's answer.)
                            waiting = False
                            turns.leave()
                finally:
                    # Closing tells CTranslate2 to stop at its next token and waits for it.
                    steps.close()
                if ended or len(said) >= max_tokens or should_stop():
                    break
                # Stopped short of its end: it gave way to an answer that has not spoken yet. Resume once none is.
                turns.wait_clear(should_stop)
                if should_stop():
                    return
                turns.resumed += 1
        finally:
            if waiting:
                turns.leave()
        rest = framing.finish() if framing is not None else ""
        if rest and not should_stop():
            yield rest

    def _split(self, prompt: list[int]) -> tuple[list[int], list[int], int]:
        """The prompt's longest prefix whose state is held (or will be: a known system prompt), the rest,
        and how many of its tokens need no reading."""
        with self._lock:
            # Shorter pieces are read differently from the whole prompt (MIN_KEPT_TOKENS).
            held = self.prefixes.find(prompt[: len(prompt) - MIN_KEPT_TOKENS + 1])
            if len(held) < MIN_KEPT_TOKENS:
                held = []
            known, rest = self._static.split(prompt)
            if len(known) < MIN_KEPT_TOKENS or len(rest) < MIN_KEPT_TOKENS:
                known, rest = [], prompt
            if len(held) > len(known):
                return held, prompt[len(held) :], len(held)
            cached = len(known) if self.prefixes.holds(known) else 0
            if known:
                # CTranslate2 keeps it from this answer on.
                self.prefixes.add(known)
            return known, rest, cached

    def prime(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = ()) -> bool:
        """Read ``messages`` now, so that the next answer after them reads only what follows.

        ``messages`` is a conversation as the next answer's prompt will
        begin (ending with the last answer); CTranslate2 keeps the model
        state after it. The next :meth:`stream` whose prompt starts with it
        reads only the new turn; one that does not (the conversation was
        changed, or cut to fit the context) reads the whole prompt, as
        without it. Past ``prefix_cache_tokens`` of held state the model is
        reloaded first, forgetting every held prefix. Costs what reading
        the conversation costs; run it when the model is otherwise idle.

        Returns:
            whether the state after ``messages`` is held now.
        """
        generator = self._generator
        if generator is None or not self.prefixes.budget_tokens:
            return False
        chat = self._chat.encode(messages, tools)
        prefix = [token for turn in chat.turns[:-1] for token in turn]
        if len(prefix) + 64 > self.max_context_tokens:
            return False  # the next answer will be cut to fit, and start differently
        with self._lock:
            if self.prefixes.holds(prefix):
                return True
            if not self.prefixes.worth_keeping(prefix):
                return False
            reload = not self.prefixes.fits(prefix)
            if reload:
                self.prefixes.clear()
            self.prefixes.add(prefix)
        if reload:
            # Streams running on the old model finish on it; it is freed after them.
            self._generator = generator = self._load()
            self.reloads += 1
        steps = generator.generate_tokens(
            [self._vocabulary[chat.turns[-1][0]]],
            static_prompt=[self._vocabulary[i] for i in prefix],
            max_length=1,
            sampling_topk=1,
        )
        for _step in steps:
            break
        steps.close()
        return True

    def turn_end_probability(self, messages: Sequence[ChatMessage]) -> float:
        """The probability that the user's words (the last message) are all they meant to say.

        It is the model's probability that the user's sentence ends right
        after the words: that its next token is a full stop, question mark
        or exclamation mark. The recogniser's own punctuation is taken off
        first: Whisper closes a fragment cut at a pause with one ("I would
        like to book a table for."), and the model, reading that, found the
        turn finished (0.41 for it, against 0.97 for a question). Read
        without it, fragments that stop mid-phrase get 0.0001 or less,
        questions, greetings and commands 0.02-0.95. One pass over a short
        prompt and one step, no sampling (:class:`~s2s_rt.turn.SemanticTurnEnd`).
        """
        generator = self._generator
        if generator is None:
            raise RuntimeError(f"the LLM engine for {self.model_dir} is closed")
        *context, last = messages
        words = last.content.strip().rstrip(" .?!,;:…")
        if not words or not self._sentence_ends:
            return 1.0
        tokens = [t for turn in self._chat.encode([*context, ChatMessage("user", words)]).turns[:-1] for t in turn]
        end = max(i for i, token in enumerate(tokens) if token == self._chat.end_id)
        tokens = tokens[:end][-self.max_context_tokens :]  # up to the words, without the turn's end
        result = generator.generate_batch(
            [[self._vocabulary[i] for i in tokens]],
            max_length=1,
            sampling_topk=1,
            return_logits_vocab=True,
            include_prompt_in_result=False,
        )[0]
        logits = np.asarray(result.logits[0][0], dtype=np.float64)
        probabilities = np.exp(logits - logits.max())
        return float(probabilities[self._sentence_ends].sum() / probabilities.sum())

    def count_tokens(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = ()) -> int:
        """Return the prompt length of ``messages`` in tokens (with the chat markup)."""
        return sum(len(turn) for turn in self._chat.encode(messages, tools).turns)

    def _fit(self, chat: ChatPrompt, max_tokens: int) -> tuple[list[int], int]:
        """Return the prompt ids and the answer budget within the context.

        Drops the oldest turns after the system prompt until the prompt leaves
        room for at least a short answer, then shortens the answer budget.
        """
        turns = list(chat.turns)
        min_answer = min(max_tokens, 64)
        # Always keep the pinned turns, the last message and the answer's opening.
        while sum(map(len, turns)) + min_answer > self.max_context_tokens and len(turns) > chat.pinned + 2:
            del turns[chat.pinned]
        prompt = [token for turn in turns for token in turn]
        if len(prompt) + min_answer > self.max_context_tokens:
            # One enormous message: keep its end, which a user speaking last said.
            prompt = prompt[len(prompt) + min_answer - self.max_context_tokens :]
        return prompt, min(max_tokens, self.max_context_tokens - len(prompt))

    def _stop_ids(self, tokenizer_config: dict[str, Any]) -> list[int]:
        ids = [self._chat.end_id]
        eos = _read_json(self.model_dir / "generation_config.json").get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        for config in (tokenizer_config, _read_json(self.model_dir / "config.json")):
            token = config.get("eos_token")
            if isinstance(token, dict):  # tokenizer_config's AddedToken form
                token = token.get("content")
            if isinstance(token, str) and (token_id := self._tokenizer.control_id(token)) is not None:
                ids.append(token_id)
        return list(dict.fromkeys(ids))


#: Vocabulary entries that end a sentence: marks, then perhaps quotes and line breaks (byte-level BPE
#: writes a space as "Ġ" and a line break as "Ċ"; SentencePiece a space as "▁").
_SENTENCE_END = re.compile(r"[Ġ▁]?[.?!]+[\"')]*(Ċ|ĊĊ|<0x0A>)*")


#: An answer goes before answers already being heard for at most this many tokens (about a second), spoken or not.
URGENT_TOKENS = 24


class Turns:
    """Which answers are waiting for their first words: they decode before answers already being heard.

    CTranslate2 runs one generation at a time per model (``inter_threads``
    1): an answer asked for while another streams would wait for all of it.
    An answer already being heard gives way instead, between two tokens,
    and resumes when no answer is waiting for its first words.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        #: Answers that have not spoken yet.
        self.urgent = 0
        #: Times an answer resumed after giving way.
        self.resumed = 0

    def enter(self) -> None:
        with self._changed:
            self.urgent += 1

    def leave(self) -> None:
        with self._changed:
            self.urgent -= 1
            self._changed.notify_all()

    def wait_clear(self, should_stop: StopCheck) -> None:
        """Block until no answer is urgent (or ``should_stop``)."""
        with self._changed:
            while self.urgent and not should_stop():
                self._changed.wait(0.05)


#: Engines still loaded, released before the interpreter shuts down.
_LOADED: weakref.WeakSet[CT2ChatLLM] = weakref.WeakSet()


@atexit.register
def _close_engines_at_exit() -> None:
    # CTranslate2 streams tokens through Python callbacks held by its worker
    # threads; a Generator still alive when the interpreter finalises aborts
    # the process now and then ("terminate called without an active
    # exception", exit status 134: 3 to 10 exits in 30 on a busy 2-core
    # machine). Destroyed here, while the interpreter is whole, it never did.
    for engine in list(_LOADED):
        engine.close()


def _begin_ids(tokenizer_config: dict[str, Any], tokenizer: _Tokenizer) -> list[int]:
    """The BOS token, for models that start every prompt with it (Gemma, Llama 3)."""
    token = tokenizer_config.get("bos_token")
    if isinstance(token, dict):  # tokenizer_config's AddedToken form
        token = token.get("content")
    if not tokenizer_config.get("add_bos_token") or not isinstance(token, str):
        return []
    token_id = tokenizer.control_id(token)
    return [] if token_id is None else [token_id]


def _default_compute_type(ctranslate2: Any, device: str) -> str:
    supported = ctranslate2.get_supported_compute_types(device)
    preferred = ("int8", "int8_float32") if device == "cpu" else ("int8_float16", "float16")
    return next((c for c in preferred if c in supported), "default")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path} is unreadable ({exc}); fix: {PREPARE_COMMAND} --force") from exc
    return value if isinstance(value, dict) else {}


def _read_vocabulary(model_dir: Path) -> list[str]:
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

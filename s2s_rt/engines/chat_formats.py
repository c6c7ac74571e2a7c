"""Chat formats: a conversation (and the functions offered) as a model's turn markup, in token ids.

ChatML (Qwen), Llama 3, Gemma, Phi-3 and Mistral, recognised by the chat
template a model directory ships, then by its vocabulary.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s2s_rt.engines.base import ChatMessage
from s2s_rt.engines.function_choice import call_opening
from s2s_rt.engines.tokenizing import Tokenizer
from s2s_rt.models.errors import ModelError
from s2s_rt.toolcalls import OPEN, chat_tool, is_error_result


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation in a model's chat format, as token ids."""

    #: One list of ids per turn, the answer's opening last; kept apart so
    #: that the oldest turns can be dropped to fit the context.
    turns: list[list[int]]
    #: Leading turns never dropped (the system turn).
    pinned: int

    def fit(self, context_tokens: int, max_tokens: int) -> tuple[list[int], int]:
        """Return the prompt ids and the answer budget within ``context_tokens``.

        Drops the oldest turns after the pinned ones until the prompt leaves
        room for at least a short answer, then shortens the answer budget.
        """
        turns = list(self.turns)
        min_answer = min(max_tokens, 64)
        # Always keep the pinned turns, the last message and the answer's opening.
        while sum(map(len, turns)) + min_answer > context_tokens and len(turns) > self.pinned + 2:
            del turns[self.pinned]
        prompt = [token for turn in turns for token in turn]
        if len(prompt) + min_answer > context_tokens:
            # One enormous message: keep its end, which a user speaking last said.
            prompt = prompt[len(prompt) + min_answer - context_tokens :]
        return prompt, min(max_tokens, context_tokens - len(prompt))


#: Told to a model that cannot see when images are in the conversation.
BLIND = (
    "\n\nYou cannot see images. When the user shares an image, you do not know what it shows: say that you"
    " cannot see images, and never guess or describe what an image shows."
)


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

    def __init__(self, tokenizer: Tokenizer, default_system: str | None = None, begin: Sequence[int] = ()) -> None:
        missing = [token for token in self.REQUIRED if tokenizer.control_id(token) is None]
        if missing:
            known = ", ".join(chat.NAME for chat in CHAT_FORMATS)
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
    def from_template(template: str | None, tokenizer: Tokenizer, where: Path, begin: Sequence[int] = ()) -> ChatFormat:
        """Recognise the chat format of a Jinja chat template, or else of a vocabulary.

        Raises:
            ModelError: if the template is of no known format and the
                vocabulary has no known format's markers either.
        """
        for chat in CHAT_FORMATS:
            if template and any(marker in template for marker in chat.MARKERS):
                return chat.for_template(template, tokenizer, begin)
        for chat in CHAT_FORMATS:
            if all(tokenizer.control_id(token) is not None for token in chat.REQUIRED):
                return chat(tokenizer, None, begin)
        described = "has no chat template" if not template else "uses a chat format s2s-rt does not know"
        known = ", ".join(chat.NAME for chat in CHAT_FORMATS)
        raise ModelError(f"{where} {described}; s2s-rt supports these chat formats: {known}")

    @classmethod
    def for_template(cls, template: str, tokenizer: Tokenizer, begin: Sequence[int]) -> ChatFormat:
        return cls(tokenizer, None, begin)

    def encode(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[dict[str, Any]] = (),
        require_tool: bool = False,
        call: str | None = None,
    ) -> ChatPrompt:
        """Render ``messages`` (and the offered ``tools``) as token ids.

        A function's result (a ``tool`` message that names its call) is
        shown to the model as words that follow the user's request it
        answers: ``"{request}\\n\\n(get_weather says: temperature: 17, …)"``,
        and the call itself is left out. An answer to results is asked
        without the tools section unless a call is required. Measured on
        the default model (BENCHMARKS.md, "Function calls"): shown as
        Qwen2.5's ``<tool_response>`` turn after the call, with the tools in
        view, a result was answered in words 0 times in 7 (5 called the
        same function again, 2 read the JSON back); as words after the
        request, without the tools, 7 in 7. Results of which one reports a
        failure (:func:`~s2s_rt.toolcalls.is_error_result`) keep the tools
        in view: the model may call again, and the server sends a retry
        (:func:`~s2s_rt.protocol.prompt.repeats_answered`). A result whose
        call is not in the conversation, and a call still waiting for its
        result, keep Qwen2.5's markup.

        Args:
            messages: the conversation, oldest first.
            tools: Realtime function definitions (name, description,
                parameters).
            require_tool: the answer must be a call (only with ``tools``).
            call: the answer is a call to this function: its opening holds
                the call's start up to the arguments
                (:func:`~s2s_rt.engines.function_choice.call_opening`); the
                functions stay in view, so the prompt before it is the one a
                free answer reads (and its kept state serves both).
        """
        system = None
        if messages and messages[0].role == "system":
            system, messages = messages[0].content, messages[1:]
        elif self.default_system is not None:
            system = self.default_system
        results = _last_results(messages)
        answering_results = bool(results) and not any(is_error_result(m.content) for m in results)
        if any(m.images for m in messages):
            system = (system or "") + BLIND
        if tools and (require_tool or not answering_results):
            system = (system or "") + tools_section(tools)
        else:
            require_tool = False
        pinned: list[list[int]] = [self._begin] if self._begin else []
        if system is not None and self.SYSTEM_ROLE:
            pinned.append(self.turn("system", system))
        said = _conversation_turns(messages)
        if system is not None and not self.SYSTEM_ROLE and said and said[0][0] == "user":
            said[0] = ("user", f"{system}\n\n{said[0][1]}")
        turns = [self.turn(role, content) for role, content in said]
        if tools and call is not None:
            turns.append(self.opening(f"{OPEN}\n{call_opening(call)}"))
        else:
            turns.append(self.opening(OPEN + "\n" if tools and require_tool else ""))
        return ChatPrompt([*pinned, *turns], pinned=len(pinned))

    @abc.abstractmethod
    def turn(self, role: str, content: str) -> list[int]:
        """One message as ids."""

    def message_tokens(self, message: ChatMessage) -> int:
        """What one message costs in a prompt (a result or a call, shown otherwise, about the same)."""
        role = message.role if message.role in ("system", "assistant") else "user"
        return len(self.turn(role, message.shown_without_images()))

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
        tokenizer: Tokenizer,
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
    def for_template(cls, template: str, tokenizer: Tokenizer, begin: Sequence[int]) -> ChatFormat:
        return cls(tokenizer, default_system_prompt(template), begin, no_thinking="enable_thinking" in template)

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
CHAT_FORMATS: tuple[type[ChatFormat], ...] = (ChatML, Llama3Chat, GemmaChat, Phi3Chat, MistralChat)


#: Ends the description of the functions. Measured on the default model, three samplings of the
#: evaluation's sixteen requests (BENCHMARKS.md, "Function calls"): without it, 3 of 18 requests that
#: need no function were answered with a call ("What is the capital of Italy?" → get_weather(Paris));
#: with it, none, and the calls that were needed were as often right (40 of 48 requests right either way).
WHEN_TO_CALL = (
    "Call a function only when the user's request needs it. Answer greetings, thanks and questions you"
    " know the answer to directly, in words."
)


def tools_section(tools: Sequence[dict[str, Any]]) -> str:
    """Qwen2.5's description of the offered functions, word for word, then :data:`WHEN_TO_CALL`."""
    signatures = "".join(f"\n{json.dumps(chat_tool(tool), ensure_ascii=False)}" for tool in tools)
    return (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{signatures}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        f"\n\n{WHEN_TO_CALL}"
    )


def _conversation_turns(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    """The turns (role, text) of the conversation after the system message, results shown as words.

    A result that names its call follows the last user turn before that
    call, as ``({name} says: …)``, and the call is left out: the user may
    have spoken again before the results came back, and a result shown under
    the later words answers the wrong request. A result whose call is not in
    the conversation, or came before any user turn, follows the last user
    turn before the result; with no user turn before it, it gets one. Other results (consecutive ones form
    one user turn) keep Qwen2.5's ``<tool_response>`` blocks.
    """
    answered_ids = {m.answers.call_id for m in messages if m.answers is not None and m.answers.call_id is not None}
    turns: list[tuple[str, str]] = []
    request: int | None = None  # the last user turn so far
    asked_in: dict[str | None, int | None] = {}  # the user turn before each answered call, by call id
    i = 0
    while i < len(messages):
        message = messages[i]
        i += 1
        if message.call is not None and message.call.call_id in answered_ids:
            asked_in[message.call.call_id] = request
            continue  # shown with its result
        if message.role == "tool" and message.answers is not None:
            said = f"({message.answers.name} says: {result_words(message.content)})"
            under = asked_in.get(message.answers.call_id)
            if under is None:
                under = request
            if under is None:
                turns.append(("user", said))
                request = len(turns) - 1
            else:
                turns[under] = ("user", f"{turns[under][1]}\n\n{said}")
            continue
        if message.role == "tool":
            results = [message.content]
            while i < len(messages) and messages[i].role == "tool" and messages[i].answers is None:
                results.append(messages[i].content)
                i += 1
            turns.append(("user", tool_responses(results)))
            continue
        turns.append((message.role, message.shown_without_images()))
        if message.role == "user":
            request = len(turns) - 1
    return turns


def _last_results(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The function results that end the conversation: none unless the last message is the result of a named call."""
    if not messages or messages[-1].answers is None:
        return []
    n = len(messages)
    while n and messages[n - 1].role == "tool":
        n -= 1
    return list(messages[n:])


def result_words(output: str) -> str:
    """A function's output as words a small model reads as facts: JSON objects as ``key: value, …``.

    ``{"temperature_c": 17, "ok": true}`` reads ``temperature c: 17, ok: yes``;
    nested objects name their parents (``wind speed: 12``), lists are joined
    with commas, and output that is not JSON is kept as it is.
    """
    try:
        value = json.loads(output)
    except ValueError:
        return output.strip()

    def words(value: Any, path: str = "") -> list[str]:
        if isinstance(value, dict) and value:
            return [w for key, sub in value.items() for w in words(sub, f"{path} {key}".strip())]
        if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            return [w for n, sub in enumerate(value, 1) for w in words(sub, f"{path} {n}".strip())]
        if isinstance(value, dict):
            text = "none" if path else "nothing"
        else:
            text = ", ".join(_scalar(v) for v in value) if isinstance(value, list) else _scalar(value)
        return [f"{path.replace('_', ' ')}: {text}" if path else text]

    return ", ".join(words(value))


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "none"
    return str(value)


def tool_responses(results: Sequence[str]) -> str:
    """Function results as the user turn that carries them back (Qwen2.5's ``<tool_response>`` blocks)."""
    return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


def default_system_prompt(template: str) -> str | None:
    # The default is the literal system turn the template writes when the
    # conversation has none: '<|im_start|>system\nYou are …<|im_end|>'. In the
    # template source the newline is either a real one or the escape "\n".
    match = re.search(r"<\|im_start\|>system(?:\\n|\n)([^'\"{}<>]+?)<\|im_end\|>", template)
    return match.group(1) if match else None

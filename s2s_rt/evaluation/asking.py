"""Asking the LLM as the server does, and timing the answer.

:class:`Assistant` builds the prompt the way a default session does (the
session's instructions, the answer context of :mod:`s2s_rt.spoken_answer`,
the session's temperature), streams the answer, cuts its first clause as the
LLM stage does and synthesises it, so that an answer's first-token and
first-audio times are those of a turn after the transcript is known.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from s2s_rt.engines.base import LLM, TTS, ChatMessage, FunctionCall, LLMRequest, LLMUsage
from s2s_rt.pipeline.clauses import ClauseSplitter
from s2s_rt.protocol.config import DEFAULT_MAX_OUTPUT_TOKENS
from s2s_rt.protocol.prompt import call_message, repeats_answered
from s2s_rt.spoken_answer import with_answer_context
from s2s_rt.toolcalls import Call, Text, ToolCallError, ToolCallFilter, parse_call


@dataclass(slots=True)
class Answer:
    """One answer and its times, in seconds from the request."""

    text: str
    first_token_s: float | None
    #: When the first clause's audio was ready (None without a TTS or an answer).
    first_audio_s: float | None
    total_s: float
    output_tokens: int


@dataclass(slots=True)
class CallResult:
    """What the model did with tools on offer: its calls (name, arguments) and what it said."""

    calls: list[tuple[str, dict[str, Any]]]
    #: Calls that failed the schema check, with the reason.
    invalid: list[str]
    text: str


@dataclass(slots=True)
class RoundTrip:
    """A request's first answer, and the answer to its call's result (None: no call was made)."""

    first: CallResult
    answer: CallResult | None
    #: Calls in the answer identical to one already answered (not sent; the answer was asked again without tools).
    repeated: int


class Assistant:
    """The LLM as a session's answer sees it.

    Args:
        llm: the chat model.
        tts: speaks the first clause to time the first audio; None skips it.
        instructions: the session's instructions.
        temperature: the session's temperature.
        now: the moment the answers pretend it is.
        context: add :func:`s2s_rt.spoken_answer.with_answer_context` (the
            server does); off measures the answers without it.
        examples: with the context, its worked examples too (off measures them).
        max_tokens: the answer's token budget.
    """

    def __init__(
        self,
        llm: LLM,
        tts: TTS | None,
        *,
        instructions: str,
        temperature: float,
        now: datetime,
        context: bool = True,
        examples: bool = True,
        max_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
    ) -> None:
        self.llm = llm
        self.tts = tts
        self.instructions = instructions
        self.temperature = temperature
        self.now = now
        self.context = context
        self.examples = examples
        self.max_tokens = max_tokens

    def messages(self, text: str, language: str | None = None, tools: bool = False) -> list[ChatMessage]:
        """The chat messages for one user turn, as the server would build them."""
        messages = [ChatMessage("system", self.instructions)] if self.instructions else []
        messages.append(ChatMessage("user", text))
        if self.context:
            messages = with_answer_context(
                messages,
                now=self.now,
                language=language,
                tools=tools,
                examples=self.examples,
            )
        return messages

    def answer(self, text: str, language: str | None = None) -> Answer:
        """Answer one user turn; times the first token and the first clause's audio."""
        usage = LLMUsage()
        clauses = ClauseSplitter()
        pieces: list[str] = []
        first_token = first_audio = None
        start = time.perf_counter()
        asked = LLMRequest.of(self.messages(text, language), max_tokens=self.max_tokens, temperature=self.temperature)
        stream = self.llm.stream(asked, should_stop=lambda: False, usage=usage)
        for piece in stream:
            if first_token is None:
                first_token = time.perf_counter() - start
            pieces.append(piece)
            if first_audio is None:
                ready = clauses.feed(piece)
                if ready:
                    first_audio = self._speak_first(ready[0], start)
        if first_audio is None and pieces:
            first_audio = self._speak_first(clauses.flush(), start)
        return Answer(
            "".join(pieces).strip(), first_token, first_audio, time.perf_counter() - start, usage.output_tokens
        )

    def round_trip(self, text: str, tools: Sequence[dict[str, Any]], output: str) -> RoundTrip:
        """A call, its result handed back as ``output``, and the answer to it, as a client library runs it.

        The conversation after the call is built as the server builds it
        from the client's ``function_call_output``; a call the answer makes
        again with the same arguments is not sent, and the answer is asked
        again without the tools, as the server does.
        """
        messages = self.messages(text, tools=bool(tools))
        first = self._ask_tools(messages, tools)
        if not first.calls:
            return RoundTrip(first, None, repeated=0)
        for n, (name, arguments) in enumerate(first.calls):
            call = FunctionCall(name, json.dumps(arguments), f"call_{n}")
            messages += [call_message(call), ChatMessage("tool", output, answers=call)]
        answer = self._ask_tools(messages, tools)
        made = [FunctionCall(name, json.dumps(arguments)) for name, arguments in answer.calls]
        repeated = sum(repeats_answered(c, messages) for c in made)
        if repeated and repeated == len(made) and not answer.text:
            answer = self._ask_tools(messages, ())
        return RoundTrip(first, answer, repeated)

    def _ask_tools(self, messages: list[ChatMessage], tools: Sequence[dict[str, Any]]) -> CallResult:
        usage = LLMUsage()
        asked = LLMRequest.of(messages, max_tokens=self.max_tokens, temperature=self.temperature, tools=tools)
        stream = self.llm.stream(asked, should_stop=lambda: False, usage=usage)
        splitter = ToolCallFilter()
        parts = [part for piece in stream for part in splitter.feed(piece)]
        parts += splitter.flush()
        result = CallResult([], [], "".join(p.text for p in parts if isinstance(p, Text)).strip())
        for part in parts:
            if isinstance(part, Call):
                try:
                    name, arguments = parse_call(part.raw, list(tools))
                except ToolCallError as exc:
                    result.invalid.append(str(exc))
                    continue
                result.calls.append((name, json.loads(arguments)))
        return result

    def _speak_first(self, clause: str, start: float) -> float | None:
        if self.tts is None or not clause.strip():
            return None
        for _audio in self.tts.synthesize(clause, voice=None, should_stop=lambda: False):
            return time.perf_counter() - start
        return None

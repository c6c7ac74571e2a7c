"""Answering ahead: an answer begun in a turn's closing silence, held until the turn ends.

When the words of a turn are transcribed before its silence has ended
(:mod:`s2s_rt.pipeline.speculation`), the answer to them
is started too: the LLM streams into an :class:`Anticipation`, and its first
clause is synthesised as soon as it is complete. Nothing of it reaches the
client: no response exists yet. When the turn ends, the turn's response
adopts it if it would have asked the model exactly the same thing (an
equal :class:`~s2s_rt.engines.base.LLMRequest`, voice and speed), reading
the pieces made so far and then the rest as it comes; if speech returns first, or the response asks something else, the
anticipation is dropped and its engine work stopped. Both build what they
ask here, in one way (:func:`answer_request`, :func:`first_clause_pause`),
so that they stay equal.

An anticipation's scope is a child of its session's: it is stale when the
listener drops it, when the session ends, or, once adopted, when the
adopting response is cancelled or fails.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from s2s_rt.engines.base import AsyncLLM, ChatMessage, FirstWordsPause, Float32Array, LLMRequest, LLMUsage
from s2s_rt.inference import OneAtATime
from s2s_rt.pipeline.clauses import ClauseSplitter
from s2s_rt.scope import Scope
from s2s_rt.spoken_answer import with_answer_context
from s2s_rt.toolcalls import offered_tools

if TYPE_CHECKING:
    from s2s_rt.protocol.response_params import ResponseParams

log = logging.getLogger(__name__)


def answer_request(messages: Sequence[ChatMessage], params: ResponseParams, language: str | None) -> LLMRequest:
    """What an answer asks the model: ``messages`` (the prompt up to the words answered) under ``params``.

    The one way a response (:mod:`s2s_rt.pipeline.responding`) and the
    answer begun in its turn's closing silence (:mod:`s2s_rt.pipeline.speculation`)
    build their request: the response adopts that answer only if the two
    are equal (:meth:`Anticipation.answers`). The functions shown are those
    ``tool_choice`` allows; the prompt gets the answer's context (date,
    language, numbers in digits where functions are offered:
    :func:`~s2s_rt.spoken_answer.with_answer_context`) in ``language``.
    """
    tools, must_call = offered_tools(params.tools, params.tool_choice)
    messages = with_answer_context(messages, language=language, tools=bool(tools))
    return LLMRequest.of(
        messages, max_tokens=params.token_limit, temperature=params.temperature, tools=tools, require_tool=must_call
    )


def first_clause_pause(
    first_words: int, request: LLMRequest, spoken: bool, resume: Callable[[], bool]
) -> FirstWordsPause | None:
    """Where an answer to ``request`` pauses: at its first clause's end, until ``resume()`` (that clause is spoken).

    Only a spoken answer with no functions in view pauses (None otherwise);
    its first clause is cut as the responding stage cuts it (``first_words``).
    """
    if not spoken or request.tools:
        return None
    return FirstWordsPause(ClauseSplitter(first_words=first_words).ends_first, resume)


@dataclass(frozen=True, slots=True)
class SpokenAhead:
    """A clause's speech, synthesised ahead of its turn's end."""

    audio: list[Float32Array]
    #: ``perf_counter()`` when it was ready.
    ready: float


class Anticipation:
    """An answer streaming ahead of its turn's end, and its first clause's speech.

    Args:
        request: what the model was asked.
        speed: the speaking rate of the first clause's speech.
        voice: the voice of the first clause's speech.
        scope: its cancellation scope (a child of the session's).
    """

    def __init__(
        self, request: LLMRequest, speed: float, voice: str, scope: Scope, gate: OneAtATime | None = None
    ) -> None:
        self.request = request
        #: The tools as they were when asked, as JSON: a tool changed in place later, or ``true`` where ``1``
        #: was, is another request (dicts compare ``True == 1``).
        self._tools = json.dumps(request.tools, sort_keys=True)
        self.speed = speed
        self.voice = voice
        self.scope = scope
        #: The session's gate for LLM calls it gave up on (see :class:`~s2s_rt.inference.OneAtATime`).
        self.gate = gate
        self.usage = LLMUsage()
        self.pieces: list[str] = []
        self.done = False
        self.error: BaseException | None = None
        self._changed = asyncio.Event()
        #: The first clause, and its speech as the TTS engine made it (synthesised ahead).
        self.first_clause: str | None = None
        self.first_audio: asyncio.Task[SpokenAhead | None] | None = None
        #: Its first clause's speech is made (or will not be): the model, paused at that clause's end, goes on.
        #: Read from the model's thread.
        self.first_spoken = False
        #: ``perf_counter()`` times of its first piece and of its first clause's end, and the tokens to that end
        #: (the turn's waterfall, :class:`~s2s_rt.pipeline.work.TurnTiming`).
        self.first_token: float | None = None
        self.first_clause_at: float | None = None
        self.clause_tokens: int | None = None

    def answers(self, request: LLMRequest, speed: float, voice: str) -> bool:
        """Whether a response asking ``request``, spoken at ``speed`` in ``voice``, would make this same answer."""
        return (
            request == self.request
            and json.dumps(request.tools, sort_keys=True) == self._tools
            and speed == self.speed
            and voice == self.voice
        )

    def add(self, piece: str) -> None:
        """A piece of the answer came (an empty one, that the engine is alive, is not kept)."""
        if not piece:
            return
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self.pieces.append(piece)
        self._changed.set()

    def end(self, error: BaseException | None = None) -> None:
        """The answer is complete (or failed with ``error``)."""
        self.error = error
        self.done = True
        self._changed.set()

    def adopt(self, response_scope: Scope) -> AsyncIterator[str]:
        """The turn's response takes the answer: its pieces from the first, and the rest as they come.

        From now on the answer stops when the response is cancelled or fails.
        """
        response_scope.on_close(lambda: self.scope.close("response closed"))
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[str]:
        i = 0
        while True:
            while i < len(self.pieces):
                yield self.pieces[i]
                i += 1
            if self.done:
                if self.error is not None:
                    raise self.error
                self.scope.release()
                return
            self._changed.clear()
            if i == len(self.pieces) and not self.done:
                await self._changed.wait()

    def speak_first(self, clause: str, speech: asyncio.Task[SpokenAhead | None] | None) -> None:
        """The first clause is complete, and ``speech`` makes it (None: its session is closing)."""
        self.first_clause_at = time.perf_counter()
        self.clause_tokens = self.usage.output_tokens
        self.first_clause = clause
        self.first_audio = speech
        if speech is None:
            self.first_spoken = True
            return

        def spoken(_: asyncio.Task[SpokenAhead | None]) -> None:
            self.first_spoken = True

        speech.add_done_callback(spoken)

    def first_speech(self, clause: str) -> asyncio.Task[SpokenAhead | None] | None:
        """The speech synthesised ahead for ``clause``, if it is the first clause (given once)."""
        audio, self.first_audio = self.first_audio, None
        if audio is not None and clause != self.first_clause:
            audio.cancel()
            return None
        return audio

    def drop(self, reason: str) -> None:
        """Not wanted: stop its engine work."""
        self.scope.close(reason)


def can_anticipate(llm: Any) -> bool:
    """Answers run ahead only on a model in this process (a remote one streams on the loop, unheld)."""
    return not isinstance(llm, AsyncLLM)

"""Responding: the LLM stage streams an answer, cuts it into clauses to speak, and checks tool calls."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from s2s_rt.engines.base import (
    AsyncLLM,
    ChatMessage,
    FunctionCall,
    LLMError,
    LLMRequest,
    LLMUsage,
    ReadsAhead,
    TakesTurns,
)
from s2s_rt.inference import EngineTimeout
from s2s_rt.pipeline.anticipation import Anticipation, answer_request, first_clause_pause
from s2s_rt.pipeline.clauses import ClauseSplitter
from s2s_rt.pipeline.context import SessionContext
from s2s_rt.pipeline.stage import Stage, StageContext
from s2s_rt.pipeline.work import CallOut, ResponseEnd, ResponseRequest, SessionEnd, Speak, TurnTiming
from s2s_rt.protocol.errors import ServerFault
from s2s_rt.protocol.prompt import repeats_answered
from s2s_rt.protocol.truncation import ContextFull
from s2s_rt.toolcalls import Call as CallPart
from s2s_rt.toolcalls import Text as TextPart
from s2s_rt.toolcalls import ToolCallError, ToolCallFilter, UnknownFunction, frame, parse_call

if TYPE_CHECKING:
    from s2s_rt.metrics import Metrics
    from s2s_rt.protocol.response import Response

log = logging.getLogger(__name__)

#: How long reading a conversation ahead waits for the LLM to be free before giving up.
PRIME_WAIT_S = 20.0
#: Follows the user's last words when an answer with nothing in it is asked again (:func:`asked_for_words`).
NUDGE = "(Answer in words.)"
#: The answer when the model, asked twice, said nothing and made no call: a response never ends empty.
NO_ANSWER = "Sorry, I have no answer to that."


class Responder(Stage[SessionContext, ResponseRequest]):
    """The LLM stage: streams each response's answer, cuts it into clauses to speak, and checks its function calls.

    Args:
        stage: the slot's stage context.
        serving: the session the slot serves now.
        inbox: its queue (response requests, session ends).
        to_tts: the speaking stage's queue.
    """

    name = "llm"

    def __init__(
        self,
        stage: StageContext,
        serving: Callable[[], SessionContext | None],
        inbox: asyncio.Queue[Any],
        to_tts: asyncio.Queue[Any],
    ) -> None:
        super().__init__(stage, serving, inbox)
        self.to_tts = to_tts
        #: The answer being generated has its first words on their way (it then gives way to answers that do not).
        self._words_out = False

    async def forward(self, end: SessionEnd) -> None:
        await self.to_tts.put(end)

    def dropped(self, item: ResponseRequest) -> None:
        if isinstance(item, ResponseRequest) and item.anticipation is not None:
            item.anticipation.drop("response closed")

    async def work(self, ctx: SessionContext, req: ResponseRequest) -> None:
        stage = self.stage
        session = ctx.session
        r = req.response
        scope = req.scope
        # As the answer begun in the turn's closing silence asked it (see Speculator._anticipate): then it is this one.
        try:
            messages = session.prompt(r)
        except ContextFull as exc:  # ``truncation: disabled``
            if req.anticipation is not None:
                req.anticipation.drop("the conversation does not fit")
            stage.metrics.turns.inc(status="failed")
            await stage.outbox.emit(session.fail_response(r, exc), session.scope)
            return
        asked = answer_request(messages, r.params, ctx.language)
        tools = list(asked.tools)
        usage = LLMUsage()
        ahead = req.anticipation
        if ahead is not None:
            if ahead.answers(asked, r.params.speed, r.params.voice) and not ahead.scope.stale:
                stage.metrics.speculative_responses.inc(outcome="used")
                usage = ahead.usage
            else:
                ahead.drop("the response asks something else")
                stage.metrics.speculative_responses.inc(outcome="unused")
                ahead = None

        def stale() -> bool:
            return scope.stale

        clauses = ClauseSplitter(first_words=stage.first_clause_words, speed=r.params.speed)
        spoke = False
        self._words_out = False
        made = ctx.timings.of(r.id)  # when its first clause's speech was made
        told_invalid = asked_again = False
        before_told = asked  # the request before the model was told what was wrong with its call
        sent_any = False  # a call went to the client
        for attempt in range(4):
            calls: list[str] = []
            splitter = ToolCallFilter()
            try:
                llm = stage.stack.llm
                pieces: contextlib.AbstractAsyncContextManager[AsyncIterator[str]]
                if ahead is not None and attempt == 0:
                    # Begun in the turn's closing silence: what it made so far, then the rest as it comes.
                    pieces = contextlib.nullcontext(ahead.adopt(scope))
                elif isinstance(llm, AsyncLLM):
                    # A remote model streams on the loop: no thread held, and closing it closes its connection.
                    pieces = contextlib.aclosing(
                        _timed(llm.astream(asked, should_stop=stale, usage=usage), stage.metrics)
                    )
                else:
                    answer = functools.partial(llm.stream, asked, should_stop=stale, usage=usage)
                    if isinstance(llm, TakesTurns):
                        answer = functools.partial(
                            answer,
                            urgent=lambda: not self._words_out,
                            # Spoken, it pauses at its first clause's end while that clause's speech is made.
                            pause=None
                            if made is None
                            else first_clause_pause(
                                stage.first_clause_words,
                                asked,
                                r.audio,
                                lambda: made.synthesised is not None or scope.stale,
                            ),
                        )
                    pieces = contextlib.nullcontext(stage.pools["llm"].stream(answer, gate=ctx.llm_gate))
                timing = ctx.timings.of(r.id)
                if ahead is not None and attempt == 0:
                    if timing is not None:
                        timing.ahead = ahead
                    timing = None  # its steps were taken ahead, before the pieces are read again here
                async with pieces as stream:
                    async for piece in stream:
                        if scope.stale:
                            return
                        if not piece:
                            continue  # the engine is alive (it chose a function), nothing said yet
                        if timing is not None and timing.prompt_read is None:
                            timing.prompt_read, timing.boarded = time.perf_counter(), usage.boarded
                        for part in splitter.feed(piece):
                            spoke |= await self._say(r, part, clauses, calls, ahead, timing, usage)
                for part in splitter.flush():
                    spoke |= await self._say(r, part, clauses, calls, ahead, timing, usage)
            except Exception as exc:
                log.warning("slot %d: LLM failed: %r", stage.index, exc)
                if not scope.stale:
                    stage.metrics.turns.inc(status="failed")
                    code = (
                        exc.code
                        if isinstance(exc, LLMError)
                        else "llm_timeout"
                        if isinstance(exc, EngineTimeout)
                        else "llm_failed"
                    )
                    stage.metrics.errors.inc(code=code)
                    await stage.outbox.emit(
                        session.fail_response(r, ServerFault(code, f"The language model failed: {exc}")), session.scope
                    )
                return
            if scope.stale:
                stage.metrics.dropped_stale.inc(stage="llm")
                return
            problems = []
            sent = repeated = invented = 0
            for raw in calls:
                try:
                    name, arguments = parse_call(raw, tools)
                except UnknownFunction:
                    # Made up (small models greeted with functions in view call "hello"): never sent, never
                    # apologised for; the user hears the model's words instead.
                    stage.metrics.tool_calls.inc(outcome="invented")
                    invented += 1
                    continue
                except ToolCallError as exc:
                    stage.metrics.tool_calls.inc(outcome="invalid")
                    problems.append((raw, str(exc)))
                    continue
                if repeats_answered(FunctionCall(name, arguments), asked.messages):
                    # Its result is in the conversation already: a client would run it again, and again.
                    stage.metrics.tool_calls.inc(outcome="repeated")
                    log.info("slot %d: the model called %s again with the same arguments; not sent", stage.index, name)
                    repeated += 1
                    continue
                stage.metrics.tool_calls.inc(outcome="sent")
                await self.to_tts.put(CallOut(scope, r, name, arguments))
                sent += 1
            sent_any |= sent > 0
            if (repeated or invented) and not problems and not sent and not spoke and asked.tools:
                # Ask for the answer again with the functions out of view: a result it has already, or a
                # function that does not exist, is answered in words.
                asked = without_functions(asked)
                continue
            if not problems:
                if spoke or sent_any or asked_again:
                    break
                # Nothing usable (no words, no call): asked once more, in words.
                log.info("slot %d: the answer had nothing in it; asked again", stage.index)
                asked_again = True
                asked = asked_for_words(asked)
                continue
            if not told_invalid and not spoke and not sent and not repeated:
                # One retry, telling the model what was wrong with its call.
                told_invalid, before_told = True, asked
                raw, why = problems[0]
                retry = (
                    ChatMessage("assistant", frame(raw)),
                    ChatMessage("tool", f"Error: {why}. Call the function again with valid arguments."),
                )
                asked = dataclasses.replace(asked, messages=(*asked.messages, *retry))
                continue
            if asked.tools and not spoke and not sent:
                # Still no valid call after being told why: the answer is asked in words, functions out of view.
                # The user never hears the server's complaint about a call ("... is not valid JSON"): on CI's
                # slow AMD EPYC the default model answered a weather result with a broken call twice, and the
                # user heard "Sorry, I could not make that call: the call is not valid JSON (Expecting ...)".
                log.info(
                    "slot %d: the model's call was still invalid (%s); asked in words", stage.index, problems[0][1]
                )
                asked = without_functions(before_told)
                continue
            break  # no usable call even in words: said that there is no answer, below
        if not spoke and not sent_any:
            log.warning("slot %d: the answer had nothing in it twice; said that there is no answer", stage.index)
            await self._say(r, TextPart(NO_ANSWER), clauses, calls)
        rest = clauses.flush()
        if rest and r.audio:
            timing = ctx.timings.of(r.id)
            if timing is not None and timing.first_clause is None:  # the whole answer is one short clause
                timing.first_clause, timing.clause_tokens = time.perf_counter(), usage.output_tokens
            await self.to_tts.put(Speak(scope, r, rest))
        await self.to_tts.put(ResponseEnd(scope, r, usage))

    def read_ahead(self, ctx: SessionContext) -> None:
        """Read what the session's next answer will begin with into the LLM's kept state, in the background.

        Called when a session starts, when its settings change, and when an
        answer ends. The next answer then reads only its new user turn (see
        :meth:`~s2s_rt.engines.llm.CT2ChatLLM.prime`): after an answer, the
        conversation so far; before the first, the instructions and tools.
        Kept state is the process's: instructions and tools another session
        sent before are held already, and a fresh conversation's first answer
        reads only its own words. It waits until no answer is being generated
        (answers come first), runs while the user speaks, and is cancelled
        with the session.
        """
        stage = self.stage
        if not isinstance(stage.stack.llm, ReadsAhead) or ctx.session.transcription_only:
            return
        stage.spawn(ctx.session.scope, self._prime(ctx), "prime")

    async def _prime(self, ctx: SessionContext) -> None:
        stage = self.stage
        session = ctx.session
        pool = stage.pools["llm"]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PRIME_WAIT_S):
                await pool.idle()
        if pool.running or session.response is not None:
            stage.metrics.primes.inc(outcome="busy")
            return
        # As the next answer will ask it, up to its user turn.
        following = answer_request(*session.next_prompt(), ctx.language)
        try:
            llm = stage.stack.llm
            assert isinstance(llm, ReadsAhead)
            held = await pool.call(llm.prime, list(following.messages), list(following.tools), gate=ctx.llm_gate)
        except Exception as exc:  # the next answer reads everything, as without it
            log.warning("slot %d: reading the conversation ahead failed: %r", stage.index, exc)
            stage.metrics.primes.inc(outcome="failed")
            return
        stage.metrics.primes.inc(outcome="held" if held else "skipped")

    async def _say(
        self,
        r: Response,
        part: TextPart | CallPart,
        clauses: ClauseSplitter,
        calls: list[str],
        ahead: Anticipation | None = None,
        timing: TurnTiming | None = None,
        usage: LLMUsage | None = None,
    ) -> bool:
        """Route one piece of model output; returns whether it was speakable text.

        ``timing`` (None when the answer's steps were taken ahead) gets the end of the first clause.
        """
        if isinstance(part, CallPart):
            calls.append(part.raw)
            return False
        if not part.text:
            return False
        if not r.audio:
            # Text goes through the TTS stage's queue too, so it stays in order with calls and the end.
            await self.to_tts.put(Speak(r.scope, r, part.text))
            self._words_out = True
        else:
            for clause in clauses.feed(part.text):
                if timing is not None and timing.first_clause is None:
                    timing.first_clause = time.perf_counter()
                    timing.clause_tokens = usage.output_tokens if usage is not None else None
                spoken = ahead.first_speech(clause) if ahead is not None else None
                await self.to_tts.put(Speak(r.scope, r, clause, spoken))
                self._words_out = True
        return any(char.isalnum() for char in part.text)  # words, not only spaces or punctuation


def asked_for_words(asked: LLMRequest) -> LLMRequest:
    """``asked`` again for an answer that had nothing in it: no functions in view, :data:`NUDGE` after the user's words.

    A small model offered functions sometimes ends its turn with no call
    and no words (issue 38: 2 of 14 everyday tool requests); asked once
    more without them, and told to answer in words, it gets a second chance
    before the server says :data:`NO_ANSWER`.
    """
    messages = list(asked.messages)
    last_user = next((n for n in range(len(messages) - 1, -1, -1) if messages[n].role == "user"), None)
    if last_user is None:
        messages.append(ChatMessage("user", NUDGE))
    else:
        said = messages[last_user]
        messages[last_user] = dataclasses.replace(said, content=f"{said.content}\n\n{NUDGE}")
    return without_functions(dataclasses.replace(asked, messages=tuple(messages)))


def without_functions(asked: LLMRequest) -> LLMRequest:
    """``asked`` with no functions in view, to be answered in words."""
    return dataclasses.replace(asked, tools=(), require_tool=False)


async def _timed(pieces: AsyncGenerator[str, None], metrics: Metrics) -> AsyncGenerator[str, None]:
    """A remote answer, timed into the LLM stage latency as an executor stream is."""
    started = time.perf_counter()
    try:
        async for piece in pieces:
            yield piece
    finally:
        await pieces.aclose()
        metrics.stage_latency.observe(time.perf_counter() - started, stage="llm")

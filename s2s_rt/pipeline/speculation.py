"""Speculation: a turn transcribed in its closing silence, judged, and answered ahead of its end.

While the user's closing silence runs, the words so far are transcribed
(a :class:`Guess`); under ``semantic_vad`` the chat LLM then judges whether
they end the turn; and the answer to them may be started
(:class:`~s2s_rt.pipeline.anticipation.Anticipation`). When the turn ends,
the turn takes what was made; when speech returns, it is dropped. A guess's
lifecycle is one table (:data:`TRANSITIONS`)::

    IDLE ──start──► SPECULATING ──judge──► JUDGED ──anticipate──► ANTICIPATING
                        │   └────────────anticipate────────────────►│
                        └── use / drop (from any of the three) ──► USED | DROPPED

A :class:`Speculator` belongs to one session (made when a slot takes it):
it keeps that session's guess and anticipation, and never costs more than
one engine call at a time.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from s2s_rt.engines.base import (
    ChatMessage,
    FirstWordsPause,
    Float32Array,
    JudgesTurnEnd,
    TakesTurns,
    Transcript,
    ms_to_samples,
    samples_to_ms,
)
from s2s_rt.lifecycle import Lifecycle
from s2s_rt.listening.buffer import join
from s2s_rt.pipeline.anticipation import (
    Anticipation,
    SpokenAhead,
    answer_request,
    can_anticipate,
    first_clause_pause,
)
from s2s_rt.pipeline.clauses import ClauseSplitter
from s2s_rt.pipeline.turns import TurnState
from s2s_rt.pipeline.work import TurnTiming
from s2s_rt.scope import Scope
from s2s_rt.turn import SemanticTurnEnd, shorten_pauses

if TYPE_CHECKING:
    from s2s_rt.pipeline.stage import StageContext
    from s2s_rt.protocol.response_params import ResponseParams
    from s2s_rt.protocol.server_events import ServerEvent
    from s2s_rt.protocol.session import Session

log = logging.getLogger(__name__)

#: ``semantic_vad``: what the LLM reads to judge whether the user has finished (besides their words). Told that
#: the words are speech transcribed as it is said, the model separated 24 questions cut mid-sentence from the
#: same 24 whole a little better (AUC 0.935 against 0.925, six voices unlike Piper's) and scored whole ones
#: higher (median 0.27 against 0.14); asked outright whether the speaker had finished, it could not (0.62).
JUDGE_SYSTEM = "You are a helpful voice assistant. The user's words were transcribed from speech as they spoke."
JUDGED_ANSWER_CHARS = 200

#: A transcription session's words are transcribed this often while the user speaks (live captions).
CAPTION_EVERY_MS = 1000


class Phase(enum.Enum):
    IDLE = "idle"
    SPECULATING = "speculating"
    JUDGED = "judged"
    ANTICIPATING = "anticipating"
    USED = "used"
    DROPPED = "dropped"


class Event(enum.Enum):
    #: The transcription of the turn so far began.
    START = "start"
    #: ``semantic_vad``: the LLM judged how likely the words end the turn.
    JUDGE = "judge"
    #: The answer to the words began.
    ANTICIPATE = "anticipate"
    #: The turn ended: it takes what was made.
    USE = "use"
    #: Speech came back, or the turn was cleared or committed by hand.
    DROP = "drop"


_LIVE = (Phase.SPECULATING, Phase.JUDGED, Phase.ANTICIPATING)

#: A guess's lifecycle: every allowed (phase, event) and where it leads. Anything else is a bug.
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (Phase.IDLE, Event.START): Phase.SPECULATING,
    (Phase.SPECULATING, Event.JUDGE): Phase.JUDGED,
    (Phase.SPECULATING, Event.ANTICIPATE): Phase.ANTICIPATING,
    (Phase.JUDGED, Event.ANTICIPATE): Phase.ANTICIPATING,
    **{(phase, Event.USE): Phase.USED for phase in _LIVE},
    **{(phase, Event.DROP): Phase.DROPPED for phase in _LIVE},
}
LIFECYCLE = Lifecycle("speculation", TRANSITIONS)


@dataclass
class Guess:
    """A transcription of a turn started during its closing silence."""

    task: asyncio.Task[Transcript | BaseException]
    #: Set by the worker thread when the engine call really starts.
    started: threading.Event
    #: The turn's waterfall, from this transcription's start (the turn takes it when it ends).
    timing: TurnTiming
    #: ``semantic_vad``: the probability that the words transcribed end the turn, once judged.
    finished: float | None = None
    _phase: Phase = field(default=Phase.IDLE)

    @property
    def phase(self) -> Phase:
        """Where the guess is in :data:`LIFECYCLE`; only :meth:`step` moves it."""
        return self._phase

    def step(self, event: Event) -> None:
        self._phase = LIFECYCLE.step(self._phase, event)


class Speculator:
    """One session's speculation: its guess, its anticipation, and the one engine call they may run.

    Args:
        stage: the slot's stage context.
        session: the session it belongs to.
        turns: the session's turn state (the listener's).
        language: the language the user last spoke.
        emit: sends events to the session's client (closing it if they cannot be queued).
        semantic: the waits of ``semantic_vad``.
        speculate_after_ms: silence after which a turn is transcribed ahead of its end (0: never).
    """

    def __init__(
        self,
        stage: StageContext,
        session: Session,
        turns: TurnState,
        language: Callable[[], str | None],
        emit: Callable[[list[ServerEvent]], None],
        semantic: SemanticTurnEnd,
        speculate_after_ms: int,
    ) -> None:
        self.stage = stage
        self.session = session
        self.turns = turns
        self.language = language
        self.emit = emit
        self.semantic = semantic
        self.speculate_after_ms = speculate_after_ms
        self.guess: Guess | None = None
        #: The answer to the guess, begun in the closing silence.
        self.anticipation: Anticipation | None = None
        #: A speculative engine call is running (wanted or not): no second one starts meanwhile.
        self.running = False

    @property
    def finished(self) -> float | None:
        """``semantic_vad``: the judged probability that the turn is over (None: not judged)."""
        return self.guess.finished if self.guess is not None else None

    def take(self) -> tuple[asyncio.Task[Transcript | BaseException] | None, Anticipation | None, TurnTiming]:
        """The turn ended: its transcription begun ahead, the answer begun ahead (each None if none), and its
        waterfall so far."""
        guess, self.guess = self.guess, None
        anticipation, self.anticipation = self.anticipation, None
        if guess is None:
            return None, anticipation, TurnTiming()
        guess.step(Event.USE)
        self.stage.metrics.speculations.inc(outcome="used")
        return guess.task, anticipation, guess.timing

    def drop(self) -> None:
        """Speech came back (or the turn was cleared): the guess is stale; stop it if it has not begun."""
        metrics = self.stage.metrics
        if self.guess is not None:
            self.guess.step(Event.DROP)
            self.guess.task.cancel()
            self.guess = None
            metrics.speculations.inc(outcome="discarded")
        if self.anticipation is not None:
            self.anticipation.drop("speech resumed")
            self.anticipation = None
            metrics.speculative_responses.inc(outcome="discarded")

    def on_voice(self) -> None:
        """A VAD window was heard while the user's turn is open: speculate, or caption, if it is time.

        While a turn's closing silence runs, what was said so far is
        transcribed. If the silence lasts, the turn ends with this
        transcript already made (or nearly); if speech returns, the guess is
        dropped — cancelled if its engine call has not begun, else left to
        finish unread, and no other speculation starts until it has. In a
        transcription session the words are also transcribed every second
        while the user speaks, and the new ones streamed (live captions).
        """
        turns = self.turns
        detector = turns.detector
        if detector is None:
            return
        silence_ms = samples_to_ms(turns.position) - detector.last_voice_ms
        if silence_ms == 0 and self.session.transcription_only:
            self._caption()
        judge = detector.settings.type == "semantic_vad"
        after_ms = self.speculate_after_ms
        if judge:  # semantic_vad needs the words to judge them
            after_ms = min(after_ms, self.semantic.speculate_ms) if after_ms else self.semantic.speculate_ms
        if not after_ms:
            return
        if self.guess is not None:
            if silence_ms == 0:
                self.drop()
            return
        if silence_ms < after_ms or self.running:
            return

        async def then(words: Transcript) -> Transcript:
            # The conversation as the turn's answer will read it, once for the judgement and the answer.
            conversation = self.session.next_prompt()
            if judge:
                await self._judge(words.text.strip(), guess, conversation[0])
            self._anticipate(words, guess, conversation)
            return words

        timing = TurnTiming()
        begun = self._transcribe_ahead(then, "speculation", timing)
        if begun is not None:
            guess = self.guess = Guess(*begun, timing)
            guess.step(Event.START)

    def _caption(self) -> None:
        """A transcription session: transcribe the turn so far each second of speech, and stream the new words."""
        turns = self.turns
        detector = turns.detector
        item_id = turns.turn_item_id
        now_ms = samples_to_ms(turns.position)
        if (
            detector is None
            or item_id is None
            or self.running
            or not self.session.transcribing
            or now_ms - max(detector.start_ms, turns.captioned_ms) < CAPTION_EVERY_MS
        ):
            return
        turns.captioned_ms = now_ms

        async def caption(words: Transcript) -> Transcript:
            if turns.turn_item_id == item_id:  # the turn is still being spoken
                self.emit(self.session.partly_heard(item_id, words.text.strip()))
            return words

        self._transcribe_ahead(caption, "caption")

    def _transcribe_ahead(
        self, then: Callable[[Transcript], Awaitable[Transcript]], what: str, timing: TurnTiming | None = None
    ) -> tuple[asyncio.Task[Transcript | BaseException], threading.Event] | None:
        """Transcribe the turn so far in the STT pool, then ``then`` on the loop; one such call at a time.

        ``timing`` gets the engine call's start (``speculated``) and its end (``transcribed``).

        The task is the session's (its scope's :meth:`~s2s_rt.scope.Scope.spawn`):
        cancelled with it, and never started once it is closing (None). It
        never raises (a failure is its result); :attr:`running` is set until
        its engine call ends.
        """
        turns = self.turns
        assert turns.detector is not None
        # Up to the chunk just judged, not all the audio this tick brought: the words transcribed depend on
        # the audio alone, never on how it was batched.
        begin = max(ms_to_samples(turns.detector.start_ms), turns.buffer.start_sample)
        chunks, start, end = turns.buffer.between(begin, turns.position)
        pauses = list(turns.detector.pauses)
        tr = self.session.config.transcription
        stt = self.stage.stack.stt
        started = threading.Event()
        loop = asyncio.get_running_loop()

        def done_running() -> None:
            self.running = False

        def transcribe() -> Transcript:
            started.set()
            if timing is not None:
                timing.speculated = time.perf_counter()
            try:
                heard = shorten_pauses(join(chunks, start, end), begin, pauses)
                words = stt.transcribe(heard, language=tr.language if tr else None, prompt=tr.prompt if tr else None)
                if timing is not None:
                    timing.transcribed = time.perf_counter()
                return words
            finally:
                loop.call_soon_threadsafe(done_running)

        async def run() -> Transcript | BaseException:
            # Never raises: its outcome is read by the STT stage, or nobody wants it.
            try:
                words = await self.stage.pools["stt"].call(transcribe)
            except Exception as exc:
                return exc
            return await then(words)

        task = self.stage.spawn(self.session.scope, run(), what)
        if task is None:
            return None  # the session is closing
        self.running = True

        def finished(t: asyncio.Task[Any]) -> None:
            if not started.is_set():  # dropped before its engine call began
                self.running = False

        task.add_done_callback(finished)
        return task, started

    async def _judge(self, text: str, guess: Guess, messages: list[ChatMessage]) -> None:
        """``semantic_vad``: how likely the words so far end the user's turn (the chat LLM judges).

        Left unknown if the model cannot judge (a remote LLM) or fails: the
        turn then ends after :attr:`SemanticTurnEnd.unknown_ms` of silence.
        """
        if not text:  # nothing was said: no words to wait for
            self._judged(guess, 1.0)
            return
        llm = self.stage.stack.llm
        if not isinstance(llm, JudgesTurnEnd):
            return
        answer = next((m for m in reversed(messages) if m.role == "assistant"), None)
        # The conversation's last answer (its end) gives the words their context; the instructions are left
        # out: this is read three times within the silence, so it is kept short.
        context = [ChatMessage("assistant", answer.content[-JUDGED_ANSWER_CHARS:])] if answer else []
        judged = [ChatMessage("system", JUDGE_SYSTEM), *context, ChatMessage("user", text)]
        index = self.stage.index
        try:
            finished = await self.stage.pools["llm"].call(llm.turn_end_probability, judged)
        except Exception as exc:
            log.warning("slot %d: judging the end of the turn failed: %r", index, exc)
            return
        log.debug("slot %d: %r sounds finished with probability %.4g", index, text, finished)
        self._judged(guess, finished)

    @staticmethod
    def _judged(guess: Guess, finished: float) -> None:
        if guess.phase is Phase.SPECULATING:  # not dropped or used meanwhile
            guess.finished = finished
            guess.step(Event.JUDGE)

    def _anticipate(
        self, words: Transcript, guess: Guess, conversation: tuple[list[ChatMessage], ResponseParams]
    ) -> None:
        """Begin answering the words transcribed in the closing silence, before the turn ends.

        Only for a turn that will be answered (``create_response``, no
        response running), and for ``semantic_vad`` only when the words
        sounded finished (the turn is about to end). The answer is asked
        exactly as the turn's response will ask it, so that it can adopt it.
        """
        stage = self.stage
        session = self.session
        detector = self.turns.detector
        text = words.text.strip()
        if (
            self.guess is not guess
            or guess.phase not in (Phase.SPECULATING, Phase.JUDGED)
            or self.anticipation is not None
            or detector is None
            or not text
            or not detector.settings.create_response
            or session.transcription_only
            or session.response is not None
            or session.scope.stale
            or not can_anticipate(stage.stack.llm)
        ):
            return
        td = detector.settings
        if td.type == "semantic_vad" and (
            guess.finished is None
            or detector.semantic.wait_ms(guess.finished, td.eagerness) > detector.semantic.min_silence_ms
        ):
            return
        messages, params = conversation
        # As the turn's response will ask it (see Responder.work), its words last.
        request = answer_request([*messages, ChatMessage("user", text)], params, words.language or self.language())
        scope = Scope("anticipation", parent=session.scope)
        ahead = self.anticipation = Anticipation(request, params.speed, params.voice, scope)
        guess.step(Event.ANTICIPATE)
        pause = first_clause_pause(
            stage.first_clause_words, request, "audio" in params.modalities, lambda: ahead.first_spoken
        )
        # Spoken (it pauses at its first clause's end): its first clause is cut, and spoken, ahead too.
        splitter = ClauseSplitter(first_words=stage.first_clause_words) if pause is not None else None
        answer = _answer_ahead(stage, ahead, splitter, pause, stage.voice(params.voice))
        if stage.spawn(ahead.scope, answer, "ahead") is None:
            ahead.end()  # its session is closing: nothing to adopt


async def _answer_ahead(
    stage: StageContext,
    ahead: Anticipation,
    splitter: ClauseSplitter | None,
    pause: FirstWordsPause | None,
    voice: str | None,
) -> None:
    """Stream the answer into ``ahead``, and synthesise its first clause in ``voice`` if given a splitter.

    ``splitter`` is a fresh clause splitter, as the LLM stage would cut the answer (None: text only);
    ``pause``, where the model pauses while that clause's speech is made (:func:`first_clause_pause`).
    """
    llm = stage.stack.llm
    stream = functools.partial(llm.stream, ahead.request, should_stop=lambda: ahead.scope.stale, usage=ahead.usage)
    if isinstance(llm, TakesTurns):
        # Urgent until its first clause is cut (or, unspoken, its first words are out).
        stream = functools.partial(
            stream,
            urgent=lambda: (ahead.first_clause is None) if splitter is not None else not ahead.pieces,
            pause=pause,
        )
    try:
        async for piece in stage.pools["llm"].stream(stream, gate=ahead.gate):
            ahead.add(piece)
            # Its first clause's speech only: what follows is the response's, cut by the response's own splitter
            # (the speech it takes leaves ``first_audio`` empty again; it is not a sign to speak the next clause).
            if splitter is not None and ahead.first_clause is None:
                clauses = splitter.feed(piece)
                if clauses:
                    ahead.speak_first(
                        clauses[0],
                        stage.spawn(ahead.scope, _speak_first_clause(stage, ahead, clauses[0], voice), "ahead-tts"),
                    )
    except Exception as exc:
        ahead.end(exc)
    else:
        ahead.end()


async def _speak_first_clause(
    stage: StageContext, ahead: Anticipation, text: str, voice: str | None
) -> SpokenAhead | None:
    """The first clause's speech; None if synthesis failed (the TTS stage then tries again, and reports)."""
    pieces: list[Float32Array] = []
    try:
        async for audio in stage.pools["tts"].stream(
            lambda: stage.stack.tts.synthesize(
                text, voice=voice, should_stop=lambda: ahead.scope.stale, speed=ahead.speed
            )
        ):
            pieces.append(audio)
    except Exception as exc:
        log.warning("slot %d: speaking the first clause ahead failed: %r", stage.index, exc)
        return None
    return SpokenAhead(pieces, time.perf_counter())

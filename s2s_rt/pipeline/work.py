"""What travels between a slot's stages, and how scoped work runs.

Every piece of work carries the :class:`~s2s_rt.scope.Scope` it was made
for (its session's, or its response's); a stage drops work whose scope is
stale. ``SESSION_END`` follows a session's last work through every stage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from s2s_rt.engines.base import Float32Array, LLMUsage, Transcript
from s2s_rt.scope import Scope

if TYPE_CHECKING:
    from s2s_rt.pipeline.anticipation import Anticipation, SpokenAhead
    from s2s_rt.protocol.response import Response


class SessionEnd:
    """Travels through every stage after a session's last work; the send loop frees the slot on it.

    It names the session it ends, so a copy that arrives late (after a stage
    restart re-sent it) can never end the next session.
    """

    __slots__ = ("session_id",)

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"SESSION_END({self.session_id})"


@dataclass(slots=True)
class BufferCommand:
    scope: Scope
    kind: str  # "commit" | "clear"
    event_id: str | None


@dataclass(slots=True)
class SettingsChanged:
    """The session's turn detection settings changed; applied in order with the audio."""

    scope: Scope


@dataclass(slots=True)
class ResponseRequest:
    """A response to produce; travels behind earlier transcriptions."""

    scope: Scope
    response: Response
    #: The answer begun in the turn's closing silence, to adopt if it asked the same.
    anticipation: Anticipation | None = None


@dataclass(slots=True)
class Transcribe:
    scope: Scope
    item_id: str
    audio: Float32Array
    respond: bool
    #: The turn's waterfall so far (None: committed by hand, or an idle timeout: nobody is waiting on it).
    timing: TurnTiming | None
    #: A transcription of this turn started during its closing silence, if any.
    speculation: asyncio.Task[Transcript | BaseException] | None = None
    #: The answer to it begun in that silence, if any.
    anticipation: Anticipation | None = None
    #: Where ``audio`` begins (a sample of the session's audio) and the turn's long pauses (ms): the
    #: recogniser hears them shortened (:func:`~s2s_rt.turn.shorten_pauses`).
    start: int = 0
    pauses: tuple[tuple[float, float], ...] = ()


@dataclass(slots=True)
class Speak:
    scope: Scope
    response: Response
    text: str
    #: Its speech, synthesised ahead of the turn's end (as the TTS engine made it), and when it was ready.
    ahead: asyncio.Task[SpokenAhead | None] | None = None


@dataclass(slots=True)
class CallOut:
    """A validated function call, emitted in order with the speech around it."""

    scope: Scope
    response: Response
    name: str
    arguments: str


@dataclass(slots=True)
class ResponseEnd:
    scope: Scope
    response: Response
    usage: LLMUsage


@dataclass(slots=True)
class CloseRequest:
    """Close the socket once everything queued before it has been sent."""

    scope: Scope
    code: int
    reason: str


@dataclass(slots=True)
class Outgoing:
    """One server event, already encoded: what it says was fixed when it was made."""

    scope: Scope
    type: str
    data: bytes
    #: Called once it has been written to the client (a turn's waterfall step).
    sent: Callable[[], None] | None = None
    #: An audio delta for a call's track instead of its events: (response id, item id, audio, its format).
    play: tuple[str, str, bytes, Any] | None = None
    #: The response whose audio this event ends (its ``response.done``): a call's track has it all.
    ends_audio_of: str | None = None


#: The steps of a turn's waterfall, in order: what happened between the user's last word and their answer's
#: first audio on the wire (:meth:`TurnTiming.waterfall`).
WATERFALL_STEPS = (
    "silence",  # the turn's end was decided (speech_stopped): the silence waited
    "speculated",  # the words so far began to be transcribed, in that silence
    "transcribed",  # the transcript was ready
    "boarded",  # the answer took its place in a call into the model (the model was free, or freed)
    "prompt_read",  # the model's first token: its prompt was read
    "first_clause",  # the first clause's last token: the first words to speak are complete
    "synthesised",  # the first clause's speech was ready
    "audio_sent",  # the first audio delta was written to the client
)


@dataclass(slots=True)
class TurnTiming:
    """``perf_counter()`` times of one response's turn, from the user's last word to its first audio sent.

    The listener makes it when a turn ends (or the dispatcher, for a
    ``response.create``); the stages fill in their steps as they reach them,
    the answer begun in the closing silence included (its steps then come
    before the turn's end); the outbox logs it when the response is done.
    """

    #: When the last voiced audio of the turn was heard (None: the turn did not end by voice activity).
    last_voice: float | None = None
    speech_end: float | None = None
    speculated: float | None = None
    transcribed: float | None = None
    created: float = field(default_factory=time.perf_counter)
    boarded: float | None = None
    prompt_read: float | None = None
    first_clause: float | None = None
    #: Tokens the model wrote up to the end of the first clause.
    clause_tokens: int | None = None
    synthesised: float | None = None
    #: The first audio delta was queued for the client, and written to it.
    first_audio: float | None = None
    audio_sent: float | None = None
    #: The outbox watches the response's first audio delta (and no other) for when it is written.
    first_delta_queued: bool = False
    #: The answer begun in the turn's closing silence, if the response adopted it: its model's steps are the turn's.
    ahead: Anticipation | None = None
    user_text: str | None = None

    @property
    def origin(self) -> float:
        """What the waterfall counts from: the last word, else the turn's end, else the response's creation."""
        for t in (self.last_voice, self.speech_end):
            if t is not None:
                return t
        return self.created

    def waterfall(self) -> dict[str, float]:
        """Seconds from :attr:`origin` to each step reached (:data:`WATERFALL_STEPS`)."""
        origin = self.origin
        marks = {"silence": self.speech_end if self.last_voice is not None else None}
        marks |= {step: getattr(self, step) for step in WATERFALL_STEPS[1:]}
        ahead = self.ahead
        if ahead is not None:
            marks["boarded"] = ahead.usage.boarded
            marks["prompt_read"] = ahead.first_token
            marks["first_clause"] = ahead.first_clause_at or self.first_clause
        return {step: t - origin for step, t in marks.items() if t is not None}

    @property
    def tokens_to_first_clause(self) -> int | None:
        ahead = self.ahead
        if ahead is not None and ahead.clause_tokens is not None:
            return ahead.clause_tokens
        return self.clause_tokens


class ResponseTimings:
    """One session's :class:`TurnTiming` of each response in flight, by response id.

    The session owns it (:class:`~s2s_rt.pipeline.context.SessionContext`):
    a response's timing begins when the response is created (:meth:`begin`),
    the stages fill in their steps (:meth:`of`), and the outbox ends it as the
    response's ``response.done`` is queued (:meth:`end`). It goes with the
    session: nothing of one session's timings reaches the next.
    """

    def __init__(self) -> None:
        self._by_response: dict[str, TurnTiming] = {}

    def begin(self, response_id: str, timing: TurnTiming | None = None) -> TurnTiming:
        """The response was created: its timing (``timing``, begun at the turn's end, or a new one)."""
        timing = timing if timing is not None else TurnTiming()
        self._by_response[response_id] = timing
        return timing

    def of(self, response_id: str) -> TurnTiming | None:
        """The timing of a response in flight (None: unknown, or ended)."""
        return self._by_response.get(response_id)

    def end(self, response_id: str) -> TurnTiming | None:
        """The response is done: its timing, taken out (None: it had none)."""
        return self._by_response.pop(response_id, None)


async def run_scoped(scope: Scope, coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` as a task that is cancelled the moment ``scope`` closes.

    The stage awaiting it then moves on at once, instead of waiting for an
    engine call whose result nobody wants. An exception of ``coro``
    propagates; a cancellation caused by the scope does not.
    """
    task = asyncio.ensure_future(coro)
    scope.on_close(task.cancel)
    try:
        await asyncio.wait((task,))
    except BaseException:  # the stage itself is cancelled: so is its work
        task.cancel()
        raise
    finally:
        scope.forget(task.cancel)
    if not task.cancelled():
        exc = task.exception()
        if exc is not None:
            raise exc

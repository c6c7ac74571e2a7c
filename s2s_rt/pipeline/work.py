"""What travels between a slot's stages, and how scoped work runs.

Every piece of work carries the :class:`~s2s_rt.scope.Scope` it was made
for (its session's, or its response's); a stage drops work whose scope is
stale. ``SESSION_END`` follows a session's last work through every stage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from s2s_rt.engines.base import PIPELINE_RATE, Float32Array, LLMUsage, Transcript
from s2s_rt.scope import Scope

if TYPE_CHECKING:
    from s2s_rt.pipeline.anticipation import Anticipation
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


def ms_to_samples(ms: float) -> int:
    return round(ms * PIPELINE_RATE / 1000)


def samples_to_ms(n: int) -> float:
    return n * 1000 / PIPELINE_RATE


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
    speech_end: float | None
    #: A transcription of this turn started during its closing silence, if any.
    speculation: asyncio.Task[Transcript | BaseException] | None = None
    #: The answer to it begun in that silence, if any.
    anticipation: Anticipation | None = None


@dataclass(slots=True)
class Speak:
    scope: Scope
    response: Response
    text: str
    #: Its speech, synthesised ahead of the turn's end (as the TTS engine made it).
    ahead: asyncio.Task[list[Float32Array] | None] | None = None


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


@dataclass(slots=True)
class TurnTiming:
    """``perf_counter()`` times of one response's turn."""

    speech_end: float | None = None
    transcribed: float | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    first_audio: float | None = None
    user_text: str | None = None


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

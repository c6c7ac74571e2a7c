"""What a slot keeps about the session it serves now."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from s2s_rt.config import DEFAULTS, mib
from s2s_rt.inference import OneAtATime
from s2s_rt.listening.hearing import SessionAudio
from s2s_rt.pipeline.mcp_runs import McpRuns
from s2s_rt.pipeline.speculation import Speculator
from s2s_rt.pipeline.turns import TurnState
from s2s_rt.pipeline.work import ResponseTimings
from s2s_rt.protocol.session import Session
from s2s_rt.turn import SemanticTurnEnd

if TYPE_CHECKING:
    from s2s_rt.pipeline.ports import Channel


class SessionContext:
    """One session's run in a slot: the one owner of its moving parts.

    It owns, each behind its own methods:

    - :attr:`audio`: the audio and commands waiting to be heard, and their byte budget
      (:class:`~s2s_rt.listening.hearing.SessionAudio`: put by the receive path, taken by the listening clock);
    - :attr:`timings`: each response's turn timing (:class:`~s2s_rt.pipeline.work.ResponseTimings`);
    - :attr:`speculator`: the work done ahead in a turn's closing silence;
    - :attr:`mcp`: its MCP listings and calls (:class:`~s2s_rt.pipeline.mcp_runs.McpRuns`);
    - the ending state: :attr:`ending`, moved by :meth:`stop_hearing` and the session's own end.

    The listening clock alone touches :attr:`turns` and :attr:`speculator`
    (through the slot's listener).

    Args:
        speculate: makes the session's speculator (the slot's listener knows how).
        max_waiting_bytes: most bytes of its raw audio waiting to be heard.
    """

    def __init__(
        self,
        channel: Channel,
        session: Session,
        client: str,
        vad_state: Any,
        semantic: SemanticTurnEnd,
        speculate: Callable[[SessionContext], Speculator],
        max_waiting_bytes: int = mib(DEFAULTS.max_input_queue_mib),
    ) -> None:
        #: What carries its events (a WebSocket, a call); ``channel.playback`` is where its answers' audio plays.
        self.channel = channel
        self.session = session
        self.client = client
        td = session.config.turn_detection
        self.audio = SessionAudio(
            session.scope, vad_state, session.config.input_format, td is not None, max_waiting_bytes
        )
        self.timings = ResponseTimings()
        self.turns = TurnState(td, semantic)
        #: The session's LLM calls given up on: a new one waits until they have ended (one at a time).
        self.llm_gate = OneAtATime()
        #: The language the user last spoke (given by the session, or detected): answers are in it.
        self.language: str | None = None
        self.speculator = speculate(self)
        #: Its MCP servers' listings and its answers' MCP calls, in flight.
        self.mcp = McpRuns(session)

    @property
    def ending(self) -> bool:
        """The session is ending: nothing more of it is heard, started or sent (its audio closed, or its scope)."""
        return self.audio.closed

    def stop_hearing(self) -> int:
        """Hear no more of this session (it fell behind, or failed); returns how many waiting items were dropped."""
        return self.audio.close()

    def end(self) -> int:
        """The session ends: nothing more is heard, and its work in flight is cancelled; returns items dropped."""
        dropped = self.audio.close()
        self.session.end()
        return dropped

"""What a slot keeps about the session it serves now."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from s2s_rt.inference import OneAtATime
from s2s_rt.listening.hearing import SessionAudio
from s2s_rt.pipeline.speculation import Speculator
from s2s_rt.pipeline.turns import TurnState
from s2s_rt.protocol.session import Session
from s2s_rt.turn import SemanticTurnEnd

if TYPE_CHECKING:
    from s2s_rt.pipeline.outbox import Channel


class SessionContext:
    """A session's channel and state, as the slot's stages see it.

    The listening clock alone touches :attr:`audio`, :attr:`turns` and
    :attr:`speculator` (through the slot's listener), and the receive path
    appends to the audio's inbox.

    Args:
        speculate: makes the session's speculator (the slot's listener knows how).
    """

    def __init__(
        self,
        channel: Channel,
        session: Session,
        client: str,
        vad_state: Any,
        semantic: SemanticTurnEnd,
        speculate: Callable[[SessionContext], Speculator],
    ) -> None:
        #: What carries its events (a WebSocket, a call); ``channel.media`` plays a call's audio.
        self.channel = channel
        self.session = session
        self.client = client
        td = session.config.turn_detection
        self.audio = SessionAudio(session.scope, vad_state, session.config.input_format, scoring=td is not None)
        self.turns = TurnState(td, semantic)
        #: The session's LLM calls given up on: a new one waits until they have ended (one at a time).
        self.llm_gate = OneAtATime()
        #: The language the user last spoke (given by the session, or detected): answers are in it.
        self.language: str | None = None
        self.speculator = speculate(self)

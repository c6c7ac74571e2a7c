"""What a slot keeps about the session it serves now."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from s2s_rt.inference import OneAtATime
from s2s_rt.pipeline.listening import ListeningState
from s2s_rt.protocol.session import Session
from s2s_rt.turn import SemanticTurnEnd

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection


class SessionContext:
    """A session's socket and state, as the slot's stages see it.

    The listening clock alone owns :attr:`listening`.
    """

    def __init__(
        self, ws: ServerConnection, session: Session, vad_state: Any, client: str, semantic: SemanticTurnEnd
    ) -> None:
        self.ws = ws
        self.session = session
        self.client = client
        self.listening = ListeningState(vad_state, session.config.turn_detection, session.config.input_format, semantic)
        #: The session's LLM calls given up on: a new one waits until they have ended (one at a time).
        self.llm_gate = OneAtATime()
        #: The language the user last spoke (given by the session, or detected): answers are in it.
        self.language: str | None = None

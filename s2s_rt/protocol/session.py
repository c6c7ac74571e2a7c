"""One Realtime session's state, as plain Python with no I/O.

:class:`Session` ties together what a conversation is: its configuration
(:mod:`~s2s_rt.protocol.config`), its ordered items
(:mod:`~s2s_rt.protocol.conversation`) and at most one active response
(:mod:`~s2s_rt.protocol.response`, whose lifecycle is a state table). Its
methods take a decoded client event (or a pipeline fact such as "this item
was transcribed") and return the server events that follow, raising
:class:`~s2s_rt.protocol.errors.ProtocolError` when the client asked for
something impossible. The slot feeds it and sends what it returns; tests
drive it directly.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from typing import Any

from s2s_rt.engines.base import ChatMessage
from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol import server_events as se
from s2s_rt.protocol.config import (
    SessionConfig,
    Transcription,
    apply_update,
    render,
)
from s2s_rt.protocol.conversation import Conversation
from s2s_rt.protocol.errors import ProtocolError, RealtimeError
from s2s_rt.protocol.mcp import McpPolicy, McpTools
from s2s_rt.protocol.prompt import build_prompt
from s2s_rt.protocol.response import Response
from s2s_rt.protocol.response_params import ResponseParams, settle
from s2s_rt.protocol.server_events import new_id, snapshot
from s2s_rt.protocol.truncation import ContextFull, ContextWindow
from s2s_rt.protocol.voices import Voices
from s2s_rt.scope import Scope


class Session:
    """State of one Realtime session.

    Args:
        dialect: GA or beta naming for the events this session emits.
        voices: the voices a session may ask for (or the installed ones, the first the default).
        window: the model's context, where the LLM can say what messages cost in it (``truncation``).
    """

    def __init__(
        self,
        dialect: se.Dialect,
        voices: Voices | Iterable[str] = ("default",),
        *,
        max_conversation_bytes: int = 16 << 20,
        transcription_only: bool = False,
        model: str | None = None,
        window: ContextWindow | None = None,
        mcp: McpPolicy | None = None,
    ) -> None:
        self.dialect = dialect
        #: What the model reads of the conversation (``truncation``); None: the LLM keeps within its context itself.
        self.window = window
        self.voices = voices if isinstance(voices, Voices) else Voices.of(voices)
        #: Its MCP servers and the tools they listed (``type: "mcp"`` tools; the operator's policy).
        self.mcp = McpTools(mcp or McpPolicy())
        self.id = new_id("sess")
        self.config = SessionConfig(voice=self.voices.default)
        if model:
            self.config.model = model  # echoed as the client asked (beta: when its types know the name)
        if transcription_only:
            self.config.kind = "transcription"
            self.config.transcription = Transcription()
        self.conversation = Conversation(dialect, max_conversation_bytes)
        #: Closed when the session ends: all its work, and its responses', is stale then.
        self.scope = Scope(f"session {self.id}")
        #: The active response, if any (at most one).
        self.response: Response | None = None
        #: Responses started in this session.
        self.turns = 0
        #: Per item: the words already streamed as transcription deltas while the user spoke.
        self._streamed: dict[str, str] = {}
        #: The id ``speech_started`` announced for the turn being spoken: the server's, until it is committed.
        self._announced: str | None = None

    # --- event helpers -------------------------------------------------

    def _ev(self, cls: type[se.E], ga_name: str, **fields: Any) -> se.E:
        return self.dialect.event(cls, ga_name, **fields)

    def error(self, exc: RealtimeError) -> se.Error:
        return self._ev(
            se.Error,
            "error",
            error=se.ErrorDetail(
                type=exc.type, code=exc.code, message=exc.message, param=exc.param, event_id=exc.event_id
            ),
        )

    @property
    def transcription_only(self) -> bool:
        """A transcription session: every turn is transcribed, none is answered."""
        return self.config.kind == "transcription"

    def _session_event(self, ga_name: str) -> se.ServerEvent:
        # Beta names a transcription session's updates ``transcription_session.updated``; it has no
        # ``transcription_session.created`` (the SDK's beta types reject one): a session starts as any other.
        session = self.render()
        if self.transcription_only and self.dialect.beta:
            if ga_name == "session.updated":
                ga_name = "transcription_session.updated"
            else:
                session.pop("client_secret", None)  # a transcription session's field, not a session's
        return self._ev(se.SessionEvent, ga_name, session=session)

    def created_events(self) -> list[se.ServerEvent]:
        """``session.created`` and ``conversation.created``, sent on connect."""
        return [
            self._session_event("session.created"),
            self._ev(
                se.ConversationCreated,
                "conversation.created",
                conversation={"id": self.conversation.id, "object": "realtime.conversation"},
            ),
        ]

    def render(self) -> dict[str, Any]:
        return render(self.config, self.dialect, self.id)

    def handle(self, ev: ce.ClientEvent) -> list[se.ServerEvent]:
        """Apply a client event that concerns the conversation, not the audio buffer.

        Args:
            ev: any client event but ``input_audio_buffer.*`` (those belong to
                the audio pipeline).

        Raises:
            ProtocolError: the event cannot be honoured.
        """
        match ev:
            case ce.SessionUpdate():
                return self.update(ev)
            case ce.TranscriptionSessionUpdate():
                return self.update_transcription(ev)
            case ce.ConversationItemCreate():
                return self.create_item(ev)
            case ce.ConversationItemRetrieve():
                return self.retrieve_item(ev)
            case ce.ConversationItemTruncate():
                return self.truncate_item(ev)
            case ce.ConversationItemDelete():
                return self.delete_item(ev)
            case ce.ResponseCreate():
                return self.start_response(ev.response, ev.event_id)
            case ce.ResponseCancel():
                return self.cancel_response("client_cancelled", ev.response_id, ev.event_id)
        raise TypeError(f"{type(ev).__name__} is handled by the audio pipeline")

    def end(self) -> None:
        """The session is over: all of its work is stale from now on."""
        self.response = None
        self.scope.close("session ended")

    # --- session.update ----------------------------------------------

    def update(self, ev: ce.SessionUpdate) -> list[se.ServerEvent]:
        """Apply a ``session.update`` in either shape, all or nothing.

        Raises:
            ProtocolError: an unsupported format, voice, modality or value.
        """
        apply_update(self.config, ev, self.voices, None if self.dialect.beta else self.mcp)
        self.mcp.configure(self.config.tools)
        return [self._session_event("session.updated")]

    def update_transcription(self, ev: ce.TranscriptionSessionUpdate) -> list[se.ServerEvent]:
        """Beta ``transcription_session.update``: this becomes (or stays) a transcription session.

        Raises:
            ProtocolError: an unsupported format or value.
        """
        ev.session.type = "transcription"
        apply_update(self.config, ce.SessionUpdate(session=ev.session, event_id=ev.event_id), self.voices)
        return [self._session_event("session.updated")]

    # --- conversation items -------------------------------------------

    def _added(self, item: se.Item, prev: str | None) -> list[se.ServerEvent]:
        """``conversation.item.added`` (beta: ``created``), then GA's ``done``, for a complete item."""
        events: list[se.ServerEvent] = [
            self._ev(se.ItemEvent, "conversation.item.added", previous_item_id=prev, item=snapshot(item))
        ]
        if not self.dialect.beta:
            events.append(self._ev(se.ItemEvent, "conversation.item.done", previous_item_id=prev, item=snapshot(item)))
        return events

    def create_item(self, ev: ce.ConversationItemCreate) -> list[se.ServerEvent]:
        """``conversation.item.create``: add a message, function call or function output.

        Raises:
            ProtocolError: a bad role/content, duplicate id, unknown previous item.
        """
        item = self.conversation.item_from_client(ev.item, ev.event_id)
        if item.id == self._announced:
            raise ProtocolError(
                "item_id_already_exists",
                f"Item id {item.id!r} was announced by input_audio_buffer.speech_started for the turn being spoken;"
                " choose another id",
                param="item.id",
                event_id=ev.event_id,
            )
        self.conversation.check_fits(item, ev.event_id)
        prev = self.conversation.insert(item, ev.previous_item_id, ev.event_id)
        return self._added(item, prev) + self.trim()

    def trim(self) -> list[se.ServerEvent]:
        """Keep the conversation within its byte budget: drop its oldest items, telling the client.

        The items of the response in progress are never dropped.
        """
        keep = {o.id for o in self.response.outputs} if self.response is not None else set()
        return [
            self._ev(se.ItemDeleted, "conversation.item.deleted", item_id=item_id)
            for item_id in self.conversation.trim(keep)
        ]

    def retrieve_item(self, ev: ce.ConversationItemRetrieve) -> list[se.ServerEvent]:
        item = self.conversation.find(ev.item_id, ev.event_id, "retrieve")
        return [self._ev(se.ItemRetrieved, "conversation.item.retrieved", item=snapshot(item))]

    def delete_item(self, ev: ce.ConversationItemDelete) -> list[se.ServerEvent]:
        self.conversation.find(ev.item_id, ev.event_id, "delete")
        if self.response is not None and any(o.id == ev.item_id for o in self.response.outputs):
            raise ProtocolError(
                "item_delete_active_response",
                "Cannot delete the item of the response in progress; cancel it first",
                param="item_id",
                event_id=ev.event_id,
            )
        self.conversation.delete(ev.item_id)
        return [self._ev(se.ItemDeleted, "conversation.item.deleted", item_id=ev.item_id)]

    def truncate_item(self, ev: ce.ConversationItemTruncate) -> list[se.ServerEvent]:
        """Trim an assistant item's audio transcript to what was heard (it stays trimmed).

        Raises:
            ProtocolError: not an assistant audio item, or ``audio_end_ms``
                beyond the audio it has.
        """
        self.conversation.truncate(ev)
        return [
            self._ev(
                se.ItemTruncated,
                "conversation.item.truncated",
                item_id=ev.item_id,
                content_index=ev.content_index or 0,
                audio_end_ms=ev.audio_end_ms,
            )
        ]

    # --- input audio turns ----------------------------------------------

    def commit_audio(self, item_id: str) -> list[se.ServerEvent]:
        """The input buffer became a user item (its transcript ``null`` until transcribed)."""
        if item_id == self._announced:
            self._announced = None
        item = self.conversation.user_audio(item_id)
        prev = self.conversation.insert(item, None, None)
        return [
            self._ev(se.BufferCommitted, "input_audio_buffer.committed", previous_item_id=prev, item_id=item_id),
            *self._added(item, prev),
            *self.trim(),
        ]

    @property
    def transcribing(self) -> bool:
        """Whether the client asked for input transcription events."""
        return self.config.transcription is not None

    def transcribed(self, item_id: str, text: str, audio_seconds: float) -> list[se.ServerEvent]:
        """The STT stage heard ``text`` in an item; its events only if the client asked for them."""
        item = self.conversation.items.get(item_id)
        if item is None:  # deleted meanwhile
            return []
        self.conversation.heard[item_id] = text
        self.conversation.account(item_id)
        trimmed = self.trim()
        if not self.transcribing:
            return trimmed
        if item.content:
            item.content[0].transcript = text
        streamed = self._streamed.pop(item_id, "")
        rest = text[len(streamed) :] if _extends(text, streamed) else ""
        return [
            *trimmed,
            *self._transcription_deltas(item_id, rest),
            self._ev(
                se.TranscriptionCompleted,
                "conversation.item.input_audio_transcription.completed",
                item_id=item_id,
                content_index=0,
                transcript=text,
                usage={"type": "duration", "seconds": round(audio_seconds, 3)},
            ),
        ]

    def partly_heard(self, item_id: str, text: str) -> list[se.ServerEvent]:
        """Words of a turn the user is still speaking, transcribed so far: deltas for the new ones.

        Deltas only add (a client appends them), so only words that extend
        what was already streamed go out, and not the last one (the audio
        may end inside it); the completed transcript, which may differ, has
        the last word.
        """
        if not self.transcribing:
            return []
        words = text.split()
        stable = " ".join(words[:-1])
        streamed = self._streamed.get(item_id, "")
        if len(stable) <= len(streamed) or not _extends(stable, streamed):
            return []
        self._streamed[item_id] = stable
        return self._transcription_deltas(item_id, stable[len(streamed) :])

    def _transcription_deltas(self, item_id: str, text: str) -> list[se.ServerEvent]:
        """``text`` as streamed deltas, a word each with the space before it (a client appends them)."""
        return [
            self._ev(
                se.TranscriptionDelta,
                "conversation.item.input_audio_transcription.delta",
                item_id=item_id,
                content_index=0,
                delta=piece,
            )
            for piece in re.findall(r"\s*\S+", text)
        ]

    def transcription_failed(self, item_id: str, message: str) -> list[se.ServerEvent]:
        self._streamed.pop(item_id, None)
        if not self.transcribing or item_id not in self.conversation.items:
            return []
        return [
            self._ev(
                se.TranscriptionFailed,
                "conversation.item.input_audio_transcription.failed",
                item_id=item_id,
                content_index=0,
                error={"type": "server_error", "code": "transcription_failed", "message": message, "param": None},
            )
        ]

    # --- responses -----------------------------------------------------

    def start_response(self, params: ce.ResponseIn | None, event_id: str | None = None) -> list[se.ServerEvent]:
        """Begin the one active response (:attr:`response`).

        Raises:
            ProtocolError: a response is already active, or a bad parameter.
        """
        if self.transcription_only:
            raise ProtocolError(
                "invalid_request_error",
                "A transcription session transcribes what it hears and never answers; response.create is not"
                " available in it",
                event_id=event_id,
            )
        if self.response is not None:
            raise ProtocolError(
                "conversation_already_has_active_response",
                f"Response {self.response.id} is still in progress; cancel it or wait for response.done",
                event_id=event_id,
            )
        settled = settle(
            self.config, self.voices, params or ce.ResponseIn(), event_id, self._input_item, self.mcp.as_functions
        )
        self.turns += 1
        self.response = r = Response(settled, self.dialect, self.conversation, Scope("response", parent=self.scope))
        return [r.created()]

    def _input_item(self, src: ce.ItemIn, event_id: str | None) -> se.Item:
        """An item of ``response.input``: a new item, or a reference to one in the conversation."""
        if src.type == "item_reference":
            if not isinstance(src.id, str):
                raise ProtocolError(
                    "invalid_value", "An item_reference needs an 'id'", param="response.input.id", event_id=event_id
                )
            return self.conversation.find(src.id, event_id, "reference")
        return self.conversation.item_from_client(src, event_id)

    def finish_response(self, r: Response) -> list[se.ServerEvent]:
        """The response produced everything: its closing events, in order."""
        if self.response is r:
            self.response = None
        return r.finish() + self.trim()

    def cancel_response(
        self, reason: str, response_id: str | None = None, event_id: str | None = None
    ) -> list[se.ServerEvent]:
        """End the active response as cancelled (client or turn detection).

        Raises:
            ProtocolError: no response is active, or ``response_id`` is not it.
        """
        r = self.response
        if r is None:
            raise ProtocolError(
                "response_cancel_not_active", "There is no active response to cancel", event_id=event_id
            )
        if response_id is not None and response_id != r.id:
            raise ProtocolError(
                "response_cancel_not_active",
                f"Response {response_id!r} is not the active response",
                param="response_id",
                event_id=event_id,
            )
        self.response = None
        return r.cancel(reason)

    def fail_response(self, r: Response, error: RealtimeError) -> list[se.ServerEvent]:
        """End the response as failed, with an ``error`` event for the client (a server fault, or its setting's)."""
        if self.response is r:
            self.response = None
        return r.fail(error)

    def prompt(self, r: Response) -> list[ChatMessage]:
        """The chat messages the LLM sees for response ``r``; :class:`ContextFull` if they cannot fit (``disabled``)."""
        if r.params.input_items is not None:
            items = r.params.input_items
        else:
            own = {o.id for o in r.outputs}
            said = [self.conversation.items[i] for i in self.conversation.order if i not in own]
            items = self._in_context(said, r.params)
        return build_prompt(r.params.instructions, items, self.conversation)

    def next_prompt(self) -> tuple[list[ChatMessage], ResponseParams]:
        """What the next default response would read before a new turn: the conversation so far, and its settings."""
        params = settle(self.config, self.voices, ce.ResponseIn(), None, self._input_item, self.mcp.as_functions)
        items = [self.conversation.items[i] for i in self.conversation.order]
        with contextlib.suppress(ContextFull):  # the response itself will fail
            items = self._in_context(items, params)
        return build_prompt(params.instructions, items, self.conversation), params

    def _in_context(self, items: list[se.Item], params: ResponseParams) -> list[se.Item]:
        """The conversation's ``items`` the model reads (``truncation``); raises :class:`ContextFull`."""
        if self.window is None:
            return items
        conversation, setting = self.conversation, self.config.truncation
        return self.window.read(items, setting, params, lambda item: build_prompt("", [item], conversation))

    # --- events the pipeline reports -------------------------------------

    def speech_started(self, audio_start_ms: int, item_id: str) -> se.ServerEvent:
        self._announced = item_id
        return self._ev(
            se.SpeechStarted, "input_audio_buffer.speech_started", audio_start_ms=audio_start_ms, item_id=item_id
        )

    def speech_stopped(self, audio_end_ms: int, item_id: str) -> se.ServerEvent:
        return self._ev(
            se.SpeechStopped, "input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id
        )

    def buffer_cleared(self) -> se.ServerEvent:
        self._streamed.clear()  # no turn is open any more
        return self._ev(se.BufferCleared, "input_audio_buffer.cleared")

    def output_audio_buffer(self, kind: str, response_id: str) -> se.ServerEvent:
        """``output_audio_buffer.started``, ``.stopped`` or ``.cleared``: what a call's track played (WebRTC)."""
        return self._ev(se.OutputAudioBuffer, f"output_audio_buffer.{kind}", response_id=response_id)

    def cut_off(self, response_id: str | None, item_id: str | None, heard_ms: float) -> list[se.ServerEvent]:
        """A call's audio was cut off after ``heard_ms`` of ``item_id``: ``cleared``, and the item truncated there.

        The server played it, so it truncates the assistant's item at what
        was heard, as a client over WebSocket does with ``conversation.item.truncate``.
        """
        events: list[se.ServerEvent] = []
        if response_id is not None:
            events.append(self.output_audio_buffer("cleared", response_id))
        if item_id is not None and item_id in self.conversation.spoken:
            truncate = ce.ConversationItemTruncate(item_id=item_id, content_index=0, audio_end_ms=int(heard_ms))
            try:
                events += self.truncate_item(truncate)
            except ProtocolError:
                pass  # the item was deleted meanwhile, or is no longer one that holds audio
        return events

    def timeout_triggered(self, start_ms: int, end_ms: int, item_id: str) -> list[se.ServerEvent]:
        """``input_audio_buffer.timeout_triggered`` (a GA event: beta has no such type)."""
        if self.dialect.beta:
            return []
        fields = {"audio_start_ms": start_ms, "audio_end_ms": end_ms, "item_id": item_id}
        return [self._ev(se.TimeoutTriggered, "input_audio_buffer.timeout_triggered", **fields)]


def _extends(text: str, prefix: str) -> bool:
    """Whether ``text`` starts with the words of ``prefix`` (whole words)."""
    return not prefix or text == prefix or text.startswith(prefix + " ")

"""One Realtime session's state, as plain Python with no I/O.

:class:`Session` holds what a conversation is: the session settings, the
ordered conversation items, and the one active response. Its methods take a
decoded client event (or a pipeline fact such as "this item was transcribed")
and return the server events that follow, raising
:class:`~s2s_rt.protocol.errors.ProtocolError` when the client asked for
something impossible. The slot feeds it and sends what it returns; tests
drive it directly.

A response moves through these states, and only these::

    (none) --start_response--> in_progress --finish_response--> completed
                                    |
                                    +--cancel_response--> cancelled
                                    +--fail_response----> failed
"""

from __future__ import annotations

import base64
import dataclasses
import json
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from msgspec import UNSET

from s2s_rt.audio import AudioFormat, AudioFormatError
from s2s_rt.engines.base import ChatMessage
from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol import server_events as se
from s2s_rt.protocol.errors import ProtocolError

T = TypeVar("T")
E = TypeVar("E", bound=se.ServerEvent)

#: Cap applied when a client asks for "inf" output tokens.
MAX_OUTPUT_TOKENS_CAP = 4096
DEFAULT_MAX_OUTPUT_TOKENS = 1024


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


@dataclass(slots=True)
class TurnDetection:
    """``server_vad`` settings (OpenAI's defaults)."""

    type: str = "server_vad"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None


@dataclass(slots=True)
class Transcription:
    model: str = "whisper-1"
    language: str | None = None
    prompt: str | None = None


@dataclass(slots=True)
class SessionConfig:
    model: str = "s2s-rt"
    instructions: str = (
        "You are a helpful voice assistant. Answer briefly, in one to three short"
        " spoken sentences, without lists or markdown."
    )
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    voice: str = ""
    input_format: AudioFormat = field(default_factory=AudioFormat)
    output_format: AudioFormat = field(default_factory=AudioFormat)
    transcription: Transcription | None = field(default_factory=Transcription)
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    temperature: float = 0.8
    max_output_tokens: int | str = "inf"
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"


@dataclass(slots=True)
class SpokenSegment:
    """A piece of an assistant item's audio and the words it speaks."""

    text: str
    start_ms: float
    end_ms: float


@dataclass(slots=True)
class ActiveResponse:
    """The response being produced, and what it has produced so far."""

    id: str
    generation: int
    in_conversation: bool
    modalities: list[str]
    voice: str
    output_format: AudioFormat
    instructions: str
    max_output_tokens: int | str
    temperature: float
    input_items: list[se.Item] | None
    metadata: dict[str, Any] | None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    #: The assistant message item, made when the first text or audio arrives.
    item: se.Item | None = None
    #: Every output item in order (the message and any function calls).
    outputs: list[se.Item] = field(default_factory=list)
    text: str = ""
    audio_ms: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def token_limit(self) -> int:
        if isinstance(self.max_output_tokens, int):
            return min(self.max_output_tokens, MAX_OUTPUT_TOKENS_CAP)
        return DEFAULT_MAX_OUTPUT_TOKENS


class Session:
    """State of one Realtime session.

    Args:
        dialect: GA or beta naming for the events this session emits.
        voices: the voices the TTS offers; the first is the default.
    """

    def __init__(self, dialect: se.Dialect, voices: Iterable[str] = ("default",)) -> None:
        self.dialect = dialect
        self.voices = list(voices) or ["default"]
        self.id = new_id("sess")
        self.conversation_id = new_id("conv")
        self.config = SessionConfig(voice=self.voices[0])
        self.items: dict[str, se.Item] = {}
        self.order: list[str] = []
        self.response: ActiveResponse | None = None
        # Spoken audio of assistant items, for truncation.
        self.spoken: dict[str, list[SpokenSegment]] = {}
        #: Responses started in this session.
        self.turns = 0

    # --- event helpers -------------------------------------------------

    def _ev(self, cls: type[E], ga_name: str, **fields: Any) -> E:
        return cls(type=self.dialect.name(ga_name), event_id=new_id("event"), **fields)

    def error(self, exc: ProtocolError) -> se.Error:
        return self._ev(
            se.Error,
            "error",
            error=se.ErrorDetail(
                type=exc.type, code=exc.code, message=exc.message, param=exc.param, event_id=exc.event_id
            ),
        )

    def created_events(self) -> list[se.ServerEvent]:
        """``session.created`` and ``conversation.created``, sent on connect."""
        return [
            self._ev(se.SessionEvent, "session.created", session=self.render()),
            self._ev(
                se.ConversationCreated,
                "conversation.created",
                conversation={"id": self.conversation_id, "object": "realtime.conversation"},
            ),
        ]

    def handle(self, ev: ce.ClientEvent, generation: int) -> list[se.ServerEvent]:
        """Apply a client event that concerns the conversation, not the audio buffer.

        Args:
            ev: any client event but ``input_audio_buffer.*`` (those belong to
                the audio pipeline).
            generation: the generation a ``response.create`` would start.

        Raises:
            ProtocolError: the event cannot be honoured.
        """
        match ev:
            case ce.SessionUpdate():
                return self.update(ev)
            case ce.ConversationItemCreate():
                return self.create_item(ev)
            case ce.ConversationItemRetrieve():
                return self.retrieve_item(ev)
            case ce.ConversationItemTruncate():
                return self.truncate_item(ev)
            case ce.ConversationItemDelete():
                return self.delete_item(ev)
            case ce.ResponseCreate():
                return self.start_response(ev.response, generation, ev.event_id)
            case ce.ResponseCancel():
                return self.cancel_response("client_cancelled", ev.response_id, ev.event_id)
        raise TypeError(f"{type(ev).__name__} is handled by the audio pipeline")

    # --- session.update ----------------------------------------------

    def update(self, ev: ce.SessionUpdate) -> list[se.ServerEvent]:
        """Apply a ``session.update`` in either shape, all or nothing.

        Raises:
            ProtocolError: an unsupported format, voice, modality or value.
        """
        patch = ev.session
        cfg = self.config
        new: dict[str, Any] = {}
        eid = ev.event_id

        def fail(code: str, message: str, param: str) -> ProtocolError:
            return ProtocolError(code, message, param=f"session.{param}", event_id=eid)

        if patch.type is not UNSET and patch.type not in ("realtime", "transcription"):
            raise fail("invalid_value", f"session.type must be 'realtime', not {patch.type!r}", "type")
        if patch.model is not UNSET:
            new["model"] = patch.model
        if patch.instructions is not UNSET:
            new["instructions"] = patch.instructions
        for name in ("modalities", "output_modalities"):
            mods = getattr(patch, name)
            if mods is not UNSET:
                new["output_modalities"] = _checked(_check_modalities, mods, fail, name)
        # Voice: beta flat field or GA audio.output.voice.
        voice = patch.voice
        if patch.audio is not UNSET and patch.audio.output is not UNSET and patch.audio.output.voice is not UNSET:
            voice = patch.audio.output.voice
        if voice is not UNSET:
            new["voice"] = self.check_voice(voice, eid, "session.voice")
        # Formats.
        try:
            if patch.input_audio_format is not UNSET:
                new["input_format"] = AudioFormat.parse(patch.input_audio_format)
            if patch.output_audio_format is not UNSET:
                new["output_format"] = AudioFormat.parse(patch.output_audio_format)
            if patch.audio is not UNSET:
                if patch.audio.input is not UNSET and patch.audio.input.format is not UNSET:
                    new["input_format"] = _parse_format(patch.audio.input.format)
                if patch.audio.output is not UNSET and patch.audio.output.format is not UNSET:
                    new["output_format"] = _parse_format(patch.audio.output.format)
        except AudioFormatError as exc:
            raise ProtocolError(
                "unsupported_audio_format", str(exc), param="session.audio.format", event_id=eid
            ) from None
        # Transcription and turn detection, beta then GA.
        trans: Any = patch.input_audio_transcription
        turn: Any = patch.turn_detection
        if patch.audio is not UNSET and patch.audio.input is not UNSET:
            if patch.audio.input.transcription is not UNSET:
                trans = patch.audio.input.transcription
            if patch.audio.input.turn_detection is not UNSET:
                turn = patch.audio.input.turn_detection
        if trans is not UNSET:
            new["transcription"] = None if trans is None else _merge_transcription(cfg.transcription, trans)
        if turn is not UNSET:
            new["turn_detection"] = None if turn is None else _merge_turn(cfg.turn_detection, turn, fail)
        if patch.temperature is not UNSET:
            if not 0.0 <= patch.temperature <= 2.0:
                raise fail("invalid_value", "temperature must be between 0 and 2", "temperature")
            new["temperature"] = patch.temperature
        for name in ("max_response_output_tokens", "max_output_tokens"):
            value = getattr(patch, name)
            if value is not UNSET:
                new["max_output_tokens"] = _checked(_check_max_tokens, value, fail, name)
        if patch.tools is not UNSET:
            new["tools"] = patch.tools
        if patch.tool_choice is not UNSET:
            new["tool_choice"] = patch.tool_choice
        for key, value in new.items():
            setattr(cfg, key, value)
        return [self._ev(se.SessionEvent, "session.updated", session=self.render())]

    def check_voice(self, voice: str, event_id: str | None, param: str) -> str:
        if voice in self.voices:
            return voice
        # OpenAI voice names (alloy, verse…) map to our default voice, so
        # clients written for the hosted service work unchanged.
        if voice in OPENAI_VOICES:
            return self.voices[0]
        raise ProtocolError(
            "unknown_voice",
            f"Unknown voice {voice!r}; available: {', '.join(self.voices)}",
            param=param,
            event_id=event_id,
        )

    def render(self) -> dict[str, Any]:
        """The session object as the client's dialect shapes it."""
        cfg = self.config
        td = None
        if cfg.turn_detection is not None:
            t = cfg.turn_detection
            td = {
                "type": t.type,
                "threshold": t.threshold,
                "prefix_padding_ms": t.prefix_padding_ms,
                "silence_duration_ms": t.silence_duration_ms,
                "create_response": t.create_response,
                "interrupt_response": t.interrupt_response,
                "idle_timeout_ms": t.idle_timeout_ms,
            }
        tr = None
        if cfg.transcription is not None:
            tr = {
                "model": cfg.transcription.model,
                "language": cfg.transcription.language,
                "prompt": cfg.transcription.prompt,
            }
        common = {
            "id": self.id,
            "object": "realtime.session",
            "model": cfg.model,
            "instructions": cfg.instructions,
            "tools": cfg.tools,
            "tool_choice": cfg.tool_choice,
            "temperature": cfg.temperature,
        }
        if self.dialect.beta:
            return common | {
                "modalities": _beta_modalities(cfg.output_modalities),
                "voice": cfg.voice,
                "input_audio_format": cfg.input_format.beta_name,
                "output_audio_format": cfg.output_format.beta_name,
                "input_audio_transcription": tr,
                "turn_detection": td,
                "max_response_output_tokens": cfg.max_output_tokens,
            }
        return common | {
            "type": "realtime",
            "output_modalities": cfg.output_modalities,
            "audio": {
                "input": {
                    "format": _render_format(cfg.input_format),
                    "transcription": tr,
                    "turn_detection": td,
                    "noise_reduction": None,
                },
                "output": {"format": _render_format(cfg.output_format), "voice": cfg.voice, "speed": 1.0},
            },
            "max_output_tokens": cfg.max_output_tokens,
        }

    # --- conversation items -------------------------------------------

    def _insert(self, item: se.Item, previous_item_id: str | None, event_id: str | None) -> str | None:
        """Insert an item; returns the id of the item now before it."""
        if item.id in self.items:
            raise ProtocolError(
                "item_id_already_exists", f"Item {item.id!r} already exists", param="item.id", event_id=event_id
            )
        if previous_item_id is None:
            prev = self.order[-1] if self.order else None
            self.order.append(item.id)
        elif previous_item_id == "root":
            prev = None
            self.order.insert(0, item.id)
        else:
            if previous_item_id not in self.items:
                raise ProtocolError(
                    "previous_item_not_found",
                    f"previous_item_id {previous_item_id!r} is not in the conversation",
                    param="previous_item_id",
                    event_id=event_id,
                )
            prev = previous_item_id
            self.order.insert(self.order.index(previous_item_id) + 1, item.id)
        self.items[item.id] = item
        return prev

    def item_added_events(self, item: se.Item, prev: str | None, *, done: bool) -> list[se.ServerEvent]:
        events: list[se.ServerEvent] = [
            self._ev(se.ItemEvent, "conversation.item.added", previous_item_id=prev, item=item)
        ]
        if done and not self.dialect.beta:
            events.append(self._ev(se.ItemEvent, "conversation.item.done", previous_item_id=prev, item=item))
        return events

    def create_item(self, ev: ce.ConversationItemCreate) -> list[se.ServerEvent]:
        """``conversation.item.create``: add a message or function output.

        Raises:
            ProtocolError: a bad role/content, duplicate id, unknown previous item.
        """
        item = self._item_from_client(ev.item, ev.event_id)
        prev = self._insert(item, ev.previous_item_id, ev.event_id)
        return self.item_added_events(item, prev, done=True)

    def _item_from_client(self, src: ce.ItemIn, event_id: str | None) -> se.Item:
        item_id = src.id if src.id is not UNSET else new_id("item")

        def fail(message: str, param: str) -> ProtocolError:
            return ProtocolError("invalid_value", message, param=f"item.{param}", event_id=event_id)

        if src.type == "message":
            role = src.role if src.role is not UNSET else None
            if role not in ("user", "assistant", "system"):
                raise fail(f"A message item needs role user, assistant or system, not {role!r}", "role")
            if src.content is UNSET or not src.content:
                raise fail("A message item needs at least one content part", "content")
            parts = []
            allowed = {
                "user": {"input_text", "input_audio", "text"},
                "system": {"input_text", "text"},
                "assistant": {"output_text", "output_audio", "text", "audio"},
            }[role]
            for i, c in enumerate(src.content):
                if c.type not in allowed:
                    raise fail(f"A {role} message cannot hold {c.type!r} content", f"content[{i}].type")
                text = c.text if c.text is not UNSET else None
                transcript = c.transcript if c.transcript is not UNSET else None
                if c.type in ("input_text", "output_text", "text") and text is None:
                    raise fail(f"{c.type!r} content needs 'text'", f"content[{i}].text")
                audio = base64.b64encode(c.audio).decode() if c.audio is not UNSET else None
                parts.append(se.ContentPart(type=c.type, text=text, transcript=transcript, audio=audio))
            return se.Item(
                id=item_id, object="realtime.item", type="message", status="completed", role=role, content=parts
            )
        if src.type == "function_call_output":
            if src.call_id is UNSET or src.output is UNSET:
                raise fail("A function_call_output item needs 'call_id' and 'output'", "call_id")
            known = {i.call_id for i in self.items.values() if i.type == "function_call" and i.call_id is not None}
            if src.call_id not in known:
                raise ProtocolError(
                    "unknown_call_id",
                    f"No function_call item has call_id {src.call_id!r}",
                    param="item.call_id",
                    event_id=event_id,
                )
            return se.Item(
                id=item_id,
                object="realtime.item",
                type="function_call_output",
                status="completed",
                call_id=src.call_id,
                output=src.output,
            )
        if src.type == "function_call":
            if src.call_id is UNSET or src.name is UNSET:
                raise fail("A function_call item needs 'call_id' and 'name'", "call_id")
            return se.Item(
                id=item_id,
                object="realtime.item",
                type="function_call",
                status="completed",
                call_id=src.call_id,
                name=src.name,
                arguments=src.arguments if src.arguments is not UNSET else "{}",
            )
        raise fail(f"Unknown item type {src.type!r}; use message, function_call or function_call_output", "type")

    def _find(self, item_id: str, event_id: str | None, action: str) -> se.Item:
        item = self.items.get(item_id)
        if item is None:
            raise ProtocolError(
                f"item_{action}_invalid_item_id",
                f"No item with id {item_id!r} in the conversation",
                param="item_id",
                event_id=event_id,
            )
        return item

    def retrieve_item(self, ev: ce.ConversationItemRetrieve) -> list[se.ServerEvent]:
        item = self._find(ev.item_id, ev.event_id, "retrieve")
        return [self._ev(se.ItemRetrieved, "conversation.item.retrieved", item=item)]

    def delete_item(self, ev: ce.ConversationItemDelete) -> list[se.ServerEvent]:
        self._find(ev.item_id, ev.event_id, "delete")
        if self.response is not None and any(o.id == ev.item_id for o in self.response.outputs):
            raise ProtocolError(
                "item_delete_active_response",
                "Cannot delete the item of the response in progress; cancel it first",
                param="item_id",
                event_id=ev.event_id,
            )
        del self.items[ev.item_id]
        self.order.remove(ev.item_id)
        self.spoken.pop(ev.item_id, None)
        return [self._ev(se.ItemDeleted, "conversation.item.deleted", item_id=ev.item_id)]

    def truncate_item(self, ev: ce.ConversationItemTruncate) -> list[se.ServerEvent]:
        """Trim an assistant item's audio transcript to what was heard.

        Raises:
            ProtocolError: not an assistant audio item, or ``audio_end_ms``
                beyond the audio it has.
        """
        item = self._find(ev.item_id, ev.event_id, "truncate")
        parts = item.content or []
        if item.role != "assistant" or not (0 <= ev.content_index < len(parts)):
            raise ProtocolError(
                "invalid_value",
                "Only the audio content of an assistant message can be truncated",
                param="content_index",
                event_id=ev.event_id,
            )
        part = parts[ev.content_index]
        segments = self.spoken.get(item.id, [])
        played = segments[-1].end_ms if segments else 0.0
        if part.type not in ("output_audio", "audio"):
            raise ProtocolError(
                "invalid_value", "That content part holds no audio", param="content_index", event_id=ev.event_id
            )
        if ev.audio_end_ms < 0 or ev.audio_end_ms > played + 1:
            raise ProtocolError(
                "invalid_value",
                f"audio_end_ms {ev.audio_end_ms} is beyond the item's {int(played)} ms of audio",
                param="audio_end_ms",
                event_id=ev.event_id,
            )
        part.transcript = heard_text(segments, ev.audio_end_ms)
        part.audio = None
        self.spoken[item.id] = [s for s in segments if s.start_ms < ev.audio_end_ms]
        return [
            self._ev(
                se.ItemTruncated,
                "conversation.item.truncated",
                item_id=item.id,
                content_index=ev.content_index,
                audio_end_ms=ev.audio_end_ms,
            )
        ]

    # --- input audio turns ----------------------------------------------

    def commit_audio(self, item_id: str) -> list[se.ServerEvent]:
        """The input buffer became a user item (awaiting its transcript)."""
        item = se.Item(
            id=item_id,
            object="realtime.item",
            type="message",
            status="completed",
            role="user",
            content=[se.ContentPart(type="input_audio", transcript=None)],
        )
        prev = self._insert(item, None, None)
        return [
            self._ev(se.BufferCommitted, "input_audio_buffer.committed", previous_item_id=prev, item_id=item_id),
            *self.item_added_events(item, prev, done=True),
        ]

    def transcribed(self, item_id: str, text: str, audio_seconds: float) -> list[se.ServerEvent]:
        """The STT stage finished an item's transcript."""
        item = self.items.get(item_id)
        if item is not None and item.content:
            item.content[0].transcript = text
        return [
            self._ev(
                se.TranscriptionCompleted,
                "conversation.item.input_audio_transcription.completed",
                item_id=item_id,
                content_index=0,
                transcript=text,
                usage={"type": "duration", "seconds": round(audio_seconds, 3)},
            )
        ]

    def transcription_failed(self, item_id: str, message: str) -> list[se.ServerEvent]:
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

    def start_response(
        self, params: ce.ResponseIn | None, generation: int, event_id: str | None = None
    ) -> list[se.ServerEvent]:
        """Begin the one active response.

        Raises:
            ProtocolError: a response is already active, or a bad parameter.
        """
        if self.response is not None:
            raise ProtocolError(
                "conversation_already_has_active_response",
                f"Response {self.response.id} is still in progress; cancel it or wait for response.done",
                event_id=event_id,
            )
        cfg = self.config
        p = params or ce.ResponseIn()

        def fail(code: str, message: str, param: str) -> ProtocolError:
            return ProtocolError(code, message, param=f"response.{param}", event_id=event_id)

        conversation = p.conversation if p.conversation is not UNSET else "auto"
        if conversation not in ("auto", "none"):
            raise fail("invalid_value", "conversation must be 'auto' or 'none'", "conversation")
        modalities = cfg.output_modalities
        for name in ("modalities", "output_modalities"):
            mods = getattr(p, name)
            if mods is not UNSET:
                modalities = _checked(_check_modalities, mods, fail, name)
        voice = cfg.voice
        if p.voice is not UNSET:
            voice = self.check_voice(p.voice, event_id, "response.voice")
        fmt = cfg.output_format
        try:
            if p.output_audio_format is not UNSET:
                fmt = AudioFormat.parse(p.output_audio_format)
            if p.audio is not UNSET and p.audio.output is not UNSET:
                if p.audio.output.format is not UNSET:
                    fmt = _parse_format(p.audio.output.format)
                if p.audio.output.voice is not UNSET:
                    voice = self.check_voice(p.audio.output.voice, event_id, "response.audio.output.voice")
        except AudioFormatError as exc:
            raise ProtocolError(
                "unsupported_audio_format", str(exc), param="response.audio.output.format", event_id=event_id
            ) from None
        max_tokens = cfg.max_output_tokens
        for name in ("max_output_tokens", "max_response_output_tokens"):
            value = getattr(p, name)
            if value is not UNSET:
                max_tokens = _checked(_check_max_tokens, value, fail, name)
        temperature = cfg.temperature if p.temperature is UNSET else p.temperature
        inputs = None
        if p.input is not UNSET:
            inputs = [self._item_from_client(i, event_id) for i in p.input]
        tools = cfg.tools if p.tools is UNSET else p.tools
        tool_choice = cfg.tool_choice if p.tool_choice is UNSET else p.tool_choice
        _check_tool_choice(tool_choice, tools, fail)
        self.turns += 1
        self.response = r = ActiveResponse(
            id=new_id("resp"),
            generation=generation,
            in_conversation=conversation == "auto",
            modalities=modalities,
            voice=voice,
            output_format=fmt,
            instructions=p.instructions if p.instructions is not UNSET else cfg.instructions,
            max_output_tokens=max_tokens,
            temperature=temperature,
            input_items=inputs,
            metadata=p.metadata if p.metadata is not UNSET else None,
            tools=tools,
            tool_choice=tool_choice,
        )
        return [self._ev(se.ResponseEvent, "response.created", response=self._render_response(r, "in_progress"))]

    def _add_output(self, r: ActiveResponse, item: se.Item) -> list[se.ServerEvent]:
        """A new output item of ``r``: into the conversation (unless out of band) and announced."""
        events: list[se.ServerEvent] = []
        output_index = len(r.outputs)
        r.outputs.append(item)
        if r.in_conversation:
            prev = self._insert(item, None, None)
            events += self.item_added_events(item, prev, done=False)
        events.append(
            self._ev(
                se.OutputItemEvent, "response.output_item.added", response_id=r.id, output_index=output_index, item=item
            )
        )
        return events

    def _open_message(self, r: ActiveResponse) -> list[se.ServerEvent]:
        """Make the assistant message item on the first text or audio of ``r``."""
        if r.item is not None:
            return []
        part_type = self.dialect.part("output_audio" if r.audio else "output_text")
        part = se.ContentPart(type=part_type, transcript="" if r.audio else None, text=None if r.audio else "")
        r.item = se.Item(
            id=new_id("item"),
            object="realtime.item",
            type="message",
            status="in_progress",
            role="assistant",
            content=[part],
        )
        events = self._add_output(r, r.item)
        events.append(
            self._ev(
                se.ContentPartEvent,
                "response.content_part.added",
                part=se.ContentPart(type=part_type, transcript=part.transcript, text=part.text),
                **self._ids(r),
            )
        )
        return events

    def _ids(self, r: ActiveResponse) -> dict[str, Any]:
        assert r.item is not None
        return {
            "response_id": r.id,
            "item_id": r.item.id,
            "output_index": r.outputs.index(r.item),
            "content_index": 0,
        }

    def function_call(self, r: ActiveResponse, name: str, arguments: str) -> list[se.ServerEvent]:
        """The model called a tool: a ``function_call`` output item, complete."""
        call_id = new_id("call")
        item = se.Item(
            id=new_id("item"),
            object="realtime.item",
            type="function_call",
            status="in_progress",
            call_id=call_id,
            name=name,
            arguments="",
        )
        events = self._add_output(r, item)
        output_index = len(r.outputs) - 1
        common = {"response_id": r.id, "item_id": item.id, "output_index": output_index, "call_id": call_id}
        events.append(
            self._ev(se.FunctionCallArgumentsDelta, "response.function_call_arguments.delta", delta=arguments, **common)
        )
        events.append(
            self._ev(
                se.FunctionCallArgumentsDone,
                "response.function_call_arguments.done",
                name=name,
                arguments=arguments,
                **common,
            )
        )
        item.arguments = arguments
        item.status = "completed"
        events.append(
            self._ev(
                se.OutputItemEvent, "response.output_item.done", response_id=r.id, output_index=output_index, item=item
            )
        )
        if r.in_conversation and not self.dialect.beta:
            events.append(
                self._ev(se.ItemEvent, "conversation.item.done", previous_item_id=self._previous(item.id), item=item)
            )
        return events

    def prompt(self, r: ActiveResponse) -> list[ChatMessage]:
        """The chat messages the LLM sees for response ``r``."""
        messages = [ChatMessage("system", r.instructions)] if r.instructions else []
        if r.input_items is not None:
            items = r.input_items
        else:
            own = {o.id for o in r.outputs}
            items = [self.items[i] for i in self.order if i not in own]
        for item in items:
            if item.type == "message" and item.role is not None:
                text = " ".join(t for t in (_content_text(c) for c in item.content or []) if t)
                if text:
                    messages.append(ChatMessage(item.role, text))
            elif item.type == "function_call":
                call = json.dumps({"name": item.name, "arguments": _json_or_text(item.arguments or "{}")})
                messages.append(ChatMessage("assistant", f"<tool_call>\n{call}\n</tool_call>"))
            elif item.type == "function_call_output":
                messages.append(ChatMessage("tool", item.output or ""))
        return messages

    def text_delta(self, r: ActiveResponse, delta: str) -> list[se.ServerEvent]:
        """A piece of a text-only response."""
        events = self._open_message(r)
        r.text += delta
        events.append(self._ev(se.DeltaEvent, "response.output_text.delta", delta=delta, **self._ids(r)))
        return events

    def audio_events(self, r: ActiveResponse, chunks: list[bytes], text: str, ms: float) -> list[se.ServerEvent]:
        """Audio deltas for one spoken segment, then its transcript delta."""
        events = self._open_message(r)
        assert r.item is not None
        ids = self._ids(r)
        events += [
            self._ev(se.DeltaEvent, "response.output_audio.delta", delta=base64.b64encode(chunk).decode("ascii"), **ids)
            for chunk in chunks
        ]
        segment = SpokenSegment(text, r.audio_ms, r.audio_ms + ms)
        r.audio_ms += ms
        if r.in_conversation:
            self.spoken.setdefault(r.item.id, []).append(segment)
        if text:
            delta = text if not r.text else " " + text
            r.text += delta
            if r.item.content:
                r.item.content[0].transcript = r.text
            events.append(self._ev(se.DeltaEvent, "response.output_audio_transcript.delta", delta=delta, **ids))
        return events

    def finish_response(self, r: ActiveResponse) -> list[se.ServerEvent]:
        """The response produced everything: the closing events, in order."""
        if self.response is not r:
            return []
        self.response = None
        events: list[se.ServerEvent] = []
        if r.item is not None:
            r.item.status = "completed"
            ids = self._ids(r)
            if r.audio:
                events.append(self._ev(se.AudioDone, "response.output_audio.done", **ids))
                events.append(
                    self._ev(se.TranscriptDone, "response.output_audio_transcript.done", transcript=r.text, **ids)
                )
                part = se.ContentPart(type=self.dialect.part("output_audio"), transcript=r.text)
            else:
                events.append(self._ev(se.TextDone, "response.output_text.done", text=r.text, **ids))
                part = se.ContentPart(type=self.dialect.part("output_text"), text=r.text)
            r.item.content = [part]
            events.append(self._ev(se.ContentPartEvent, "response.content_part.done", part=part, **ids))
            events.append(
                self._ev(
                    se.OutputItemEvent,
                    "response.output_item.done",
                    response_id=r.id,
                    output_index=ids["output_index"],
                    item=r.item,
                )
            )
            if r.in_conversation and not self.dialect.beta:
                prev = self._previous(r.item.id)
                events.append(self._ev(se.ItemEvent, "conversation.item.done", previous_item_id=prev, item=r.item))
        events.append(self._response_done(r, "completed", None))
        return events

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
        self._close_incomplete(r)
        return [self._response_done(r, "cancelled", {"type": "cancelled", "reason": reason})]

    def _close_incomplete(self, r: ActiveResponse) -> None:
        if r.item is None:
            return
        r.item.status = "incomplete"
        if r.item.content:
            if r.audio:
                r.item.content[0].transcript = r.text
            else:
                r.item.content[0].text = r.text

    def fail_response(self, r: ActiveResponse, code: str, message: str) -> list[se.ServerEvent]:
        """End the response as failed, with an ``error`` event for the client."""
        if self.response is not r:
            return []
        self.response = None
        self._close_incomplete(r)
        details = {"type": "failed", "error": {"type": "server_error", "code": code, "message": message}}
        return [
            self._response_done(r, "failed", details),
            self.error(ProtocolError(code, message, type="server_error")),
        ]

    def _response_done(self, r: ActiveResponse, status: str, details: dict[str, Any] | None) -> se.ServerEvent:
        return self._ev(se.ResponseEvent, "response.done", response=self._render_response(r, status, details))

    def _render_response(self, r: ActiveResponse, status: str, details: dict[str, Any] | None = None) -> se.Response:
        usage = None
        if status != "in_progress":
            usage = se.Usage(
                total_tokens=r.input_tokens + r.output_tokens,
                input_tokens=r.input_tokens,
                output_tokens=r.output_tokens,
                input_token_details={"text_tokens": r.input_tokens, "audio_tokens": 0, "cached_tokens": 0},
                output_token_details={"text_tokens": r.output_tokens, "audio_tokens": 0},
            )
        return se.Response(
            id=r.id,
            object="realtime.response",
            status=status,
            status_details=details,
            output=list(r.outputs) if status != "in_progress" else [],
            conversation_id=self.conversation_id if r.in_conversation else None,
            output_modalities=r.modalities,
            max_output_tokens=r.max_output_tokens,
            usage=usage,
            metadata=r.metadata,
        )

    def _previous(self, item_id: str) -> str | None:
        i = self.order.index(item_id) if item_id in self.order else 0
        return self.order[i - 1] if i > 0 else None

    # --- events the pipeline reports -------------------------------------

    def speech_started(self, audio_start_ms: int, item_id: str) -> se.ServerEvent:
        return self._ev(
            se.SpeechStarted, "input_audio_buffer.speech_started", audio_start_ms=audio_start_ms, item_id=item_id
        )

    def speech_stopped(self, audio_end_ms: int, item_id: str) -> se.ServerEvent:
        return self._ev(
            se.SpeechStopped, "input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id
        )

    def buffer_cleared(self) -> se.ServerEvent:
        return self._ev(se.BufferCleared, "input_audio_buffer.cleared")

    def timeout_triggered(self, start_ms: int, end_ms: int, item_id: str) -> se.ServerEvent:
        return self._ev(
            se.TimeoutTriggered,
            "input_audio_buffer.timeout_triggered",
            audio_start_ms=start_ms,
            audio_end_ms=end_ms,
            item_id=item_id,
        )


#: Voice names of the hosted service; accepted and spoken with the default voice.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar"})


def heard_text(segments: list[SpokenSegment], audio_end_ms: float) -> str:
    """The words of ``segments`` spoken before ``audio_end_ms``.

    A segment cut in the middle keeps the share of its words that fits in
    the share of its audio that was played.
    """
    words: list[str] = []
    for s in segments:
        if s.end_ms <= audio_end_ms:
            words += s.text.split()
        elif s.start_ms < audio_end_ms:
            seg_words = s.text.split()
            share = (audio_end_ms - s.start_ms) / max(s.end_ms - s.start_ms, 1e-9)
            words += seg_words[: int(len(seg_words) * share)]
    return " ".join(words)


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _check_tool_choice(
    choice: Any, tools: list[dict[str, Any]], fail: Callable[[str, str, str], ProtocolError]
) -> None:
    names = {t.get("name") for t in tools}
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise fail("invalid_value", "tool_choice 'required' needs at least one tool", "tool_choice")
        return
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if name not in names:
            raise fail("invalid_value", f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return
    raise fail("invalid_value", "tool_choice must be auto, none, required or {type: function, name}", "tool_choice")


def _content_text(c: se.ContentPart) -> str | None:
    return c.text if c.text is not None else c.transcript


def _parse_format(fmt: ce.AudioFormatIn | str) -> AudioFormat:
    if isinstance(fmt, str):
        return AudioFormat.parse(fmt)
    return AudioFormat.parse(fmt.type, None if fmt.rate is UNSET else fmt.rate)


def _render_format(fmt: AudioFormat) -> dict[str, Any]:
    return {"type": fmt.type, "rate": fmt.rate} if fmt.type == "audio/pcm" else {"type": fmt.type}


def _beta_modalities(mods: list[str]) -> list[str]:
    # Beta clients say ["text", "audio"] for a spoken answer with transcript.
    return ["text", "audio"] if "audio" in mods else ["text"]


def _checked(check: Callable[[Any], T], value: Any, fail: Callable[[str, str, str], ProtocolError], param: str) -> T:
    try:
        return check(value)
    except ValueError as exc:
        raise fail("invalid_value", str(exc), param) from None


def _check_modalities(mods: list[str]) -> list[str]:
    if not mods or any(m not in ("text", "audio") for m in mods):
        raise ValueError(f"modalities must be ['text'], ['audio'] or ['text', 'audio'], not {mods!r}")
    return ["audio"] if "audio" in mods else ["text"]


def _check_max_tokens(value: int | str) -> int | str:
    if value == "inf":
        return "inf"
    if isinstance(value, int) and 1 <= value <= MAX_OUTPUT_TOKENS_CAP:
        return value
    raise ValueError(f"max output tokens must be 1..{MAX_OUTPUT_TOKENS_CAP} or 'inf', not {value!r}")


def _merge_transcription(old: Transcription | None, new: ce.TranscriptionIn) -> Transcription:
    t = Transcription() if old is None else dataclasses.replace(old)
    if new.model is not UNSET and new.model is not None:
        t.model = new.model
    if new.language is not UNSET:
        t.language = new.language or None
    if new.prompt is not UNSET:
        t.prompt = new.prompt or None
    return t


def _merge_turn(old: TurnDetection | None, new: ce.TurnDetectionIn, fail: Any) -> TurnDetection:
    if new.type not in ("server_vad", "semantic_vad"):
        raise fail(
            "invalid_value", f"turn_detection.type {new.type!r} is not supported; use server_vad", "turn_detection.type"
        )
    t = TurnDetection() if old is None else dataclasses.replace(old)
    # semantic_vad is served by the same detector with its defaults.
    t.type = new.type
    for name in (
        "threshold",
        "prefix_padding_ms",
        "silence_duration_ms",
        "create_response",
        "interrupt_response",
        "idle_timeout_ms",
    ):
        value = getattr(new, name)
        if value is not UNSET:
            setattr(t, name, value)
    if not 0.0 <= t.threshold <= 1.0:
        raise fail("invalid_value", "threshold must be between 0 and 1", "turn_detection.threshold")
    if not 0 <= t.prefix_padding_ms <= 10_000 or not 0 <= t.silence_duration_ms <= 10_000:
        raise fail("invalid_value", "padding and silence must be 0..10000 ms", "turn_detection")
    if t.idle_timeout_ms is not None and not 1_000 <= t.idle_timeout_ms <= 3_600_000:
        raise fail("invalid_value", "idle_timeout_ms must be 1000..3600000", "turn_detection.idle_timeout_ms")
    return t

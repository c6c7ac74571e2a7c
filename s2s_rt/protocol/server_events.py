"""Server → client events of the Realtime API, as msgspec Structs.

Events are built with their GA names; :class:`Dialect` renames them for a
client that asked for the beta protocol (``response.audio.delta`` instead of
``response.output_audio.delta``, ``conversation.item.created`` instead of
``conversation.item.added``…). The choice is made once per connection.
"""

from __future__ import annotations

import secrets
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, Struct, UnsetType

# --- Items and content ---------------------------------------------------


class ContentPart(Struct, kw_only=True, omit_defaults=True):
    """A content part; a field left UNSET is absent, one set to None is sent as ``null``."""

    type: str
    text: str | UnsetType | None = UNSET
    transcript: str | UnsetType | None = UNSET
    audio: str | UnsetType | None = UNSET
    image_url: str | UnsetType | None = UNSET
    detail: str | UnsetType | None = UNSET

    @property
    def words(self) -> str | None:
        """The part's text or transcript, whichever it holds."""
        for value in (self.text, self.transcript):
            if isinstance(value, str):
                return value
        return None


class Item(Struct, kw_only=True, omit_defaults=True):
    """A conversation item. MCP items (``mcp_*``) have no ``object`` or ``status``; a field left UNSET is absent."""

    id: str
    type: str
    object: str | UnsetType = UNSET
    status: str | UnsetType = UNSET
    role: str | None = None
    content: list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    #: An ``mcp_call``'s is ``null`` until it has run (sent so: client libraries read it).
    output: str | UnsetType | None = UNSET
    server_label: str | UnsetType = UNSET
    tools: list[dict[str, Any]] | UnsetType = UNSET
    error: dict[str, Any] | UnsetType | None = UNSET
    approval_request_id: str | UnsetType | None = UNSET
    approve: bool | UnsetType = UNSET
    reason: str | UnsetType | None = UNSET


def snapshot(item: Item) -> Item:
    """A copy of ``item`` that later changes to the live item cannot reach.

    Events carry snapshots: what a queued event says is fixed when it is made.
    """
    content = None if item.content is None else [msgspec.structs.replace(c) for c in item.content]
    return msgspec.structs.replace(item, content=content)


class Usage(Struct, kw_only=True):
    total_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    input_token_details: dict[str, int] = msgspec.field(
        default_factory=lambda: {"text_tokens": 0, "audio_tokens": 0, "cached_tokens": 0}
    )
    output_token_details: dict[str, int] = msgspec.field(default_factory=lambda: {"text_tokens": 0, "audio_tokens": 0})


class Response(Struct, kw_only=True):
    id: str
    object: str
    status: str
    status_details: dict[str, Any] | None
    output: list[Item]
    conversation_id: str | None
    max_output_tokens: int | str
    usage: Usage | None
    metadata: dict[str, Any] | None = None
    #: GA name of the modalities; beta calls them ``modalities``. Only one is sent.
    output_modalities: list[str] | UnsetType = UNSET
    modalities: list[str] | UnsetType = UNSET


class ErrorDetail(Struct, kw_only=True):
    type: str
    code: str
    message: str
    param: str | None
    event_id: str | None


# --- Events ----------------------------------------------------------------


class ServerEvent(Struct, kw_only=True):
    type: str
    event_id: str


class Error(ServerEvent):
    error: ErrorDetail


class SessionEvent(ServerEvent):  # session.created / session.updated
    session: dict[str, Any]


class ConversationCreated(ServerEvent):
    conversation: dict[str, str]


class SpeechStarted(ServerEvent):
    audio_start_ms: int
    item_id: str


class SpeechStopped(ServerEvent):
    audio_end_ms: int
    item_id: str


class BufferCommitted(ServerEvent):
    previous_item_id: str | None
    item_id: str


class BufferCleared(ServerEvent):
    pass


class OutputAudioBuffer(ServerEvent):  # output_audio_buffer.started|stopped|cleared (WebRTC)
    response_id: str


class DtmfReceived(ServerEvent, kw_only=True, omit_defaults=True):  # input_audio_buffer.dtmf_event_received
    event: str
    received_at: int
    event_id: str = ""  # OpenAI's type has none: left out


class TimeoutTriggered(ServerEvent):
    audio_start_ms: int
    audio_end_ms: int
    item_id: str


class ItemEvent(ServerEvent):  # conversation.item.added|created|done
    previous_item_id: str | None
    item: Item


class ItemRetrieved(ServerEvent):
    item: Item


class ItemTruncated(ServerEvent):
    item_id: str
    content_index: int
    audio_end_ms: int


class ItemDeleted(ServerEvent):
    item_id: str


class TranscriptionDelta(ServerEvent):
    item_id: str
    content_index: int
    delta: str


class TranscriptionCompleted(ServerEvent):
    item_id: str
    content_index: int
    transcript: str
    usage: dict[str, Any]


class TranscriptionFailed(ServerEvent):
    item_id: str
    content_index: int
    error: dict[str, Any]


class ResponseEvent(ServerEvent):  # response.created / response.done
    response: Response


class OutputItemEvent(ServerEvent):  # response.output_item.added|done
    response_id: str
    output_index: int
    item: Item


class ContentPartEvent(ServerEvent):  # response.content_part.added|done
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


class DeltaEvent(ServerEvent):  # audio, transcript and text deltas
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str


class AudioDelta(ServerEvent):  # response.output_audio.delta (beta: response.audio.delta)
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    #: The audio as made, in the session's output format: base64 only when encoded for the wire
    #: (msgspec writes bytes as base64), and not at all for a call, whose track plays the bytes.
    delta: bytes


class AudioDone(ServerEvent):
    response_id: str
    item_id: str
    output_index: int
    content_index: int


class TranscriptDone(AudioDone):
    transcript: str


class TextDone(AudioDone):
    text: str


class FunctionCallArgumentsDelta(ServerEvent):
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    delta: str


class FunctionCallArgumentsDone(ServerEvent, omit_defaults=True):
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    arguments: str
    name: str | UnsetType = UNSET


class McpListToolsEvent(ServerEvent):  # mcp_list_tools.in_progress|completed|failed
    item_id: str


class McpCallArgumentsDelta(ServerEvent):  # response.mcp_call_arguments.delta
    response_id: str
    item_id: str
    output_index: int
    delta: str


class McpCallArgumentsDone(ServerEvent):  # response.mcp_call_arguments.done
    response_id: str
    item_id: str
    output_index: int
    arguments: str


class McpCallEvent(ServerEvent):  # response.mcp_call.in_progress|completed|failed
    item_id: str
    output_index: int


E = TypeVar("E", bound=ServerEvent)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


# --- Dialects --------------------------------------------------------------

_BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}
_BETA_PARTS = {"output_audio": "audio", "output_text": "text"}


class Dialect:
    """GA or beta naming, chosen once per connection.

    Args:
        beta: True for a client that sent ``OpenAI-Beta: realtime=v1`` or
            offered the ``openai-beta.realtime-v1`` subprotocol.
    """

    def __init__(self, beta: bool) -> None:
        self.beta = beta

    def name(self, ga_name: str) -> str:
        return _BETA_NAMES.get(ga_name, ga_name) if self.beta else ga_name

    def part(self, ga_type: str) -> str:
        """An item's content type: ``output_audio`` in GA is ``audio`` in beta.

        The ``part`` of ``response.content_part.*`` events is ``audio`` or
        ``text`` in both dialects (see :func:`event_part`).
        """
        return _BETA_PARTS.get(ga_type, ga_type) if self.beta else ga_type

    def event(self, cls: type[E], ga_name: str, **fields: Any) -> E:
        """A new server event of class ``cls``, named for this dialect, with a fresh ``event_id``."""
        return cls(type=self.name(ga_name), event_id=new_id("event"), **fields)


def event_part(part: ContentPart) -> ContentPart:
    """An item's content part as ``response.content_part.*`` events show it (type ``audio``/``text``)."""
    kind = _BETA_PARTS.get(part.type, part.type)
    return ContentPart(type=kind, text=part.text, transcript=part.transcript, audio=part.audio)


GA = Dialect(beta=False)
BETA = Dialect(beta=True)

_encoder = msgspec.json.Encoder()


def encode_event(event: ServerEvent) -> bytes:
    return _encoder.encode(event)

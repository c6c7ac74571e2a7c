"""Client → server events of the Realtime API, decoded and validated in one call.

Every client event is a msgspec Struct tagged by its ``type``; ``ClientEvent``
is their union and :func:`decode_client_event` turns a text frame into one of
them or raises :class:`~s2s_rt.protocol.errors.ProtocolError` with a code that
names what was wrong. Both session shapes are accepted: the beta one (flat
``voice``, ``input_audio_format``, ``turn_detection``…) and the GA one (nested
``audio.input`` / ``audio.output``); :mod:`s2s_rt.protocol.session` merges them.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec
from msgspec import UNSET, Struct, UnsetType

from s2s_rt.protocol.errors import ProtocolError


class TurnDetectionIn(Struct, kw_only=True):
    type: str | UnsetType | None = UNSET
    threshold: float | UnsetType | None = UNSET
    prefix_padding_ms: int | UnsetType | None = UNSET
    silence_duration_ms: int | UnsetType | None = UNSET
    create_response: bool | UnsetType | None = UNSET
    interrupt_response: bool | UnsetType | None = UNSET
    idle_timeout_ms: int | UnsetType | None = UNSET
    eagerness: str | UnsetType | None = UNSET


class TranscriptionIn(Struct, kw_only=True):
    model: str | UnsetType | None = UNSET
    language: str | UnsetType | None = UNSET
    prompt: str | UnsetType | None = UNSET


class AudioFormatIn(Struct, kw_only=True):
    type: str
    rate: int | UnsetType | None = UNSET


class AudioInputIn(Struct, kw_only=True):
    format: AudioFormatIn | str | UnsetType | None = UNSET
    transcription: TranscriptionIn | UnsetType | None = UNSET
    turn_detection: TurnDetectionIn | UnsetType | None = UNSET
    noise_reduction: Any = UNSET


class VoiceIdIn(Struct, kw_only=True):
    """A custom voice object (``{"id": ...}``), as the newest types allow wherever a voice name goes."""

    id: str


Voice = str | VoiceIdIn


class AudioOutputIn(Struct, kw_only=True):
    format: AudioFormatIn | str | UnsetType | None = UNSET
    voice: Voice | UnsetType | None = UNSET
    speed: float | UnsetType | None = UNSET


class AudioIn(Struct, kw_only=True):
    input: AudioInputIn | UnsetType | None = UNSET
    output: AudioOutputIn | UnsetType | None = UNSET


MaxTokens = int | Literal["inf"]


class SessionIn(Struct, kw_only=True):
    """A ``session.update`` payload in either shape; absent fields stay UNSET."""

    type: str | UnsetType | None = UNSET
    model: str | UnsetType | None = UNSET
    instructions: str | UnsetType | None = UNSET
    # beta
    modalities: list[str] | UnsetType | None = UNSET
    voice: str | UnsetType | None = UNSET
    speed: float | UnsetType | None = UNSET
    input_audio_format: str | UnsetType | None = UNSET
    output_audio_format: str | UnsetType | None = UNSET
    input_audio_transcription: TranscriptionIn | UnsetType | None = UNSET
    turn_detection: TurnDetectionIn | UnsetType | None = UNSET
    input_audio_noise_reduction: Any = UNSET
    max_response_output_tokens: MaxTokens | UnsetType | None = UNSET
    # GA
    output_modalities: list[str] | UnsetType | None = UNSET
    audio: AudioIn | UnsetType | None = UNSET
    max_output_tokens: MaxTokens | UnsetType | None = UNSET
    # both
    temperature: float | UnsetType | None = UNSET
    tools: list[dict[str, Any]] | UnsetType | None = UNSET
    tool_choice: Any = UNSET
    #: GA: ``auto``, ``disabled`` or a retention-ratio object (checked by ``truncation.parse_truncation``).
    truncation: Any = UNSET


class ContentIn(Struct, kw_only=True):
    type: str
    text: str | UnsetType | None = UNSET
    audio: bytes | UnsetType | None = UNSET
    transcript: str | UnsetType | None = UNSET
    #: ``input_image`` (GA): a PNG or JPEG data URI, and how closely to look (``auto``, ``low``, ``high``).
    image_url: str | UnsetType | None = UNSET
    detail: str | UnsetType | None = UNSET


class ItemIn(Struct, kw_only=True):
    id: str | UnsetType | None = UNSET
    type: str | UnsetType | None = UNSET
    object: str | UnsetType | None = UNSET
    status: str | UnsetType | None = UNSET
    role: str | UnsetType | None = UNSET
    content: list[ContentIn] | UnsetType | None = UNSET
    call_id: str | UnsetType | None = UNSET
    name: str | UnsetType | None = UNSET
    arguments: str | UnsetType | None = UNSET
    output: str | UnsetType | None = UNSET
    #: MCP items (GA): ``mcp_approval_response`` answers an ``mcp_approval_request``; the others are history.
    server_label: str | UnsetType | None = UNSET
    tools: list[dict[str, Any]] | UnsetType | None = UNSET
    error: dict[str, Any] | UnsetType | None = UNSET
    approval_request_id: str | UnsetType | None = UNSET
    approve: bool | UnsetType | None = UNSET
    reason: str | UnsetType | None = UNSET


class ResponseAudioOutputIn(Struct, kw_only=True):
    format: AudioFormatIn | str | UnsetType | None = UNSET
    voice: Voice | UnsetType | None = UNSET


class ResponseAudioIn(Struct, kw_only=True):
    output: ResponseAudioOutputIn | UnsetType | None = UNSET


class ResponseIn(Struct, kw_only=True):
    conversation: str | UnsetType | None = UNSET
    instructions: str | UnsetType | None = UNSET
    modalities: list[str] | UnsetType | None = UNSET
    output_modalities: list[str] | UnsetType | None = UNSET
    max_output_tokens: MaxTokens | UnsetType | None = UNSET
    max_response_output_tokens: MaxTokens | UnsetType | None = UNSET
    voice: str | UnsetType | None = UNSET
    output_audio_format: str | UnsetType | None = UNSET
    audio: ResponseAudioIn | UnsetType | None = UNSET
    temperature: float | UnsetType | None = UNSET
    input: list[ItemIn] | UnsetType | None = UNSET
    metadata: dict[str, Any] | UnsetType | None = UNSET
    tools: list[dict[str, Any]] | UnsetType | None = UNSET
    tool_choice: Any = UNSET


class _Event(Struct, tag_field="type", kw_only=True):
    event_id: str | None = None


class SessionUpdate(_Event, tag="session.update"):
    session: SessionIn


class TranscriptionSessionUpdate(_Event, tag="transcription_session.update"):
    """Beta: configure a transcription session (same fields as ``session.update``'s, where they apply)."""

    session: SessionIn


class InputAudioBufferAppend(_Event, tag="input_audio_buffer.append"):
    audio: bytes


class InputAudioBufferCommit(_Event, tag="input_audio_buffer.commit"):
    pass


class OutputAudioBufferClear(_Event, tag="output_audio_buffer.clear"):
    """WebRTC: cut off the audio the server is playing (it truncates the item at what was heard)."""


class InputAudioBufferClear(_Event, tag="input_audio_buffer.clear"):
    pass


class ConversationItemCreate(_Event, tag="conversation.item.create"):
    item: ItemIn
    previous_item_id: str | None = None


class ConversationItemRetrieve(_Event, tag="conversation.item.retrieve"):
    item_id: str


class ConversationItemTruncate(_Event, tag="conversation.item.truncate"):
    item_id: str
    audio_end_ms: int
    content_index: int | None = 0


class ConversationItemDelete(_Event, tag="conversation.item.delete"):
    item_id: str


class ResponseCreate(_Event, tag="response.create"):
    response: ResponseIn | None = None


class ResponseCancel(_Event, tag="response.cancel"):
    response_id: str | None = None


ClientEvent = Union[  # noqa: UP007 - a runtime Union msgspec can read __args__ from
    SessionUpdate,
    TranscriptionSessionUpdate,
    InputAudioBufferAppend,
    InputAudioBufferCommit,
    InputAudioBufferClear,
    OutputAudioBufferClear,
    ConversationItemCreate,
    ConversationItemRetrieve,
    ConversationItemTruncate,
    ConversationItemDelete,
    ResponseCreate,
    ResponseCancel,
]

CLIENT_EVENT_TYPES: frozenset[str] = frozenset(
    str(cls.__struct_config__.tag)
    for cls in ClientEvent.__args__  # type: ignore[attr-defined]
)

_decoder = msgspec.json.Decoder(ClientEvent)
_loose = msgspec.json.Decoder()


def decode_client_event(data: str | bytes | bytearray | memoryview) -> ClientEvent:
    """Decode and validate one text frame.

    Args:
        data: the frame's payload.

    Returns:
        The typed client event.

    Raises:
        ProtocolError: with ``code`` one of ``invalid_json``, ``invalid_event``
            (not an object), ``missing_type``, ``unknown_event_type``,
            ``invalid_base64`` or ``invalid_value`` (a field of the wrong type
            or a missing required field; ``param`` names it), and ``event_id``
            set when the frame carried one.
    """
    try:
        event: ClientEvent = _decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # The fast path failed; only now look at the frame loosely to say why.
        raise _classify(data, exc) from None
    except RecursionError:
        raise ProtocolError("invalid_json", "The frame is nested too deeply") from None
    if isinstance(event, (SessionUpdate, TranscriptionSessionUpdate, ResponseCreate, ConversationItemCreate)):
        _nulls_unset(event)
    return event


#: Fields where ``null`` means something ("turn detection off"), not "not set".
_MEANINGFUL_NULLS = frozenset({"turn_detection", "input_audio_transcription", "transcription", "idle_timeout_ms"})


def _nulls_unset(struct: Struct) -> None:
    """Treat ``null`` as "not set" for optional fields, as OpenAI does (in place, recursively)."""
    for name in struct.__struct_fields__:
        value = getattr(struct, name)
        if value is None:
            if name not in _MEANINGFUL_NULLS and name not in ("event_id", "previous_item_id", "response"):
                setattr(struct, name, UNSET)
        elif isinstance(value, Struct):
            _nulls_unset(value)
        elif isinstance(value, list):
            for element in value:
                if isinstance(element, Struct):
                    _nulls_unset(element)


def _classify(data: str | bytes | bytearray | memoryview, exc: Exception) -> ProtocolError:
    try:
        raw = _loose.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as jexc:
        return ProtocolError("invalid_json", f"The frame is not valid JSON: {jexc}")
    except RecursionError:
        return ProtocolError("invalid_json", "The frame is nested too deeply")
    if not isinstance(raw, dict):
        return ProtocolError("invalid_event", f"A client event must be a JSON object, not {type(raw).__name__}")
    event_id = raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
    kind = raw.get("type")
    if kind is None:
        return ProtocolError("missing_type", "The event has no 'type' field", param="type", event_id=event_id)
    if not isinstance(kind, str) or kind not in CLIENT_EVENT_TYPES:
        return ProtocolError(
            "unknown_event_type",
            f"Unknown event type {kind!r}; supported: {', '.join(sorted(CLIENT_EVENT_TYPES))}",
            param="type",
            event_id=event_id,
        )
    message = str(exc)
    param = _param_of(message)
    code = "invalid_base64" if "base64" in message else "invalid_value"
    return ProtocolError(code, f"Invalid '{kind}' event: {message}", param=param, event_id=event_id)


def _param_of(message: str) -> str | None:
    # msgspec says where: "Expected `int`, got `str` - at `$.session.temperature`"
    marker = "at `$."
    at = message.rfind(marker)
    if at < 0:
        if "missing required field `" in message:
            return message.split("missing required field `", 1)[1].split("`", 1)[0]
        return None
    path = message[at + len(marker) :].rstrip("`")
    if "missing required field `" in message:
        path += "." + message.split("missing required field `", 1)[1].split("`", 1)[0]
    return path


#: Events the session does not handle (:meth:`Session.handle` refuses them): the audio pipeline's and the call's.
PIPELINE_EVENTS = (InputAudioBufferAppend, InputAudioBufferCommit, InputAudioBufferClear, OutputAudioBufferClear)

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
    type: str = "server_vad"
    threshold: float | UnsetType = UNSET
    prefix_padding_ms: int | UnsetType = UNSET
    silence_duration_ms: int | UnsetType = UNSET
    create_response: bool | UnsetType = UNSET
    interrupt_response: bool | UnsetType = UNSET
    idle_timeout_ms: int | UnsetType | None = UNSET
    eagerness: str | UnsetType = UNSET


class TranscriptionIn(Struct, kw_only=True):
    model: str | UnsetType | None = UNSET
    language: str | UnsetType | None = UNSET
    prompt: str | UnsetType | None = UNSET


class AudioFormatIn(Struct, kw_only=True):
    type: str
    rate: int | UnsetType = UNSET


class AudioInputIn(Struct, kw_only=True):
    format: AudioFormatIn | str | UnsetType = UNSET
    transcription: TranscriptionIn | UnsetType | None = UNSET
    turn_detection: TurnDetectionIn | UnsetType | None = UNSET
    noise_reduction: Any = UNSET


class AudioOutputIn(Struct, kw_only=True):
    format: AudioFormatIn | str | UnsetType = UNSET
    voice: str | UnsetType = UNSET
    speed: float | UnsetType = UNSET


class AudioIn(Struct, kw_only=True):
    input: AudioInputIn | UnsetType = UNSET
    output: AudioOutputIn | UnsetType = UNSET


MaxTokens = int | Literal["inf"]


class SessionIn(Struct, kw_only=True):
    """A ``session.update`` payload in either shape; absent fields stay UNSET."""

    type: str | UnsetType = UNSET
    model: str | UnsetType = UNSET
    instructions: str | UnsetType = UNSET
    # beta
    modalities: list[str] | UnsetType = UNSET
    voice: str | UnsetType = UNSET
    input_audio_format: str | UnsetType = UNSET
    output_audio_format: str | UnsetType = UNSET
    input_audio_transcription: TranscriptionIn | UnsetType | None = UNSET
    turn_detection: TurnDetectionIn | UnsetType | None = UNSET
    max_response_output_tokens: MaxTokens | UnsetType = UNSET
    # GA
    output_modalities: list[str] | UnsetType = UNSET
    audio: AudioIn | UnsetType = UNSET
    max_output_tokens: MaxTokens | UnsetType = UNSET
    # both
    temperature: float | UnsetType = UNSET
    tools: list[dict[str, Any]] | UnsetType = UNSET
    tool_choice: Any = UNSET


class ContentIn(Struct, kw_only=True):
    type: str
    text: str | UnsetType = UNSET
    audio: bytes | UnsetType = UNSET
    transcript: str | UnsetType | None = UNSET


class ItemIn(Struct, kw_only=True):
    id: str | UnsetType = UNSET
    type: str = "message"
    object: str | UnsetType = UNSET
    status: str | UnsetType = UNSET
    role: str | UnsetType = UNSET
    content: list[ContentIn] | UnsetType = UNSET
    call_id: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET
    output: str | UnsetType = UNSET


class ResponseAudioOutputIn(Struct, kw_only=True):
    format: AudioFormatIn | str | UnsetType = UNSET
    voice: str | UnsetType = UNSET


class ResponseAudioIn(Struct, kw_only=True):
    output: ResponseAudioOutputIn | UnsetType = UNSET


class ResponseIn(Struct, kw_only=True):
    conversation: str | UnsetType = UNSET
    instructions: str | UnsetType = UNSET
    modalities: list[str] | UnsetType = UNSET
    output_modalities: list[str] | UnsetType = UNSET
    max_output_tokens: MaxTokens | UnsetType = UNSET
    max_response_output_tokens: MaxTokens | UnsetType = UNSET
    voice: str | UnsetType = UNSET
    output_audio_format: str | UnsetType = UNSET
    audio: ResponseAudioIn | UnsetType = UNSET
    temperature: float | UnsetType = UNSET
    input: list[ItemIn] | UnsetType = UNSET
    metadata: dict[str, Any] | UnsetType | None = UNSET
    tools: list[dict[str, Any]] | UnsetType = UNSET
    tool_choice: Any = UNSET


class _Event(Struct, tag_field="type", kw_only=True):
    event_id: str | None = None


class SessionUpdate(_Event, tag="session.update"):
    session: SessionIn


class InputAudioBufferAppend(_Event, tag="input_audio_buffer.append"):
    audio: bytes


class InputAudioBufferCommit(_Event, tag="input_audio_buffer.commit"):
    pass


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
    content_index: int = 0


class ConversationItemDelete(_Event, tag="conversation.item.delete"):
    item_id: str


class ResponseCreate(_Event, tag="response.create"):
    response: ResponseIn | None = None


class ResponseCancel(_Event, tag="response.cancel"):
    response_id: str | None = None


ClientEvent = Union[  # noqa: UP007 - a runtime Union msgspec can read __args__ from
    SessionUpdate,
    InputAudioBufferAppend,
    InputAudioBufferCommit,
    InputAudioBufferClear,
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


def decode_client_event(data: str | bytes) -> ClientEvent:
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
        return event
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # The fast path failed; only now look at the frame loosely to say why.
        raise _classify(data, exc) from None


def _classify(data: str | bytes, exc: Exception) -> ProtocolError:
    try:
        raw = _loose.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as jexc:
        return ProtocolError("invalid_json", f"The frame is not valid JSON: {jexc}")
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

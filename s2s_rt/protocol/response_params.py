"""What a response asks for: ``response.create``'s parameters, checked and settled against the session's config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET

from s2s_rt.audio import AudioFormat, AudioFormatError
from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol import server_events as se
from s2s_rt.protocol.config import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    MAX_OUTPUT_TOKENS_CAP,
    SessionConfig,
    check_max_tokens,
    check_modalities,
    check_temperature,
    check_tool_choice,
    check_tools,
    checked,
    parse_format,
)
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.voices import Voices


@dataclass(slots=True)
class ResponseParams:
    """What a ``response.create`` (or a turn) asked for, settled against the session's config."""

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
    #: Speaking rate (the session's ``audio.output.speed``).
    speed: float = 1.0

    @property
    def token_limit(self) -> int:
        """Most tokens the answer may have."""
        limit = self.max_output_tokens
        return min(limit, MAX_OUTPUT_TOKENS_CAP) if isinstance(limit, int) else DEFAULT_MAX_OUTPUT_TOKENS


def settle(
    cfg: SessionConfig,
    voices: Voices,
    p: ce.ResponseIn,
    event_id: str | None,
    input_item: Callable[[ce.ItemIn, str | None], se.Item],
    functions: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] = lambda tools: tools,
) -> ResponseParams:
    """What a ``response.create`` (or a turn, with nothing given) asks for, settled against the session's config.

    Args:
        voices: the voices a session may ask for.
        input_item: makes an item of ``response.input`` (a new one, or one the conversation holds).
        functions: the tools as the model sees them (the session's MCP tools replaced by the tools listed).

    Raises:
        ProtocolError: a bad parameter (``param`` names it under ``response.``).
    """

    def fail(code: str, message: str, param: str) -> ProtocolError:
        return ProtocolError(code, message, param=f"response.{param}", event_id=event_id)

    conversation = p.conversation if isinstance(p.conversation, str) else "auto"
    if conversation not in ("auto", "none"):
        raise fail("invalid_value", "conversation must be 'auto' or 'none'", "conversation")
    modalities = cfg.output_modalities
    for name in ("modalities", "output_modalities"):
        mods = getattr(p, name)
        if mods is not UNSET:
            modalities = checked(check_modalities, mods, fail, name)
    voice = cfg.voice
    if p.voice is not UNSET:
        voice = voices.pick(str(p.voice), event_id, "response.voice")
    fmt = cfg.output_format
    try:
        if p.output_audio_format is not UNSET:
            fmt = AudioFormat.parse(str(p.output_audio_format))
        if isinstance(p.audio, ce.ResponseAudioIn) and isinstance(p.audio.output, ce.ResponseAudioOutputIn):
            if p.audio.output.format is not UNSET and p.audio.output.format is not None:
                fmt = parse_format(p.audio.output.format)
            if isinstance(p.audio.output.voice, (str, ce.VoiceIdIn)):
                voice = voices.pick(p.audio.output.voice, event_id, "response.audio.output.voice")
    except AudioFormatError as exc:
        raise ProtocolError(
            "unsupported_audio_format", str(exc), param="response.audio.output.format", event_id=event_id
        ) from None
    max_tokens = cfg.max_output_tokens
    for name in ("max_output_tokens", "max_response_output_tokens"):
        value = getattr(p, name)
        if value is not UNSET:
            max_tokens = checked(check_max_tokens, value, fail, name)
    inputs = None
    if isinstance(p.input, list):
        inputs = [input_item(i, event_id) for i in p.input]
    given = cfg.tools if not isinstance(p.tools, list) else check_tools(p.tools, fail)
    tools = functions(given)
    tool_choice = cfg.tool_choice if p.tool_choice is UNSET or p.tool_choice is None else p.tool_choice
    # Against the tools as given too: an MCP server's entry counts before its tools are listed (a turn's
    # response must not fail on tools that are still on their way).
    check_tool_choice(tool_choice, [*given, *tools], fail)
    return ResponseParams(
        in_conversation=conversation == "auto",
        modalities=modalities,
        voice=voice,
        output_format=fmt,
        instructions=p.instructions if isinstance(p.instructions, str) else cfg.instructions,
        max_output_tokens=max_tokens,
        temperature=(
            cfg.temperature if not isinstance(p.temperature, (int, float)) else check_temperature(p.temperature, fail)
        ),
        input_items=inputs,
        metadata=p.metadata if isinstance(p.metadata, dict) else None,
        tools=tools,
        tool_choice=tool_choice,
        speed=cfg.speed,
    )

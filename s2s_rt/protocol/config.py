"""A session's configuration: its settings, how ``session.update`` changes them, and how they are shown.

:class:`SessionConfig` is what ``session.created``/``session.updated`` render,
in the client's dialect (beta flat fields or GA nested ``audio``).
:func:`apply_update` applies a ``session.update`` all or nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from msgspec import UNSET

from s2s_rt.audio import AudioFormat, AudioFormatError
from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.mcp import McpTools
from s2s_rt.protocol.server_events import Dialect
from s2s_rt.protocol.truncation import Truncation, parse_truncation
from s2s_rt.protocol.voices import Voices

T = TypeVar("T")

#: Cap applied when a client asks for "inf" output tokens.
MAX_OUTPUT_TOKENS_CAP = 4096
DEFAULT_MAX_OUTPUT_TOKENS = 1024

#: Speaking rates the Realtime API allows (``audio.output.speed``).
MIN_SPEED, MAX_SPEED = 0.25, 1.5

#: Longest wait in the closing silence per ``semantic_vad`` eagerness (OpenAI's maxima).
EAGERNESS_MAX_MS = {"low": 8000, "medium": 4000, "high": 2000, "auto": 4000}


@dataclass(slots=True)
class TurnDetection:
    """``server_vad`` / ``semantic_vad`` settings (OpenAI's defaults)."""

    type: str = "server_vad"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    eagerness: str = "auto"


@dataclass(slots=True)
class Transcription:
    model: str = "whisper-1"
    language: str | None = None
    prompt: str | None = None


@dataclass(slots=True)
class SessionConfig:
    #: ``realtime`` (a conversation) or ``transcription`` (live captions: every turn transcribed, never answered).
    kind: str = "realtime"
    model: str = "s2s-rt"
    instructions: str = (
        "You are a helpful voice assistant. Answer briefly, in one to three short"
        " spoken sentences, without lists or markdown."
    )
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    voice: str = ""
    #: Speaking rate of the answers (``audio.output.speed``; beta ``speed``): 0.25-1.5, 1.0 the voice's own.
    speed: float = 1.0
    input_format: AudioFormat = field(default_factory=AudioFormat)
    output_format: AudioFormat = field(default_factory=AudioFormat)
    #: Input transcription events are sent only when this is set (as OpenAI: off by default).
    transcription: Transcription | None = None
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    temperature: float = 0.8
    max_output_tokens: int | str = "inf"
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    #: ``near_field`` or ``far_field``: input audio is denoised before the VAD and the recogniser hear it (None: off).
    noise_reduction: str | None = None
    #: What the model stops reading once the conversation outgrows its context (:mod:`s2s_rt.protocol.truncation`).
    truncation: Truncation = field(default_factory=Truncation)


def apply_update(cfg: SessionConfig, ev: ce.SessionUpdate, voices: Voices, mcp: McpTools | None = None) -> None:
    """Apply a ``session.update`` in either shape to ``cfg``, all or nothing.

    ``mcp``: the session's MCP servers, where it may have them (GA), checked against the operator's policy.

    Raises:
        ProtocolError: an unsupported format, voice, modality or value.
    """
    patch = ev.session
    new: dict[str, Any] = {}
    eid = ev.event_id

    def fail(code: str, message: str, param: str) -> ProtocolError:
        return ProtocolError(code, message, param=f"session.{param}", event_id=eid)

    if patch.type is not UNSET and patch.type is not None:
        if patch.type not in ("realtime", "transcription"):
            raise fail(
                "invalid_value", f"session.type must be 'realtime' or 'transcription', not {patch.type!r}", "type"
            )
        new["kind"] = patch.type
    if patch.model is not UNSET:
        new["model"] = patch.model
    if patch.instructions is not UNSET:
        new["instructions"] = patch.instructions
    for name in ("modalities", "output_modalities"):
        mods = getattr(patch, name)
        if mods is not UNSET:
            new["output_modalities"] = checked(check_modalities, mods, fail, name)
    # The GA shape nests audio settings; null and absent both mean "not set" here.
    audio = patch.audio if isinstance(patch.audio, ce.AudioIn) else None
    a_in = audio.input if audio is not None and isinstance(audio.input, ce.AudioInputIn) else None
    a_out = audio.output if audio is not None and isinstance(audio.output, ce.AudioOutputIn) else None
    # Voice: beta flat field or GA audio.output.voice.
    voice = a_out.voice if a_out is not None and a_out.voice not in (UNSET, None) else patch.voice
    if isinstance(voice, (str, ce.VoiceIdIn)):
        param = "session.voice" if voice is patch.voice else "session.audio.output.voice"
        new["voice"] = voices.pick(voice, eid, param)
    speed = a_out.speed if a_out is not None and isinstance(a_out.speed, (int, float)) else patch.speed
    if isinstance(speed, (int, float)) and not isinstance(speed, bool):
        if not MIN_SPEED <= speed <= MAX_SPEED:
            param = "audio.output.speed" if a_out is not None and a_out.speed is not UNSET else "speed"
            raise fail("invalid_value", f"speed must be between {MIN_SPEED} and {MAX_SPEED}, not {speed}", param)
        new["speed"] = float(speed)
    # Formats.
    try:
        if isinstance(patch.input_audio_format, str):
            new["input_format"] = AudioFormat.parse(patch.input_audio_format)
        if isinstance(patch.output_audio_format, str):
            new["output_format"] = AudioFormat.parse(patch.output_audio_format)
        if a_in is not None and isinstance(a_in.format, (ce.AudioFormatIn, str)):
            new["input_format"] = parse_format(a_in.format)
        if a_out is not None and isinstance(a_out.format, (ce.AudioFormatIn, str)):
            new["output_format"] = parse_format(a_out.format)
    except AudioFormatError as exc:
        raise ProtocolError("unsupported_audio_format", str(exc), param="session.audio.format", event_id=eid) from None
    # Transcription and turn detection, beta then GA (null turns them off).
    trans: Any = patch.input_audio_transcription
    turn: Any = patch.turn_detection
    if a_in is not None:
        if a_in.transcription is not UNSET:
            trans = a_in.transcription
        if a_in.turn_detection is not UNSET:
            turn = a_in.turn_detection
    if trans is not UNSET:
        new["transcription"] = None if trans is None else _merge_transcription(cfg.transcription, trans)
    if turn is not UNSET:
        new["turn_detection"] = None if turn is None else _merge_turn(cfg.turn_detection, turn, fail)
    if isinstance(patch.temperature, (int, float)):
        new["temperature"] = check_temperature(patch.temperature, fail)
    for name in ("max_response_output_tokens", "max_output_tokens"):
        value = getattr(patch, name)
        if value is not UNSET:
            new["max_output_tokens"] = checked(check_max_tokens, value, fail, name)
    tools = new["tools"] = check_tools(patch.tools, fail, mcp) if isinstance(patch.tools, list) else cfg.tools
    if patch.tool_choice is not UNSET and patch.tool_choice is not None:
        check_tool_choice(patch.tool_choice, tools, fail)
        new["tool_choice"] = patch.tool_choice
    elif isinstance(patch.tools, list):
        check_tool_choice(cfg.tool_choice, tools, fail)
    noise: Any = patch.input_audio_noise_reduction
    if a_in is not None and a_in.noise_reduction is not UNSET:
        noise = a_in.noise_reduction
    if noise is not UNSET:
        new["noise_reduction"] = _noise_reduction(noise, fail, "audio.input" if a_in is not None else "input_audio")
    if patch.truncation is not UNSET and patch.truncation is not None:
        new["truncation"] = parse_truncation(patch.truncation, eid)
    if new.get("kind", cfg.kind) == "transcription" and new.get("transcription", cfg.transcription) is None:
        new["transcription"] = Transcription()  # a transcription session always transcribes
    for key, value in new.items():
        setattr(cfg, key, value)


def check_temperature(value: float, fail: Callable[[str, str, str], ProtocolError]) -> float:
    if not 0.0 <= value <= 2.0:
        raise fail("invalid_value", "temperature must be between 0 and 2", "temperature")
    return float(value)


#: The deepest a tool's parameters may nest (objects and arrays within each other). The session is echoed in
#: ``session.created`` / ``session.updated``, and a client reading JSON gives up at a depth of its own: the
#: official SDK refused an event whose tool schema nested 100 objects deep ("recursion limit exceeded"; 60 it
#: read), so the session would be accepted here and unreadable there.
MAX_SCHEMA_DEPTH = 64


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in ``value`` (a scalar: 0); walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_tools(
    tools: list[Any], fail: Callable[[str, str, str], ProtocolError], mcp: McpTools | None = None
) -> list[dict[str, Any]]:
    """Tools as OpenAI defines them: functions (a name, optionally a description and a JSON-schema object),
    and MCP servers where ``mcp`` is given (``session.update``, GA).

    Raises:
        ProtocolError: a tool of another shape, naming which one and why.
    """
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise fail("invalid_value", f"{where} must be an object", where)
        if tool.get("type") == "mcp":
            if mcp is None:
                text = "MCP tools are set with a GA session.update (the server lists their tools once per session)"
                raise fail("invalid_value", f"{where}: {text}", f"{where}.type")
            continue  # checked below, all at once
        if tool.get("type", "function") != "function":
            raise fail("invalid_value", f"{where}.type must be 'function' or 'mcp'", f"{where}.type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise fail("invalid_value", f"{where}.name must be a non-empty string", f"{where}.name")
        if not isinstance(tool.get("description", ""), (str, type(None))):
            raise fail("invalid_value", f"{where}.description must be a string", f"{where}.description")
        if not isinstance(tool.get("parameters", {}), (dict, type(None))):
            raise fail("invalid_value", f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
        if json_depth(tool.get("parameters")) > MAX_SCHEMA_DEPTH:
            raise fail(
                "invalid_value",
                f"{where}.parameters nests deeper than {MAX_SCHEMA_DEPTH} objects and arrays",
                f"{where}.parameters",
            )
    if mcp is not None:
        mcp.check(tools, fail)
    return tools


def check_tool_choice(choice: Any, tools: list[dict[str, Any]], fail: Callable[[str, str, str], ProtocolError]) -> None:
    names = {t.get("name") for t in tools}
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise fail("invalid_value", "tool_choice 'required' needs at least one tool", "tool_choice")
        return
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = choice.get("name") or (function.get("name") if isinstance(function, dict) else None)
        if not isinstance(name, str) or name not in names:
            raise fail("invalid_value", f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return
    if isinstance(choice, dict) and choice.get("type") == "mcp":
        labels = {t.get("server_label") for t in tools if t.get("type") == "mcp"}
        if choice.get("server_label") not in labels:
            raise fail("invalid_value", "tool_choice names an MCP server that is not among the tools", "tool_choice")
        return
    raise fail(
        "invalid_value",
        "tool_choice must be auto, none, required, {type: function, name} or {type: mcp, ...}",
        "tool_choice",
    )


#: The model names the beta session type allows (the first stands for ours when the client asked for none of them).
BETA_MODELS = (
    "gpt-realtime",
    "gpt-realtime-2025-08-28",
    "gpt-4o-realtime-preview",
    "gpt-4o-realtime-preview-2024-10-01",
    "gpt-4o-realtime-preview-2024-12-17",
    "gpt-4o-realtime-preview-2025-06-03",
    "gpt-4o-mini-realtime-preview",
    "gpt-4o-mini-realtime-preview-2024-12-17",
)


def render(cfg: SessionConfig, dialect: Dialect, session_id: str) -> dict[str, Any]:
    """The session object as the client's dialect shapes it."""
    noise = {"type": cfg.noise_reduction} if cfg.noise_reduction else None
    td: dict[str, Any] | None = None
    if cfg.turn_detection is not None:
        t = cfg.turn_detection
        td = {"type": t.type, "create_response": t.create_response, "interrupt_response": t.interrupt_response}
        if t.type == "semantic_vad":
            td["eagerness"] = t.eagerness
        else:
            td |= {
                "threshold": t.threshold,
                "prefix_padding_ms": t.prefix_padding_ms,
                "silence_duration_ms": t.silence_duration_ms,
            }
            if not dialect.beta:  # beta's turn detection has no idle timeout
                td["idle_timeout_ms"] = t.idle_timeout_ms
    tr = None
    if cfg.transcription is not None:
        tr = {
            "model": cfg.transcription.model,
            "language": cfg.transcription.language,
            "prompt": cfg.transcription.prompt,
        }
    common = {
        "id": session_id,
        "model": cfg.model,
        "instructions": cfg.instructions,
        "tools": cfg.tools,
        "tool_choice": cfg.tool_choice,
    }
    if cfg.kind == "transcription":
        return render_transcription(cfg, dialect, session_id, tr, td)
    if dialect.beta:
        # The beta types know only OpenAI's model names: a strict client rejects any other.
        common["model"] = cfg.model if cfg.model in BETA_MODELS else BETA_MODELS[0]
        return common | {
            "temperature": cfg.temperature,
            "modalities": _beta_modalities(cfg.output_modalities),
            "voice": cfg.voice,
            "speed": cfg.speed,
            "input_audio_format": cfg.input_format.beta_name,
            "output_audio_format": cfg.output_format.beta_name,
            "input_audio_transcription": tr,
            "turn_detection": td,
            "input_audio_noise_reduction": noise,
            "max_response_output_tokens": cfg.max_output_tokens,
        }
    return common | {
        "object": "realtime.session",
        "type": "realtime",
        "output_modalities": cfg.output_modalities,
        "audio": {
            "input": {
                "format": render_format(cfg.input_format),
                "transcription": tr,
                "turn_detection": td,
                "noise_reduction": noise,
            },
            "output": {"format": render_format(cfg.output_format), "voice": cfg.voice, "speed": cfg.speed},
        },
        "max_output_tokens": cfg.max_output_tokens,
        "truncation": cfg.truncation.render(),
    }


def render_transcription(
    cfg: SessionConfig, dialect: Dialect, session_id: str, tr: dict[str, Any] | None, td: dict[str, Any] | None
) -> dict[str, Any]:
    """A transcription session, as GA's ``session.*`` or beta's ``transcription_session.updated`` shows it."""
    noise = {"type": cfg.noise_reduction} if cfg.noise_reduction else None
    if dialect.beta:
        beta_td = None
        if td is not None:
            beta_td = {k: td[k] for k in ("type", "threshold", "prefix_padding_ms", "silence_duration_ms") if k in td}
        return {
            # No ephemeral keys are issued here; the type requires the field.
            "client_secret": {"value": "", "expires_at": 0},
            "input_audio_format": cfg.input_format.beta_name,
            "input_audio_transcription": tr,
            "modalities": ["text"],
            "turn_detection": beta_td,
        }
    return {
        "id": session_id,
        "object": "realtime.transcription_session",
        "type": "transcription",
        "audio": {
            "input": {
                "format": render_format(cfg.input_format),
                "transcription": tr,
                "turn_detection": td,
                "noise_reduction": noise,
            }
        },
        "include": None,
    }


def parse_format(fmt: ce.AudioFormatIn | str) -> AudioFormat:
    if isinstance(fmt, str):
        return AudioFormat.parse(fmt)
    return AudioFormat.parse(fmt.type, None if fmt.rate is UNSET else fmt.rate)


def render_format(fmt: AudioFormat) -> dict[str, Any]:
    return {"type": fmt.type, "rate": fmt.rate} if fmt.type == "audio/pcm" else {"type": fmt.type}


def _beta_modalities(mods: list[str]) -> list[str]:
    # Beta clients say ["text", "audio"] for a spoken answer with transcript.
    return ["text", "audio"] if "audio" in mods else ["text"]


def checked(check: Callable[[Any], T], value: Any, fail: Callable[[str, str, str], ProtocolError], param: str) -> T:
    try:
        return check(value)
    except ValueError as exc:
        raise fail("invalid_value", str(exc), param) from None


def check_modalities(mods: list[str]) -> list[str]:
    if not mods or any(m not in ("text", "audio") for m in mods):
        raise ValueError(f"modalities must be ['text'], ['audio'] or ['text', 'audio'], not {mods!r}")
    return ["audio"] if "audio" in mods else ["text"]


def check_max_tokens(value: int | str) -> int | str:
    if value == "inf":
        return "inf"
    if isinstance(value, int) and 1 <= value <= MAX_OUTPUT_TOKENS_CAP:
        return value
    raise ValueError(f"max output tokens must be 1..{MAX_OUTPUT_TOKENS_CAP} or 'inf', not {value!r}")


#: ``noise_reduction.type`` values (OpenAI's: a close-talking microphone, or one across the room).
NOISE_REDUCTION_TYPES = ("near_field", "far_field")


def _noise_reduction(value: Any, fail: Callable[[str, str, str], ProtocolError], where: str) -> str | None:
    """``noise_reduction`` as sent: null (off) or ``{"type": "near_field" | "far_field"}``."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in NOISE_REDUCTION_TYPES or set(value) - {"type"}:
        raise fail(
            "invalid_value",
            f'noise_reduction must be null or {{"type": "near_field" | "far_field"}}, not {value!r}',
            f"{where}_noise_reduction" if where == "input_audio" else f"{where}.noise_reduction",
        )
    return str(kind)


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
    kind = new.type if isinstance(new.type, str) else (old.type if old is not None else "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise fail(
            "invalid_value",
            f"turn_detection.type {kind!r} is not supported; use server_vad or semantic_vad",
            "turn_detection.type",
        )
    t = TurnDetection() if old is None else dataclasses.replace(old)
    t.type = kind
    for name in (
        "threshold",
        "prefix_padding_ms",
        "silence_duration_ms",
        "create_response",
        "interrupt_response",
        "idle_timeout_ms",
        "eagerness",
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
    if t.eagerness not in EAGERNESS_MAX_MS:
        raise fail("invalid_value", "eagerness must be low, medium, high or auto", "turn_detection.eagerness")
    return t

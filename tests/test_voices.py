"""Voices by name: the operator maps OpenAI's voice names (or names of their own) to installed voices.

The fake stack has two voices, ``tone`` (the default) and ``tone-low`` (every
word's tone an octave lower), so which voice spoke is heard in the audio.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from conftest import live_server, run, sdk_client

from s2s_rt.config import ConfigError, load_config


def _pitch(audio: bytes) -> float:
    """Zero crossings per second of PCM16 at 24 kHz: twice the tone's frequency."""
    pcm = np.frombuffer(audio, dtype=np.int16).astype(np.float32)
    voiced = pcm[np.abs(pcm) > 0]
    crossings = np.count_nonzero(np.signbit(voiced[1:]) != np.signbit(voiced[:-1]))
    return crossings / (len(voiced) / 24_000)


async def _answer(conn, **response: object) -> tuple[list, bytes]:  # type: ignore[no-untyped-def]
    """Ask for an answer to "hello"; the events up to ``response.done`` (or an error) and its audio."""
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
    )
    await conn.response.create(**({"response": response} if response else {}))
    events = []
    async for event in conn:
        events.append(event)
        if event.type in ("response.done", "error"):
            break
    audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    return events, audio


async def _updated(conn, voice: object) -> object:  # type: ignore[no-untyped-def]
    """Send ``audio.output.voice``; the ``session.updated`` or ``error`` that answers it."""
    await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": voice}}})
    async for event in conn:
        if event.type in ("session.updated", "error"):
            return event
    raise AssertionError("connection ended")


def test_an_openai_voice_name_speaks_with_the_voice_the_operator_mapped_it_to() -> None:
    async def scenario() -> None:
        async with live_server(voice_names={"ash": "tone-low"}) as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                _, default_audio = await _answer(conn)
                updated = await _updated(conn, "ash")
                assert updated.type == "session.updated"
                assert updated.session.audio.output.voice == "tone-low"  # which voice is speaking
                _, ash_audio = await _answer(conn)
                # Same words, the mapped voice an octave lower.
                assert 0.4 < _pitch(ash_audio) / _pitch(default_audio) < 0.6
                unmapped = await _updated(conn, "verse")  # OpenAI's, not mapped: the default voice
                assert unmapped.type == "session.updated" and unmapped.session.audio.output.voice == "tone"

    run(scenario())


def test_a_custom_voice_object_selects_an_installed_voice_by_id_and_an_unknown_id_is_an_error() -> None:
    async def scenario() -> None:
        async with live_server(voice_names={"narrator": "tone-low"}) as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                _, default_audio = await _answer(conn)
                by_id = await _updated(conn, {"id": "tone-low"})
                assert by_id.type == "session.updated" and by_id.session.audio.output.voice == "tone-low"
                by_name = await _updated(conn, {"id": "narrator"})
                assert by_name.type == "session.updated" and by_name.session.audio.output.voice == "tone-low"
                unknown = await _updated(conn, {"id": "voice_1234"})
                assert unknown.type == "error" and unknown.error.code == "unknown_voice"
                assert unknown.error.param == "session.audio.output.voice"
                assert "voice_1234" in unknown.error.message and "tone, tone-low, narrator" in unknown.error.message
                # A custom voice must be installed: OpenAI's names are names, not ids.
                ash_id = await _updated(conn, {"id": "ash"})
                assert ash_id.type == "error" and ash_id.error.code == "unknown_voice"
                # The refused updates changed nothing: still the low voice.
                _, audio = await _answer(conn)
                assert 0.4 < _pitch(audio) / _pitch(default_audio) < 0.6

    run(scenario())


def test_a_response_may_speak_with_another_voice_for_itself_alone() -> None:
    async def scenario() -> None:
        async with live_server(voice_names={"ash": "tone-low"}) as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                _, plain = await _answer(conn)
                events, low = await _answer(conn, audio={"output": {"voice": "ash"}})
                assert events[-1].type == "response.done"
                assert 0.4 < _pitch(low) / _pitch(plain) < 0.6
                _, again = await _answer(conn)
                assert 0.9 < _pitch(again) / _pitch(plain) < 1.1
                refused, _ = await _answer(conn, audio={"output": {"voice": {"id": "nobody"}}})
                error = next(e for e in refused if e.type == "error")
                assert error.error.code == "unknown_voice" and error.error.param == "response.audio.output.voice"

    run(scenario())


def test_voice_names_come_from_toml_environment_and_flags_and_must_name_installed_voices(tmp_path) -> None:  # type: ignore[no-untyped-def]
    toml = tmp_path / "s2s-rt.toml"
    toml.write_text('[voice_names]\nash = "tone-low"\n')
    assert load_config(toml, environ={}).voice_names == {"ash": "tone-low"}
    env = {"S2S_RT_VOICE_NAMES": "ash=tone-low, verse = tone"}
    assert load_config(environ=env).voice_names == {"ash": "tone-low", "verse": "tone"}
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        load_config(environ={"S2S_RT_VOICE_NAMES": "ash"})

    async def scenario() -> None:
        with pytest.raises(ConfigError, match="'ash' maps to 'en_US-ryan-medium', which is not installed"):
            async with live_server(voice_names={"ash": "en_US-ryan-medium"}):
                pass

    run(scenario())

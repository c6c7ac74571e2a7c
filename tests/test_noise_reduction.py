"""``noise_reduction``: input audio denoised (RNNoise) before the VAD and the recogniser hear it.

On the fake stack, whose VAD takes any window louder than -40 dBFS for
speech: steady noise at -30 dBFS holds a turn open forever without noise
reduction, and with it the question spoken in that noise (espeak-ng) starts
and ends a turn that is answered. The real noise reduction runs here (it is
small and deterministic); what it buys on the default stack is measured in
BENCHMARKS.md. The server runs in a process of its own: once RNNoise's
library is loaded, that process's default-stack answers are slower (not
understood yet; see ``engines/rnnoise.LazyRNNoise``), and the tests after
these share this one.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import require, run, sdk_client

from s2s_rt.audio import Resampler
from s2s_rt.bench.server import ServerHandle

RATE = 24_000


class _Spawned:
    """A fake-stack server in its own process, as ``live_server`` gives one in this process."""

    async def __aenter__(self) -> _Spawned:
        self.handle = ServerHandle.spawn("fake", 2, env={}, timeout_s=60)
        self.port = int(self.handle.http.rsplit(":", 1)[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.handle.stop()


def live_server() -> _Spawned:
    return _Spawned()


def _question_in_noise(tmp_path: Path) -> bytes:
    """A spoken question in steady white noise at -30 dBFS, noise before and after: PCM16 at 24 kHz."""
    require(shutil.which("espeak-ng"), "espeak-ng is not installed (apt-get install espeak-ng)")
    wav = tmp_path / "q.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "What time is it in Tokyo"], check=True)
    with wave.open(str(wav)) as w:
        rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    voice = Resampler(rate, RATE).process(np.frombuffer(pcm, np.int16).astype(np.float32) / 32768)
    voice *= 0.3 / np.max(np.abs(voice))
    quiet = np.zeros(int(0.6 * RATE), np.float32)
    clean = np.concatenate([quiet, voice, quiet, quiet, quiet])
    noise = np.random.default_rng(3).standard_normal(len(clean)).astype(np.float32) * 10 ** (-30 / 20)
    return (np.clip(clean + noise, -1, 1) * 32767).astype(np.int16).tobytes()


async def _events_after(conn, audio: bytes, wait_s: float) -> list[Any]:  # type: ignore[no-untyped-def]
    """Stream ``audio`` (in 100 ms appends), then the events that come within ``wait_s``."""
    import asyncio

    step = RATE // 10 * 2
    for i in range(0, len(audio), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i : i + step]).decode())
    events: list[Any] = []

    async def collect() -> None:
        async for event in conn:
            events.append(event)
            if event.type == "response.done":
                return

    try:
        await asyncio.wait_for(collect(), wait_s)
    except TimeoutError:
        pass
    return events


async def _setup(conn, noise_reduction: Any) -> Any:  # type: ignore[no-untyped-def]
    session = {"type": "realtime", "output_modalities": ["text"], "audio": {"input": {}}}
    session["audio"]["input"]["noise_reduction"] = noise_reduction
    await conn.session.update(session=session)
    async for event in conn:
        if event.type in ("session.updated", "error"):
            return event
    raise AssertionError("connection ended")


def test_in_steady_noise_a_question_ends_its_turn_and_is_answered_only_with_noise_reduction(tmp_path: Path) -> None:
    audio = _question_in_noise(tmp_path)

    async def scenario() -> None:
        async with live_server() as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                updated = await _setup(conn, {"type": "near_field"})
                assert updated.type == "session.updated"
                assert updated.session.audio.input.noise_reduction.type == "near_field"
                events = await _events_after(conn, audio, 10.0)
                types = [e.type for e in events]
                assert "input_audio_buffer.speech_stopped" in types and types[-1] == "response.done", types
                started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
                assert 300 <= started.audio_start_ms <= 1000  # the voice, not the noise before it
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                off = await _setup(conn, None)
                assert off.type == "session.updated" and off.session.audio.input.noise_reduction is None
                events = await _events_after(conn, audio, 3.0)
                types = [e.type for e in events]
                assert "input_audio_buffer.speech_started" in types  # the noise, from the start
                assert "input_audio_buffer.speech_stopped" not in types, types  # and it never stops

    run(scenario())


@pytest.mark.parametrize("value", [{"type": "studio"}, {"type": "near_field", "level": 3}, "near_field"])
def test_a_bad_noise_reduction_is_refused_naming_the_field(value: Any) -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                refused = await _setup(conn, value)
                assert refused.type == "error" and refused.error.code == "invalid_value"
                assert refused.error.param == "session.audio.input.noise_reduction"

    run(scenario())


def test_the_beta_interface_sets_it_as_input_audio_noise_reduction() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with sdk_client(server.port).beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
                await conn.session.update(session={"input_audio_noise_reduction": {"type": "far_field"}})
                async for event in conn:
                    if event.type in ("session.updated", "error"):
                        break
                assert event.type == "session.updated"
                assert event.session.input_audio_noise_reduction.type == "far_field"

    run(scenario())

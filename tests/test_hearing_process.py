"""Hearing in a process of its own (:mod:`s2s_rt.listening.remote`): what the clock gets back is what it would
get hearing in the server's process, a child that dies or hangs costs one batch and is replaced, sessions that
are gone are forgotten there, and the server ends its child when it stops.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import signal
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import RealtimeClient, live_server, run, tone
from test_hearing import PCM24, ULAW, _speechlike

from s2s_rt.audio import AudioFormat
from s2s_rt.engines.fake import load_fake_stack
from s2s_rt.engines.rnnoise import DenoiserUnavailable, LazyRNNoise
from s2s_rt.engines.silero import SileroVAD
from s2s_rt.listening.hearing import AudioBytes, SessionAudio, hear
from s2s_rt.listening.remote import IN_BYTES, ChildFailed, HearingProcess, hearing_for
from s2s_rt.models.recipes import _SILERO
from s2s_rt.scope import Scope

PCM48 = AudioFormat("audio/pcm", 48_000)


@pytest.fixture(scope="module")
def vad() -> SileroVAD:
    return SileroVAD(_SILERO.file("data/silero_vad.onnx"))


def _noise() -> LazyRNNoise | None:
    try:
        return LazyRNNoise()
    except DenoiserUnavailable:
        return None


@pytest.fixture
def process(vad: SileroVAD) -> Iterator[HearingProcess]:
    hearing, started = hearing_for(vad, _noise(), True)
    assert isinstance(started, HearingProcess) and hearing is started
    yield started
    started.close()


def _twins(vad: SileroVAD, formats: list[AudioFormat]) -> tuple[list[SessionAudio], list[SessionAudio]]:
    scope = Scope("test")
    return (
        [SessionAudio(scope, vad.new_state(), fmt) for fmt in formats],
        [SessionAudio(scope, vad.new_state(), fmt) for fmt in formats],
    )


def test_the_process_hears_what_the_server_would_hear_itself(vad: SileroVAD, process: HearingProcess) -> None:
    """Formats, several appends a tick, a format change, a session not scored and one denoised: the samples and
    scores that come back are those of hearing in this process, tick after tick (each session's state kept)."""
    rng = np.random.default_rng(3)
    formats = [PCM24] * 4 + [ULAW, PCM48, PCM24, PCM24]
    there, here = _twins(vad, formats)
    noise = _noise()
    if noise is not None:
        there[7].noise = here[7].noise = noise
    streams = [fmt.encode(_speechlike(rng, 2.0, fmt.rate)) for fmt in formats]
    step = [fmt.bytes_per_sample * fmt.rate // 50 for fmt in formats]  # 20 ms appends
    scope = Scope("test")
    moved = 0.0
    for tick in range(40):
        work_there, work_here = [], []
        for i, fmt in enumerate(formats):
            pieces = [streams[i][(tick * 2 + k) * step[i] : (tick * 2 + k + 1) * step[i]] for k in range(1 + i % 2)]
            if i == 0 and tick == 15:
                pieces.append(PCM48.encode(_speechlike(rng, 0.05, 48_000)))
            segments = [AudioBytes(scope, p, PCM48 if i == 0 and k == 2 else fmt) for k, p in enumerate(pieces)]
            scored = i != 6
            work_there.append((there[i], segments, scored))
            work_here.append((here[i], segments, scored))
        got, expected = process(work_there), hear(vad, work_here)
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert a.error is None and b.error is None
            np.testing.assert_allclose(a.samples, b.samples, atol=1e-6)
            np.testing.assert_allclose(a.probabilities, b.probabilities, atol=1e-5)
            moved = max(moved, float(np.ptp(b.probabilities)) if len(b.probabilities) else 0.0)
    assert process.pid is not None and process.pid != os.getpid()
    assert moved > 0.02  # the scores moved: each session's state in the child mattered


def test_a_batch_larger_than_the_shared_memory_is_heard_in_parts(vad: SileroVAD, process: HearingProcess) -> None:
    """A hundred sessions uploading a second of 48 kHz audio each: more than one exchange carries; all heard."""
    rng = np.random.default_rng(4)
    there, here = _twins(vad, [PCM48] * 100)
    scope = Scope("test")
    data = [PCM48.encode(_speechlike(rng, 1.0, 48_000)) for _ in range(100)]
    assert sum(len(d) for d in data) > IN_BYTES
    got = process([(s, [AudioBytes(scope, d, PCM48)], True) for s, d in zip(there, data, strict=True)])
    expected = hear(vad, [(s, [AudioBytes(scope, d, PCM48)], True) for s, d in zip(here, data, strict=True)])
    for a, b in zip(got, expected, strict=True):
        assert a.error is None and b.error is None
        np.testing.assert_allclose(a.samples, b.samples, atol=1e-6)
        np.testing.assert_allclose(a.probabilities, b.probabilities, atol=1e-5)


def test_sessions_that_are_gone_are_forgotten_by_the_child(vad: SileroVAD, process: HearingProcess) -> None:
    scope = Scope("test")
    chunk = PCM24.encode(np.zeros(480, np.float32))
    many = [SessionAudio(scope, vad.new_state(), PCM24) for _ in range(30)]
    process([(s, [AudioBytes(scope, chunk, PCM24)], True) for s in many])
    assert process.held == 30
    del many
    gc.collect()
    one = SessionAudio(scope, vad.new_state(), PCM24)
    process([(one, [AudioBytes(scope, chunk, PCM24)], True)])
    assert process.held == 1


def _until(check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("fate", ["killed", "hung"])
def test_a_child_that_dies_or_hangs_fails_one_batch_and_another_takes_over(vad: SileroVAD, fate: str) -> None:
    process = HearingProcess(
        vad.hearing_recipe(), None, functools.partial(hear, vad), vad.chunk_samples, reply_timeout_s=1.0
    )
    process.start()
    try:
        scope = Scope("test")
        session = SessionAudio(scope, vad.new_state(), PCM24)
        audio = [AudioBytes(scope, PCM24.encode(np.zeros(4800, np.float32)), PCM24)]
        assert len(process([(session, audio, True)])[0].samples) == 3200
        first = process.pid
        assert first is not None
        os.kill(first, signal.SIGKILL if fate == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ChildFailed):
            process([(session, audio, True)])
        assert time.monotonic() - started < 3.0  # a hung child is given up after the reply timeout
        # Meanwhile batches are heard in this process; then the new child hears them.
        assert len(process([(session, audio, True)])[0].samples) == 3200
        _until(lambda: process.pid is not None)
        assert process.pid != first and process.restarts == 1
        got = process([(session, audio, True)])[0]
        assert got.error is None and len(got.samples) == 3200 and len(got.probabilities) > 0
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)  # the old child is gone, not left stopped
    finally:
        process.close()
    assert process.pid is None


def test_a_server_hears_in_its_child_tells_a_session_when_it_dies_and_ends_it_at_shutdown(vad: SileroVAD) -> None:
    """The fake stack with Silero as its VAD: its sessions are heard in a child. When the child is killed, a
    session is told (an ``error`` event) and goes on: its next audio is heard. The child ends with the server."""
    stack = load_fake_stack()
    stack.vad = vad

    async def main() -> int:
        async with live_server(stack, vad_timeout_s=2.0) as server:
            child = server.clock.hearing
            assert isinstance(child, HearingProcess)
            pid = child.pid
            assert pid is not None
            async with RealtimeClient.connect(server) as client:
                await client.send("session.update", session={"turn_detection": None})
                await client.until("session.updated")
                await client.append_audio(tone(300, 0.5))
                await client.send("input_audio_buffer.commit")
                await client.until("input_audio_buffer.committed")
                os.kill(pid, signal.SIGKILL)
                error = None
                for _ in range(100):  # audio until a batch finds the child gone
                    await client.append_audio(tone(300, 0.1))
                    try:
                        error = await client.until("error", timeout=0.2)
                        break
                    except TimeoutError:
                        continue
                assert error is not None and error["error"]["code"] == "vad_failed"
                await client.append_audio(tone(300, 0.5))
                await client.send("input_audio_buffer.commit")
                await client.until("input_audio_buffer.committed")
            for _ in range(600):
                if child.pid is not None:
                    break
                await asyncio.sleep(0.1)
            replaced = child.pid
            assert replaced is not None and replaced != pid
        return replaced

    replaced = run(main(), timeout=120)
    with pytest.raises(ProcessLookupError):
        os.kill(replaced, 0)


@pytest.mark.skipif(_noise() is None, reason="RNNoise is not installed")
def test_a_session_asking_for_noise_reduction_is_denoised_in_the_child_not_in_the_servers_process(
    vad: SileroVAD,
) -> None:
    """Loading RNNoise into the server's process once slowed every answer (:class:`LazyRNNoise`): with a hearing
    process, the session's stream is made and run in the child, and the server's process never loads it."""
    stack = load_fake_stack()
    stack.vad = vad
    noise = stack.noise = _noise()
    assert noise is not None

    async def main() -> None:
        async with live_server(stack) as server:
            assert isinstance(server.clock.hearing, HearingProcess)
            async with RealtimeClient.connect(server) as client:
                near = {"type": "near_field"}
                session = {"type": "realtime", "audio": {"input": {"noise_reduction": near, "turn_detection": None}}}
                await client.send("session.update", session=session)
                updated = await client.until("session.updated")
                assert updated["session"]["audio"]["input"]["noise_reduction"] == near
                await client.append_audio(tone(300, 1.0))
                await client.send("input_audio_buffer.commit")
                await client.until("input_audio_buffer.committed")
        assert noise._loaded is None

    run(main(), timeout=120)

"""``s2s-rt talk`` against a live fake-stack server, as a user at a terminal sees it."""

from __future__ import annotations

import asyncio
import re
import socket
import wave
from pathlib import Path

import numpy as np
import pytest
from conftest import RealtimeClient, live_server, run

from s2s_rt import talk
from s2s_rt.server import Server


def write_wav(path: Path, samples: np.ndarray, rate: int, *, width: int = 2) -> Path:
    """``samples``: float in [-1, 1], shape (n,) or (n, channels)."""
    frames = samples if samples.ndim == 2 else samples[:, None]
    with wave.open(str(path), "wb") as w:
        w.setnchannels(frames.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 2:
            w.writeframes((frames * 32767).astype("<i2").tobytes())
        else:
            w.writeframes((frames * 127 + 128).astype(np.uint8).tobytes())
    return path


def stereo_tone(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    left = 0.3 * np.sin(2 * np.pi * 330 * t)
    return np.stack([left, 0.5 * left], axis=1)


def read_wav(path: Path) -> tuple[wave._wave_params, np.ndarray]:
    with wave.open(str(path), "rb") as w:
        params = w.getparams()
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return params, pcm.astype(np.float32) / 32768


async def talk_to(server: Server, *args: str) -> int:
    """``s2s-rt talk ARGS --url <server>`` in a thread, as the command runs it."""
    url = f"ws://127.0.0.1:{server.port}/v1/realtime"
    return await asyncio.to_thread(talk.main, [*args, "--url", url, "--timeout", "20"])


def test_wav_turn_prints_both_transcripts_and_writes_the_spoken_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    question = write_wav(tmp_path / "question.wav", stereo_tone(1.0, 44_100), 44_100)
    answer = tmp_path / "answer.wav"

    async def scenario() -> int:
        async with live_server() as server:
            return await talk_to(server, "--wav", str(question), "--out", str(answer))

    assert run(scenario()) == 0
    out = capsys.readouterr().out
    # The whole file is one turn: the fake STT hears its full second.
    heard = re.search(r"^you: (heard (\d+) ms crc [0-9a-f]{8})$", out, re.M)
    assert heard is not None and int(heard.group(2)) == 1000
    assert f"assistant: You said: {heard.group(1)}." in out
    params, samples = read_wav(answer)
    assert (params.nchannels, params.sampwidth, params.framerate) == (1, 2, 24_000)
    # 7 words, each a 100 ms tone and 20 ms of silence.
    assert abs(len(samples) / 24_000 - 0.84) < 0.03
    assert np.sqrt(np.mean(samples**2)) > 0.1


def test_text_mode_says_the_text_and_writes_its_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    answer = tmp_path / "answer.wav"

    async def scenario() -> int:
        async with live_server() as server:
            return await talk_to(server, "--text", "hello there", "--out", str(answer))

    assert run(scenario()) == 0
    out = capsys.readouterr().out
    assert "you: hello there\n" in out
    assert "assistant: You said: hello there.\n" in out
    _, samples = read_wav(answer)
    assert abs(len(samples) / 24_000 - 0.48) < 0.03  # 4 words


def test_full_server_is_a_clear_error_with_exit_status_5(capsys: pytest.CaptureFixture[str]) -> None:
    async def scenario() -> int:
        async with live_server(pool_size=1) as server:
            async with RealtimeClient.connect(server) as holder:
                await holder.until("session.created")
                return await talk_to(server, "--text", "anyone there?")

    assert run(scenario()) == talk.EXIT_BUSY
    assert "the server is full" in capsys.readouterr().err


def test_wrong_api_key_is_refused_with_exit_status_4_and_the_right_one_from_the_environment_works(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)

    async def scenario() -> tuple[int, int]:
        async with live_server(api_keys=["right-key"]) as server:
            wrong = await talk_to(server, "--text", "hi", "--api-key", "wrong-key")
            monkeypatch.setenv("S2S_RT_API_KEY", "right-key")
            right = await talk_to(server, "--text", "hi")
            return wrong, right

    assert run(scenario()) == (talk.EXIT_REFUSED, 0)
    captured = capsys.readouterr()
    assert "refused the API key (HTTP 401)" in captured.err
    assert "assistant: You said: hi." in captured.out


def test_nothing_listening_is_connection_refused_with_exit_status_3(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The port was free a moment ago; nothing listens on it now.
    status = talk.main(["--text", "hi", "--url", f"ws://127.0.0.1:{port}/v1/realtime", "--timeout", "5"])
    assert status == talk.EXIT_UNREACHABLE
    assert "connection refused" in capsys.readouterr().err


def test_a_wav_that_is_not_16_bit_is_rejected_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    eight_bit = write_wav(tmp_path / "q8.wav", stereo_tone(0.5, 8_000), 8_000, width=1)
    # The URL goes nowhere: the file is checked first.
    assert talk.main(["--wav", str(eight_bit), "--url", "ws://127.0.0.1:9/v1/realtime"]) == talk.EXIT_USAGE
    assert "only 16-bit PCM WAV" in capsys.readouterr().err

"""The listening clock's batch (``hear``): many sessions' audio worked in groups, as if one by one.

Sessions send audio in different formats, lengths and numbers of appends per
tick, and one changes format midway; whatever groups the batch forms, each
session must get exactly the samples and VAD scores it would get alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from s2s_rt.audio import AudioFormat, Resampler
from s2s_rt.engines.base import PIPELINE_RATE
from s2s_rt.engines.silero import SileroVAD
from s2s_rt.listening.hearing import AudioBytes, SessionAudio, hear
from s2s_rt.models.recipes import _SILERO
from s2s_rt.scope import Scope

PCM24 = AudioFormat("audio/pcm", 24_000)
PCM16 = AudioFormat("audio/pcm", 16_000)
ULAW = AudioFormat("audio/pcmu", 8_000)


@pytest.fixture(scope="module")
def vad() -> SileroVAD:
    return SileroVAD(_SILERO.file("data/silero_vad.onnx"))


def _speechlike(rng: np.random.Generator, seconds: float, rate: int) -> np.ndarray:
    """Voiced bursts (a pulse train through two formant-like resonances) and quiet, so the VAD's scores move."""
    n = int(seconds * rate)
    t = np.arange(n) / rate
    f0 = rng.uniform(100, 220)
    pulses = np.sign(np.sin(2 * np.pi * f0 * t)) * 0.5
    voiced = sum(np.sin(2 * np.pi * f * t) * pulses for f in (rng.uniform(500, 800), rng.uniform(1000, 1600)))
    envelope = (np.sin(2 * np.pi * 0.8 * t + rng.uniform(0, 6)) > 0).astype(np.float32)
    return (voiced * 0.3 * envelope + rng.standard_normal(n) * 0.01).astype(np.float32)


def test_sessions_heard_together_get_what_each_would_get_alone(vad: SileroVAD) -> None:
    rng = np.random.default_rng(5)
    scope = Scope("test")
    # (format, bytes per append, appends per tick): the usual 20 ms appends, odd sizes, bursts.
    kinds = [(PCM24, 960, 1)] * 6 + [
        (PCM24, 960, 3),
        (PCM16, 640, 1),
        (PCM24, 4800, 1),
        (ULAW, 160, 2),
        (PCM24, 902, 1),
    ]
    sessions = [SessionAudio(Scope("test"), vad.new_state(), fmt) for fmt, _, _ in kinds]
    alone_states = [vad.new_state() for _ in kinds]
    sent: list[list[tuple[AudioFormat, bytes]]] = [[] for _ in kinds]
    streams = [fmt.encode(_speechlike(rng, 3.0, fmt.rate)) for fmt, _, _ in kinds]
    offsets = [0] * len(kinds)
    got_samples: list[list[np.ndarray]] = [[] for _ in kinds]
    got_probs: list[list[np.ndarray]] = [[] for _ in kinds]
    changed = False
    for tick in range(40):
        work = []
        for i, (fmt, size, per_tick) in enumerate(kinds):
            segments = []
            for _ in range(per_tick):
                piece = streams[i][offsets[i] : offsets[i] + size]
                offsets[i] += size
                if piece:
                    segments.append(AudioBytes(scope, piece, fmt))
                    sent[i].append((fmt, piece))
            if i == 0 and tick == 20 and not changed:
                # Session 0 switches to 16 kHz within a tick's audio.
                changed = True
                other = PCM16.encode(_speechlike(rng, 0.1, 16_000))
                segments.append(AudioBytes(scope, other, PCM16))
                sent[i].append((PCM16, other))
                kinds[0] = (PCM16, 640, 1)
                streams[0] = PCM16.encode(_speechlike(rng, 2.0, 16_000))
                offsets[0] = 0
            work.append((sessions[i], segments, True))
        for i, h in enumerate(hear(vad, work)):
            assert h.error is None
            got_samples[i].append(h.samples)
            got_probs[i].append(h.probabilities)
    for i in range(len(kinds)):
        # Alone: decode and resample each append in order, then score window by window.
        resampler: Resampler | None = None
        fmt_now = None
        pieces = []
        for fmt, data in sent[i]:
            if fmt != fmt_now:
                fmt_now, resampler = fmt, Resampler(fmt.rate, PIPELINE_RATE)
            assert resampler is not None
            pieces.append(resampler.process(fmt.decode(data)))
        expected = np.concatenate(pieces)
        heard = np.concatenate(got_samples[i])
        assert heard.shape == expected.shape
        np.testing.assert_allclose(heard, expected, atol=1e-6)
        windows = expected[: len(expected) // 512 * 512].reshape(-1, 512)
        expected_probs = np.array([vad.speech_probabilities(w[None, :], [alone_states[i]])[0] for w in windows])
        probs = np.concatenate(got_probs[i])
        assert len(probs) == len(windows)
        np.testing.assert_allclose(probs, expected_probs, atol=1e-4)
        assert np.ptp(probs) > 0.02  # the scores moved with the bursts: each session's state mattered


def test_a_session_that_is_not_scored_still_gets_its_samples(vad: SileroVAD) -> None:
    scope = Scope("test")
    listening = SessionAudio(Scope("test"), vad.new_state(), PCM24)
    data = PCM24.encode(np.zeros(480, np.float32))
    (h,) = hear(vad, [(listening, [AudioBytes(scope, data, PCM24)], False)])
    assert h.error is None and len(h.samples) == 320 and len(h.probabilities) == 0


def test_vad_rows_are_reused_and_grow_without_mixing_sessions(vad: SileroVAD) -> None:
    """Sessions come and go while others are mid-stream; the state table grows past its first size."""
    rng = np.random.default_rng(9)
    stream = np.stack([_speechlike(rng, 1.5, 16_000) for _ in range(3)])
    windows = stream[:, : stream.shape[1] // 512 * 512].reshape(3, -1, 512)
    alone = [vad.new_state() for _ in range(3)]
    expected = np.array([[vad.speech_probabilities(w[None], [alone[i]])[0] for w in windows[i]] for i in range(3)])
    live = [vad.new_state() for _ in range(3)]
    rows = [state.row for state in live]
    got = []
    for k in range(windows.shape[1]):
        if k == 10:
            # Many sessions arrive (the table doubles, maybe more than once) and most leave again.
            crowd = [vad.new_state() for _ in range(200)]
            vad.speech_probabilities(np.repeat(windows[:1, k], len(crowd), axis=0), crowd)
            del crowd[:150]
        if k == 20:
            vad.speech_probabilities(np.repeat(windows[:1, k], len(crowd), axis=0), crowd)
            del crowd
        got.append(vad.speech_probabilities(windows[:, k], live))
    np.testing.assert_allclose(np.array(got).T, expected, atol=1e-5)
    assert [state.row for state in live] == rows
    # Rows of sessions that left are handed out again, zeroed: a new session starts fresh.
    fresh = vad.new_state()
    first = vad.speech_probabilities(windows[:1, 0], [fresh])
    np.testing.assert_allclose(first, expected[:1, 0], atol=1e-5)


def test_empty_appends_of_several_sessions_in_one_tick_are_heard_as_nothing(vad: SileroVAD) -> None:
    scope = Scope("test")
    sessions = [SessionAudio(Scope("test"), vad.new_state(), PCM24) for _ in range(3)]
    got = hear(vad, [(ls, [AudioBytes(scope, b"", PCM24)], True) for ls in sessions])
    assert [(h.error, len(h.samples), len(h.probabilities)) for h in got] == [(None, 0, 0)] * 3

"""Turn detection cuts turns at exactly the configured padding and silence."""

from __future__ import annotations

import numpy as np

from s2s_rt.engines.base import PIPELINE_RATE
from s2s_rt.protocol.config import TurnDetection
from s2s_rt.turn import PAUSE_HEARD_MS, SpeechStart, SpeechStop, TurnDetector, shorten_pauses

CHUNK_MS = 32.0


def _feed(detector: TurnDetector, probs: list[float]) -> list[tuple[int, object]]:
    out = []
    for i, p in enumerate(probs):
        ev = detector.feed(p, i * CHUNK_MS, (i + 1) * CHUNK_MS)
        if ev is not None:
            out.append((i, ev))
    return out


def test_speech_start_includes_prefix_padding() -> None:
    d = TurnDetector(TurnDetection(prefix_padding_ms=300))
    events = _feed(d, [0.0] * 20 + [0.9])
    assert events == [(20, SpeechStart(20 * CHUNK_MS - 300))]


def test_speech_stops_after_exactly_the_silence_duration() -> None:
    d = TurnDetector(TurnDetection(silence_duration_ms=500))
    probs = [0.9] * 10 + [0.0] * 30
    events = _feed(d, probs)
    assert isinstance(events[1][1], SpeechStop)
    # Last voiced chunk ends at 320 ms; the turn ends 500 ms later, not at a chunk edge.
    assert events[1][1].audio_end_ms == 320 + 500
    # It is reported on the first chunk that reaches that time.
    assert (events[1][0] + 1) * CHUNK_MS >= 820 > events[1][0] * CHUNK_MS


def test_short_pause_does_not_end_the_turn() -> None:
    d = TurnDetector(TurnDetection(silence_duration_ms=500))
    events = _feed(d, [0.9] * 5 + [0.0] * 10 + [0.9] * 5 + [0.0] * 20)
    assert [type(e) for _, e in events] == [SpeechStart, SpeechStop]


def test_threshold_is_honoured_and_changes_apply_at_once() -> None:
    settings = TurnDetection(threshold=0.8)
    d = TurnDetector(settings)
    assert _feed(d, [0.7] * 5) == []
    settings.threshold = 0.6
    assert len(_feed(d, [0.7])) == 1


def test_a_long_pause_inside_a_turn_is_heard_shortened_and_a_short_one_whole() -> None:
    """The recogniser hears a pause inside a turn at most PAUSE_HEARD_MS long; the committed audio keeps it."""
    d = TurnDetector(TurnDetection(silence_duration_ms=2000, prefix_padding_ms=0))
    # Voice 0-320 ms, a 960 ms pause, voice 1280-1600, a 320 ms pause, voice 1920-2240, then silence.
    _feed(d, [0.9] * 10 + [0.0] * 30 + [0.9] * 10 + [0.0] * 10 + [0.9] * 10 + [0.0] * 70)
    assert d.pauses == [(320.0, 1280.0)]
    rate_ms = PIPELINE_RATE // 1000
    audio = np.arange(2240 * rate_ms, dtype=np.float32)  # each sample names its place
    heard = shorten_pauses(audio, 0, d.pauses)
    keep = PAUSE_HEARD_MS // 2 * rate_ms
    assert len(heard) == len(audio) - (960 - PAUSE_HEARD_MS) * rate_ms
    # Half the pause kept after the voice before, half before the voice after, nothing else moved.
    assert heard[320 * rate_ms + keep - 1] == 320 * rate_ms + keep - 1
    assert heard[320 * rate_ms + keep] == 1280 * rate_ms - keep
    assert heard[-1] == audio[-1]
    # Audio that begins later (a turn's own) is cut at the same places of the session's clock.
    later = shorten_pauses(audio[100 * rate_ms :], 100 * rate_ms, d.pauses)
    assert np.array_equal(later, heard[100 * rate_ms :])
    assert shorten_pauses(audio, 0, []) is audio

"""Wire audio formats and resampling keep a tone's frequency and level."""

from __future__ import annotations

import numpy as np
import pytest

from s2s_rt.audio import PLANS, AudioFormat, AudioFormatError, Resampler, _filter_bank, resample
from s2s_rt.engines.base import PIPELINE_RATE

FORMATS = [
    ("audio/pcm", 16_000),
    ("audio/pcm", 24_000),
    ("audio/pcm", 48_000),
    ("audio/pcmu", 8_000),
    ("audio/pcma", 8_000),
]


def _tone(rate: int, freq: float = 1000.0, seconds: float = 1.0, level: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (level * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _peak_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * rate / len(x))


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x[200:-200]))))


@pytest.mark.parametrize(("kind", "rate"), FORMATS)
def test_round_trip_through_pipeline_rate_keeps_1khz_tone(kind: str, rate: int) -> None:
    fmt = AudioFormat.parse(kind, rate)
    wire = fmt.encode(_tone(rate))
    inside = resample(fmt.decode(wire), rate, PIPELINE_RATE)
    back = fmt.decode(fmt.encode(resample(inside, PIPELINE_RATE, rate)))
    assert abs(_peak_hz(inside, PIPELINE_RATE) - 1000) <= 2
    assert abs(_peak_hz(back, rate) - 1000) <= 2
    expected = 0.5 / np.sqrt(2)
    assert _rms(inside) == pytest.approx(expected, rel=0.03)
    assert _rms(back) == pytest.approx(expected, rel=0.03)


@pytest.mark.parametrize(("src", "dst"), [(24_000, 16_000), (16_000, 24_000), (22_050, 24_000), (48_000, 16_000)])
def test_streaming_resampler_matches_one_shot_whatever_the_chunking(src: int, dst: int) -> None:
    x = _tone(src, 440.0)
    whole = Resampler(src, dst).process(x)
    r = Resampler(src, dst)
    pieces = np.concatenate([r.process(c) for c in np.array_split(x, 53)])
    assert len(pieces) == len(whole)
    assert np.max(np.abs(pieces - whole)) < 1e-4


@pytest.mark.parametrize(("src", "dst"), [(24_000, 16_000), (48_000, 16_000), (8_000, 16_000), (22_050, 24_000)])
def test_each_output_is_its_phases_filter_over_the_inputs_before_it(src: int, dst: int) -> None:
    """The definition, computed output by output: output k sits at input position k*down/up and is the
    dot product of the taps inputs up to it (zeros before the first) with the filter of its phase."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(9_000).astype(np.float32) * 0.3
    r = Resampler(src, dst)
    # Chunks of many lengths (some shorter than a filter, some of hundreds of outputs), at every phase.
    cuts = np.cumsum(rng.integers(0, 700, 40))
    got = np.concatenate([r.process(c) for c in np.split(x, cuts[cuts < len(x)])])
    up, down, taps = r.up, r.down, 16
    bank = _filter_bank(up, down, taps)
    padded = np.concatenate([np.zeros(taps - 1, np.float32), x])
    k = np.arange(len(got))
    newest = k * down // up
    expected = np.array([padded[n : n + taps] @ bank[p] for n, p in zip(newest, k * down % up, strict=True)])
    assert len(got) == -(-len(x) * up // down)  # every output whose newest input came
    assert np.allclose(got, expected, atol=1e-6), np.max(np.abs(got - expected))


def test_sessions_at_the_same_rates_share_plans_and_odd_lengths_do_not_take_a_steady_ones() -> None:
    steady, other = Resampler(24_000, 16_000), Resampler(24_000, 16_000)
    chunk = np.zeros(480, np.float32)
    steady.process(chunk)
    other.process(chunk)
    plan = steady._plan_for(480)
    assert other._plan_for(480) is plan  # one plan for both sessions, not one each
    # Another client's long appends of odd lengths fill the process's plans past their bound (emptying them)…
    odd = Resampler(24_000, 16_000)
    seen = [PLANS.bytes]
    for n in range(200):
        odd.process(np.zeros(40_000 + 3 * n, np.float32))
        seen.append(PLANS.bytes)
        assert PLANS.bytes <= PLANS.limit
        if seen[-1] < seen[-2]:
            break
    assert seen[-1] < seen[-2], seen  # emptied at least once
    # …and the steady session goes on with its plan, not one made again.
    steady.process(chunk)
    assert steady._plan_for(480) is plan


def test_resampled_length_follows_the_rate_ratio() -> None:
    assert len(resample(np.zeros(24_000, np.float32), 24_000, 16_000)) == 16_000
    assert len(resample(np.zeros(22_050, np.float32), 22_050, 24_000)) == 24_000


def test_g711_decodes_to_the_standard_values() -> None:
    # ITU-T G.711 reference points: μ-law 0xFF and A-law 0xD5 are (near) zero,
    # μ-law 0x00 is the most negative value.
    ulaw, alaw = AudioFormat.parse("g711_ulaw"), AudioFormat.parse("g711_alaw")
    assert ulaw.decode(bytes([0xFF]))[0] == 0.0
    assert ulaw.decode(bytes([0x00]))[0] == pytest.approx(-32124 / 32768)
    assert abs(alaw.decode(bytes([0xD5]))[0]) < 0.001
    assert alaw.decode(bytes([0x2A]))[0] == pytest.approx(-32256 / 32768)


def test_pcm16_with_odd_byte_count_is_refused() -> None:
    with pytest.raises(AudioFormatError, match="even number of bytes"):
        AudioFormat.parse("audio/pcm", 24_000).decode(b"\x00\x01\x02")


@pytest.mark.parametrize(
    ("kind", "rate"), [("audio/pcm", 44_100), ("audio/pcmu", 16_000), ("audio/opus", None), ("mp3", None)]
)
def test_unsupported_formats_are_refused_with_the_alternatives(kind: str, rate: int | None) -> None:
    with pytest.raises(AudioFormatError):
        AudioFormat.parse(kind, rate)


def test_beta_format_names_map_to_ga_formats() -> None:
    assert AudioFormat.parse("pcm16") == AudioFormat("audio/pcm", 24_000)
    assert AudioFormat.parse("g711_ulaw").beta_name == "g711_ulaw"
    assert AudioFormat.parse("g711_alaw").type == "audio/pcma"


def test_many_sessions_resampled_together_match_each_one_alone() -> None:
    rng = np.random.default_rng(7)
    for src, dst in ((24_000, 16_000), (48_000, 16_000), (8_000, 16_000), (22_050, 24_000), (16_000, 16_000)):
        alone = [Resampler(src, dst) for _ in range(12)]
        together = [Resampler(src, dst) for _ in range(12)]
        for _ in range(25):
            # Mostly one append length (the usual case), some odd ones and empty ones, so groups vary.
            lengths = [int(rng.choice([480, 480, 480, 960, 0, int(rng.integers(1, 700))])) for _ in alone]
            chunks = [rng.standard_normal(n).astype(np.float32) * 0.3 for n in lengths]
            expected = [r.process(x) for r, x in zip(alone, chunks, strict=True)]
            # Rows of one length go together, in whatever phase each resampler is.
            for n in set(lengths):
                rows = [i for i, length in enumerate(lengths) if length == n]
                block = np.stack([chunks[i] for i in rows]) if n else np.zeros((len(rows), 0), np.float32)
                got = Resampler.process_block([together[i] for i in rows], block)
                for i, g in zip(rows, got, strict=True):
                    assert expected[i].shape == g.shape and np.allclose(expected[i], g, atol=1e-6)

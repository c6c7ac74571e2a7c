"""What input noise reduction (RNNoise) buys and costs: spoken questions in noise, with and without it.

Each of the evaluation's questions is said by a voice unlike the server's
(flite slt and awb, espeak-ng's Scottish and Caribbean accents) and mixed
with synthesised noise: no recorded noise ships offline, so babble is made
of other synthetic voices talking at once, a fan of pink and brown noise
with a wobbling hum, a street of rumble, passing cars and the odd horn. A
clip is 0.5 s of noise, the question, 1.5 s of noise; the noise is scaled
to 0, 5 and 10 dB below the speech's power over its voiced part.

Every clip is heard twice, as it is and through a fresh denoiser fed 20 ms
at a time (as a session's audio is), then scored by Silero VAD 512 samples
at a time and turned into turns by the server's own
:class:`~s2s_rt.turn.TurnDetector` (``server_vad``: threshold 0.5, prefix
padding 300 ms, silence 500 ms). Counted per condition: turns that start in
the noise before the voice (false starts), questions cut into more than one
turn, clips still inside a turn when the 1.5 s after the voice end (held
open), questions no turn overlaps (missed), and turns started on the noise
after the voice. The first turn overlapping the voice is transcribed by the
server's Whisper as the server would (pauses shortened; to the clip's end if
it never ended; the whole clip if there is none) and its word error rate
taken (over all words, and the clips heard word for word). With noise
reduction the voice's span moves by the denoiser's delay, measured once by
cross-correlation. The denoiser's CPU time is measured alone, in its thread.

    python -m s2s_rt.evaluation.noise --out DIR [--questions N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from s2s_rt.cpuinfo import cpu_name
from s2s_rt.engines.base import PIPELINE_RATE, Float32Array, ms_to_samples, samples_to_ms
from s2s_rt.engines.rnnoise import DELAY_SAMPLES, RNNoise
from s2s_rt.evaluation.grading import spoken_word_error_rate
from s2s_rt.evaluation.questions import QUESTIONS
from s2s_rt.evaluation.voices import FOREIGN_VOICES, Voice, say
from s2s_rt.protocol.config import TurnDetection
from s2s_rt.speech_text import speakable
from s2s_rt.turn import SpeechStart, SpeechStop, TurnDetector, shorten_pauses
from s2s_rt.wer import words

RATE = PIPELINE_RATE
#: Complete questions from the evaluation's set, the order in which ``--questions N`` takes them.
CHOSEN = (
    "What is the capital of Australia?",
    "Which planet is closest to the Sun?",
    "What is fifteen plus twenty-seven?",
    "How many minutes are there in three and a half hours?",
    "Who wrote Pride and Prejudice?",
    "At what temperature does water boil, in degrees Celsius?",
    "What is the square root of one hundred forty-four?",
    "How many seconds are there in an hour?",
    "In which country are the pyramids of Giza?",
    "What day of the week is it today?",
    "How can I fall asleep faster?",
    "What should I do if I burn my finger?",
)
#: Who says the questions, in turn.
SPEAKERS = tuple(v for v in FOREIGN_VOICES if v.name in ("slt", "awb", "en-gb-scotland+f3", "en-029+m3"))
#: Who talks in the babble (none of them says a question).
TALKERS = (
    Voice("flite", "rms"),
    Voice("flite", "kal"),
    Voice("espeak-ng", "en-us"),
    Voice("espeak-ng", "en-gb-x-rp"),
    Voice("espeak-ng", "en-us+f2"),
    Voice("espeak-ng", "en-gb-x-gbclan"),
)
NOISES = ("babble", "fan", "street")
SNRS_DB = (0, 5, 10)
LEAD_S, TAIL_S = 0.5, 1.5
#: The questions' voiced power (-26 dBFS): the noise is set against it.
SPEECH_RMS = 0.05
#: The server's client audio arrives in pieces; the denoiser is fed this many samples at a time.
FEED = ms_to_samples(20)


def voiced_frames(audio: Float32Array, frame: int = ms_to_samples(20), floor_db: float = 40.0) -> np.ndarray:
    """Which 20 ms frames of ``audio`` are within ``floor_db`` of the loudest one (the voiced part)."""
    n = len(audio) // frame
    power = (audio[: n * frame].astype(np.float64).reshape(n, frame) ** 2).mean(axis=1)
    return np.asarray(power > power.max() * 10 ** (-floor_db / 10))


def voiced_power(audio: Float32Array) -> float:
    frame = ms_to_samples(20)
    mask = voiced_frames(audio, frame)
    return float((audio[: len(mask) * frame].reshape(len(mask), frame)[mask].astype(np.float64) ** 2).mean())


def voice_span(audio: Float32Array) -> tuple[int, int]:
    """First and last sample of the voiced part."""
    frame = ms_to_samples(20)
    idx = np.flatnonzero(voiced_frames(audio, frame))
    return int(idx[0]) * frame, int(idx[-1] + 1) * frame


def unit(x: np.ndarray) -> Float32Array:
    return (x / max(float(np.sqrt(np.mean(x.astype(np.float64) ** 2))), 1e-12)).astype(np.float32)


def shaped(rng: np.random.Generator, n: int, gain: Callable[[np.ndarray], np.ndarray]) -> Float32Array:
    """White noise of ``n`` samples shaped by ``gain(frequency)`` in the frequency domain, at unit RMS."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    freqs = np.fft.rfftfreq(n, 1 / RATE)
    return unit(np.fft.irfft(spectrum * gain(np.maximum(freqs, 1.0)), n))


def fan(rng: np.random.Generator, n: int) -> Float32Array:
    """Pink and brown noise, blade-rate flutter, and a motor hum with harmonics that slowly wobbles."""
    t = np.arange(n) / RATE
    pink = shaped(rng, n, lambda f: (f > 20) / np.sqrt(f))
    brown = shaped(rng, n, lambda f: (f > 20) / f)
    flutter = 1 + 0.15 * np.sin(2 * np.pi * rng.uniform(6, 12) * t)
    broad = unit((0.6 * pink + 0.4 * brown) * flutter)
    f0 = float(rng.choice([50.0, 60.0, 100.0, 120.0]))
    hum = sum(np.sin(2 * np.pi * k * f0 * t + rng.uniform(0, 2 * np.pi)) / k for k in range(1, 6))
    wobble = 1 + 0.3 * np.sin(2 * np.pi * rng.uniform(0.2, 0.8) * t + rng.uniform(0, 2 * np.pi))
    return unit(broad + 0.5 * unit(np.asarray(hum)) * wobble)


def street(rng: np.random.Generator, n: int) -> Float32Array:
    """Low rumble, cars passing (band-limited noise under slow swells), now and then a short horn."""
    t = np.arange(n) / RATE
    rumble = shaped(rng, n, lambda f: (f > 20) / (np.sqrt(f) * (1 + (f / 150) ** 4)))
    out = rumble.astype(np.float64)
    for _ in range(int(rng.integers(1, 4))):
        band = shaped(rng, n, lambda f: ((f > 80) & (f < 2500)) / np.sqrt(f))
        centre, width = rng.uniform(0, n / RATE), rng.uniform(0.6, 2.0)
        out += rng.uniform(1.0, 3.0) * band * np.exp(-(((t - centre) / width) ** 2))
    for _ in range(int(rng.choice([0, 0, 1, 2]))):
        length, at = int(rng.uniform(0.2, 0.5) * RATE), int(rng.uniform(0, n / RATE - 0.5) * RATE)
        tt = np.arange(length) / RATE
        f0 = rng.uniform(380, 520)
        tone = sum(np.sin(2 * np.pi * k * f * tt) / k for f in (f0, f0 * 1.25) for k in (1, 3, 5, 7))
        ramp = np.minimum(1, np.minimum(tt, tt[::-1]) / 0.02)
        out[at : at + length] += rng.uniform(1.0, 2.5) * unit(np.asarray(tone)) * ramp
    return unit(out)


@dataclass
class Babble:
    """Talker streams (each of a voice's sentences in a row, at unit voiced power); a clip sums 4-6."""

    streams: list[Float32Array] = field(default_factory=list)

    @classmethod
    def make(cls, sentences: Sequence[str]) -> Babble:
        streams = []
        for i, voice in enumerate(TALKERS):
            said = [say(voice, s) for s in sentences[i :: len(TALKERS)]]
            gap = np.zeros(ms_to_samples(150), np.float32)
            stream = np.concatenate([x for s in said for x in (s, gap)])
            streams.append((stream / np.sqrt(voiced_power(stream))).astype(np.float32))
        return cls(streams)

    def __call__(self, rng: np.random.Generator, n: int) -> Float32Array:
        out = np.zeros(n)
        for k in rng.choice(len(self.streams), size=int(rng.integers(4, 7)), replace=False):
            s = self.streams[int(k)]
            out += np.roll(np.tile(s, n // len(s) + 2), -int(rng.integers(len(s))))[:n]
        return unit(out)


def mix(speech: Float32Array, noise: Float32Array | None, snr_db: float | None) -> Float32Array:
    """``speech`` after :data:`LEAD_S` of ``noise``, :data:`TAIL_S` of it after, at ``snr_db``."""
    lead, tail = round(LEAD_S * RATE), round(TAIL_S * RATE)
    clip = np.zeros(lead + len(speech) + tail)
    clip[lead : lead + len(speech)] = speech * (SPEECH_RMS / np.sqrt(voiced_power(speech)))
    if noise is not None and snr_db is not None:
        clip += noise[: len(clip)] * SPEECH_RMS * 10 ** (-snr_db / 20)
    peak = float(np.abs(clip).max())
    return (clip / peak * 0.99 if peak > 0.99 else clip).astype(np.float32)


def denoise(denoiser: Any, audio: Float32Array) -> tuple[Float32Array, float]:
    """``audio`` through ``denoiser`` 20 ms at a time, and the CPU seconds that took.

    Counted with :func:`time.thread_time`: the denoiser runs in this thread (ctypes), and the process's
    time would also count other threads (the recogniser's) winding down after their last call.
    """
    t0 = time.thread_time()
    out = np.concatenate([denoiser.process(audio[i : i + FEED]) for i in range(0, len(audio), FEED)])
    return out, time.thread_time() - t0


def measured_delay(rnnoise: RNNoise, speech: Float32Array) -> int:
    """How many samples later the denoised ``speech`` comes out, by cross-correlation (up to 100 ms)."""
    clip = mix(speech, None, None)
    out, _ = denoise(rnnoise.denoiser(), clip)
    return max(range(ms_to_samples(100)), key=lambda lag: float(np.dot(out[lag:], clip[: len(clip) - lag])))


@dataclass
class Turn:
    start_ms: float  # with the prefix padding
    first_voice_ms: float  # the chunk that started it
    last_voice_ms: float
    end_ms: float | None  # None: never ended
    pauses: list[tuple[float, float]]


def detect_turns(vad: Any, audio: Float32Array) -> list[Turn]:
    """The turns ``server_vad`` (OpenAI's defaults) finds in ``audio``, with the server's turn detector."""
    detector, state, chunk = TurnDetector(TurnDetection()), vad.new_state(), vad.chunk_samples
    turns: list[Turn] = []
    for k in range(len(audio) // chunk):
        p = float(vad.speech_probabilities(audio[None, k * chunk : (k + 1) * chunk], [state])[0])
        begin, end = samples_to_ms(k * chunk), samples_to_ms((k + 1) * chunk)
        event = detector.feed(p, begin, end)
        if isinstance(event, SpeechStart):
            turns.append(Turn(event.audio_start_ms, begin, end, None, []))
        elif isinstance(event, SpeechStop):
            turns[-1].end_ms = event.audio_end_ms
        if turns and (detector.speaking or isinstance(event, SpeechStop)):
            turns[-1].last_voice_ms, turns[-1].pauses = detector.last_voice_ms, list(detector.pauses)
    return turns


@dataclass
class Outcome:
    question: str
    voice: str
    noise: str
    snr_db: float | None
    reduced: bool
    turns: list[dict[str, Any]]
    false_starts: int
    cut_in_two: bool
    held_open: bool
    missed: bool
    late_turns: int
    heard: str
    wer: float
    words: int


def judge(stt: Any, vad: Any, question: str, voice: str, audio: Float32Array, span: tuple[int, int]) -> Outcome:
    """Turns, counts and what the recogniser makes of the first turn over the voice (``span`` in samples)."""
    turns = detect_turns(vad, audio)
    v0, v1 = samples_to_ms(span[0]), samples_to_ms(span[1])
    over = [t for t in turns if t.first_voice_ms < v1 and t.last_voice_ms > v0]
    if over:
        t = over[0]
        start, end = ms_to_samples(t.start_ms), ms_to_samples(t.end_ms) if t.end_ms is not None else len(audio)
        heard = stt.transcribe(shorten_pauses(audio[start:end], start, t.pauses)).text
    else:
        heard = stt.transcribe(audio).text
    return Outcome(
        question,
        voice,
        "",
        None,
        False,
        [asdict(t) for t in turns],
        false_starts=sum(t.first_voice_ms + 32 <= v0 for t in turns),
        cut_in_two=len(over) > 1,
        held_open=bool(turns) and turns[-1].end_ms is None,
        missed=not over,
        late_turns=sum(t.first_voice_ms >= v1 for t in turns),
        heard=heard,
        wer=spoken_word_error_rate(question, heard),
        words=len(words(speakable(question))),
    )


def summarise(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    n_words = sum(o.words for o in outcomes)
    return {
        "clips": len(outcomes),
        "wer": sum(o.wer * o.words for o in outcomes) / max(n_words, 1),
        "false_starts": sum(o.false_starts for o in outcomes),
        "cut_in_two": sum(o.cut_in_two for o in outcomes),
        "held_open": sum(o.held_open for o in outcomes),
        "missed": sum(o.missed for o in outcomes),
        "late_turns": sum(o.late_turns for o in outcomes),
        "word_for_word": sum(o.wer == 0 for o in outcomes),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per noise and SNR, each figure without → with noise reduction."""
    lines = [
        "| noise | SNR | clips | WER off → on | heard word for word | false starts | cut in two | held open | missed"
        " | turns after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        off, on = r["off"], r["on"]
        counts = ("word_for_word", "false_starts", "cut_in_two", "held_open", "missed", "late_turns")
        cells = [f"{off[k]} → {on[k]}" for k in counts]
        snr = "—" if r["snr_db"] is None else f"{r['snr_db']} dB"
        wer = f"{100 * off['wer']:.1f} % → {100 * on['wer']:.1f} %"
        lines.append(f"| {r['noise']} | {snr} | {off['clips']} | {wer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(n_questions: int, out: Path, progress: Callable[[str], None] = print) -> dict[str, Any]:
    from s2s_rt.engines.silero import SileroVAD
    from s2s_rt.engines.whisper import WhisperSTT
    from s2s_rt.models import ensure_prepared

    texts = {q.text for q in QUESTIONS}
    assert all(c in texts for c in CHOSEN), "a chosen question is no longer in the evaluation's set"
    chosen = CHOSEN[:n_questions]
    load_before = os.getloadavg()
    started = time.perf_counter()
    prepared = ensure_prepared()
    stt = WhisperSTT(prepared.whisper, languages=["en"])
    vad = SileroVAD(prepared.vad)
    rnnoise = RNNoise()
    babble = Babble.make([q.text for q in QUESTIONS if q.text not in CHOSEN][:24])
    makers: dict[str, Callable[[np.random.Generator, int], Float32Array]] = {
        "babble": babble,
        "fan": fan,
        "street": street,
    }
    # The voice's span moves by the denoiser's delay: measured, not taken from DELAY_SAMPLES.
    delay = measured_delay(rnnoise, say(SPEAKERS[0], CHOSEN[0]))
    progress(f"denoiser delay: {delay} samples measured, {DELAY_SAMPLES} declared")
    outcomes: list[Outcome] = []
    removed: dict[str, list[float]] = {name: [] for name in NOISES}  # dB of noise taken out after the question
    cpu_s = denoised_s = 0.0
    for qi, text in enumerate(chosen):
        voice = SPEAKERS[qi % len(SPEAKERS)]
        speech = say(voice, text)
        lo, hi = voice_span(speech)
        lead = round(LEAD_S * RATE)
        n = lead + len(speech) + round(TAIL_S * RATE)
        cases: list[tuple[str, Float32Array | None, float | None]] = [("clean", None, None)]
        for ni, name in enumerate(NOISES):
            made = makers[name](np.random.default_rng(4000 + 100 * ni + qi), n)
            cases += [(name, made, float(snr)) for snr in SNRS_DB]
        for name, noise, snr in cases:
            clip = mix(speech, noise, snr)
            for reduced in (False, True):
                heard: Float32Array = clip
                shift = 0
                if reduced:
                    heard, cpu = denoise(rnnoise.denoiser(), clip)
                    cpu_s, denoised_s, shift = cpu_s + cpu, denoised_s + len(clip) / RATE, delay
                    if noise is not None:  # from 0.3 s after the voice to the end
                        after, end = lead + hi + ms_to_samples(300), len(clip) - delay
                        kept = float(np.mean(heard[after + delay :] ** 2) / np.mean(clip[after:end] ** 2))
                        removed[name].append(-10 * float(np.log10(max(kept, 1e-12))))
                o = judge(stt, vad, text, voice.label, heard, (lead + lo + shift, lead + hi + shift))
                o.noise, o.snr_db, o.reduced = name, snr, reduced
                outcomes.append(o)
        done = [o for o in outcomes if o.question == text]
        off, on = (summarise([o for o in done if o.reduced is r])["wer"] for r in (False, True))
        progress(f"{qi + 1}/{len(chosen)} {voice.label}: {text!r}: WER off {off:.2f}, on {on:.2f}")
    rows = []
    for name, snr in [("clean", None), *[(m, float(s)) for m in NOISES for s in SNRS_DB], ("all noisy", None)]:
        every = name == "all noisy"
        pick = [o for o in outcomes if (o.noise, o.snr_db) == (name, snr) or (every and o.noise != "clean")]
        rows.append(
            {
                "noise": name,
                "snr_db": None if snr is None else int(snr),
                "off": summarise([o for o in pick if not o.reduced]),
                "on": summarise([o for o in pick if o.reduced]),
            }
        )
    voices = {}
    for label in dict.fromkeys(o.voice for o in outcomes):
        mine = [o for o in outcomes if o.voice == label]
        voices[label] = {
            f"{kind} {state}": summarise([o for o in mine if (o.noise == "clean") == clean and o.reduced is reduced])
            for kind, clean in (("clean", True), ("noisy", False))
            for state, reduced in (("off", False), ("on", True))
        }
    report = {
        "questions": list(chosen),
        "speakers": [v.label for v in SPEAKERS],
        "babble_talkers": [v.label for v in TALKERS],
        "turn_detection": asdict(TurnDetection()),
        "denoiser_delay_samples": {"measured": delay, "declared": DELAY_SAMPLES},
        "noise_removed_db_median": {name: float(np.median(v)) for name, v in removed.items() if v},
        "denoiser_cpu_s": cpu_s,
        "denoised_audio_s": denoised_s,
        "denoiser_cpu_per_audio_s": cpu_s / max(denoised_s, 1e-9),
        "wall_s": time.perf_counter() - started,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "machine": {"cpu_count": os.cpu_count(), "processor": cpu_name(), "python": platform.python_version()},
        "table": rows,
        "by_voice": voices,
        "clips": [asdict(o) for o in outcomes],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "noise.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m s2s_rt.evaluation.noise", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for noise.json")
    parser.add_argument("--questions", type=int, default=len(CHOSEN), help=f"how many questions (1-{len(CHOSEN)})")
    args = parser.parse_args(argv)
    if not 1 <= args.questions <= len(CHOSEN):
        parser.error(f"--questions must be 1-{len(CHOSEN)}")
    report = run(args.questions, args.out)
    print()
    print(table(report["table"]))
    print()
    print("| voice | clean: WER off → on | noisy: WER off → on |\n|---|---|---|")
    for label, v in report["by_voice"].items():
        wer = [f"{100 * v[k + ' off']['wer']:.1f} % → {100 * v[k + ' on']['wer']:.1f} %" for k in ("clean", "noisy")]
        print(f"| {label} | {wer[0]} | {wer[1]} |")
    print()
    taken = ", ".join(f"{k} {v:.1f} dB" for k, v in report["noise_removed_db_median"].items())
    print(f"Noise taken out after the question (median): {taken}.")
    print(
        f"Denoiser CPU: {report['denoiser_cpu_s']:.2f} s for {report['denoised_audio_s']:.1f} s of audio"
        f" = {report['denoiser_cpu_per_audio_s']:.3f} of a core per streaming session."
        f" Wall {report['wall_s']:.0f} s; load average before {report['load_average_before'][0]:.2f},"
        f" after {report['load_average_after'][0]:.2f}."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

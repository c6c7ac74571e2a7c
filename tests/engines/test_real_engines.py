"""The real engines (Silero VAD, Whisper, Piper, espeak-ng) on the default models.

The models come from the model cache (built from the installed model packages
on first use). Each is loaded once for the module. Test speech comes from the
project's own Piper voice, so nothing is downloaded and the audio is the same
on every machine.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import word_error_rate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from s2s_rt.audio import resample
from s2s_rt.cpuinfo import cpu_flags, cpu_name, cpuinfo_field
from s2s_rt.engines import device
from s2s_rt.engines.base import PIPELINE_RATE, Float32Array
from s2s_rt.engines.default import load_default_stack
from s2s_rt.engines.device import CPU_PROVIDER, ct2_compute_type, multiplies_int8_fast, resolve_device
from s2s_rt.engines.mel import LogMelSpectrogram
from s2s_rt.engines.phonemes import espeak_phonemizer
from s2s_rt.engines.piper import PiperTTS
from s2s_rt.engines.silero import SileroVAD
from s2s_rt.engines.silero_forward import WEIGHTS, SileroForward, WeightsNotFound, read_weights
from s2s_rt.engines.whisper import WhisperSTT
from s2s_rt.models import ModelError, PreparedModels, ensure_prepared

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def prepared() -> PreparedModels:
    try:
        return ensure_prepared(progress=lambda _line: None)
    except ModelError as exc:
        pytest.skip(f"default models unavailable: {exc}")


@pytest.fixture(scope="module")
def tts(prepared: PreparedModels) -> PiperTTS:
    return PiperTTS(prepared.voices)


@pytest.fixture(scope="module")
def stt(prepared: PreparedModels) -> WhisperSTT:
    return WhisperSTT(prepared.whisper, device="cpu", compute_type="int8")


@pytest.fixture(scope="module")
def vad(prepared: PreparedModels) -> SileroVAD:
    return SileroVAD(prepared.vad)


@pytest.fixture(scope="module")
def question_audio(tts: PiperTTS) -> Float32Array:
    """The question spoken by the Piper voice, at the voice's rate."""
    return np.concatenate(list(tts.synthesize(QUESTION, voice=None, should_stop=lambda: False)))


@pytest.fixture(scope="module")
def question_16k(tts: PiperTTS, question_audio: Float32Array) -> Float32Array:
    return resample(question_audio, tts.sample_rate, PIPELINE_RATE)


def vad_probabilities(vad: SileroVAD, audio: Float32Array) -> Float32Array:
    state = vad.new_state()
    n = len(audio) // vad.chunk_samples
    chunks = audio[: n * vad.chunk_samples].reshape(n, 1, vad.chunk_samples)
    return np.array([vad.speech_probabilities(chunk, [state])[0] for chunk in chunks])


# --- Piper -----------------------------------------------------------------


def test_piper_speaks_audible_speech_at_the_voice_rate(tts: PiperTTS, question_audio: Float32Array) -> None:
    assert tts.sample_rate == 22_050
    assert tts.voices == ["en_US-joe-medium"]
    assert question_audio.dtype == np.float32
    seconds = len(question_audio) / tts.sample_rate
    assert 1.0 < seconds < 4.0
    assert float(np.sqrt(np.mean(question_audio**2))) > 0.02
    assert float(np.max(np.abs(question_audio))) <= 1.0


def test_piper_yields_one_piece_per_sentence(tts: PiperTTS) -> None:
    pieces = list(tts.synthesize("Hello there. How are you? Fine!", voice=tts.voices[0], should_stop=lambda: False))
    assert len(pieces) == 3


def test_piper_stops_between_sentences_when_asked(tts: PiperTTS) -> None:
    produced: list[Float32Array] = []
    text = "First sentence here. Second sentence here. Third sentence here."
    for piece in tts.synthesize(text, voice=None, should_stop=lambda: len(produced) >= 1):
        produced.append(piece)
    assert len(produced) == 1


def test_piper_says_nothing_for_blank_text(tts: PiperTTS) -> None:
    assert list(tts.synthesize("   ", voice=None, should_stop=lambda: False)) == []


def test_piper_unknown_voice_error_lists_the_voices(tts: PiperTTS) -> None:
    with pytest.raises(ValueError, match=r"unknown voice 'nobody'; available: en_US-joe-medium"):
        list(tts.synthesize("Hi.", voice="nobody", should_stop=lambda: False))


# --- Whisper -----------------------------------------------------------------


def test_whisper_transcribes_piper_speech(stt: WhisperSTT, question_16k: Float32Array) -> None:
    transcript = stt.transcribe(question_16k)
    assert word_error_rate(QUESTION, transcript.text) <= 0.2, transcript.text
    assert transcript.language == "en"


def test_whisper_transcribes_with_a_given_language_and_prompt(stt: WhisperSTT, question_16k: Float32Array) -> None:
    transcript = stt.transcribe(question_16k, language="en", prompt="A geography quiz.")
    assert word_error_rate(QUESTION, transcript.text) <= 0.2, transcript.text
    assert transcript.language == "en"


def test_whisper_returns_empty_text_for_empty_or_tiny_audio(stt: WhisperSTT) -> None:
    assert stt.transcribe(np.zeros(0, dtype=np.float32)).text == ""
    assert stt.transcribe(np.zeros(800, dtype=np.float32), language="en").text == ""


def test_whisper_rejects_an_unknown_language(stt: WhisperSTT, question_16k: Float32Array) -> None:
    with pytest.raises(ValueError, match="unknown language"):
        stt.transcribe(question_16k, language="xx")


# --- Silero VAD ----------------------------------------------------------------


def test_vad_hears_speech(vad: SileroVAD, question_16k: Float32Array) -> None:
    probabilities = vad_probabilities(vad, question_16k)
    assert probabilities.max() > 0.9
    assert np.mean(probabilities > 0.5) > 0.7


def test_vad_ignores_silence_and_low_noise(vad: SileroVAD) -> None:
    rng = np.random.default_rng(0)
    assert vad_probabilities(vad, np.zeros(PIPELINE_RATE, dtype=np.float32)).max() < 0.2
    noise = (rng.standard_normal(2 * PIPELINE_RATE) * 0.003).astype(np.float32)
    assert vad_probabilities(vad, noise).max() < 0.3


def test_vad_batched_scores_equal_separate_scores(vad: SileroVAD, question_16k: Float32Array) -> None:
    sessions = 5
    rng = np.random.default_rng(1)
    # Each session hears the question from another offset, over its own noise.
    streams = np.stack(
        [
            np.roll(question_16k, 3000 * i) + rng.standard_normal(len(question_16k)).astype(np.float32) * 0.01
            for i in range(sessions)
        ]
    ).astype(np.float32)
    batched_states = [vad.new_state() for _ in range(sessions)]
    separate_states = [vad.new_state() for _ in range(sessions)]
    for k in range(len(question_16k) // vad.chunk_samples):
        chunks = streams[:, k * vad.chunk_samples : (k + 1) * vad.chunk_samples]
        batched = vad.speech_probabilities(chunks, batched_states)
        separate = [vad.speech_probabilities(chunks[i : i + 1], [separate_states[i]])[0] for i in range(sessions)]
        np.testing.assert_allclose(batched, separate, atol=1e-5)


def test_the_batched_numpy_vad_scores_as_onnx_runtime_does(
    prepared: PreparedModels, question_16k: Float32Array
) -> None:
    """The default VAD on the CPU scores in numpy: 40 sessions, speech at other offsets and loudness over
    noise, state carried through the whole question: the same probabilities and the same decisions."""
    batched, reference = SileroVAD(prepared.vad), SileroVAD(prepared.vad, batched_forward=False)
    assert batched.describe().endswith("batched in numpy") and "numpy" not in reference.describe()
    sessions = 40
    rng = np.random.default_rng(2)
    streams = np.stack(
        [
            np.roll(question_16k, 1700 * i) * (0.1 + 0.05 * i)
            + rng.standard_normal(len(question_16k)).astype(np.float32) * 0.002 * (i % 5)
            for i in range(sessions)
        ]
    ).astype(np.float32)
    ours, theirs = [batched.new_state() for _ in range(sessions)], [reference.new_state() for _ in range(sessions)]
    decisions = 0
    for k in range(len(question_16k) // batched.chunk_samples):
        chunks = streams[:, k * batched.chunk_samples : (k + 1) * batched.chunk_samples]
        mine = batched.speech_probabilities(chunks, ours)
        expected = reference.speech_probabilities(chunks, theirs)
        np.testing.assert_allclose(mine, expected, atol=1e-4)
        assert ((mine > 0.5) == (expected > 0.5)).all()
        decisions += int((expected > 0.5).sum())
    assert decisions > 100, "the streams held speech"


def test_the_batched_numpy_vad_takes_full_scale_audio_as_onnx_runtime_does(prepared: PreparedModels) -> None:
    """A full-scale square wave sweeping up for ten seconds drives the LSTM's gates past exp's range in float32:
    no overflow, and the same probabilities."""
    batched, reference = SileroVAD(prepared.vad), SileroVAD(prepared.vad, batched_forward=False)
    ours, theirs = [batched.new_state()], [reference.new_state()]
    n = np.arange(batched.chunk_samples)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(320):
            chunk = np.sign(np.sin(n * (0.01 + 0.01 * k)))[None].astype(np.float32)
            mine = batched.speech_probabilities(chunk, ours)
            np.testing.assert_allclose(mine, reference.speech_probabilities(chunk, theirs), atol=1e-4)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    windows=arrays(np.float32, st.tuples(st.integers(1, 48), st.just(576)), elements=st.floats(-1, 1, width=32)),
    state_scale=st.sampled_from([0.0, 0.5, 5.0, 50.0]),
    seed=st.integers(0, 2**16),
)
def test_any_batch_of_windows_and_states_scores_as_onnx_runtime_does(
    vad_pair: tuple[SileroForward, Any], windows: Float32Array, state_scale: float, seed: int
) -> None:
    """Any windows in [-1, 1] (with their context), any batch size, any state of the size the LSTM reaches."""
    forward, session = vad_pair
    state = (np.random.default_rng(seed).standard_normal((2, len(windows), 128)) * state_scale).astype(np.float32)
    mine, my_state = forward(windows, state)
    expected, expected_state = session.run(None, {"input": windows, "state": state, "sr": np.array(16000)})
    np.testing.assert_allclose(mine, expected, atol=1e-4)
    np.testing.assert_allclose(my_state, expected_state, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def vad_pair(prepared: PreparedModels) -> tuple[SileroForward, Any]:
    """The numpy forward pass and the ONNX Runtime session it stands in for."""
    reference = SileroVAD(prepared.vad, batched_forward=False)
    return SileroForward.from_onnx(prepared.vad), reference._session


def test_the_vad_weights_are_read_from_the_packaged_model_and_a_file_without_them_is_refused(
    prepared: PreparedModels, tmp_path: Path
) -> None:
    weights = read_weights(prepared.vad)
    assert {name: w.shape for name, w in weights.items()} == WEIGHTS
    assert all(w.dtype == np.float32 and np.isfinite(w).all() and w.any() for w in weights.values())
    (tmp_path / "other.onnx").write_bytes(prepared.vad.read_bytes().replace(b"then_branch", b"else_branch"))
    with pytest.raises(WeightsNotFound, match="no single 16 kHz"):
        read_weights(tmp_path / "other.onnx")


def test_vad_rejects_chunks_of_the_wrong_size(vad: SileroVAD) -> None:
    with pytest.raises(ValueError, match="shape"):
        vad.speech_probabilities(np.zeros((1, 480), dtype=np.float32), [vad.new_state()])


# --- espeak-ng phonemes ------------------------------------------------------------


def test_phonemizer_gives_ipa_for_hello_world() -> None:
    sentences = espeak_phonemizer().phonemize("hello world", "en-us")
    assert ["".join(s) for s in sentences] == ["həlˈoʊ wˈɜːld"]


def test_phonemizer_keeps_punctuation_and_splits_sentences_as_piper() -> None:
    sentences = espeak_phonemizer().phonemize("Hello, world! How are you today?", "en-us")
    # Piper's own phonemizer gives exactly this (checked against piper-phonemize 1.1.0).
    assert ["".join(s) for s in sentences] == ["həlˈoʊ, wˈɜːld!", "hˌaʊ ɑːɹ juː tədˈeɪ?"]


def test_phonemizer_is_safe_to_call_from_many_threads() -> None:
    phonemizer = espeak_phonemizer()
    texts = ["hello world", "Bonjour, monde!", "The quick brown fox.", "What time is it?"]
    voices = ["en-us", "fr", "en-us", "de"]
    expected = [phonemizer.phonemize(t, v) for t, v in zip(texts, voices, strict=True)]
    results: list[list[object]] = [[] for _ in texts]

    def worker(i: int) -> None:
        for _ in range(20):
            results[i].append(phonemizer.phonemize(texts[i], voices[i]))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, outputs in enumerate(results):
        assert all(output == expected[i] for output in outputs)


# --- log-mel front end and device choice ----------------------------------------------


@pytest.mark.parametrize(
    ("pad_to_window", "seconds", "frames"),
    [(True, 2.0, 3000), (False, 2.0, 1000), (False, 9.5, 1050), (False, 30.0, 3000)],
)
def test_log_mel_frames(pad_to_window: bool, seconds: float, frames: int) -> None:
    audio = np.zeros(int(seconds * PIPELINE_RATE), dtype=np.float32)
    features = LogMelSpectrogram(80, pad_to_window=pad_to_window)(audio)
    assert features.shape == (80, frames)
    assert features.dtype == np.float32


def test_cpu_device_uses_the_cpu_provider() -> None:
    choice = resolve_device("cpu")
    assert choice.onnx_providers == [CPU_PROVIDER]
    assert choice.ct2_device == ("cpu", 0)
    assert choice.ct2_compute_type() == "int8"


AMD_EPYC_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2\n"
XEON_VNNI = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx avx2 avx512f avx512bw avx512_vnni\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\nCPU implementer\t: 0x41\n"


def test_the_llm_runs_in_float32_where_int8_is_slow_and_whisper_stays_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not multiplies_int8_fast(AMD_EPYC_AVX2)
    assert multiplies_int8_fast(XEON_VNNI)
    assert multiplies_int8_fast(ARM)
    for fast, llm in ((False, "float32"), (True, "int8")):
        monkeypatch.setattr(device, "multiplies_int8_fast", lambda fast=fast: fast)
        assert ct2_compute_type("cpu", quantized=True) == llm
        assert ct2_compute_type("cpu") == "int8"
        assert resolve_device("cpu").ct2_compute_type(quantized=True) == llm


def test_one_reader_gives_the_cpus_name_and_flags() -> None:
    assert cpuinfo_field("vendor_id", AMD_EPYC_AVX2) == "AuthenticAMD"
    assert cpu_flags(XEON_VNNI) == {"fpu", "avx", "avx2", "avx512f", "avx512bw", "avx512_vnni"}
    assert cpu_flags(ARM) is None and cpuinfo_field("model name", ARM) is None
    assert cpu_name() and cpu_name() != "unknown"


def test_auto_device_always_ends_with_the_cpu_provider() -> None:
    assert resolve_device("auto").onnx_providers[-1] == CPU_PROVIDER


def test_unknown_device_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")


# --- the whole default stack ---------------------------------------------------------


def test_default_stack_loads_every_engine_and_describes_them(prepared: PreparedModels) -> None:
    stack = load_default_stack(
        vad_model=prepared.vad,
        whisper_dir=prepared.whisper,
        llm_dir=prepared.llm,
        voices=prepared.voices,
        device="cpu",
    )
    assert stack.name == "default"
    assert stack.tts.voices == list(prepared.voices)
    text = "\n".join(stack.description)
    for path in (prepared.vad, prepared.whisper, prepared.llm, *prepared.voices.values()):
        assert str(path) in text
    assert CPU_PROVIDER in text
    # Where int8 is slow (and read differently in pieces), the LLM runs in float32 and keeps its state.
    llm = next(line for line in stack.description if line.startswith("LLM"))
    assert ("CTranslate2 float32" in llm) == (not multiplies_int8_fast()), llm
    assert ("kept model state checked" in llm) or multiplies_int8_fast(), llm
    # The VAD on the CPU scores its batches in numpy.
    assert "batched in numpy" in next(line for line in stack.description if line.startswith("VAD"))

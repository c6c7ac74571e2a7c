"""The default stack: Silero VAD, Whisper STT, a CTranslate2 chat LLM (or a remote one), Piper TTS."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from s2s_rt.engines.base import LLM, Stack
from s2s_rt.engines.device import resolve_device
from s2s_rt.engines.piper import PiperTTS, voice_languages
from s2s_rt.engines.rnnoise import LazyRNNoise
from s2s_rt.engines.silero import SileroVAD
from s2s_rt.engines.whisper import WhisperSTT
from s2s_rt.inference import call_lowered

_Engine = TypeVar("_Engine")


def load_default_stack(
    *,
    vad_model: Path,
    whisper_dir: Path,
    llm_dir: Path | None = None,
    voices: Mapping[str, Path],
    llm: LLM | None = None,
    device: str = "auto",
    stt_threads: int = 1,
    llm_threads: int = 1,
    tts_threads: int = 2,
    vad_threads: int = 1,
    languages: Sequence[str] = (),
    llm_temperature_scale: float = 1.0,
    llm_prefix_cache_tokens: int = 0,
    llm_prefix_session_tokens: int = 2048,
    llm_choose_functions: bool = True,
    engine_nice: int = 0,
) -> Stack:
    """Load each of the four engines once, for every slot of the process.

    Args:
        vad_model: ``silero_vad.onnx``.
        whisper_dir: a CTranslate2 Whisper conversion.
        llm_dir: a CTranslate2 decoder LLM with its tokenizer, loaded
            unless ``llm`` is given.
        voices: Piper voice name -> ``.onnx`` path; the first is the default.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (see
            :func:`s2s_rt.engines.device.resolve_device`).
        stt_threads: threads one transcription may use.
        llm_threads: threads one LLM generation may use.
        tts_threads: threads one sentence's synthesis may use.
        vad_threads: threads one VAD batch may use.
        languages: the languages the server hears (ISO 639-1 codes): speech
            without a session language is transcribed as the most likely
            of these. Empty: the languages of the voices, since the server
            can answer only in those.
        llm_temperature_scale: multiplies every answer's temperature for
            the local LLM (see :class:`~s2s_rt.engines.llm.CT2ChatLLM`).
        llm_prefix_cache_tokens, llm_prefix_session_tokens: the local LLM's
            conversation state kept between answers (see
            :meth:`~s2s_rt.engines.llm.CT2ChatLLM.prime`).
        engine_nice: the STT, LLM and TTS are loaded on a thread this much
            nicer, so the threads they compute on are too (see
            :func:`s2s_rt.inference.lower_this_thread`); the VAD is not.
        llm_choose_functions: the local LLM chooses the function a request
            needs by likelihood (:mod:`~s2s_rt.engines.function_choice`);
            off only to measure it.
        llm: an LLM engine made elsewhere (a remote endpoint's) instead of
            loading ``llm_dir``; the caller describes it.

    Returns:
        The stack, whose ``description`` names each model, its device or
        providers, and how long it took to load.

    Raises:
        RuntimeError: CUDA was requested explicitly and does not work.
        ValueError: an unknown device, or an unusable voice config, or
            neither ``llm_dir`` nor ``llm``.
        FileNotFoundError: a model file is missing.
        s2s_rt.models.ModelError: the LLM directory is unusable.
    """
    choice = resolve_device(device)
    kind, index = choice.ct2_device
    providers = choice.onnx_providers
    description = [choice.describe()]

    load_seconds: dict[str, float] = {}

    def timed(what: str, load: Callable[[], _Engine]) -> _Engine:
        start = time.perf_counter()
        engine = load() if what == "VAD" else call_lowered(load, engine_nice)
        load_seconds[what] = time.perf_counter() - start
        return engine

    served = list(languages) or voice_languages(voices)
    vad = timed("VAD", lambda: SileroVAD(vad_model, providers=providers, intra_threads=vad_threads))
    stt = timed(
        "STT",
        lambda: WhisperSTT(
            whisper_dir,
            device=kind,
            device_index=index,
            compute_type=choice.ct2_compute_type(),
            intra_threads=stt_threads,
            languages=served,
        ),
    )
    llm_lines = []
    if llm is None:
        if llm_dir is None:
            raise ValueError("load_default_stack needs llm_dir or llm")
        # Imported here: the LLM engine is the heaviest module and the only one
        # the other engines do not need.
        from s2s_rt.engines.llm import CT2ChatLLM

        directory = llm_dir
        # CT2ChatLLM takes no device index: on cuda:N with N > 0 it would run on
        # device 0, so CUDA_VISIBLE_DEVICES is the way to pick another GPU for it.
        local = timed(
            "LLM",
            lambda: CT2ChatLLM(
                directory,
                device=kind,
                compute_type=choice.ct2_compute_type(quantized=True),
                intra_threads=llm_threads,
                temperature_scale=llm_temperature_scale,
                cached_system_prompts=_default_instructions(),
                prefix_cache_tokens=llm_prefix_cache_tokens,
                prefix_session_tokens=llm_prefix_session_tokens,
                choose_functions=llm_choose_functions,
            ),
        )
        llm_lines.append(f"{local.describe()}; loaded in {load_seconds['LLM']:.2f} s")
        llm = local
    tts = timed("TTS", lambda: PiperTTS(voices, providers=providers, intra_threads=tts_threads))
    description += [
        f"{vad.describe()}; loaded in {load_seconds['VAD']:.2f} s",
        f"{stt.describe()}; loaded in {load_seconds['STT']:.2f} s",
        *llm_lines,
        *tts.describe(),
        f"TTS: {len(tts.voices)} voice(s) loaded in {load_seconds['TTS']:.2f} s",
    ]
    noise = LazyRNNoise()
    description.append(noise.describe())
    return Stack(name="default", vad=vad, stt=stt, llm=llm, tts=tts, description=description, noise=noise)


def _default_instructions() -> tuple[str, ...]:
    """The instructions of sessions whose client gives none: the LLM keeps its state after them."""
    from s2s_rt.spoken_answer import ANSWER_EXAMPLES, DEFAULT_INSTRUCTIONS

    return (DEFAULT_INSTRUCTIONS, f"{DEFAULT_INSTRUCTIONS}\n\n{ANSWER_EXAMPLES}")

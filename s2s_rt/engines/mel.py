"""Whisper's log-mel spectrogram front end, in numpy."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from s2s_rt.engines.base import PIPELINE_RATE, Float32Array


def mel_filter_bank(sample_rate: int, n_fft: int, n_mels: int) -> Float32Array:
    """Slaney-style triangular mel filters, as Whisper's (librosa's) ``mel``.

    Args:
        sample_rate: audio rate in Hz.
        n_fft: FFT size; the filters cover its ``n_fft // 2 + 1`` bins.
        n_mels: number of filters.

    Returns:
        shape ``(n_mels, n_fft // 2 + 1)``: area-normalised filters from 0 Hz
        to the Nyquist frequency.
    """
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sample_rate)
    # Slaney's mel scale: linear to 1 kHz, logarithmic above.
    f_sp = 200.0 / 3
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    log_step = np.log(6.4) / 27.0

    def hz_to_mel(hz: float) -> float:
        if hz < min_log_hz:
            return hz / f_sp
        return float(min_log_mel + np.log(hz / min_log_hz) / log_step)

    mels = np.linspace(0.0, hz_to_mel(sample_rate / 2), n_mels + 2)
    freqs = f_sp * mels
    log_region = mels >= min_log_mel
    freqs[log_region] = min_log_hz * np.exp(log_step * (mels[log_region] - min_log_mel))

    widths = np.diff(freqs)
    ramps = np.subtract.outer(freqs, fft_freqs)
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    # Slaney normalisation: each filter has the same area.
    weights *= (2.0 / (freqs[2 : n_mels + 2] - freqs[:n_mels]))[:, None]
    filters: Float32Array = weights.astype(np.float32)
    return filters


class LogMelSpectrogram:
    """Audio at 16 kHz -> Whisper's normalised log-mel features.

    A centred STFT (Hann window, reflect padding) of power spectra, mel
    filters, ``log10`` clamped at 1e-10, a floor 8 below the maximum, and
    Whisper's ``(x + 4) / 4`` scaling.

    Args:
        n_mels: mel bins (80 for Whisper up to large-v2, 128 for large-v3).
        pad_to_window: zero-pad the features to a full 30 s window (3000
            frames), as Whisper was trained. When False, the features cover
            the audio plus a margin of zero frames (``margin_frames``, and at
            least ``min_frames`` in all): the encoder's cost grows with the
            frames, so a short utterance encodes several times faster. The
            margin matters: without it Whisper drops or repeats the last words
            of clips that end right after speech, and with windows under
            about 8 s it sometimes says a short sentence twice.
        margin_frames: zero frames after the audio when not padding to the window.
        min_frames: the fewest frames returned when not padding to the window.
        sample_rate: audio rate in Hz.
        n_fft: STFT size (400 = 25 ms).
        hop_length: STFT hop (160 = 10 ms per frame).
        window_seconds: length of Whisper's input window.
    """

    def __init__(
        self,
        n_mels: int = 80,
        *,
        pad_to_window: bool = False,
        margin_frames: int = 100,
        min_frames: int = 1000,
        sample_rate: int = PIPELINE_RATE,
        n_fft: int = 400,
        hop_length: int = 160,
        window_seconds: int = 30,
    ) -> None:
        self.n_mels = n_mels
        self.pad_to_window = pad_to_window
        self.margin_frames = margin_frames
        self.min_frames = min_frames
        self.sample_rate = sample_rate
        self.n_fft = n_fft
        self.hop_length = hop_length
        #: Samples and frames of one full Whisper window.
        self.window_samples = window_seconds * sample_rate
        self.window_frames = self.window_samples // hop_length
        self.filters = mel_filter_bank(sample_rate, n_fft, n_mels)
        # Periodic Hann window, as torch.hann_window.
        self._hann = np.hanning(n_fft + 1)[:-1].astype(np.float32)

    def __call__(self, audio: Float32Array) -> Float32Array:
        """Compute the features of at most one window of audio.

        Args:
            audio: float32 mono samples at ``sample_rate``, at most
                ``window_samples`` long.

        Returns:
            shape ``(n_mels, frames)``, float32: ``window_frames`` frames when
            ``pad_to_window``, else one frame per hop of audio plus the
            margin, an even count (the encoder halves the frame rate) of at
            most ``window_frames``.

        Raises:
            ValueError: the audio is longer than one window.
        """
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        if len(audio) > self.window_samples:
            raise ValueError(f"at most {self.window_samples} samples per window, got {len(audio)}")
        content_frames = max(1, len(audio) // self.hop_length)
        log_mel = self._log_mel(audio)[:, :content_frames]
        if self.pad_to_window:
            frames = self.window_frames
        else:
            frames = max(content_frames + self.margin_frames, self.min_frames)
            frames = min(frames + frames % 2, self.window_frames)
        # Whisper pads the features, not the audio, with zeros past the content.
        return np.pad(log_mel, ((0, 0), (0, frames - log_mel.shape[1])))

    def _log_mel(self, audio: Float32Array) -> Float32Array:
        half = self.n_fft // 2
        # Reflect padding needs more samples than half a window; Whisper pads
        # short clips with zeros first, which is the same as silence after them.
        if len(audio) <= half:
            audio = np.pad(audio, (0, half + 1 - len(audio)))
        padded = np.pad(audio, (half, half), mode="reflect")
        frames = np.lib.stride_tricks.sliding_window_view(padded, self.n_fft)[:: self.hop_length]
        spectrum = np.fft.rfft(frames * self._hann, axis=-1)
        # Whisper drops the STFT's last frame.
        power: npt.NDArray[np.float32] = (np.abs(spectrum[:-1]) ** 2).astype(np.float32)
        mel = self.filters @ power.T
        log_mel = np.log10(np.maximum(mel, 1e-10))
        log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
        normalized: Float32Array = ((log_mel + 4.0) / 4.0).astype(np.float32)
        return normalized

"""Audio formats on the wire and conversion to and from the pipeline's rate.

The wire carries base64 of PCM16 little-endian mono (16, 24 or 48 kHz) or
G.711 μ-law / A-law at 8 kHz. Inside, the pipeline works on float32 in
[-1, 1]. Everything here is vectorised numpy: no per-sample Python loops.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

import numpy as np
import numpy.typing as npt

Float32Array = npt.NDArray[np.float32]

PCM_RATES = (16_000, 24_000, 48_000)
G711_RATE = 8_000

# Beta names of formats, as sent in `input_audio_format` / `output_audio_format`.
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
GA_TO_BETA = {v: k for k, v in BETA_FORMATS.items()}


class AudioFormatError(ValueError):
    """A format name or rate the server does not speak."""


@dataclass(frozen=True, slots=True)
class AudioFormat:
    """One wire format: ``audio/pcm`` at a rate, or ``audio/pcmu|pcma`` at 8 kHz."""

    type: str = "audio/pcm"
    rate: int = 24_000

    @classmethod
    def parse(cls, type_: str, rate: int | None = None) -> AudioFormat:
        """Build a format from a GA type or a beta name, validating the rate.

        Raises:
            AudioFormatError: unknown type, or a rate the type does not allow.
        """
        type_ = BETA_FORMATS.get(type_, type_)
        if type_ == "audio/pcm":
            rate = 24_000 if rate is None else rate
            if rate not in PCM_RATES:
                raise AudioFormatError(
                    f"audio/pcm rate {rate} is not supported; use one of {', '.join(map(str, PCM_RATES))}"
                )
            return cls("audio/pcm", rate)
        if type_ in ("audio/pcmu", "audio/pcma"):
            if rate not in (None, G711_RATE):
                raise AudioFormatError(f"{type_} is 8000 Hz only, not {rate}")
            return cls(type_, G711_RATE)
        raise AudioFormatError(
            f"unsupported audio format {type_!r}; use audio/pcm, audio/pcmu or audio/pcma"
            " (beta: pcm16, g711_ulaw, g711_alaw)"
        )

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.type == "audio/pcm" else 1

    @property
    def beta_name(self) -> str:
        return GA_TO_BETA[self.type]

    def decode(self, data: bytes | memoryview) -> Float32Array:
        """Wire bytes → float32 samples at ``self.rate``.

        Raises:
            AudioFormatError: PCM16 data with an odd number of bytes.
        """
        if self.type == "audio/pcm":
            if len(data) % 2:
                raise AudioFormatError(f"PCM16 audio must have an even number of bytes, got {len(data)}")
            return pcm16_to_float(data)
        codes = np.frombuffer(data, dtype=np.uint8)
        table = _ULAW_DECODE if self.type == "audio/pcmu" else _ALAW_DECODE
        return table[codes]

    def encode(self, samples: Float32Array) -> bytes:
        """float32 samples at ``self.rate`` → wire bytes."""
        if self.type == "audio/pcm":
            return float_to_pcm16(samples)
        pcm = _float_to_int16(samples)
        if self.type == "audio/pcmu":
            return _ulaw_encode(pcm).tobytes()
        return _alaw_encode(pcm).tobytes()


def pcm16_to_float(data: bytes | memoryview) -> Float32Array:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def _float_to_int16(samples: Float32Array) -> npt.NDArray[np.int16]:
    return np.clip(np.round(samples * 32767.0), -32768, 32767).astype(np.int16)


def float_to_pcm16(samples: Float32Array) -> bytes:
    return _float_to_int16(samples).astype("<i2").tobytes()


# --- G.711 (ITU-T G.711), vectorised -------------------------------------

_BIAS = 0x84
_CLIP = 32635


def _ulaw_encode(pcm: npt.NDArray[np.int16]) -> npt.NDArray[np.uint8]:
    x = pcm.astype(np.int32)
    sign = np.where(x < 0, 0x80, 0)
    mag = np.minimum(np.abs(x), _CLIP) + _BIAS
    exponent = np.floor(np.log2(mag)).astype(np.int32) - 7
    exponent = np.clip(exponent, 0, 7)
    mantissa = (mag >> (exponent + 3)) & 0x0F
    code: npt.NDArray[np.uint8] = (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)
    return code


def _ulaw_decode_table() -> Float32Array:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    mag = (((mantissa << 3) + _BIAS) << exponent) - _BIAS
    return (np.where(sign, -mag, mag) / 32768.0).astype(np.float32)


def _alaw_encode(pcm: npt.NDArray[np.int16]) -> npt.NDArray[np.uint8]:
    x = pcm.astype(np.int32) >> 3  # A-law works on 13-bit magnitudes
    sign = np.where(x >= 0, 0x80, 0)
    mag = np.where(x >= 0, x, -x - 1)
    mag = np.minimum(mag, 0xFFF)
    exponent = np.where(mag >= 32, np.floor(np.log2(np.maximum(mag, 1))).astype(np.int32) - 4, 0)
    exponent = np.clip(exponent, 0, 7)
    mantissa = np.where(exponent == 0, mag >> 1, mag >> exponent) & 0x0F
    code: npt.NDArray[np.uint8] = ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8)
    return code


def _alaw_decode_table() -> Float32Array:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    sign = a & 0x80
    exponent = (a >> 4) & 0x07
    mantissa = a & 0x0F
    mag = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return (np.where(sign, mag, -mag) / 32768.0).astype(np.float32)


_ULAW_DECODE = _ulaw_decode_table()
_ALAW_DECODE = _alaw_decode_table()


# --- Streaming resampling -------------------------------------------------


@functools.lru_cache(maxsize=32)
def _filter_bank(up: int, down: int, taps_per_phase: int) -> Float32Array:
    """The polyphase windowed-sinc bank for one rate ratio, built once per process."""
    # Cut-off at the lower Nyquist so downsampling does not alias.
    cutoff = min(1.0, up / down)
    n_taps = taps_per_phase * up
    t = (np.arange(n_taps) - (n_taps - 1) / 2) / up
    proto = cutoff * np.sinc(cutoff * t) * np.kaiser(n_taps, 8.0)
    # Phase p uses taps p, p+up, p+2up, … (reversed for the dot product).
    bank = proto.reshape(taps_per_phase, up).T[:, ::-1]
    # Unit DC gain for every phase keeps a tone's level exact.
    bank = bank / bank.sum(axis=1, keepdims=True)
    out: Float32Array = bank.astype(np.float32)
    out.flags.writeable = False
    return out


#: Longest piece of input resampled in one step (one second at 48 kHz).
BLOCK_SAMPLES = 48_000
#: Most bytes of gather plans one resampler keeps.
PLAN_CACHE_BYTES = 4 * 1024 * 1024
#: Most input samples one batched resampling product gathers at once (16 MB of float32).
GATHER_FLOATS = 4 * 1024 * 1024


class Resampler:
    """Streaming rational-rate resampler (windowed-sinc polyphase FIR).

    Feed chunks of any size; the output is what a one-shot conversion of the
    concatenated input would give, with the filter's delay. Keeps its own
    history between calls, so one instance serves one direction of one
    session.
    """

    def __init__(self, src_rate: int, dst_rate: int, *, taps_per_phase: int = 16) -> None:
        g = gcd(src_rate, dst_rate)
        self.up = dst_rate // g
        self.down = src_rate // g
        self.src_rate = src_rate
        self.dst_rate = dst_rate
        self._taps = taps_per_phase
        self._history = np.zeros(taps_per_phase - 1 if self.up != self.down else 0, dtype=np.float32)
        self._next = 0  # output index, in units of 1/up input samples
        self._consumed = 0  # input samples consumed before _history
        # Gather indices and filters per (chunk length, phase of the input
        # clock): a session's chunks repeat a few shapes, so each call is one
        # gather and one dot product. Bounded in bytes, not entries.
        self._plans: dict[tuple[int, int], tuple[npt.NDArray[np.intp], Float32Array]] = {}
        self._plan_bytes = 0

    def process(self, samples: Float32Array) -> Float32Array:
        """Resample the next chunk; returns what can be produced so far.

        A long chunk is worked through in blocks of at most :data:`BLOCK_SAMPLES`
        input samples, so memory for one call stays bounded whatever its length.
        """
        samples = np.asarray(samples, dtype=np.float32)
        if self.up == self.down:
            return samples
        if len(samples) <= BLOCK_SAMPLES:
            return self._process(samples)
        pieces = [self._process(samples[i : i + BLOCK_SAMPLES]) for i in range(0, len(samples), BLOCK_SAMPLES)]
        return np.concatenate(pieces)

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the cached gather plans."""
        return self._plan_bytes

    def _process(self, samples: Float32Array) -> Float32Array:
        buf = np.concatenate([self._history, samples])
        window, filters = self._plan_for(len(samples))
        self._next += len(window)
        self._roll(buf)
        if not len(window):
            return np.zeros(0, dtype=np.float32)
        out: Float32Array = np.einsum("ij,ij->i", buf[window], filters)
        return out

    def _plan_for(self, n: int) -> tuple[npt.NDArray[np.intp], Float32Array]:
        """The gather plan of the next ``n``-sample chunk, from the cache or made now."""
        key = (n, self._consumed % self.down)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(n)
            size = plan[0].nbytes + plan[1].nbytes
            if self._plan_bytes + size > PLAN_CACHE_BYTES:
                self._plans.clear()
                self._plan_bytes = 0
            if size <= PLAN_CACHE_BYTES:
                self._plans[key] = plan
                self._plan_bytes += size
        return plan

    @staticmethod
    def process_block(resamplers: Sequence[Resampler], block: Float32Array) -> list[Float32Array]:
        """Row ``i`` of ``block`` through ``resamplers[i]``, as :meth:`process` would; rows of one phase at once.

        Many sessions' 20 ms appends have the same length and, resampled at
        the same rates, one of a few phases of the input clock: their
        outputs come from the same gather plan, so one gather and one product
        serve each phase instead of one call per session.

        Args:
            resamplers: one per row.
            block: shape ``(len(resamplers), n)``: every row the same length.
        """
        block = np.asarray(block, dtype=np.float32)
        n = block.shape[1]
        out: list[Float32Array] = [block[0, :0]] * len(resamplers)
        phases: dict[tuple[int, int, int, int], list[int]] = {}
        for row, r in enumerate(resamplers):
            if r.up == r.down or not 0 < n <= BLOCK_SAMPLES:
                out[row] = r.process(block[row])
            else:
                phases.setdefault((r.up, r.down, r._taps, r._consumed % r.down), []).append(row)
        for group in phases.values():
            first = resamplers[group[0]]
            window, filters = first._plan_for(n)
            # The gather copies taps inputs per output: bound it (a session catching up brings seconds).
            rows = max(1, GATHER_FLOATS // max(1, window.size))
            for start in range(0, len(group), rows):
                members = group[start : start + rows]
                Resampler._block_phase(resamplers, block, members, window, filters, out)
        return out

    @staticmethod
    def _block_phase(
        resamplers: Sequence[Resampler],
        block: Float32Array,
        members: list[int],
        window: npt.NDArray[np.intp],
        filters: Float32Array,
        out: list[Float32Array],
    ) -> None:
        """:meth:`process_block` for rows of one phase: one gather, one product."""
        n = block.shape[1]
        bufs = np.concatenate([np.stack([resamplers[i]._history for i in members]), block[members]], axis=1)
        # The last taps-1 inputs of each row: rows of one array, replaced (never written) by the next call.
        history = bufs[:, n:]
        produced = np.einsum("bij,ij->bi", bufs[:, window], filters) if len(window) else bufs[:, :0]
        for row, i in enumerate(members):
            r = resamplers[i]
            r._next += len(window)
            r._consumed += n
            r._history = history[row]
            out[i] = produced[row]

    def _plan(self, n: int) -> tuple[npt.NDArray[np.intp], Float32Array]:
        """Which inputs and which filter phase make each output of an ``n``-sample chunk.

        Output k sits at input position k*down/up; it needs inputs up to
        floor(pos) and the taps-1 before it. Every k whose newest input has
        arrived is produced: floor(k*down/up) <= last, i.e. k < (last+1)*up/down.
        The result depends only on ``n`` and the input clock modulo ``down``.
        """
        taps = self._taps
        start = self._next
        base = self._consumed - (taps - 1)  # absolute index of buf[0]
        end = -((-(self._consumed + n) * self.up) // self.down)
        k = np.arange(start, max(start, end))
        pos = k * self.down
        idx = pos // self.up - base  # index of the newest input in buf
        window = idx[:, None] - np.arange(taps - 1, -1, -1)[None, :]
        filters = _filter_bank(self.up, self.down, taps)[pos % self.up]
        return window, filters

    def _roll(self, buf: Float32Array) -> None:
        keep = self._taps - 1
        self._consumed += len(buf) - len(self._history)
        self._history = buf[-keep:].copy() if keep else buf[:0]

    @property
    def delay_samples(self) -> int:
        """Delay of the output, in output samples (group delay of the FIR)."""
        if self.up == self.down:
            return 0
        return round((self._taps * self.up - 1) / (2 * self.down))


def resample(samples: Float32Array, src_rate: int, dst_rate: int) -> Float32Array:
    """One-shot resampling of a whole clip (delay compensated, same length ratio)."""
    if src_rate == dst_rate:
        return np.asarray(samples, dtype=np.float32)
    r = Resampler(src_rate, dst_rate)
    pad = np.zeros(r._taps, dtype=np.float32)
    out = r.process(np.concatenate([np.asarray(samples, dtype=np.float32), pad]))
    n = round(len(samples) * dst_rate / src_rate)
    d = r.delay_samples
    return out[d : d + n]

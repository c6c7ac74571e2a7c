"""Audio formats on the wire and conversion to and from the pipeline's rate.

The wire carries base64 of PCM16 little-endian mono (16, 24 or 48 kHz) or
G.711 μ-law / A-law at 8 kHz. Inside, the pipeline works on float32 in
[-1, 1]. Everything here is vectorised numpy: no per-sample Python loops.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import gcd

import numpy as np
import numpy.typing as npt

from s2s_rt.blas import blas_on_one_thread

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
#: Most bytes of resampling plans the process keeps, for all its resamplers together (a 20 ms chunk's plan
#: is 2-9 kB).
PLAN_CACHE_BYTES = 4 * 1024 * 1024
#: Outputs of one piece of a plan: one row of a matrix product each (the band of filter taps cut into
#: pieces, so the zeros outside the band are not multiplied). 32 was the fastest of 32, 64 and 128 for 250
#: sessions' 20 ms at 24 kHz, on the Xeon.
PIECE_OUTPUTS = 32


@functools.lru_cache(maxsize=32)
def _piece_bank(up: int, down: int, taps_per_phase: int) -> Float32Array:
    """Every piece's matrix, by the phase of its first output (``(first * down) % up``): ``(up, span, 32)``.

    Row ``i`` of a piece's matrix weighs input ``lo + i``, where ``lo`` is the oldest input of its first
    output; column ``j`` makes its ``j``-th output. A piece's pattern depends on its first output's phase
    only, so a ratio has ``up`` of them, built once per process.
    """
    bank = _filter_bank(up, down, taps_per_phase)
    at = np.arange(up)[:, None] + np.arange(PIECE_OUTPUTS)[None, :] * down  # (up, 32): positions x up
    newest, phase = at // up, at % up  # newest input of each output, from the first output's
    span = int(newest.max()) + taps_per_phase
    table = np.zeros((up, span, PIECE_OUTPUTS), dtype=np.float32)
    rows = newest[:, :, None] + np.arange(taps_per_phase)[None, None, :]
    table[np.arange(up)[:, None, None], rows, np.arange(PIECE_OUTPUTS)[None, :, None]] = bank[phase]
    table.flags.writeable = False
    return table


@dataclass(frozen=True, slots=True)
class _Plan:
    """How a chunk of ``n`` input samples, at one phase of the input clock, becomes its outputs.

    Output ``k`` is the dot product of the ``taps`` inputs up to its position with the filter of its phase:
    in pieces of :data:`PIECE_OUTPUTS` outputs, each piece the ``span`` inputs from its oldest times its
    matrix of :func:`_piece_bank`. Pieces of the same matrix are one product.
    """

    #: ``(pieces, span)``: the inputs each piece reads (clamped to the chunk where no output needs them).
    index: npt.NDArray[np.intp]
    #: ``(bank row, pieces)``: which pieces use which matrix; one entry with ``None`` when all use it.
    groups: tuple[tuple[int, npt.NDArray[np.intp] | None], ...]
    table: Float32Array
    #: Outputs the chunk makes.
    outputs: int

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + sum(g.nbytes for _, g in self.groups if g is not None)

    def apply(self, inputs: Float32Array) -> Float32Array:
        """The outputs of ``inputs`` (one row, or one row per stream: the history then the chunk)."""
        lead = inputs.shape[:-1]
        span = self.index.shape[1]
        # 1.1 to 1.8 times the inputs, by the ratio (a gather per output took 16 inputs for each).
        gathered = inputs[..., self.index]  # (..., pieces, span)
        if len(self.groups) == 1 and self.groups[0][1] is None:
            out = gathered.reshape(-1, span) @ self.table[self.groups[0][0]]
        else:
            out = np.empty((*lead, len(self.index), PIECE_OUTPUTS), dtype=np.float32)
            for row, pieces in self.groups:
                product = gathered[..., pieces, :].reshape(-1, span) @ self.table[row]
                out[..., pieces, :] = product.reshape(*lead, len(pieces), PIECE_OUTPUTS)  # type: ignore[arg-type]
        produced: Float32Array = out.reshape(*lead, -1)[..., : self.outputs]
        return produced


class _Plans:
    """The resampling plans of the process, shared by every resampler (of every session and thread).

    A plan depends on the rates, the taps, the chunk's length and the phase of the input clock only, and a
    session's chunks repeat a few shapes: every session at the same rates uses the same few plans. Bounded
    in bytes for the whole process (emptied when full); a resampler keeps its latest plan, so odd lengths from
    one client that empty the cache do not make a steady session's plan be made again.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._lock = threading.Lock()
        #: Bytes the plans hold now.
        self.bytes = 0

    def get(self, key: tuple[int, ...], make: Callable[[], _Plan]) -> _Plan:
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        plan = make()
        if plan.nbytes <= self.limit:
            with self._lock:
                if self.bytes + plan.nbytes > self.limit:
                    self._plans.clear()
                    self.bytes = 0
                if key not in self._plans:
                    self._plans[key] = plan
                    self.bytes += plan.nbytes
        return plan


#: Every resampler's plans.
PLANS = _Plans(PLAN_CACHE_BYTES)


class Resampler:
    """Streaming rational-rate resampler (windowed-sinc polyphase FIR).

    Feed chunks of any size; the output is what a one-shot conversion of the
    concatenated input would give, with the filter's delay. Keeps its own
    history between calls, so one instance serves one direction of one
    session; its plans are the process's (:data:`PLANS`).
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
        self._last: tuple[tuple[int, ...], _Plan] | None = None  # the latest plan, and its key

    def process(self, samples: Float32Array) -> Float32Array:
        """Resample the next chunk; returns what can be produced so far.

        A long chunk is worked through in blocks of at most :data:`BLOCK_SAMPLES`
        input samples, so memory for one call stays bounded whatever its length.
        """
        samples = np.asarray(samples, dtype=np.float32)
        if self.up == self.down:
            return samples
        blas_on_one_thread()  # a second's chunk is a product big enough for OpenBLAS to wake its threads
        if len(samples) <= BLOCK_SAMPLES:
            return self._process(samples)
        pieces = [self._process(samples[i : i + BLOCK_SAMPLES]) for i in range(0, len(samples), BLOCK_SAMPLES)]
        return np.concatenate(pieces)

    def _process(self, samples: Float32Array) -> Float32Array:
        buf = np.concatenate([self._history, samples])
        plan = self._plan_for(len(samples))
        self._next += plan.outputs
        self._roll(buf)
        return plan.apply(buf)

    def _plan_for(self, n: int) -> _Plan:
        """The plan of the next ``n``-sample chunk: the latest one, the process's, or made now."""
        key = (self.up, self.down, self._taps, n, self._consumed % self.down)
        last = self._last
        if last is not None and last[0] == key:
            return last[1]
        plan = PLANS.get(key, lambda: self._plan(n))
        if plan.nbytes <= PLANS.limit:
            self._last = (key, plan)
        return plan

    @staticmethod
    def process_block(resamplers: Sequence[Resampler], block: Float32Array) -> list[Float32Array]:
        """Row ``i`` of ``block`` through ``resamplers[i]``, as :meth:`process` would; rows of one phase at once.

        Many sessions' 20 ms appends have the same length and, resampled at
        the same rates, one of a few phases of the input clock: their
        outputs come from the same plan, so one product per piece of it
        serves every session of a phase instead of one call per session.

        Args:
            resamplers: one per row.
            block: shape ``(len(resamplers), n)``: every row the same length.
        """
        blas_on_one_thread()
        block = np.asarray(block, dtype=np.float32)
        n = block.shape[1]
        out: list[Float32Array] = [block[0, :0]] * len(resamplers)
        phases: dict[tuple[int, int, int, int], list[int]] = {}
        for row, r in enumerate(resamplers):
            if r.up == r.down or not 0 < n <= BLOCK_SAMPLES:
                out[row] = r.process(block[row])
            else:
                phases.setdefault((r.up, r.down, r._taps, r._consumed % r.down), []).append(row)
        for members in phases.values():
            plan = resamplers[members[0]]._plan_for(n)
            bufs = np.concatenate([np.stack([resamplers[i]._history for i in members]), block[members]], axis=1)
            # The last taps-1 inputs of each row: rows of one array, replaced (never written) by the next call.
            history = bufs[:, n:]
            produced = plan.apply(bufs)
            for row, i in enumerate(members):
                r = resamplers[i]
                r._next += plan.outputs
                r._consumed += n
                r._history = history[row]
                out[i] = produced[row]
        return out

    def _plan(self, n: int) -> _Plan:
        """Which inputs and which filter phase make each output of an ``n``-sample chunk.

        Output k sits at input position k*down/up; it needs inputs up to
        floor(pos) and the taps-1 before it. Every k whose newest input has
        arrived is produced: floor(k*down/up) <= last, i.e. k < (last+1)*up/down.
        The result depends only on ``n`` and the input clock modulo ``down``.
        """
        taps = self._taps
        table = _piece_bank(self.up, self.down, taps)
        start = self._next
        base = self._consumed - (taps - 1)  # absolute index of buf[0]
        end = -((-(self._consumed + n) * self.up) // self.down)
        first = np.arange(start, max(start, end), PIECE_OUTPUTS) * self.down  # each piece's first output, x up
        lo = first // self.up - base - (taps - 1)  # its oldest input in buf
        index = np.minimum(lo[:, None] + np.arange(table.shape[1])[None, :], taps - 2 + n)
        rows = first % self.up
        kinds = np.unique(rows)
        if len(kinds) == 1:
            groups: tuple[tuple[int, npt.NDArray[np.intp] | None], ...] = ((int(kinds[0]), None),)
        else:
            groups = tuple((int(k), np.flatnonzero(rows == k)) for k in kinds)
        return _Plan(index, groups, table, max(0, end - start))

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

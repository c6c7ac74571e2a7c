"""A WebRTC call's audio both ways: the answers' track (:class:`Playback`) and the caller's voice (:class:`Hearing`).

aiortc carries the media (ICE, DTLS, SRTP, RTP and RTCP); what it would
also do per 20 ms frame for features the server does not use is done here
more cheaply, because a silent call is what a server of many calls holds
most of the time:

- **Out:** the track encodes its own 24 kHz mono Opus at 32 kb/s and hands
  aiortc finished packets, where aiortc would upmix each frame to stereo,
  resample it to 48 kHz, measure its level for a header extension and encode
  it at 96 kb/s on a thread of the loop's executor. While it has nothing to
  play it sends nothing (as after Opus DTX: RTP time runs on, and receivers
  play nothing between two talkspurts); what it plays goes a few frames
  ahead of real time, so that the receiver's jitter buffer does not wait.
- **In:** each packet is released by the receiver's jitter buffer as it
  comes (:class:`InOrder`), decoded on the loop, straight to mono, and heard
  at the pipeline's 16 kHz (:class:`ToHeard`), where aiortc would hold it for
  the next, pass it to a thread of its own and each decoded frame back to
  the loop and a task. A caller's silence, the same packet again and again,
  is heard without decoding or resampling (:class:`OpusHeard`).
  The answer asks the caller for Opus DTX (``usedtx=1``): a browser then
  sends one packet in 400 ms while its user is silent, not 50 a second, and
  the gaps are heard as silence on the server's clock (:class:`Hearing`), so
  that the end of a question is heard on time.

(Past aiortc's public API: :mod:`~s2s_rt.server.internals`.)
"""

from __future__ import annotations

import asyncio
import fractions
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import av
import numpy as np
import numpy.typing as npt
from aiortc.codecs import get_decoder
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame, CodecContext, Packet

from s2s_rt.audio import AudioFormat, Resampler, float_to_pcm16
from s2s_rt.engines.base import PIPELINE_RATE
from s2s_rt.server import internals
from s2s_rt.server.playout import HEARD_DELAY_MS, Pacer, Playout

log = logging.getLogger(__name__)

#: What the outgoing track plays: 24 kHz mono PCM16 in 20 ms frames, as Opus encodes it.
PLAY_RATE = 24_000
FRAME_SAMPLES = PLAY_RATE // 50
FRAME_S = 0.02
PLAY_TIME_BASE = fractions.Fraction(1, PLAY_RATE)
#: Opus's RTP clock runs at 48 kHz whatever the audio's rate: 960 ticks a 20 ms frame.
OPUS_TIME_BASE = fractions.Fraction(1, 48_000)
OPUS_FRAME = 960
#: Speech in mono (a browser's own Opus sends 32 kb/s; aiortc's encoder 96 kb/s in stereo).
OPUS_BITRATE = 32_000
#: What a caller is heard as: mono PCM16 at the pipeline's rate, which the listening clock takes without
#: resampling. libopus through FFmpeg decodes at 48 kHz only: :class:`ToHeard` resamples it, once a packet,
#: and a caller's silence, once (:class:`OpusHeard`).
HEARD_FORMAT = AudioFormat("audio/pcm", PIPELINE_RATE)
#: A packet this many sequence numbers or fewer before the newest is late (or a copy): dropped. Further back,
#: the caller's stream began again (aiortc's own bound for misordered packets).
MAX_MISORDER = 100
#: A caller's packets stopped this long ago: the time since is heard as silence (DTX, or packets lost), up to
#: :data:`GAP_MARGIN_S` ago (a packet late by that much is still heard as it came), and again this often
#: until they come back.
GAP_S = 0.06
GAP_MARGIN_S = 0.02
#: This many packets in a row within what was heard as silence, each going on from the one before: the caller
#: is streaming, its time behind the silence heard, which waits for it (see :meth:`Hearing.put`).
BEHIND_PACKETS = 3
#: A jump in the caller's RTP time longer than this is not heard as silence (a new source, or a clock's
#: jump): the time it spans has been heard on the server's clock already, as far as it passed.
MAX_GAP_S = 1.0
#: Opus DTX as a microphone sends it (libopus, a browser asked ``usedtx=1``): after this many frames of
#: silence, one frame in :data:`DTX_EVERY`.
DTX_AFTER = 10
DTX_EVERY = 20


class Playback(Playout, MediaStreamTrack):
    """A call's outgoing track: what the session's answers say (:class:`~s2s_rt.server.playout.Playout`), as
    Opus packets that aiortc only wraps in RTP, paced by a :class:`~s2s_rt.server.playout.Pacer`.

    While nothing is queued it sends nothing (``send_silence=False``, the server's side): no frame is made,
    encoded, encrypted or sent until an answer's audio is queued, and that audio's first packets go at once,
    a few frames ahead of real time. RTP time runs on through the gaps, as after a DTX silence. A microphone
    (the load script's and the tests' callers) sends silence every 20 ms as a browser's does, and nothing
    ahead: ``send_silence=True``.
    """

    kind = "audio"

    def __init__(self, *, send_silence: bool = False, dtx: bool = False) -> None:
        MediaStreamTrack.__init__(self)
        Playout.__init__(self, PLAY_RATE, FRAME_SAMPLES, HEARD_DELAY_MS)
        self.send_silence = send_silence
        #: While silent, send as Opus DTX does (:data:`DTX_AFTER`, :data:`DTX_EVERY`): a browser's microphone
        #: when the answer asked for it (``usedtx=1``). Only with ``send_silence``.
        self.dtx = dtx
        self._silent = 0
        self._encoder = opus_encoder()
        #: What the encoder makes of a silent frame once it has made the same of two in a row (it has settled),
        #: and whether such frames went unencoded since (see :meth:`_encode`).
        self._settled: bytes | None = None
        self._last_silent: bytes | None = None
        self._owed = False
        # A microphone sends every 20 ms, in real time; the server's answers go ahead (the Pacer's defaults).
        frame_s = FRAME_SAMPLES / PLAY_RATE
        self._pacer = Pacer(frame_s, lead=0, hangover=None) if send_silence else Pacer(frame_s)

    def stop(self) -> None:
        super().stop()
        self.queued.set()  # a track waiting for audio ends now

    async def recv(self) -> Packet[Any]:
        while True:
            if self.readyState != "live":
                raise MediaStreamError
            frame = await self._pacer.next(self)
            if frame is None or self.readyState != "live":
                raise MediaStreamError
            if self.dtx:
                # Silence as libopus's DTX finds it in the signal (here: digital silence), whatever is queued.
                self._silent = 0 if frame.any() else self._silent + 1
                if self._silent > DTX_AFTER and (self._silent - DTX_AFTER) % DTX_EVERY:
                    continue  # not sent: the receiver hears the gap as silence
            packet = self._encode(frame, self._pacer.index)
            if packet is not None:
                return packet

    def _encode(self, samples: npt.NDArray[np.int16], index: int) -> Packet[Any] | None:
        """One frame as an Opus packet stamped with its RTP time (None: the encoder gave none).

        A silent frame, once the encoder has made the same packet of two in a row, is that packet again,
        not encoded: a microphone sending silence (the load script's callers: 157 µs a frame encoded, 2.5
        not) costs its machine little, and its packets while silent are the same. Before the next frame of
        sound one silent frame is encoded. The encoder adapts over longer than that, so the first frames of
        sound after a silence are encoded a little differently from encoding every frame would (in a test,
        40 dB below the sound).
        """
        silent = not samples.any()
        if silent and self._settled is not None:
            self._owed = True
            return _stamped(Packet(self._settled), index * OPUS_FRAME)
        if self._owed:
            self._owed = False
            self._encoder.encode(self._frame(np.zeros_like(samples), index - 1))
        packets = self._encoder.encode(self._frame(samples, index))
        if not packets:
            return None
        packet: Packet[Any] = packets[0]
        data = bytes(packet) if silent else None
        self._settled = data if data is not None and data == self._last_silent else None
        self._last_silent = data
        return _stamped(packet, index * OPUS_FRAME)

    @staticmethod
    def _frame(samples: npt.NDArray[np.int16], index: int) -> AudioFrame:
        frame = AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = PLAY_RATE
        frame.pts = index * FRAME_SAMPLES
        frame.time_base = PLAY_TIME_BASE
        return frame


def _stamped(packet: Packet[Any], pts: int) -> Packet[Any]:
    """``packet`` at ``pts`` on Opus's 48 kHz RTP clock."""
    packet.pts = pts
    packet.time_base = OPUS_TIME_BASE
    return packet


def opus_encoder() -> Any:
    """libopus for one call's outgoing audio: 24 kHz mono in 20 ms frames, 32 kb/s, tuned for speech."""
    codec = CodecContext.create("libopus", "w")
    codec.bit_rate = OPUS_BITRATE
    codec.format = "s16"
    codec.layout = "mono"
    codec.sample_rate = PLAY_RATE
    codec.time_base = PLAY_TIME_BASE
    codec.options = {"application": "voip"}
    return codec


class Hearing:
    """Stands in for an aiortc receiver's decoder queue: each packet put on it is decoded at once, on the loop,
    to mono PCM16 at 16 kHz (:data:`HEARD_FORMAT`), and handed to ``heard``.

    aiortc's receiver puts each encoded frame its jitter buffer releases
    (``(codec, frame)``) on a queue that a thread of its own takes from; this
    decodes it where it is put (Opus: some 50-80 µs a frame, and 15 µs to
    resample it; none for silence). aiortc's thread,
    which still starts, waits in :meth:`get` until the receiver stops
    (``put(None)``), and then ends the track as it would have.

    Nothing it is handed raises into aiortc: a packet that does not decode is
    skipped (as aiortc does), and any other failure ends the call alone.

    It owns the caller's audio timeline, kept in the caller's RTP time: when
    packets stop (Opus DTX while the caller is silent, or packets lost) the
    time that passes is heard as silence, on the loop's clock, every
    :data:`GAP_S` until they come back; a packet's jump in RTP time past what
    was heard is silence too; and a packet wholly within what was already
    heard as silence is not heard again.

    Args:
        heard: takes each decoded frame; it must not raise (the call's own handler ends the call instead).
        end: ends the call, saying why.
        call_id: the call, as the log names it.
    """

    def __init__(
        self,
        heard: Callable[[bytes], None],
        end: Callable[[str], None],
        call_id: str,
        before_gap: Callable[[], None] = lambda: None,
    ) -> None:
        self._heard = heard
        self._end = end
        self._call_id = call_id
        #: Reads what waits on the call's sockets (read on a clock: :mod:`~s2s_rt.server.call_sockets`), before
        #: a gap in its packets is heard as silence.
        self._before_gap = before_gap
        self._stopped = threading.Event()
        self._codec: str | None = None
        self._decode: Callable[[Any], bytes] = lambda encoded: b""
        #: RTP ticks a second (the codec's clock), and the RTP time heard up to (None: nothing yet).
        self._clock = 48_000
        self._heard_to: int | None = None
        #: The newest packet's end in RTP time, and when it came (``time.monotonic()``).
        self._newest = 0
        self._came = 0.0
        #: Packets in a row within what was heard as silence, each going on from the one before, and the last one's end.
        self._behind = 0
        self._behind_to = 0
        self._gap: asyncio.TimerHandle | None = None

    def put(self, task: tuple[Any, Any] | None) -> None:
        if task is None:
            self._stopped.set()
            if self._gap is not None:
                self._gap.cancel()
            return
        codec, encoded = task
        try:
            if codec.name != self._codec:
                self._decode, self._codec = decoder(codec), codec.name
                self._clock, self._heard_to = codec.clockRate or 48_000, None
            pcm = self._decode(encoded)
        except av.FFmpegError as exc:
            # A packet that does not decode is skipped, as aiortc does (the decoder keeps its state).
            _undecodable(self._call_id, codec.name, str(exc))
            return
        except Exception:
            log.exception("call %s: its audio could not be decoded; ending it", self._call_id)
            self._end("internal error while decoding its audio")
            return
        if not pcm:
            return
        start = encoded.timestamp
        end = (start + len(pcm) // 2 * self._clock // HEARD_FORMAT.rate) & 0xFFFFFFFF
        bound = MAX_GAP_S * self._clock
        now = time.monotonic()
        if self._heard_to is not None:
            ahead = _signed(start - self._heard_to)
            if 0 < ahead <= bound:
                # A jump in RTP time: DTX's gap, or packets lost; never more than the time that has passed (a
                # caller's timestamps cannot make the server hear faster than real time).
                self._silence(min(ahead, int((now - self._came + FRAME_S) * self._clock)))
            elif -bound <= _signed(end - self._heard_to) <= 0:
                # Heard already, as silence. Packets that go on from the caller's newest, one after another
                # (a packet lost between at most), say the caller is streaming, behind what was heard: it
                # paused and went on with the next RTP time. The gap's silence then waits for it, and it is
                # heard again once its time passes what was heard, not never (the silence running on ahead
                # of it on the loop's clock). One such packet is not enough: a talkspurt's last packet held
                # up on the network, or by aiortc's own jitter buffer where it could not be replaced (which
                # releases it only with the next, a DTX packet 400 ms later), is one late packet.
                follows = 0 <= _signed(start - self._behind_to) <= _signed(end - start)
                self._behind, self._behind_to = (self._behind + 1 if follows else 0), end
                if self._behind >= BEHIND_PACKETS:
                    self._newest, self._came = end, now
                return
        if self._heard_to is None or not -bound <= _signed(end - self._heard_to) <= 0:
            self._heard_to = end  # further on, or a jump past the bound either way: its time from now on
        self._newest, self._came, self._behind, self._behind_to = end, now, 0, end
        self._heard(pcm)
        if self._gap is None:
            self._gap = asyncio.get_running_loop().call_later(GAP_S, self._check_gap)

    def _silence(self, ticks: int) -> None:
        samples = ticks * HEARD_FORMAT.rate // self._clock
        if samples > 0:
            self._heard(bytes(2 * samples))

    def _check_gap(self) -> None:
        """No packet for :data:`GAP_S`: the caller's time since, up to :data:`GAP_MARGIN_S` ago, is heard as silence."""
        if not self._stopped.is_set() and self._heard_to is not None and time.monotonic() - self._came >= GAP_S:
            # A packet waiting on the call's socket is no gap: read first. What it hears comes through put(),
            # which schedules no check of its own while this one's handle is still set.
            self._before_gap()
        self._gap = None
        if self._stopped.is_set() or self._heard_to is None:
            return
        now = time.monotonic()
        if now - self._came < GAP_S:
            self._gap = asyncio.get_running_loop().call_later(self._came + GAP_S - now, self._check_gap)
            return
        target = (self._newest + int((now - self._came - GAP_MARGIN_S) * self._clock)) & 0xFFFFFFFF
        ahead = _signed(target - self._heard_to)
        if ahead > 0:
            self._heard_to = target
            self._silence(ahead)
        self._gap = asyncio.get_running_loop().call_later(GAP_S, self._check_gap)

    def get(self) -> None:
        """aiortc's decoder thread: nothing to decode there; it returns once the receiver stops."""
        self._stopped.wait()


def decoder(codec: Any) -> Callable[[Any], bytes]:
    """Decodes one of aiortc's encoded frames (``data``, ``timestamp``) of ``codec`` into what is heard: mono PCM16
    at 16 kHz (:data:`HEARD_FORMAT`).

    Opus decodes straight to mono (aiortc's own decoder gives stereo, for the call to mix down again), and a
    caller's silence is heard without decoding or resampling (:class:`OpusHeard`); any other codec a peer may
    choose (G.711, G.722) decodes as aiortc does, and is resampled as one stream (:class:`ToHeard`).
    """
    if codec.name.lower() != "opus":
        frames, heard = get_decoder(codec).decode, ToHeard()
        return lambda encoded: b"".join(heard(frame) for frame in frames(encoded) if isinstance(frame, AudioFrame))
    return OpusHeard()


class OpusHeard:
    """A caller's Opus, decoded to mono and heard at 16 kHz (:class:`ToHeard`); its silence, the same packet again
    and again, heard without decoding or resampling.

    A caller that sends silence every 20 ms (no DTX: a muted microphone, a bridge, aiortc) sends one packet
    over and over (libopus: 3 bytes a frame of digital silence; in its ``voip`` mode 32 bytes of a hiss at
    ±1), and decoding it was the largest share of the event loop's time per call (some 60 µs a packet of
    140 on the 2-core AMD EPYC, 48 calls), and resampling it the largest share of the listening thread's
    (a third of its time at 40 calls, on the 2-core Xeon). Once a packet has been heard as the same sound
    twice in a row, the decoder and the resampler have settled on it: that packet again is that sound
    again, without either. Before the next different packet it is decoded and resampled once (its sound
    already heard), so that both go on from the state they had settled in.

    Attributes:
        decoded: packets decoded; ``skipped``: packets heard without decoding.
    """

    def __init__(self) -> None:
        self._context = CodecContext.create("libopus", "r")
        self._context.format = "s16"
        self._context.layout = "mono"
        self._context.sample_rate = 48_000
        self._heard = ToHeard()
        #: The last packet decoded and its sound, and whether the one before was the same packet and sound.
        self._last: tuple[bytes, bytes] = (b"", b"")
        self._settled = False
        #: Whether that packet was heard again without decoding since.
        self._owed = False
        self.decoded = 0
        self.skipped = 0

    def __call__(self, encoded: Any) -> bytes:
        data = bytes(encoded.data)
        last, sound = self._last
        if self._settled and data == last:
            self._owed = True
            self.skipped += 1
            return sound
        if self._owed:
            self._owed = False
            self._decode(last, encoded.timestamp - OPUS_FRAME)
        pcm = self._decode(data, encoded.timestamp)
        self._settled = data == last and pcm == sound
        self._last = (data, pcm)
        return pcm

    def _decode(self, data: bytes, timestamp: int) -> bytes:
        self.decoded += 1
        return b"".join(self._heard(frame) for frame in self._context.decode(_stamped(Packet(data), timestamp)))


def _signed(ticks: int) -> int:
    """A difference of two RTP times (32 bits, wrapping) as a signed number of ticks."""
    ticks &= 0xFFFFFFFF
    return ticks - (1 << 32) if ticks >= 1 << 31 else ticks


@functools.lru_cache(maxsize=64)
def _undecodable(call_id: str, codec: str, why: str) -> None:
    log.warning("call %s: a %s packet did not decode (%s); skipped", call_id, codec, why)


def hear_on_the_loop(
    receiver: Any,
    heard: Callable[[bytes], None],
    end: Callable[[str], None],
    call_id: str,
    before_gap: Callable[[], None] = lambda: None,
) -> bool:
    """Make ``receiver`` decode on the loop and hand each frame to ``heard`` (:class:`Hearing`), before it
    starts; False where aiortc no longer allows it (its track then delivers the frames, as aiortc's own)."""
    if not internals.decoder_queue_replaceable(receiver):
        return False
    setattr(receiver, internals.DECODER_QUEUE, Hearing(heard, end, call_id, before_gap))
    return True


class InOrder(JitterBuffer):
    """A call's audio receiver's jitter buffer: each packet is released as it comes, one frame each, unless it
    is older than the newest (late, or a copy), which is dropped.

    aiortc's buffer, made for video frames of many packets, releases a frame only once a packet of the next
    has come (a talkspurt's last packet waits for the next DTX packet, 400 ms), holds ``prefetch`` frames
    (4 by default, 80 ms before each word's end is heard), and releases at most one frame per packet added:
    after a single lost packet it waits until 16 have come, and stays 14 packets (280 ms) behind for the
    rest of the call. Here a lost packet's time is heard as silence (:class:`Hearing`) when the next comes.
    """

    def __init__(self) -> None:
        super().__init__(capacity=16)
        self._next: int | None = None

    def add(self, packet: Any) -> tuple[bool, JitterFrame | None]:
        seq = packet.sequence_number
        if self._next is not None and 0 < (self._next - seq) & 0xFFFF <= MAX_MISORDER:
            return False, None
        self._next = (seq + 1) & 0xFFFF
        return False, JitterFrame(getattr(packet, internals.DEPAYLOADED), packet.timestamp)


def release_at_once(receiver: Any) -> bool:
    """Give a call's audio receiver the :class:`InOrder` jitter buffer, before its first packet comes (aiortc
    offers no setting; where it no longer allows this, the receiver keeps its own: False)."""
    if not internals.jitter_buffer_replaceable(receiver):
        return False
    setattr(receiver, internals.JITTER_BUFFER, InOrder())
    return True


def mono(frame: AudioFrame) -> npt.NDArray[Any]:
    """A decoded frame's samples in mono, at its own rate (aiortc's Opus decoder gives packed stereo)."""
    channels = len(frame.layout.channels)
    pcm = frame.to_ndarray()
    if frame.format.is_planar:
        return np.asarray(pcm.astype(np.int32).mean(axis=0) if pcm.shape[0] > 1 else pcm[0])
    if channels == 2:  # integer halves: several times cheaper than a mean, 50 frames a second
        flat = pcm.reshape(-1).astype(np.int32)
        return (flat[0::2] + flat[1::2]) >> 1
    if channels > 1:
        return np.asarray(pcm.reshape(-1, channels).astype(np.int32).mean(axis=1))
    return pcm.reshape(-1)


def mono_pcm16(frame: AudioFrame) -> bytes:
    """A decoded frame as mono PCM16 at its own rate."""
    return np.asarray(mono(frame), dtype="<i2").tobytes()


class ToHeard:
    """Decoded frames, one after another, as what is heard: mono PCM16 at 16 kHz (:data:`HEARD_FORMAT`), resampled
    as one stream (the filter's state goes on from frame to frame; a frame resampled alone would click at its
    edges). aiortc's own Opus decoder gives packed stereo at 48 kHz, G.711 8 kHz."""

    __slots__ = ("_resampler",)

    def __init__(self) -> None:
        self._resampler: Resampler | None = None

    def __call__(self, frame: AudioFrame) -> bytes:
        if frame.sample_rate == HEARD_FORMAT.rate:
            return mono_pcm16(frame)
        resampler = self._resampler
        if resampler is None or resampler.src_rate != frame.sample_rate:
            resampler = self._resampler = Resampler(frame.sample_rate, HEARD_FORMAT.rate)
        return float_to_pcm16(resampler.process(np.asarray(mono(frame), dtype=np.float32) / 32768.0))

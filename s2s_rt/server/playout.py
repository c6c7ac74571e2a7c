"""What a call plays, frame by frame, and what of it was heard: a WebRTC call's track and a phone call's RTP.

A call's transport plays its answers itself (the session's audio deltas are
not sent as events), so it knows what was heard: :class:`Playout` keeps the
audio queued per response, hands it out a frame at a time, tells the session
when a response's audio starts and stops playing, and on barge-in clears
what has not played and says where the item was cut. :class:`Pacer` says when
each frame goes, for both transports; the transport only encodes and sends it
(aiortc's track when aiortc asks for it, a phone call's sender on its own).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from websockets.exceptions import ConnectionClosed

from s2s_rt.audio import AudioFormat, resample
from s2s_rt.pipeline.ports import told_nobody

#: How far ahead of real time a talkspurt's frames go: its first ``LEAD_FRAMES + 1`` at once, then each
#: this many frames before its time. A receiver whose jitter buffer holds packets before it plays one
#: (aiortc's holds 4, a phone's fixed buffer its depth) plays the first at once rather than 80 ms later,
#: and a late tick of a busy loop is covered by what went ahead, not heard as a gap.
LEAD_FRAMES = 4
#: Frames of silence that end a talkspurt, so that a receiver holding ``LEAD_FRAMES`` packets plays the end
#: of the answer now, not when the next answer's packets push it out (and a browser conceals the gap that
#: follows from silence, not from the last word).
HANGOVER_FRAMES = LEAD_FRAMES + 1
#: How much later than it is sent a receiver plays a talkspurt's audio: what went ahead (which also fills a
#: fixed jitter buffer as the talkspurt starts: aiortc's 4 packets, a phone's depth), and a frame for decoding
#: and playout. Measured with aiortc's receiver: some 80 ms; a browser's adaptive buffer holds 20-80 ms more, a
#: receiver without one (the SIP tests' ear) plays at once. What was sent that recently is not heard yet.
HEARD_DELAY_MS = (LEAD_FRAMES + 1) * 20.0
#: The pacing fell this far behind (the loop stalled): it goes on from now rather than send a burst.
STALL_S = 0.2


class CallEnded(ConnectionClosed):
    """The call is over (a WebRTC call's channel or peer connection, a phone call's dialog): a kind of closed
    connection, as the session's send loop sees it."""

    def __init__(self) -> None:
        super().__init__(None, None)

    def __str__(self) -> str:
        return "the call ended"


@dataclass(slots=True)
class _Chunk:
    response_id: str
    item_id: str
    samples: npt.NDArray[np.int16]
    at: int = 0


class Playout:
    """The audio queued to play on a call, in mono PCM16 at ``rate``, taken ``frame_samples`` at a time.

    ``notify(kind, response_id)`` is told ``started`` when a response's
    audio begins to play and ``stopped`` when all of it has played; it runs
    on the event loop, from the transport's pacing.

    Args:
        rate: the rate frames are played at.
        frame_samples: samples per frame.
        heard_delay_ms: how much later than it is played the caller hears it (their jitter buffer, the codec).
    """

    #: The audio is played here (:class:`~s2s_rt.pipeline.ports.Playback`).
    takes_audio = True

    def __init__(self, rate: int, frame_samples: int, heard_delay_ms: float) -> None:
        self.rate = rate
        self.frame_samples = frame_samples
        self.heard_delay_ms = heard_delay_ms
        self._queue: collections.deque[_Chunk] = collections.deque()
        #: The response whose audio is playing (between ``started`` and ``stopped``/``cleared``).
        self.playing: str | None = None
        #: The item whose audio is playing (while :attr:`playing` is set), and how many ms of it have played.
        self.item_id: str | None = None
        self.played_ms = 0.0
        #: Responses whose audio has all been queued (it has ``stopped`` once it has all played).
        self._finished: set[str] = set()
        #: Responses whose remaining audio was cleared: anything of theirs that still comes is dropped.
        self._cleared: set[str] = set()
        self.notify: Callable[[str, str], None] = told_nobody
        #: Set whenever audio is queued: a transport that sends nothing while idle waits on it.
        self.queued = asyncio.Event()

    def play(self, response_id: str, item_id: str, data: bytes, fmt: AudioFormat) -> None:
        """Queue one audio delta of a response, in the session's output format."""
        if response_id in self._cleared or not data:
            return
        if fmt.type == "audio/pcm" and fmt.rate == self.rate:
            samples = np.frombuffer(data, dtype="<i2").copy()
        else:
            floats = resample(fmt.decode(data), fmt.rate, self.rate)
            samples = np.clip(np.round(floats * 32767.0), -32768, 32767).astype(np.int16)
        self._queue.append(_Chunk(response_id, item_id, samples))
        self.queued.set()

    def finish(self, response_id: str) -> None:
        """A response's audio is all queued."""
        self._finished.add(response_id)
        if self.playing is None and not any(c.response_id == response_id for c in self._queue):
            self._finished.discard(response_id)

    @property
    def queued_ms(self) -> float:
        return 1000 * sum(len(c.samples) - c.at for c in self._queue) / self.rate

    @property
    def idle(self) -> bool:
        """Nothing is playing or waiting to play."""
        return self.playing is None and not self._queue

    def clear(self) -> tuple[str | None, str | None, float]:
        """Drop the audio not yet played.

        Returns:
            The response whose audio was playing (None: none had begun), the item whose audio was cut
            (None: nothing was waiting either) and how many ms of it were heard (played, less
            ``heard_delay_ms`` still on its way; 0 for audio that had not begun).
        """
        playing = self.playing
        if playing is not None:
            item = self.item_id
        else:
            item = self._queue[0].item_id if self._queue else None
        for chunk in self._queue:
            self._cleared.add(chunk.response_id)
        if playing is not None:
            self._cleared.add(playing)
        self._queue.clear()
        self.playing = None
        self.item_id = None
        played = self.played_ms if playing is not None else 0.0
        return playing, item, max(0.0, played - self.heard_delay_ms)

    def next_frame(self) -> npt.NDArray[np.int16]:
        """The next frame to play (silence where nothing is queued), noting what starts and stops playing."""
        size = self.frame_samples
        out = np.zeros(size, dtype=np.int16)
        filled = 0
        queue = self._queue
        while filled < size and queue:
            chunk = queue[0]
            n = min(size - filled, len(chunk.samples) - chunk.at)
            out[filled : filled + n] = chunk.samples[chunk.at : chunk.at + n]
            chunk.at += n
            filled += n
            if self.playing != chunk.response_id:
                if self.playing is not None:
                    self._stopped(self.playing)
                self.playing = chunk.response_id
                self.notify("started", chunk.response_id)
            if self.item_id != chunk.item_id:
                self.item_id, self.played_ms = chunk.item_id, 0.0
            self.played_ms += 1000 * n / self.rate
            if chunk.at >= len(chunk.samples):
                queue.popleft()
        if self.playing is not None and not queue and self.playing in self._finished:
            self._stopped(self.playing)
        return out

    def _stopped(self, response_id: str) -> None:
        self._finished.discard(response_id)
        self.playing = None
        self.notify("stopped", response_id)


class Pacer:
    """When each 20 ms frame of a :class:`Playout` goes, for a transport that sends only while there is audio.

    A talkspurt begins when audio is queued after a silence: its first frame goes at once, and its frames
    go ``lead`` frames ahead of real time (:data:`LEAD_FRAMES`). It ends ``hangover`` frames of silence
    after its last audio (:data:`HANGOVER_FRAMES`); then nothing is sent, and nothing wakes, until audio
    is queued again. :attr:`index` counts 20 ms frames since the call's first, through the silences, and
    never goes back: it is the frame's RTP time, in frames. ``hangover=None`` sends every 20 ms, silence
    or not (a microphone).
    """

    def __init__(self, frame_s: float, lead: int = LEAD_FRAMES, hangover: int | None = HANGOVER_FRAMES) -> None:
        self.lead = lead
        self.hangover = hangover
        self.frame_s = frame_s
        #: The frame being sent, counted since the call's first (at :attr:`origin`).
        self.index = -1
        self.origin: float | None = None
        #: When the talkspurt began, and the index of its first frame.
        self._began = 0.0
        self._first = 0
        #: Whether a talkspurt is being sent, and how many frames of silence it has still to send.
        self._spurt = False
        self._trail = 0

    def start(self) -> None:
        """The call's RTP time begins now, and its first frame waits for audio. Without it, the first
        :meth:`next` sends a frame of silence at once, and RTP time begins with it."""
        self.origin = time.monotonic()

    async def next(self, playout: Playout, idle_timeout: float | None = None) -> npt.NDArray[np.int16] | None:
        """The next frame of ``playout``, once it is due (its index in :attr:`index`); None when nothing was
        queued within ``idle_timeout`` s of silence (None: however long).

        The playout is given, not held: a playout that owns its pacer (a WebRTC track) is then in no cycle
        with it, and is freed as soon as its call lets go of it.
        """
        if not self._spurt:
            if self.origin is not None and playout.idle:
                playout.queued.clear()
                try:
                    await asyncio.wait_for(playout.queued.wait(), idle_timeout)
                except TimeoutError:
                    return None
            self._begin(time.monotonic())
        else:
            self.index += 1
            now = time.monotonic()
            wait = self._began + (self.index - self._first - self.lead) * self.frame_s - now
            if wait > 0:
                await asyncio.sleep(wait)
            elif wait < -STALL_S:
                # The loop fell behind (a stall): the talkspurt begins again from now, and RTP time with it (a
                # gap, as after lost packets). Kept consecutive, a microphone's time would fall behind for good.
                self._begin(now)
        was_idle = playout.idle
        frame = playout.next_frame()
        if self.hangover is not None and playout.idle:
            # Silence from here: the talkspurt ends with ``hangover`` frames of it.
            self._trail = self._trail - 1 if was_idle else self.hangover
            self._spurt = self._trail > 0
        return frame

    def _begin(self, now: float) -> None:
        """A talkspurt begins now: its first frame is stamped with the time that has passed, and goes at once."""
        if self.origin is None:
            self.origin, self.index = now, 0
        else:
            self.index = max(self.index + 1, int((now - self.origin) / self.frame_s))
        self._began, self._first, self._spurt = now, self.index, True

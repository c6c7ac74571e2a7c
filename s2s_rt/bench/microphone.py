"""The uplink: pre-encoded appends, one session's microphone at real-time pace, and the metronome pacing them all."""

from __future__ import annotations

import asyncio
import base64
import time
from array import array
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

if TYPE_CHECKING:
    from s2s_rt.bench.turn import Turn


def append_message(pcm: bytes) -> str:
    """A pre-encoded ``input_audio_buffer.append`` carrying ``pcm``."""
    return '{"type":"input_audio_buffer.append","audio":"' + base64.b64encode(pcm).decode("ascii") + '"}'


CLEAR_MESSAGE = '{"type":"input_audio_buffer.clear"}'


class Microphone:
    """One session's uplink at real-time pace: silence, or a clip while one plays.

    Chunk ``k`` (audio ``[k·c, (k+1)·c)``) is sent at ``start + (k+1)·c``, as a
    microphone that sends each chunk once it is recorded. Send times of recent
    chunks are kept so an audio position can be mapped to when it left.
    """

    RING = 8192  # chunks of send times kept (164 s at 20 ms)
    #: Bytes waiting in the socket's send buffer beyond which the server is not keeping up.
    MAX_BUFFERED = 32 * 1024

    def __init__(self, ws: ClientConnection, chunk_s: float, silence: str) -> None:
        self.ws = ws
        self.chunk_s = chunk_s
        self.silence = silence
        self.start = 0.0
        self.sent = 0
        self.closed = False
        self._times = array("d", bytes(8 * self.RING))
        self._clip: deque[str] = deque()
        self._turn: Turn | None = None
        self._clip_done: asyncio.Future[None] | None = None
        self.probe_wanted = False
        self.probes: deque[float] = deque()
        self.stalls = 0

    def sent_at(self, index: int) -> float | None:
        """When chunk ``index`` was sent (None if not sent or forgotten)."""
        if index < 0 or index >= self.sent or self.sent - index > self.RING:
            return None
        return self._times[index % self.RING]

    def play(self, messages: Sequence[str], turn: Turn) -> asyncio.Future[None]:
        """Queue a clip; stamps ``turn.speech_sent`` and ``turn.eos`` as its first and last chunks leave."""
        assert self._clip_done is None, "a clip is already playing"
        self._clip.extend(messages)
        self._turn = turn
        self._clip_done = asyncio.get_running_loop().create_future()
        return self._clip_done

    async def pump(self, now: float, lateness: list[float]) -> None:
        """Send every chunk due by ``now`` (more than one when the client fell behind).

        Never waits for a server that is not reading: when this socket's send
        buffer is full the chunks stay due (as a microphone's would) and go
        out in a burst once the server reads again, so one stalled session
        cannot hold up the others sharing the metronome.
        """
        due = int((now - self.start) / self.chunk_s)
        transport = self.ws.transport
        while self.sent < due:
            if transport.get_write_buffer_size() > self.MAX_BUFFERED:
                self.stalls += 1
                return
            clip = bool(self._clip)
            await self.ws.send(self._clip.popleft() if clip else self.silence)
            t = time.perf_counter()
            k = self.sent
            self._times[k % self.RING] = t
            self.sent = k + 1
            lateness.append(t - (self.start + (k + 1) * self.chunk_s))
            if clip and self._turn is not None:
                if self._turn.speech_sent is None:
                    self._turn.speech_sent = t
                if not self._clip:
                    # This chunk holds the clip's last voiced sample: the end of the user's speech.
                    self._turn.eos, self._turn.eos_index = t, k
                    done, self._clip_done, self._turn = self._clip_done, None, None
                    if done is not None and not done.done():
                        done.set_result(None)
        if self.probe_wanted and not self._clip and transport.get_write_buffer_size() <= self.MAX_BUFFERED:
            self.probe_wanted = False
            await self.ws.send(CLEAR_MESSAGE)
            self.probes.append(time.perf_counter())


class Metronome:
    """One task that paces every microphone, in ``phases`` groups spread over a chunk.

    A single ticker costs far less than one sleeping task per session, and
    the phase groups keep sessions from all sending in the same instant.
    """

    def __init__(self, chunk_s: float, phases: int = 4) -> None:
        self.period = chunk_s
        self.phases = phases
        self.groups: list[list[Microphone]] = [[] for _ in range(phases)]
        self.t0 = time.perf_counter()
        self.tick = 0
        self.lateness: list[float] = []
        self.every: list[Microphone] = []

    def add(self, mic: Microphone) -> None:
        g = min(range(self.phases), key=lambda i: len(self.groups[i]))
        k = self.tick + 1
        k += (g - k) % self.phases
        mic.start = self.t0 + k * self.period / self.phases - self.period
        self.groups[g].append(mic)
        self.every.append(mic)

    def remove(self, mic: Microphone) -> None:
        for group in self.groups:
            if mic in group:
                group.remove(mic)

    async def run(self) -> None:
        step = self.period / self.phases
        while True:
            self.tick += 1
            delay = self.t0 + self.tick * step - time.perf_counter()
            await asyncio.sleep(max(0.0, delay))
            now = time.perf_counter()
            for mic in tuple(self.groups[self.tick % self.phases]):
                try:
                    await mic.pump(now, self.lateness)
                except ConnectionClosed:
                    mic.closed = True
                    self.remove(mic)

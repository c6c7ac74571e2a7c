"""A WebRTC client of the server (aiortc), as a browser connects: for the tests and the load script.

It offers a microphone track and an ``oai-events`` data channel, posts the
offer with the official ``openai`` package (``client.realtime.calls.create``),
and then speaks PCM into its microphone in real time, reads the events, and
keeps what it hears on the answer's track with the time it arrived.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import numpy as np
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from s2s_rt.audio import AudioFormat
from s2s_rt.server.webrtc import EVENTS_LABEL
from s2s_rt.server.webrtc_audio import Playback, mono_pcm16

MIC_FORMAT = AudioFormat("audio/pcm", 24_000)


class CallClient:
    """One call: ``await CallClient.open(base_url, key)``, then :meth:`speak`, :meth:`next_event`, :meth:`close`.

    Attributes:
        events: every event received, in order (decoded JSON).
        heard: ``(arrival time, 48 kHz mono PCM16)`` per 20 ms frame of the answer's track.
        call_id: the id the server's ``Location`` named.
    """

    def __init__(self) -> None:
        self.pc = RTCPeerConnection()
        #: The microphone: what :meth:`speak` queues plays in real time, silence otherwise.
        self.mic = Playback(send_silence=True)
        self.channel = self.pc.createDataChannel(EVENTS_LABEL)
        self.events: list[dict[str, Any]] = []
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._taken: set[int] = set()
        self.heard: list[tuple[float, bytes]] = []
        self.call_id: str | None = None
        self.opened = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.pc.addTrack(self.mic)
        self.channel.on("open", self.opened.set)
        self.channel.on("message", self._message)
        self.pc.on("track", self._track)

    @classmethod
    async def open(
        cls,
        base_url: str,
        api_key: str,
        session: dict[str, Any] | None = None,
        timeout: float = 15.0,
        *,
        beta: bool = False,
        dtx: bool = True,
    ) -> CallClient:
        """Offer, post with the ``openai`` SDK, answer, and wait until the events channel is open.

        Args:
            base_url: the server's API root (``http://HOST:PORT/v1``).
            api_key: an API key or a client secret.
            session: a session configuration sent with the offer.
            beta: ask for the beta dialect (``OpenAI-Beta: realtime=v1`` on the offer).
            dtx: the microphone sends Opus DTX while silent when the answer asks for it (``usedtx=1``), as a
                browser's does; False: silence every 20 ms whatever the answer says.
        """
        from openai import AsyncOpenAI

        self = cls()
        await self.pc.setLocalDescription(await self.pc.createOffer())
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            kwargs: dict[str, Any] = {"sdp": self.pc.localDescription.sdp}
            if session is not None:
                kwargs["session"] = session
            if beta:
                kwargs["extra_headers"] = {"OpenAI-Beta": "realtime=v1"}
            raw = await client.realtime.calls.with_raw_response.create(**kwargs)
            answer = raw.text if isinstance(raw.text, str) else raw.content.decode()
            location = raw.headers.get("location", "")
        finally:
            await client.close()
        self.call_id = location.rsplit("/", 1)[-1] or None
        await self.pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))
        self.mic.dtx = dtx and asks_for_dtx(answer)
        try:
            async with asyncio.timeout(timeout):
                await self.opened.wait()
        except TimeoutError:
            await self.close()
            raise
        return self

    def _message(self, data: str | bytes) -> None:
        event = json.loads(data)
        event["_received"] = time.perf_counter()
        self.events.append(event)
        self._inbox.put_nowait(event)

    def _track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self._tasks.append(asyncio.ensure_future(self._listen(track)))

    async def _listen(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, AudioFrame)
            self.heard.append((time.perf_counter(), mono_pcm16(frame)))

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    def ask(self, text: str) -> None:
        """Add a user message with ``text`` and ask for a response (as a typed turn), without waiting."""
        content = [{"type": "input_text", "text": text}]
        self.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": content}})
        self.send({"type": "response.create"})

    def speak(self, pcm24k: bytes) -> float:
        """Queue 24 kHz mono PCM16 on the microphone; returns when (perf_counter) it will have been played."""
        self.mic.play("mic", "mic", pcm24k, MIC_FORMAT)
        return time.perf_counter() + self.mic.queued_ms / 1000

    async def next_event(self, kind: str | tuple[str, ...], timeout: float = 30.0) -> dict[str, Any]:
        """The first event of ``kind`` not returned before, whenever it came (all stay in :attr:`events`)."""
        kinds = (kind,) if isinstance(kind, str) else kind
        async with asyncio.timeout(timeout):
            while True:
                for i in range(len(self.events)):
                    if i not in self._taken and self.events[i]["type"] in kinds:
                        self._taken.add(i)
                        return self.events[i]
                await self._inbox.get()

    def heard_between(self, start: float, end: float = float("inf")) -> np.ndarray:
        """What the answer's track carried between two ``perf_counter`` times, as int16 samples at 48 kHz."""
        chunks = [np.frombuffer(pcm, dtype="<i2") for t, pcm in self.heard if start <= t < end]
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)

    def first_sound_after(self, start: float, level: float = 0.01) -> float | None:
        """When the first frame louder than ``level`` (RMS, full scale 1) arrived after ``start``."""
        return first_sound_after(self.heard, start, level)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.pc.close()


def asks_for_dtx(sdp: str) -> bool:
    """Whether ``sdp`` asks its peer to send Opus with DTX (``usedtx=1`` on an Opus format)."""
    opus = set(re.findall(r"^a=rtpmap:(\d+) opus/", sdp, re.IGNORECASE | re.MULTILINE))
    return any(pt in opus for pt in re.findall(r"^a=fmtp:(\d+) .*\busedtx=1\b", sdp, re.MULTILINE))


def first_sound_after(heard: list[tuple[float, bytes]], start: float, level: float) -> float | None:
    """When the first of ``heard`` (arrival time, PCM16) louder than ``level`` (RMS, full scale 1) arrived
    after ``start``: a call's answer as its caller hears it, over WebRTC or a phone line."""
    for t, pcm in heard:
        if t >= start:
            samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
            if samples.size and float(np.sqrt(np.mean(samples**2))) > level:
                return t
    return None

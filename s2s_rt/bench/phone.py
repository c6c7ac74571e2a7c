"""A phone caller of the server over SIP (aiosipua's UAC, aiortp's RTP), as a PBX dials it: for the load script.

It sends an INVITE with a G.711 μ-law offer, waits for the answer, then
speaks PCM as 20 ms RTP packets in real time (silence when it has nothing to
say) and keeps what it hears with the time each packet arrived.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import time
from typing import Any

from aiortp import RTPSession
from aiosipua.message import SipResponse
from aiosipua.outgoing_call import OutgoingCall
from aiosipua.sdp import parse_sdp
from aiosipua.uac import SipUAC

from s2s_rt.audio import float_to_pcm16, pcm16_to_float, resample
from s2s_rt.bench.call import first_sound_after
from s2s_rt.server import internals

RATE = 8_000
FRAME = RATE // 50


def free_port(host: str) -> int:
    """A UDP port free now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class PhoneClient:
    """One call: ``await PhoneClient.dial(host, sip_port)``, then :meth:`speak`, :attr:`heard`, :meth:`close`."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.heard: list[tuple[float, bytes]] = []
        self._mouth: collections.deque[bytes] = collections.deque()
        self._spoken_until = 0.0
        self._transport = internals.SipUdp(local_addr=(host, 0))
        self._uac = SipUAC(self._transport)
        self._rtp: RTPSession | None = None
        self._call: OutgoingCall | None = None
        self._sender: asyncio.Task[None] | None = None

    @classmethod
    async def dial(cls, host: str, sip_port: int, timeout: float = 15.0) -> PhoneClient:
        self = cls(host)
        await self._transport.start()
        self._transport.on_message = self._message
        rtp_port = free_port(host)
        offer = parse_sdp(
            f"v=0\r\no=bench 1 1 IN IP4 {host}\r\ns=-\r\nc=IN IP4 {host}\r\nt=0 0\r\n"
            f"m=audio {rtp_port} RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:101 telephone-event/8000\r\n"
            "a=fmtp:101 0-15\r\na=ptime:20\r\n"
        )
        call = self._uac.send_invite(f"sip:bench@{host}", f"sip:agent@{host}:{sip_port}", (host, sip_port), offer)
        self._call = call
        await call.wait_answered(timeout)
        answer = call.sdp_answer
        assert answer is not None and answer.rtp_address is not None, "the answer has no audio address"
        self._rtp = await RTPSession.create(
            local_addr=(host, rtp_port), remote_addr=answer.rtp_address, payload_type=0, jitter_prefetch=1
        )
        self._rtp.on_audio = self._audio
        self._sender = asyncio.get_running_loop().create_task(self._send())
        return self

    def _message(self, message: object, addr: tuple[str, int]) -> None:
        if isinstance(message, SipResponse):
            self._uac.handle_response(message, addr)

    def _audio(self, pcm: bytes, timestamp: int) -> None:
        self.heard.append((time.perf_counter(), pcm))

    def speak(self, pcm24k: bytes) -> float:
        """Queue 24 kHz PCM16 to say; returns when its last sample will have been sent (perf_counter)."""
        audio = float_to_pcm16(resample(pcm16_to_float(pcm24k), 24_000, RATE))
        for i in range(0, len(audio), FRAME * 2):
            self._mouth.append(audio[i : i + FRAME * 2].ljust(FRAME * 2, b"\0"))
        start = max(time.perf_counter(), self._spoken_until)
        self._spoken_until = start + len(self._mouth) * 0.02
        return self._spoken_until

    async def _send(self) -> None:
        assert self._rtp is not None
        start, ticks = time.perf_counter(), 0
        silence = bytes(FRAME * 2)
        while True:
            frame = self._mouth.popleft() if self._mouth else silence
            self._rtp.send_audio_pcm(frame, ticks * FRAME)
            ticks += 1
            await asyncio.sleep(max(0.0, start + ticks * 0.02 - time.perf_counter()))

    def first_sound_after(self, start: float, level: float) -> float | None:
        """When the first packet louder than ``level`` (RMS, full scale 1) arrived after ``start``."""
        return first_sound_after(self.heard, start, level)

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        if self._call is not None:
            self._call.hangup(self._uac)
        if self._rtp is not None:
            await self._rtp.close()
        await asyncio.sleep(0.05)
        await self._transport.stop()


class Answering:
    """The application's side of phone calls for the load script: takes ``realtime.call.incoming`` posts and
    accepts each call with the official SDK and ``session`` (what the other transports' sessions are sent)."""

    def __init__(self, api_base: str, session: dict[str, Any], port: int) -> None:
        self.api_base = api_base
        self.session = session
        self.port = port
        self._server: asyncio.Server | None = None
        self._accepting: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Answering:
        self._server = await asyncio.start_server(self._post, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _post(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = next(
            (int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.lower().startswith("content-length:")),
            0,
        )
        body = json.loads(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()
        task = asyncio.get_running_loop().create_task(self._accept(body["data"]["call_id"]))
        self._accepting.add(task)
        task.add_done_callback(self._accepting.discard)

    async def _accept(self, call_id: str) -> None:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=self.api_base, api_key="unused", max_retries=0)
        await client.realtime.calls.accept(call_id, **self.session)

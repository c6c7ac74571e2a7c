"""Transports mode: the same spoken questions over WebSocket, WebRTC and SIP, in turn, in one run.

Each turn opens a fresh session on one transport (they alternate, so both
see the same machine and the same moment), configures it as the talk mode
does, speaks one question at real-time pace with silence after it, and
measures, on the client:

- over WebSocket: from the last voiced sample's append to the first
  ``response.output_audio.delta`` received;
- over WebRTC: from the moment the microphone track played the last voiced
  sample to the first non-silent frame on the answer's track (so this one
  also includes Opus both ways and the receiver's jitter buffer, which a
  WebSocket client's own playback would add in its place);
- over SIP (a phone call, answered with the default session): from the RTP
  packet that carried the last voiced sample to the first non-silent packet
  heard back (G.711 both ways, the caller's jitter buffer of one packet).

Then it holds ``--sessions`` sessions of each kind open at once, streaming
silence, and reads the server's CPU per session from ``/proc``: what an
extra call costs while nobody speaks (Opus decoding and encoding, SRTP, the
pacing of the tracks) against an extra WebSocket.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import time
from typing import Any

from websockets.asyncio.client import connect

from s2s_rt.bench.call import CallClient
from s2s_rt.bench.phone import Answering, PhoneClient
from s2s_rt.bench.procfs import machine_info
from s2s_rt.bench.server import ServerHandle, turn_log_breakdown
from s2s_rt.bench.stats import summarize
from s2s_rt.speech_cache import RATE, Clip

CHUNK = RATE // 50  # 20 ms of PCM16 per append
#: A frame of the answer's track louder than this (RMS, full scale 1) is its first sound: Piper's first
#: samples are quiet but not silent, and the WebSocket's figure counts from its first delta whatever it holds.
SOUND = 0.002


def _settings(opts: argparse.Namespace) -> dict[str, Any]:
    transcription: dict[str, Any] = {"model": "whisper-1"}
    if opts.language:
        transcription["language"] = opts.language
    return {
        "type": "realtime",
        "instructions": opts.instructions,
        "audio": {
            "input": {
                "transcription": transcription,
                "turn_detection": {"type": "server_vad", "silence_duration_ms": opts.silence_ms},
            }
        },
    }


async def websocket_turn(opts: argparse.Namespace, server: ServerHandle, clip: Clip) -> dict[str, Any]:
    async with connect(server.url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": _settings(opts)}))
        while json.loads(await ws.recv())["type"] != "session.updated":
            pass
        data = clip.pcm + bytes(int(RATE * 1.5) * 2)
        loop = asyncio.get_running_loop()
        first_audio: asyncio.Future[float] = loop.create_future()
        done: asyncio.Future[dict[str, Any]] = loop.create_future()
        server_ms: dict[str, float] = {}

        async def read() -> None:
            async for message in ws:
                event = json.loads(message)
                now = time.perf_counter()
                kind = event["type"]
                if kind == "input_audio_buffer.speech_stopped":
                    server_ms["stopped"] = now
                if kind == "response.output_audio.delta" and not first_audio.done():
                    first_audio.set_result(now)
                if kind == "response.done" and not done.done():
                    done.set_result(event)
                    return

        reader = asyncio.create_task(read())
        start = time.perf_counter()
        end_of_speech = 0.0
        for sent, i in enumerate(range(0, len(data), CHUNK * 2), start=1):
            await ws.send(
                '{"type":"input_audio_buffer.append","audio":"'
                + base64.b64encode(data[i : i + CHUNK * 2]).decode()
                + '"}'
            )
            if i < len(clip.pcm):
                end_of_speech = time.perf_counter()
            await asyncio.sleep(max(0.0, start + sent / 50 - time.perf_counter()))
            if done.done():
                break
        try:
            async with asyncio.timeout(opts.turn_timeout_s):
                response = await done
            heard = await first_audio if first_audio.done() else None
        finally:
            reader.cancel()
        return _turn("websocket", clip, end_of_speech, heard, response, server_ms.get("stopped"))


async def webrtc_turn(opts: argparse.Namespace, server: ServerHandle, clip: Clip) -> dict[str, Any]:
    call = await CallClient.open(f"{server.http}/v1", "unused", session=_settings(opts), dtx=opts.caller_dtx)
    try:
        await call.next_event("session.created")
        end_of_speech = call.speak(clip.pcm)
        call.speak(bytes(int(RATE * 1.5) * 2))
        response = await call.next_event("response.done", opts.turn_timeout_s)
        await call.next_event("output_audio_buffer.stopped", opts.turn_timeout_s)
        stopped = next((e["_received"] for e in call.events if e["type"] == "input_audio_buffer.speech_stopped"), None)
        started = next((e["_received"] for e in call.events if e["type"] == "output_audio_buffer.started"), None)
        turn = _turn("webrtc", clip, end_of_speech, call.first_sound_after(end_of_speech, SOUND), response, stopped)
        # Where the server began to play it (told on the data channel): the rest is Opus, RTP and the jitter buffer.
        turn["eos_to_playing_s"] = None if started is None else started - end_of_speech
        return turn
    finally:
        await call.close()


async def sip_turn(opts: argparse.Namespace, server: ServerHandle, clip: Clip) -> dict[str, Any]:
    """A phone call's turn: from the last voiced sample's RTP packet sent to the first sound heard back.

    The load script's webhook accepts the call with the turn's settings (:class:`~s2s_rt.bench.phone.Answering`),
    as an application would; the call's audio starts once it is answered.
    """
    phone = await PhoneClient.dial("127.0.0.1", opts.sip_port)
    try:
        end_of_speech = phone.speak(clip.pcm)
        phone.speak(bytes(int(RATE * 1.5) * 2))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + opts.turn_timeout_s
        heard = None
        while heard is None and loop.time() < deadline:
            await asyncio.sleep(0.1)
            heard = phone.first_sound_after(end_of_speech, SOUND)
        await asyncio.sleep(0.5)
        done: dict[str, Any] = {
            "response": {"status": "completed" if heard is not None else "incomplete", "output": []}
        }
        return _turn("sip", clip, end_of_speech, heard, done, None)
    finally:
        await phone.close()


def _turn(
    transport: str, clip: Clip, end_of_speech: float, heard: float | None, done: dict[str, Any], stopped: float | None
) -> dict[str, Any]:
    response = done["response"]
    output = response.get("output") or [{}]
    content = (output[0].get("content") or [{}])[0]
    return {
        "transport": transport,
        "question": clip.text,
        "status": response["status"],
        "eos_to_first_audio_s": None if heard is None else heard - end_of_speech,
        "speech_stopped_to_first_audio_s": None if heard is None or stopped is None else heard - stopped,
        "answer": content.get("transcript"),
    }


async def held_open(opts: argparse.Namespace, server: ServerHandle, kind: str, seconds: float) -> dict[str, Any]:
    """``opts.sessions`` sessions of ``kind`` open at once, streaming silence: the server's CPU while they idle."""
    n = opts.sessions
    stop = asyncio.Event()
    opened = asyncio.Event()
    ready = [0]

    async def websocket() -> None:
        async with connect(server.url) as ws:
            silence = f'{{"type":"input_audio_buffer.append","audio":"{base64.b64encode(bytes(CHUNK * 2)).decode()}"}}'
            ready[0] += 1
            if ready[0] == n:
                opened.set()
            reader = asyncio.create_task(_discard(ws))  # what the server sends: session.created, little else
            start, sent = time.perf_counter(), 0
            while not stop.is_set():
                await ws.send(silence)
                sent += 1
                await asyncio.sleep(max(0.0, start + sent / 50 - time.perf_counter()))
            reader.cancel()

    async def sip() -> None:
        phone = await PhoneClient.dial("127.0.0.1", opts.sip_port)
        try:
            ready[0] += 1
            if ready[0] == n:
                opened.set()
            await stop.wait()  # it sends silence all the while, 50 packets a second
        finally:
            await phone.close()

    async def webrtc() -> None:
        call = await CallClient.open(f"{server.http}/v1", "unused", dtx=opts.caller_dtx)
        try:
            ready[0] += 1
            if ready[0] == n:
                opened.set()
            await stop.wait()  # its microphone plays silence all the while
        finally:
            await call.close()

    kinds = {"websocket": websocket, "webrtc": webrtc, "sip": sip}
    tasks = [asyncio.create_task(kinds[kind]()) for _ in range(n)]
    async with asyncio.timeout(60):
        await opened.wait()
    await asyncio.sleep(2.0)  # settled
    before, t0 = server.proc(), time.perf_counter()
    await asyncio.sleep(seconds)
    after, t1 = server.proc(), time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await _sessions_ended(server)
    busy = None if before is None or after is None else (after.cpu_s - before.cpu_s) / (t1 - t0)
    return {"transport": kind, "sessions": n, "server_cores_busy": busy, "per_session": busy / n if busy else None}


async def _sessions_ended(server: ServerHandle, timeout_s: float = 15.0) -> None:
    """Wait until the server serves no session: a window's sessions end there a moment after their clients
    close (a call once the server reads the caller's goodbye), and the next window needs every slot."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await server.metrics()).get(("s2s_sessions_active", ()), 0.0) == 0.0:
            return
        await asyncio.sleep(0.1)


async def _discard(ws: Any) -> None:
    async for _ in ws:
        pass


async def run_transports(opts: argparse.Namespace, server: ServerHandle, clips: list[Clip]) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        if getattr(opts, "sip_webhook_port", None):
            await stack.enter_async_context(Answering(f"{server.http}/v1", _settings(opts), opts.sip_webhook_port))
        return await _run_transports(opts, server, clips)


async def _run_transports(opts: argparse.Namespace, server: ServerHandle, clips: list[Clip]) -> dict[str, Any]:
    t0 = time.perf_counter()
    turns: list[dict[str, Any]] = []
    kinds = ["websocket", "webrtc"] + (["sip"] if opts.sip_port else [])
    turn_of = {"websocket": websocket_turn, "webrtc": webrtc_turn, "sip": sip_turn}
    idle: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    # A first turn on each, not counted: the models' first calls are slower.
    for kind in kinds:
        await turn_of[kind](opts, server, clips[0])
    for m in range(opts.turns):
        clip = clips[m % len(clips)]
        # Each transport goes first in turn, so that none always follows the same one.
        order = kinds[m % len(kinds) :] + kinds[: m % len(kinds)]
        for kind in order:
            turns.append(await turn_of[kind](opts, server, clip))
            await asyncio.sleep(opts.pause_s)
    for _ in range(2):
        for kind in kinds:
            idle[kind].append(await held_open(opts, server, kind, opts.step_s))
    report: dict[str, Any] = {
        "tool": "s2s-rt bench",
        "mode": "transports",
        "ok": all(t["status"] == "completed" and t["eos_to_first_audio_s"] is not None for t in turns),
        "argv": opts.argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": time.perf_counter() - t0,
        "machine": machine_info(),
        "turns": turns,
        "idle": idle,
    }
    for kind in kinds:
        mine = [t for t in turns if t["transport"] == kind and t["eos_to_first_audio_s"] is not None]
        report[kind] = {
            "eos_to_first_audio_s": summarize([t["eos_to_first_audio_s"] for t in mine]),
            "speech_stopped_to_first_audio_s": summarize(
                [t["speech_stopped_to_first_audio_s"] for t in mine if t["speech_stopped_to_first_audio_s"] is not None]
            ),
            "idle_server_cores_per_session": [r["per_session"] for r in idle[kind]],
        }
        if kind == "webrtc":
            report[kind]["eos_to_playing_s"] = summarize(
                [t["eos_to_playing_s"] for t in mine if t.get("eos_to_playing_s") is not None]
            )
    report["server_turns"] = turn_log_breakdown(server.log_path)
    return report


def format_transports(report: dict[str, Any]) -> list[str]:
    head = f"{'transport':<10} {'turns':>5} {'eos→audio p50':>14} {'p95':>8} {'stopped→audio p50':>18}"
    lines = [head + "  idle server CPU per session"]

    def ms(value: Any) -> str:
        return "-" if value is None else f"{1000 * value:.0f} ms"

    for kind in [k for k in ("websocket", "webrtc", "sip") if k in report]:
        r = report[kind]
        lat, srv = r["eos_to_first_audio_s"], r["speech_stopped_to_first_audio_s"]
        idle = ", ".join(f"{100 * v:.2f}% of a core" for v in r["idle_server_cores_per_session"] if v is not None)
        lines.append(f"{kind:<10} {lat['n']:>5} {ms(lat['p50']):>14} {ms(lat['p95']):>8} {ms(srv['p50']):>18}  {idle}")
    playing = report["webrtc"].get("eos_to_playing_s", {})
    if playing.get("p50") is not None:
        lines.append(f"webrtc: the server began to play {ms(playing['p50'])} after the end of speech (p50)")
    return lines

"""``s2s-rt talk``: one turn with a Realtime server from the command line.

::

    s2s-rt talk --wav question.wav --out answer.wav
    s2s-rt talk --text "What is the capital of France?" --out answer.wav

The WAV file (16-bit PCM, any rate, mono or stereo) is mixed to mono,
resampled to 24 kHz and sent as fast as the socket takes it (``--realtime``
paces it like a live microphone instead). Turn detection is switched off and
the client commits the buffer itself, then asks for a response once the
server has confirmed the commit: the whole file is exactly one turn,
whatever pauses it holds, however quiet it is, and whatever the server's VAD
settings are. ``--text`` sends a user text message instead.

Both transcripts are printed (``you: …`` and ``assistant: …``) and the spoken
answer is written as a 24 kHz mono 16-bit WAV. Any server that speaks the GA
Realtime protocol works: ``--url`` picks it, ``--api-key`` (or the
``S2S_RT_API_KEY`` / ``OPENAI_API_KEY`` variables, in that order) is sent as
a Bearer token.

Exit status: 0 answered; 1 the turn failed (error event, failed or cancelled
response, timeout, connection lost); 2 bad arguments or input file; 3 cannot
connect; 4 refused at the handshake (API key, origin); 5 the server is full
or not taking sessions (``session_limit_reached``, close 1013, HTTP 503).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from s2s_rt.audio import Float32Array, float_to_pcm16, resample

WIRE_RATE = 24_000
DEFAULT_URL = "ws://127.0.0.1:8000/v1/realtime"
#: Seconds of audio per ``input_audio_buffer.append`` (as fast as possible / real time).
APPEND_S = 0.5
REALTIME_APPEND_S = 0.1
#: Servers (this one and OpenAI's) refuse to commit less than 100 ms.
MIN_TURN_S = 0.1

EXIT_OK = 0
EXIT_TURN_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_REFUSED = 4
EXIT_BUSY = 5


class TalkError(Exception):
    """A failure to report to the user, with the exit status it maps to."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Answer:
    """What one turn produced."""

    user_transcript: str | None
    assistant_transcript: str
    audio: bytearray = field(default_factory=bytearray)  # PCM16 at 24 kHz
    status: str = "completed"
    first_audio_s: float | None = None  # request sent → first audio delta

    @property
    def audio_seconds(self) -> float:
        return len(self.audio) / 2 / WIRE_RATE


# --- WAV files ----------------------------------------------------------------------


def read_wav(path: Path) -> bytes:
    """A 16-bit PCM WAV file as 24 kHz mono PCM16 bytes.

    Raises:
        TalkError: the file is missing, not 16-bit PCM WAV, or too short.
    """
    try:
        with wave.open(str(path), "rb") as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (OSError, EOFError, wave.Error) as exc:
        raise TalkError(f"cannot read {path} as a WAV file: {exc or 'not a WAV file'}", EXIT_USAGE) from None
    if width != 2:
        raise TalkError(f"{path} has {8 * width}-bit samples; only 16-bit PCM WAV is supported", EXIT_USAGE)
    pcm = np.frombuffer(frames[: len(frames) - len(frames) % (2 * channels)], dtype="<i2")
    mono: Float32Array = pcm.reshape(-1, channels).astype(np.float32).mean(axis=1) / np.float32(32768.0)
    if len(mono) < MIN_TURN_S * rate:
        raise TalkError(
            f"{path} holds {1000 * len(mono) / rate:.0f} ms of audio; a turn needs at least {1000 * MIN_TURN_S:.0f} ms",
            EXIT_USAGE,
        )
    return float_to_pcm16(resample(mono, rate, WIRE_RATE))


def write_wav(path: Path, pcm: bytes) -> None:
    """Write 24 kHz mono PCM16 bytes as a WAV file."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(WIRE_RATE)
        w.writeframes(pcm)


# --- the conversation ---------------------------------------------------------------------


def _session_update() -> dict[str, Any]:
    return {
        "type": "session.update",
        "session": {
            "type": "realtime",
            "output_modalities": ["audio"],
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": WIRE_RATE},
                    "transcription": {"model": "whisper-1"},
                    "turn_detection": None,
                },
                "output": {"format": {"type": "audio/pcm", "rate": WIRE_RATE}},
            },
        },
    }


class _Events:
    """Reads server events with a deadline and turns ``error`` events into :class:`TalkError`."""

    def __init__(self, ws: ClientConnection, deadline: float) -> None:
        self.ws = ws
        self.deadline = deadline

    async def next(self) -> dict[str, Any]:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TalkError("timed out waiting for the server (see --timeout)", EXIT_TURN_FAILED)
        try:
            message = await asyncio.wait_for(self.ws.recv(), remaining)
        except TimeoutError:
            raise TalkError("timed out waiting for the server (see --timeout)", EXIT_TURN_FAILED) from None
        except ConnectionClosed as exc:
            raise _closed(exc) from None
        try:
            event = json.loads(message)
        except ValueError:
            raise TalkError(f"the server sent something that is not JSON: {message!r:.200}", EXIT_TURN_FAILED) from None
        if not isinstance(event, dict):
            raise TalkError(f"the server sent a non-object event: {message!r:.200}", EXIT_TURN_FAILED)
        if event.get("type") == "error":
            raise _server_error(event.get("error") or {})
        return event

    async def until(self, *types: str) -> dict[str, Any]:
        while True:
            event = await self.next()
            if event.get("type") in types:
                return event


def _server_error(error: dict[str, Any]) -> TalkError:
    code = error.get("code") or error.get("type") or "error"
    message = error.get("message") or "no message"
    if code == "session_limit_reached":
        return TalkError(f"the server is full: {message}", EXIT_BUSY)
    return TalkError(f"the server reported an error ({code}): {message}", EXIT_TURN_FAILED)


def _closed(exc: ConnectionClosed) -> TalkError:
    rcvd = exc.rcvd
    if rcvd is not None and rcvd.code == 1013:
        return TalkError(f"the server is busy and closed the connection (1013 {rcvd.reason})".strip(), EXIT_BUSY)
    what = f"code {rcvd.code}{f': {rcvd.reason}' if rcvd.reason else ''}" if rcvd else "no close frame"
    return TalkError(f"the server closed the connection ({what})", EXIT_TURN_FAILED)


async def _send(ws: ClientConnection, event: dict[str, Any]) -> None:
    try:
        await ws.send(json.dumps(event))
    except ConnectionClosed as exc:
        raise _closed(exc) from None


async def converse(
    url: str,
    *,
    audio: bytes | None = None,
    text: str | None = None,
    api_key: str | None = None,
    timeout_s: float = 120.0,
    realtime: bool = False,
) -> Answer:
    """Say one thing (24 kHz PCM16 ``audio``, or ``text``) and collect the answer.

    Raises:
        TalkError: anything that stopped the turn, with its exit status.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if url.startswith(("http://", "https://")):
        url = "ws" + url[4:]  # the page's address works too
    try:
        ws = await connect(url, additional_headers=headers, max_size=None, open_timeout=min(timeout_s, 15.0))
    except InvalidURI as exc:
        raise TalkError(f"not a WebSocket URL: {exc}", EXIT_USAGE) from None
    except InvalidStatus as exc:
        raise _refused(url, exc.response.status_code) from None
    except ConnectionRefusedError:
        raise TalkError(
            f"cannot connect to {url}: connection refused (is the server running?)", EXIT_UNREACHABLE
        ) from None
    except (OSError, TimeoutError, InvalidHandshake) as exc:
        raise TalkError(f"cannot connect to {url}: {exc or type(exc).__name__}", EXIT_UNREACHABLE) from None
    async with ws:
        events = _Events(ws, time.monotonic() + timeout_s)
        await events.until("session.created")
        await _send(ws, _session_update())
        await events.until("session.updated")
        user_item: str | None = None
        if audio is not None:
            step = int(WIRE_RATE * (REALTIME_APPEND_S if realtime else APPEND_S)) * 2
            for i in range(0, len(audio), step):
                chunk = audio[i : i + step]
                await _send(ws, {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
                if realtime:
                    await asyncio.sleep(len(chunk) / 2 / WIRE_RATE)
            await _send(ws, {"type": "input_audio_buffer.commit"})
            # Ask for the answer once the turn is an item, so it follows the turn in the conversation.
            user_item = (await events.until("input_audio_buffer.committed"))["item_id"]
        else:
            await _send(
                ws,
                {
                    "type": "conversation.item.create",
                    "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
                },
            )
        asked = time.monotonic()
        await _send(ws, {"type": "response.create"})
        return await _collect(events, user_item, text, asked)


def _refused(url: str, status: int) -> TalkError:
    if status == 401:
        return TalkError(
            f"the server refused the API key (HTTP 401): pass --api-key or set S2S_RT_API_KEY ({url})", EXIT_REFUSED
        )
    if status == 403:
        return TalkError(
            f"the server refused the connection (HTTP 403: origin or key not allowed) ({url})", EXIT_REFUSED
        )
    if status == 503:
        return TalkError(f"the server is not taking new sessions (HTTP 503: draining or full) ({url})", EXIT_BUSY)
    if status == 404:
        return TalkError(f"no Realtime endpoint at {url} (HTTP 404)", EXIT_UNREACHABLE)
    return TalkError(f"the server answered the handshake with HTTP {status} ({url})", EXIT_UNREACHABLE)


async def _collect(events: _Events, user_item: str | None, text: str | None, asked: float) -> Answer:
    answer = Answer(user_transcript=text, assistant_transcript="")
    deltas: list[str] = []
    done: dict[str, Any] | None = None
    waiting_for_transcript = False
    while done is None or (user_item is not None and answer.user_transcript is None):
        if done is not None and not waiting_for_transcript:
            # The user's transcript may come after the response (servers may
            # transcribe in parallel): give it a few more seconds.
            waiting_for_transcript = True
            events.deadline = min(events.deadline, time.monotonic() + 5.0)
        try:
            event = await events.next()
        except TalkError:
            if waiting_for_transcript:
                break
            raise
        kind = event.get("type")
        if kind in ("response.output_audio.delta", "response.audio.delta"):
            if answer.first_audio_s is None:
                answer.first_audio_s = time.monotonic() - asked
            answer.audio += base64.b64decode(event.get("delta", ""))
        elif kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            deltas.append(event.get("delta", ""))
        elif kind in ("response.output_audio_transcript.done",):
            answer.assistant_transcript = event.get("transcript", "")
        elif kind == "response.output_text.done":
            answer.assistant_transcript = event.get("text", "")
        elif kind == "conversation.item.input_audio_transcription.completed" and event.get("item_id") == user_item:
            answer.user_transcript = event.get("transcript", "")
        elif kind == "conversation.item.input_audio_transcription.failed" and event.get("item_id") == user_item:
            answer.user_transcript = "(transcription failed)"
        elif kind == "response.done":
            done = event.get("response") or {}
    assert done is not None
    answer.assistant_transcript = answer.assistant_transcript or "".join(deltas)
    answer.status = str(done.get("status", "completed"))
    if answer.status in ("failed", "cancelled"):
        details = done.get("status_details") or {}
        reason = (details.get("error") or {}).get("message") or details.get("reason") or "no reason given"
        raise TalkError(f"the response {answer.status}: {reason}", EXIT_TURN_FAILED)
    return answer


# --- the command ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="s2s-rt talk",
        description="Say one thing to a Realtime server (a WAV file or text) and save its spoken answer.",
        epilog="Exit status: 0 answered, 1 turn failed, 2 bad arguments or input, 3 cannot connect,"
        " 4 refused (API key, origin), 5 server full or not taking sessions.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--wav", type=Path, help="16-bit PCM WAV to say (any rate, mono or stereo)")
    what.add_argument("--text", help="say this text instead of audio")
    p.add_argument("--out", type=Path, help="write the spoken answer here (WAV, 24 kHz mono 16-bit)")
    p.add_argument("--url", default=DEFAULT_URL, help=f"Realtime endpoint (default {DEFAULT_URL})")
    p.add_argument("--api-key", help="sent as a Bearer token (default: $S2S_RT_API_KEY, then $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds the whole turn may take (default 120)")
    p.add_argument(
        "--realtime", action="store_true", help="send the audio at the pace of a live microphone, not at once"
    )
    return p


def main(argv: list[str]) -> int:
    """Run ``s2s-rt talk`` with ``argv`` (the arguments after ``talk``); returns the exit status."""
    args = _parser().parse_args(argv)
    api_key = args.api_key or os.environ.get("S2S_RT_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    try:
        audio = read_wav(args.wav) if args.wav is not None else None
        if args.out is not None and not args.out.parent.is_dir():
            raise TalkError(f"cannot write {args.out}: no directory {args.out.parent}", EXIT_USAGE)
        answer = asyncio.run(
            converse(
                args.url,
                audio=audio,
                text=args.text,
                api_key=api_key,
                timeout_s=args.timeout,
                realtime=args.realtime,
            )
        )
    except TalkError as exc:
        print(f"s2s-rt talk: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    print(f"you: {answer.user_transcript if answer.user_transcript is not None else '(no transcript)'}")
    print(f"assistant: {answer.assistant_transcript}")
    timing = f", first audio after {1000 * answer.first_audio_s:.0f} ms" if answer.first_audio_s is not None else ""
    if answer.status != "completed":
        print(f"s2s-rt talk: the response ended as {answer.status}", file=sys.stderr)
    if args.out is not None:
        write_wav(args.out, bytes(answer.audio))
        print(f"s2s-rt talk: wrote {args.out} ({answer.audio_seconds:.2f} s of audio{timing})", file=sys.stderr)
    elif timing:
        print(f"s2s-rt talk: {answer.audio_seconds:.2f} s of audio{timing} (not saved: no --out)", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

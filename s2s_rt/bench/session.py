"""One simulated Realtime session: connects, configures, speaks its questions, and checks every event."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from s2s_rt.bench.microphone import Microphone
from s2s_rt.bench.run import Run
from s2s_rt.bench.turn import Turn
from s2s_rt.speech_cache import RATE

#: One Silero (and fake energy) VAD window: 512 samples at 16 kHz.
VAD_CHUNK_MS = 32

_json = msgspec.json.Decoder()


#: Event types that may name a new item id for the session.
_INTRODUCES_ITEM = frozenset(
    {
        "input_audio_buffer.speech_started",
        "input_audio_buffer.committed",
        "input_audio_buffer.timeout_triggered",
        "conversation.item.added",
        "conversation.item.created",
        "response.output_item.added",
    }
)


class SessionClient:
    """One Realtime session of the load: connects, configures, speaks, and checks every event."""

    def __init__(self, run: Run, index: int, *, respond: bool) -> None:
        self.run = run
        self.index = index
        self.respond = respond
        self.session_id: str | None = None
        self.items: set[str] = set()
        self.responses: set[str] = set()
        self.turn: Turn | None = None
        self.mic: Microphone | None = None
        self.ready = asyncio.Event()
        self.updated = asyncio.Event()
        self.rejected = False
        self.ws: ClientConnection | None = None
        self.reader: asyncio.Task[None] | None = None
        self.closing = False

    # --- the event checker -------------------------------------------------------

    def on_event(self, ev: dict[str, Any], now: float) -> None:
        """Check one server event belongs here, then account it to the session or its turn."""
        run = self.run
        kind = ev.get("type", "")
        if kind == "error":
            err = ev.get("error") or {}
            code = str(err.get("code"))
            if code == "session_limit_reached" and self.session_id is None:
                self.rejected = True
                run.counts["rejections"] += 1
                self.ready.set()
                return
            run.errors[code] = run.errors.get(code, 0) + 1
            run.fail("error_events", self.index, f"error {code}: {err.get('message')}")
            return
        foreign = self._foreign(kind, ev)
        if foreign:
            run.fail("foreign_events", self.index, f"{kind}: {foreign}")
            return
        if kind == "session.created":
            self.ready.set()
            return
        if kind == "session.updated":
            self.updated.set()
            return
        if kind == "input_audio_buffer.cleared":
            if self.mic is not None and self.mic.probes:
                sent = self.mic.probes.popleft()
                run.probes.append((sent, now - sent))
            else:
                run.fail("unexpected_events", self.index, "input_audio_buffer.cleared without a clear sent")
            return
        if kind in ("response.created", "response.done"):
            self._response_event(kind, ev, now)
            return
        if kind == "response.output_audio.delta":
            turn = self.turn
            rid = ev.get("response_id")
            if turn is not None and rid == turn.response_id:
                turn.hear(now, len(ev.get("delta", "")) * 3 / 4 / 2 / RATE)
            return
        turn = self.turn
        if kind == "input_audio_buffer.speech_started":
            if turn is None or turn.speech_sent is None:
                run.fail("unexpected_events", self.index, "speech_started while the client was silent")
                return
            turn.segments += 1
            if turn.speech_started is None:
                turn.speech_started = now
                start_ms = int(ev.get("audio_start_ms", 0))
                if start_ms > 0:  # else clamped at 0, and the deciding chunk is unknown
                    turn.started_decision = self._decision_delay(
                        start_ms + run.opts.prefix_padding_ms + VAD_CHUNK_MS, now
                    )
            return
        if kind == "input_audio_buffer.speech_stopped":
            if turn is None or turn.speech_started is None:
                run.fail("unexpected_events", self.index, "speech_stopped with no speech_started")
                return
            turn.speech_stopped = now
            turn.final_item = ev.get("item_id")
            end_ms = int(ev.get("audio_end_ms", 0))
            turn.stopped_decision = self._decision_delay(math.ceil(end_ms / VAD_CHUNK_MS) * VAD_CHUNK_MS, now)
            return
        if kind == "input_audio_buffer.committed":
            if turn is not None and ev.get("item_id") == turn.final_item:
                turn.committed = now
            return
        if kind == "conversation.item.input_audio_transcription.completed":
            if turn is not None and ev.get("item_id") == turn.final_item:
                turn.transcribed = now
                turn.transcript = ev.get("transcript")
                if not self.respond and self._final_segment(turn):
                    turn.done.set()
            return
        if kind == "conversation.item.input_audio_transcription.failed":
            run.fail("error_events", self.index, f"transcription failed: {ev.get('error')}")
            return

    def _response_event(self, kind: str, ev: dict[str, Any], now: float) -> None:
        r = ev.get("response") or {}
        rid = r.get("id")
        turn = self.turn
        if not self.respond:
            self.run.fail("unexpected_events", self.index, f"{kind} with create_response off")
            return
        if turn is None or turn.speech_stopped is None:
            self.run.fail("unexpected_events", self.index, f"{kind} outside a turn")
            return
        if kind == "response.created":
            # A turn's answer is the response created after its last speech_stopped.
            turn.response_id = rid
            turn.response_created = now
            turn.new_answer()
            return
        if rid != turn.response_id:
            return
        status = r.get("status")
        if not self._final_segment(turn):
            # The VAD cut the question in two and answered the first piece; the
            # rest of the question cancels that answer (barge-in) and gets its own.
            turn.cancelled += status == "cancelled"
            turn.response_id = turn.response_created = turn.first_audio = None
            return
        turn.response_done = now
        turn.status = status
        usage = r.get("usage") or {}
        turn.input_tokens = usage.get("input_tokens")
        turn.cached_tokens = (usage.get("input_token_details") or {}).get("cached_tokens")
        with contextlib.suppress(IndexError, KeyError, TypeError):
            turn.answer = (r.get("output") or [])[0]["content"][0].get("transcript")
        turn.done.set()

    @staticmethod
    def _final_segment(turn: Turn) -> bool:
        """Whether the turn's last speech_stopped came after the whole question was sent."""
        return turn.eos is not None and turn.speech_stopped is not None and turn.speech_stopped >= turn.eos

    def _foreign(self, kind: str, ev: dict[str, Any]) -> str | None:
        """Why ``ev`` does not belong to this session, or None when it does."""
        own = self.run.ownership
        if kind in ("session.created", "session.updated"):
            sid = (ev.get("session") or {}).get("id")
            if sid is None:
                return None
            if self.session_id is None and kind == "session.created":
                other = own.claim(sid, self.index)
                if other is not None:
                    return f"session id {sid} belongs to session {other}"
                self.session_id = sid
                return None
            return None if sid == self.session_id else f"session id {sid} is not this session's ({self.session_id})"
        items: list[str] = []
        if isinstance(ev.get("item_id"), str):
            items.append(ev["item_id"])
        item = ev.get("item")
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            items.append(item["id"])
        prev = ev.get("previous_item_id")
        responses: list[str] = []
        if isinstance(ev.get("response_id"), str):
            responses.append(ev["response_id"])
        if kind in ("response.created", "response.done"):
            rid = (ev.get("response") or {}).get("id")
            if isinstance(rid, str):
                if kind == "response.created":
                    other = own.claim(rid, self.index)
                    if other is not None:
                        return f"response {rid} belongs to session {other}"
                    self.responses.add(rid)
                else:
                    responses.append(rid)
        for rid in responses:
            if rid not in self.responses:
                other = own.owner.get(rid)
                return f"response {rid} was never created in this session" + (
                    f" (it is session {other}'s)" if other is not None else ""
                )
        if isinstance(prev, str) and prev not in self.items:
            return f"previous_item_id {prev} is not an item of this session"
        for iid in items:
            if iid in self.items:
                continue
            if kind in _INTRODUCES_ITEM:
                other = own.claim(iid, self.index)
                if other is not None:
                    return f"item {iid} belongs to session {other}"
                self.items.add(iid)
            else:
                other = own.owner.get(iid)
                return f"item {iid} was never introduced in this session" + (
                    f" (it is session {other}'s)" if other is not None else ""
                )
        return None

    def _decision_delay(self, audio_ms: float, now: float) -> float | None:
        """Seconds from sending the chunk that completes audio up to ``audio_ms`` to ``now``."""
        if self.mic is None or audio_ms <= 0:
            return None
        index = math.ceil(audio_ms / (self.run.chunk_s * 1000)) - 1
        sent = self.mic.sent_at(index)
        return None if sent is None else now - sent

    # --- connection --------------------------------------------------------------

    async def open(self, url: str) -> bool:
        """Connect, wait for ``session.created`` and configure the session. False if refused or failed."""
        run = self.run
        try:
            ws = await connect(
                url,
                max_size=16 * 1024 * 1024,
                compression=None,
                ping_interval=None,
                open_timeout=run.opts.open_timeout_s,
                close_timeout=5,
            )
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            run.fail("connect_failures", self.index, f"connect failed: {exc!r}")
            return False
        self.ws = ws
        self.reader = asyncio.create_task(self._read(ws), name=f"bench-read-{self.index}")
        try:
            await asyncio.wait_for(self.ready.wait(), run.opts.open_timeout_s)
        except TimeoutError:
            run.fail("lost_events", self.index, "no session.created")
            return False
        if self.rejected or self.session_id is None:
            return False
        run.counts["sessions_opened"] += 1
        td: dict[str, Any] = {
            "type": run.opts.turn_detection,
            "create_response": self.respond,
            "interrupt_response": True,
        }
        if run.opts.turn_detection == "semantic_vad":
            td["eagerness"] = run.opts.eagerness
        else:
            td |= {
                "threshold": run.opts.threshold,
                "prefix_padding_ms": run.opts.prefix_padding_ms,
                "silence_duration_ms": run.opts.silence_ms,
            }
        session: dict[str, Any] = {
            "type": "realtime",
            "instructions": run.opts.instructions,
            "temperature": run.opts.temperature,
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": td},
                "output": {"format": {"type": "audio/pcm", "rate": RATE}},
            },
        }
        # Transcription events are how the script times the transcript (off unless asked, as OpenAI).
        transcription: dict[str, Any] = {"model": "whisper-1"}
        if run.opts.language:
            transcription["language"] = run.opts.language
        session["audio"]["input"]["transcription"] = transcription
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        try:
            await asyncio.wait_for(self.updated.wait(), run.opts.open_timeout_s)
        except TimeoutError:
            run.fail("lost_events", self.index, "no session.updated")
            return False
        self.mic = Microphone(ws, run.period_s, run.silence)
        run.metronome.add(self.mic)
        return True

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for message in ws:
                now = time.perf_counter()
                try:
                    ev = _json.decode(message)
                except msgspec.DecodeError:
                    self.run.fail("unexpected_events", self.index, "a frame that is not JSON")
                    continue
                if not isinstance(ev, dict):
                    self.run.fail("unexpected_events", self.index, "a JSON frame that is not an object")
                    continue
                self.on_event(ev, now)
        except ConnectionClosed:
            pass
        finally:
            if self.ws is not None and not self.closing and not self.rejected:
                code = ws.close_code
                self.run.fail("closed_by_server", self.index, f"the server closed the session ({code})")
            if self.turn is not None:
                self.turn.done.set()
            self.ready.set()

    async def close(self) -> None:
        self.closing = True
        if self.mic is not None:
            self.run.metronome.remove(self.mic)
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
            if self.reader is not None:
                with contextlib.suppress(Exception):
                    await self.reader

    # --- speaking ------------------------------------------------------------------

    async def speak(self, number: int, clip_index: int) -> Turn:
        """Play one question and wait for its transcription (and answer, when responding)."""
        run = self.run
        assert self.mic is not None
        clip = run.clips[clip_index]
        turn = Turn(self.index, number, clip.text, self.respond)
        run.turns.append(turn)
        self.turn = turn
        await self.mic.play(run.clip_messages[clip_index], turn)
        try:
            await asyncio.wait_for(turn.done.wait(), run.opts.turn_timeout_s)
        except TimeoutError:
            turn.failure = f"unanswered after {run.opts.turn_timeout_s:g} s"
            run.fail("unanswered_turns", self.index, f"turn {number}: {turn.failure}")
        if turn.failure is None:
            missing = turn.missing()
            if self.respond and turn.status not in (None, "completed"):
                turn.failure = f"response {turn.status}"
                run.fail("lost_events", self.index, f"turn {number}: response ended {turn.status}")
            elif missing:
                turn.failure = "lost " + ", ".join(missing)
                run.counts["lost_events"] += len(missing) - 1
                run.fail("lost_events", self.index, f"turn {number}: {turn.failure}")
        self.turn = None
        return turn

"""The SIP side of the surface fuzzer (:func:`surface_fuzzing.surface_fuzz`): hostile callers, a hostile
application, and strangers on the calls' media ports.

- **Callers** send INVITEs over UDP and TCP, well formed or mutated (lines dropped, repeated, cut,
  garbled; lying ``Content-Length``; junk after the body; mutated SDP), floods from one address,
  garbage datagrams and stray requests (BYE, CANCEL, OPTIONS of unknown calls). An answered call is
  ACKed, then talks (G.711 RTP), stays silent, hangs up at any moment, or vanishes.
- **The application** (the webhook every ringing call is posted to) checks each post against the
  ``openai`` SDK's ``RealtimeCallIncomingWebhookEvent`` and, when the run signs webhooks, its
  signature; then it answers late, badly or not at all, and accepts (with valid or hostile session
  bodies), rejects (with valid or invalid statuses), accepts twice, refers (with valid and hostile
  targets), hangs up, and watches calls over ``/v1/realtime?call_id=`` with junk among its events.
- **Strangers** spray RTP and garbage at the media ports from other addresses.

Everything stays on this machine. The addresses a caller's messages name (Via, Contact, From, To, the
request line) are its own loopback socket's and are only ever dropped or repeated, never garbled; the
SDP's connection lines name the caller, loopback or one of the fuzzer's UDP sinks on this host's own
addresses (:class:`surface_fuzzing.Here`), and every SDP passes :func:`surface_fuzzing.keep_local`
(which replaces inet_aton's short forms too: a cut ``192.0.2.2`` is ``192.0``, read as 192.0.0.0).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sip_clients import ulaw
from surface_fuzzing import SURFACE_KEY, Sent, SurfaceRun, hostile_json, http_request, keep_local

from s2s_rt.server.sip import free_port, sign_webhook

#: The server's SIP settings in a run: short timeouts, so that every call the fuzzer leaves ends in time.
SIP_SETTINGS: dict[str, Any] = {"sip_answer_timeout_s": 2.0, "sip_media_timeout_s": 2.0, "sip_host": "127.0.0.1"}
#: What a caller says when it talks: a tone (the fake stack hears it as speech), as μ-law RTP payloads.
_TONE = np.sin(2 * np.pi * 300 * np.arange(8000) / 8000) * 9000


TONE = ulaw(_TONE)
SILENCE = bytes([0xFF]) * 160


def rtp(seq: int, ssrc: int, payload: bytes, payload_type: int = 0) -> bytes:
    head = bytes([0x80, (0x80 if seq == 0 else 0) | payload_type]) + (seq & 0xFFFF).to_bytes(2, "big")
    return head + ((seq * 160) & 0xFFFFFFFF).to_bytes(4, "big") + ssrc.to_bytes(4, "big") + payload


# --- the application -------------------------------------------------------------------------------


class Application:
    """The operator's application: the webhook ringing calls are posted to, and its answers through the
    routes (``POST /v1/realtime/calls/{call_id}/accept|reject|refer|hangup``) and the call's WebSocket."""

    def __init__(self, seed: int, secret: str | None) -> None:
        self.rng = random.Random(f"{seed}:app")
        self.secret = secret
        self.run: SurfaceRun | None = None
        self.port = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._post, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=10)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _post(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        run = self.run
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            fields = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in head.decode("latin-1").split("\r\n")[1:])
            }
            body = await asyncio.wait_for(reader.readexactly(int(fields.get("content-length", "0"))), 10)
            if run is None:
                return
            run.report.stats["sip webhooks"] += 1
            self._check(run, fields, body)
            how = self.rng.choices(["ok", "slow", "error", "drop"], weights=[8, 1, 1, 1])[0]
            run.report.stats[f"sip webhook answered {how}"] += 1
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self._spawn(self._answer(run, str(json.loads(body)["data"]["call_id"])))
            if how == "slow":
                await asyncio.sleep(self.rng.uniform(1.0, 3.0))
            if how == "drop":
                return
            status = b"500 Internal Server Error" if how == "error" else b"200 OK"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            pass
        finally:
            writer.close()

    def _check(self, run: SurfaceRun, fields: dict[str, str], body: bytes) -> None:
        """The post is an event the SDK's own type takes, signed when the run signs (a finding otherwise)."""
        from openai.types.webhooks import RealtimeCallIncomingWebhookEvent

        try:
            RealtimeCallIncomingWebhookEvent.model_validate_json(body)
        except Exception as exc:
            run.find(None, f"the webhook's body is no RealtimeCallIncomingWebhookEvent: {exc!r:.300} {body[:300]!r}")
        if self.secret is not None:
            expected = sign_webhook(
                self.secret, fields.get("webhook-id", ""), int(fields.get("webhook-timestamp", "0") or 0), body
            )
            if fields.get("webhook-signature") != expected:
                run.find(None, f"the webhook's signature is wrong: {fields.get('webhook-signature')!r}")

    async def _route(self, run: SurfaceRun, call_id: str, action: str, body: bytes, what: str) -> int:
        headers = [("Content-Type", "application/json")]
        if run.keys:
            headers += (
                [("Authorization", f"Bearer {SURFACE_KEY}")] if self.rng.random() < 0.9 else run.credentials(self.rng)
            )
        raw = http_request("POST", f"/v1/realtime/calls/{call_id}/{action}", run.port, headers, body)
        answer = await run.send("app", f"sip {action}: {what}", raw, timeout=10)
        return answer.status

    async def _answer(self, run: SurfaceRun, call_id: str) -> None:
        """The application's answer to one ringing call, and what it does with the call after."""
        rng = self.rng
        await asyncio.sleep(rng.choice([0.0, 0.0, 0.05, 0.3, 1.0]))
        how = rng.choices(
            ["accept", "accept hostile", "reject", "reject bad", "nothing", "late", "hangup", "twice"],
            weights=[8, 2, 2, 1, 1, 1, 1, 1],
        )[0]
        if how == "late":
            await asyncio.sleep(2.5)  # after sip_answer_timeout_s: the call is gone (404)
        if how in ("accept", "late", "twice"):
            session = {"type": "realtime", "instructions": "Answer briefly."} if rng.random() < 0.5 else {}
            status = await self._route(run, call_id, "accept", json.dumps(session).encode(), "valid")
            if how == "twice":
                await self._route(run, call_id, rng.choice(["accept", "reject"]), b"{}", "a second answer")
        elif how == "accept hostile":
            body, what = hostile_json(rng, field="session")
            status = await self._route(run, call_id, "accept", body, what)
        elif how == "reject":
            code = rng.choice([486, 603, 404, 480, 600])
            status = await self._route(run, call_id, "reject", json.dumps({"status_code": code}).encode(), str(code))
        elif how == "reject bad":
            bad = rng.choice([{"status_code": 200}, {"status_code": "486"}, {"status_code": True}, [], "x", None])
            status = await self._route(run, call_id, "reject", json.dumps(bad).encode(), f"{bad!r}")
        elif how == "hangup":
            status = await self._route(run, call_id, "hangup", b"", "while it rings")
        else:
            return
        run.report.stats[f"sip app {how} -> {status}"] += 1
        if status != 200 or how not in ("accept", "accept hostile", "twice"):
            return
        for _ in range(rng.randrange(0, 3)):
            then = rng.choices(["watch", "refer", "refer bad", "hangup", "wait"], weights=[3, 1, 1, 1, 2])[0]
            if then == "watch":
                await self._watch(run, call_id)
            elif then == "refer":
                target = rng.choice(["sip:desk@127.0.0.1", "tel:+15551234567", "sips:queue@127.0.0.1:5061"])
                await self._route(run, call_id, "refer", json.dumps({"target_uri": target}).encode(), target)
            elif then == "refer bad":
                target = rng.choice(
                    [
                        "sip:a@127.0.0.1>\r\nX-Injected: 1",
                        "http://127.0.0.1/",
                        "sip:" + "a" * 600,
                        "sip:a@127.0.0.1\x00",
                        "sip:<a>",
                        12,
                        None,
                        "",
                    ]
                )
                await self._route(run, call_id, "refer", json.dumps({"target_uri": target}).encode(), f"{target!r:.40}")
            elif then == "hangup":
                await self._route(run, call_id, "hangup", b"", "answered")
                return
            else:
                await asyncio.sleep(rng.uniform(0.2, 1.5))

    async def _watch(self, run: SurfaceRun, call_id: str) -> None:
        """The call's WebSocket: a few events, junk among them, read for a moment, then closed."""
        from websockets.asyncio.client import connect

        rng = self.rng
        asked = call_id if rng.random() < 0.8 else rng.choice(["", "rtc_nope", call_id + "x", "%00", "a" * 300])
        headers = [("Authorization", f"Bearer {SURFACE_KEY}")] if run.keys and rng.random() < 0.9 else []
        url = f"ws://127.0.0.1:{run.port}/v1/realtime?call_id={asked}"
        events: list[str | bytes] = [
            json.dumps({"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}}),
            json.dumps({"type": "response.create"}),
            json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(TONE[:4800]).decode()}),
            "{not json",
            b"\x00\xff binary",
            json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user"}}),
            json.dumps({"type": "response.cancel"}),
        ]
        try:
            async with asyncio.timeout(6):
                async with connect(url, additional_headers=headers, open_timeout=5, max_size=None) as ws:
                    run.report.stats["sip watches opened"] += 1
                    for event in rng.sample(events, rng.randrange(1, len(events))):
                        await ws.send(event)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(rng.uniform(0.2, 2.0)):
                            async for _ in ws:
                                run.report.stats["sip watch events received"] += 1
        except Exception as exc:
            run.report.stats[f"sip watch ended: {type(exc).__name__}"] += 1


# --- the callers ---------------------------------------------------------------------------------------

#: The INVITE's lines; the first six and Contact name addresses (only dropped or repeated when mutated).
INVITE = [
    "INVITE sip:agent@127.0.0.1:{sip} SIP/2.0",
    "Via: SIP/2.0/{proto} {me}:{me_port};branch=z9hG4bK{tag}",
    "From: <sip:fuzz@{me}>;tag={tag}",
    "To: <sip:agent@127.0.0.1:{sip}>",
    "Call-ID: {call_id}",
    "CSeq: 1 INVITE",
    "Contact: <sip:fuzz@{me}:{me_port};transport={proto_lower}>",
    "Max-Forwards: 70",
    "Content-Type: application/sdp",
    "User-Agent: s2s-rt-fuzz",
]
ADDRESS_LINES = {0, 1, 2, 3, 6}
SDP = [
    "v=0",
    "o=- {tag} 1 IN IP4 {me}",
    "s=-",
    "c=IN IP4 {media_host}",
    "t=0 0",
    "m=audio {media_port} RTP/AVP {payload_types}",
    "a=rtpmap:0 PCMU/8000",
    "a=rtpmap:8 PCMA/8000",
    "a=rtpmap:101 telephone-event/8000",
    "a=fmtp:101 0-15",
    "a={direction}",
]
JUNK = "abcXYZ019 ;:=<>@\"'%\\/\t,\x00\x7f\u00e9\u2028\ud800\U0001f600"


def _junk(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(JUNK) for _ in range(n))


def _mutate(rng: random.Random, lines: list[str], fixed: set[int], done: list[str]) -> list[str]:
    out: list[str] = []
    for i, line in enumerate(lines):
        how = rng.choices(["keep", "drop", "twice", "cut", "junk", "empty"], weights=[30, 1, 1, 1, 1, 1])[0]
        if i in fixed and how not in ("keep", "drop", "twice"):
            how = "keep"
        if how != "keep":
            done.append(f"{how} {line.split(':', 1)[0][:12]}")
        if how in ("keep", "twice"):
            out += [line] * (2 if how == "twice" else 1)
        elif how == "cut":
            out.append(line[: rng.randrange(len(line) + 1)])
        elif how == "junk":
            out.append(line + _junk(rng, rng.randrange(1, 30)))
        elif how == "empty":
            out.append("")
    return out


@dataclass
class Caller:
    """One caller's socket on its own loopback address."""

    run: SurfaceRun
    who: str
    me: str
    #: The server's SIP port (a request the server sends is answered there).
    sip_port: int
    sock: socket.socket = field(init=False)
    #: The CSeq of an in-dialog request sent out of order (a 500 to it is RFC 3261's answer); None: none is.
    out_of_order: list[str] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((self.me, 0))
        self.sock.setblocking(False)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()

    def record(self, what: str, raw: bytes) -> None:
        run = self.run
        run.count += 1
        run.sent_log.append(Sent(run.count, self.who, what, self.me, raw, time.monotonic(), time.monotonic()))
        run.report.stats[f"sip {what.split(':', 1)[0]}"] += 1

    async def receive(self, seconds: float) -> list[str]:
        """The SIP messages that come in ``seconds`` (a request from the server is answered 200)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        got = []
        while (left := end - loop.time()) > 0:
            try:
                data = await asyncio.wait_for(loop.sock_recv(self.sock, 65536), left)
            except TimeoutError:
                break
            text = data.decode("utf-8", "replace")
            got.append(text)
            first = text.split("\r\n", 1)[0]
            if first.startswith("SIP/2.0 "):
                self.run.report.stats[f"sip answered {first[8:11]}"] += 1
                if first[8:11] == "500" and not (
                    self.out_of_order is not None and _header(text, "cseq") == self.out_of_order
                ):
                    self.run.find_with(f"the server answered {first!r}", list(self.run.sent_log)[-6:])
                elif first[8:11] == "500":
                    self.run.report.stats["sip answered 500 to a CSeq out of order (RFC 3261 12.2.2)"] += 1
            elif first.split(" ", 1)[0] in ("BYE", "REFER", "NOTIFY", "OPTIONS"):
                self.run.report.stats[f"sip server sent {first.split(' ', 1)[0]}"] += 1
                with contextlib.suppress(OSError):
                    self.sock.sendto(_reply(text, "200 OK"), ("127.0.0.1", self.sip_port))
        return got


def _header(text: str, name: str) -> list[str]:
    """``name``'s values in a SIP message, its lines read as the server reads them (a bare LF ends one too)."""
    head = re.split(r"\r?\n\r?\n", text, maxsplit=1)[0]
    lines = re.split(r"\r?\n", head)[1:]
    return [v.strip() for k, _, v in (line.partition(":") for line in lines) if k.lower() == name]


def _reply(request: str, status: str) -> bytes:
    lines = [f"SIP/2.0 {status}"]
    for name in ("via", "from", "to", "call-id", "cseq"):
        lines += [f"{name.title()}: {v}" for v in _header(request, name)]
    return ("\r\n".join(lines) + "\r\nContent-Length: 0\r\n\r\n").encode("utf-8", "surrogatepass")


def _ack(invite: str, ok: str) -> bytes:
    lines = ["ACK sip:agent@127.0.0.1 SIP/2.0", *(f"Via: {v}" for v in _header(invite, "via")[:1])]
    lines += [f"From: {v}" for v in _header(invite, "from")[:1]]
    lines += [f"To: {v}" for v in _header(ok, "to")[:1]]
    lines += [f"Call-ID: {v}" for v in _header(invite, "call-id")[:1]]
    return ("\r\n".join([*lines, "CSeq: 1 ACK", "Max-Forwards: 70"]) + "\r\nContent-Length: 0\r\n\r\n").encode(
        "utf-8", "surrogatepass"
    )


def _bye(invite: str, ok: str) -> bytes:
    lines = ["BYE sip:agent@127.0.0.1 SIP/2.0", *(f"Via: {v}" for v in _header(invite, "via")[:1])]
    lines += [f"From: {v}" for v in _header(invite, "from")[:1]]
    lines += [f"To: {v}" for v in _header(ok, "to")[:1]]
    lines += [f"Call-ID: {v}" for v in _header(invite, "call-id")[:1]]
    return ("\r\n".join([*lines, "CSeq: 3 BYE", "Max-Forwards: 70"]) + "\r\nContent-Length: 0\r\n\r\n").encode(
        "utf-8", "surrogatepass"
    )


def build_invite(
    run: SurfaceRun, rng: random.Random, caller: Caller, sip_port: int, proto: str, mutate: bool
) -> tuple[str, str]:
    """An INVITE from ``caller`` (perhaps mutated, every address kept on this machine); it and what it is."""
    tag = f"{rng.getrandbits(48):x}"
    media_host, media_port = caller.me, rng.randrange(40000, 60000, 2)
    pick = rng.random()
    if pick < 0.15:
        media_host, media_port = run.here.sink(rng)
    elif pick < 0.25:
        media_host = rng.choice(["127.0.0.1", "0.0.0.0", caller.me])
    values = {
        "sip": sip_port,
        "proto": proto,
        "proto_lower": proto.lower(),
        "me": caller.me,
        "me_port": caller.port,
        "tag": tag,
        "call_id": f"fuzz-{tag}@{caller.me}",
        "media_host": media_host if ":" not in media_host else "127.0.0.1",
        "media_port": media_port,
        "payload_types": rng.choice(["0 8 101", "8 0", "0", "101", "9 18", "0 0 0", "96", ""]),
        "direction": rng.choice(["sendrecv"] * 5 + ["sendonly", "recvonly", "inactive"]),
    }
    done: list[str] = []
    head = [line.format(**values) for line in INVITE]
    sdp = [line.format(**values) for line in SDP]
    if mutate:
        head = _mutate(rng, head, ADDRESS_LINES, done)
        sdp = _mutate(rng, sdp, set(), done)
        if rng.random() < 0.2:
            head += [f"X-Fuzz-{i}: {_junk(rng, 20)}" for i in range(rng.choice([1, 50, 400]))]
            done.append("many headers")
    body = keep_local("\r\n".join(sdp) + "\r\n", run.here)
    length = len(body.encode("utf-8", "surrogatepass"))
    if mutate and rng.random() < 0.2:
        length = rng.choice([0, length - 7, length + 50, 10**9, -1])
        done.append(f"Content-Length {length}")
    tail = _junk(rng, rng.randrange(1, 80)) if mutate and rng.random() < 0.1 else ""
    # The head's addresses are the caller's own (only dropped or repeated); the SDP's pass keep_local. The head
    # does not (its SIP/2.0 would read as an address), nor does the tail (no dots in the junk: no address).
    text = "\r\n".join(head) + f"\r\nContent-Length: {length}\r\n\r\n" + body + tail
    return text, "; ".join(done) or "well formed"


async def _call(run: SurfaceRun, rng: random.Random, caller: Caller, sip_port: int, mutate: bool) -> None:
    """One INVITE over UDP, and the call after it when the server answers."""
    text, what = build_invite(run, rng, caller, sip_port, "UDP", mutate)
    raw = text.encode("utf-8", "surrogatepass")[:65000]
    caller.record(f"invite: {what}", raw)
    with contextlib.suppress(OSError):
        caller.sock.sendto(raw, ("127.0.0.1", sip_port))
    ok = ""
    loop = asyncio.get_running_loop()
    end = loop.time() + 5.0  # ringing, the webhook's answer (2 s at most) and a margin
    while not ok and loop.time() < end and not run.hostile_over():
        for message in await caller.receive(0.25):
            first = message.split("\r\n", 1)[0]
            if first.startswith("SIP/2.0 200"):
                ok = message
            elif re.match(r"SIP/2\.0 [3-6]\d\d", first):
                with contextlib.suppress(OSError):  # a refusal is ACKed
                    caller.sock.sendto(_ack(text, message), ("127.0.0.1", sip_port))
                return
    if not ok:
        return
    run.report.stats["sip calls answered"] += 1
    fate = rng.choices(
        ["talk", "talk and bye", "bye at once", "no ack", "silent", "vanish", "reinvite"],
        weights=[3, 3, 1, 1, 1, 1, 2],
    )
    fate_name = fate[0]
    run.report.stats[f"sip call {fate_name}"] += 1
    if fate_name != "no ack":
        with contextlib.suppress(OSError):
            caller.sock.sendto(_ack(text, ok), ("127.0.0.1", sip_port))
    media = re.search(r"m=audio (\d+)", ok)
    host = re.search(r"c=IN IP4 ([\d.]+)", ok)
    if fate_name.startswith("talk") and media and host and run.here.allows(host.group(1)):
        target = (host.group(1), int(media.group(1)))
        rtp_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rtp_sock.bind((caller.me, 0))
        ssrc = rng.getrandbits(32)
        try:
            for seq in range(int(rng.uniform(0.5, 4.0) * 50)):
                payload = TONE[(seq % 50) * 160 : (seq % 50 + 1) * 160] if (seq // 50) % 2 == 0 else SILENCE
                with contextlib.suppress(OSError):
                    rtp_sock.sendto(rtp(seq, ssrc, payload), target)
                if seq % 10 == 0:
                    await caller.receive(0.0)
                await asyncio.sleep(0.02)
                if run.hostile_over():
                    break
        finally:
            rtp_sock.close()
    elif fate_name == "silent":
        await caller.receive(rng.uniform(0.5, 3.0))
    elif fate_name == "reinvite":
        # In the dialog (the 200's To tag): a refresh, or the media moved to a sink or held (c=0.0.0.0).
        again, what = build_invite(run, rng, caller, sip_port, "UDP", mutate=rng.random() < 0.5)
        again = again.replace("CSeq: 1 INVITE", "CSeq: 2 INVITE")
        for to in _header(ok, "to")[:1]:
            again = re.sub(r"(?m)^To: [^\r\n]*", lambda _, to=to: f"To: {to}", again)  # a literal: values may hold "\\"
        for call_id in _header(text, "call-id")[:1]:
            again = re.sub(r"(?m)^Call-ID: [^\r\n]*", lambda _, c=call_id: f"Call-ID: {c}", again)
        sender = "From: " + (_header(text, "from") or [""])[0]
        again = re.sub(r"(?m)^From: [^\r\n]*", lambda _: sender, again)  # its line's CR kept
        raw = again.encode("utf-8", "surrogatepass")[:65000]
        caller.record(f"reinvite: {what}", raw)
        # A CSeq not above the dialog's (1, the INVITE's; a mutation may cut or garble it) is out of order: RFC 3261
        # 12.2.2 has it refused with a 500, which is then the right answer, not a fault.
        cseq = _header(again, "cseq")
        number = cseq[0].split(" ", 1)[0] if cseq else ""
        caller.out_of_order = cseq if not (number.isdigit() and int(number) > 1) else None
        with contextlib.suppress(OSError):
            caller.sock.sendto(raw, ("127.0.0.1", sip_port))
        for message in await caller.receive(rng.uniform(0.3, 2.0)):
            if message.startswith("SIP/2.0 2"):
                with contextlib.suppress(OSError):
                    caller.sock.sendto(
                        _ack(again, message).replace(b"CSeq: 1 ACK", b"CSeq: 2 ACK"), ("127.0.0.1", sip_port)
                    )
    if fate_name in ("talk and bye", "bye at once"):
        with contextlib.suppress(OSError):
            caller.sock.sendto(_bye(text, ok), ("127.0.0.1", sip_port))
        await caller.receive(0.5)


async def sip_worker(run: SurfaceRun, index: int, seed: int, sip_port: int, media: range) -> None:
    """A hostile caller: INVITEs (well formed, mutated, over TCP, in floods), garbage and strangers' RTP."""
    rng = random.Random(f"{seed}:sip{index}")
    who = f"s{index}"
    actions = {"call": 6, "mutated": 6, "tcp": 2, "flood": 1, "garbage": 2, "stray": 2, "pause": 2}
    while not run.hostile_over():
        action = rng.choices(list(actions), weights=list(actions.values()))[0]
        me = f"127.0.{40 + index}.{rng.randrange(1, 9)}"
        if action in ("call", "mutated"):
            caller = Caller(run, who, me, sip_port)
            try:
                await _call(run, rng, caller, sip_port, mutate=action == "mutated")
            finally:
                caller.close()
        elif action == "tcp":
            caller = Caller(run, who, me, sip_port)
            text, what = build_invite(run, rng, caller, sip_port, "TCP", mutate=rng.random() < 0.7)
            raw = text.encode("utf-8", "surrogatepass")
            caller.record(f"tcp invite: {what}", raw)
            caller.close()
            try:
                async with asyncio.timeout(5):
                    reader, writer = await asyncio.open_connection("127.0.0.1", sip_port, local_addr=(me, 0))
                    writer.write(raw[: rng.choice([len(raw), len(raw), rng.randrange(len(raw) + 1)])])
                    await writer.drain()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(rng.uniform(0.0, 3.0)):
                            while chunk := await reader.read(65536):
                                if chunk.startswith(b"SIP/2.0 500"):
                                    run.find_with(f"the server answered {chunk[:40]!r}", list(run.sent_log)[-6:])
                    writer.close()
            except (OSError, TimeoutError):
                pass
        elif action == "flood":
            source = run.fresh_source()
            caller = Caller(run, who, source, sip_port)
            try:
                for _ in range(rng.choice([10, 40])):
                    text, what = build_invite(run, rng, caller, sip_port, "UDP", mutate=rng.random() < 0.3)
                    raw = text.encode("utf-8", "surrogatepass")[:65000]
                    caller.record(f"flood invite: {what}", raw)
                    with contextlib.suppress(OSError):
                        caller.sock.sendto(raw, ("127.0.0.1", sip_port))
                await caller.receive(1.0)
            finally:
                caller.close()
        elif action == "garbage":
            caller = Caller(run, who, me, sip_port)
            try:
                kind = rng.choice(["bytes", "bye", "cancel", "options", "response"])
                if kind == "bytes":
                    raw = rng.randbytes(rng.randrange(0, 1400))
                else:
                    method = {"bye": "BYE", "cancel": "CANCEL", "options": "OPTIONS", "response": ""}[kind]
                    first = f"{method} sip:agent@127.0.0.1:{sip_port} SIP/2.0" if method else "SIP/2.0 200 OK"
                    raw = (
                        f"{first}\r\nVia: SIP/2.0/UDP {me}:{caller.port};branch=z9hG4bK{rng.getrandbits(32)}\r\n"
                        f"From: <sip:x@{me}>;tag=1\r\nTo: <sip:agent@127.0.0.1>\r\n"
                        f"Call-ID: nope-{rng.getrandbits(32)}\r\n"
                        f"CSeq: 1 {method or 'INVITE'}\r\nContent-Length: 0\r\n\r\n"
                    ).encode()
                caller.record(f"garbage: {kind}", raw)
                with contextlib.suppress(OSError):
                    caller.sock.sendto(raw, ("127.0.0.1", sip_port))
                await caller.receive(0.2)
            finally:
                caller.close()
        elif action == "stray":
            stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            stranger.bind((f"127.0.60.{rng.randrange(1, 9)}", 0))
            ssrc = rng.getrandbits(32)
            run.report.stats["sip stray media bursts"] += 1
            try:
                for seq in range(rng.choice([20, 100])):
                    port = rng.choice(list(media))
                    data = rtp(seq, ssrc, TONE[:160]) if rng.random() < 0.7 else rng.randbytes(rng.randrange(1, 300))
                    with contextlib.suppress(OSError):
                        stranger.sendto(data, ("127.0.0.1", port))
                    if seq % 20 == 0:
                        await asyncio.sleep(0.01)
            finally:
                stranger.close()
        else:
            await asyncio.sleep(rng.choice([0.0, 0.1, 0.5]))


@dataclass
class SipSide:
    """A run's SIP: the server's port and media ports, and the application its webhook posts to."""

    port: int
    media: range
    app: Application

    @classmethod
    async def open(cls, seed: int, keys: bool) -> SipSide:
        rng = random.Random(f"{seed}:sip")
        secret = "whsec_" + base64.b64encode(rng.randbytes(32)).decode() if keys else None
        app = Application(seed, secret)
        await app.start()
        low = rng.randrange(32000, 39000, 2)
        return cls(free_port("127.0.0.1"), range(low, low + 40), app)

    def settings(self) -> dict[str, Any]:
        out = SIP_SETTINGS | {
            "sip_port": self.port,
            "sip_media_ports": f"{self.media.start}-{self.media.stop - 1}",
            "sip_webhook_url": f"http://127.0.0.1:{self.app.port}/hook",
        }
        if self.app.secret is not None:
            out["sip_webhook_secret"] = self.app.secret
        return out

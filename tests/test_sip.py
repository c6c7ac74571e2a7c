"""Phone calls over SIP (issue 41): a real SIP client (SIPp) dials the server, which answers with the pool's sessions.

The caller's offer asks for the answers' audio on a UDP port the test reads
itself, so what the caller would hear is checked here: RTP packets of G.711.
The application's side (the webhook, accept, reject) is played by the
official ``openai`` SDK: ``webhooks.unwrap`` checks the signature and
``realtime.calls.accept`` / ``reject`` answer the call.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import socket
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import RealtimeClient, collector_off, eventually, live_server, run, serving_now, silence, still_held, tone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI, BadRequestError
from sip_clients import answered, cancelled, from_ulaw, moved, refused, silent, sipp, transferred, ulaw
from test_third_party_clients import needs_question_voice, spoken_question

SECRET = "whsec_" + base64.b64encode(b"a test secret of thirty-two bytes").decode()


def _question() -> bytes:
    """What the caller says: a second of tone (the fake stack's VAD hears it as speech), then silence."""
    pcm = np.frombuffer(tone(300, 1.2, rate=8000) + silence(4.0, rate=8000), dtype="<i2")
    return ulaw(pcm)


class Ear:
    """The caller's side of the answers' RTP: counts G.711 payload bytes that are not silence."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port = int(self.sock.getsockname()[1])
        self.packets = 0
        #: Every payload byte heard, in order of arrival (G.711 as sent).
        self.payload = bytearray()
        self.loud_samples = 0
        self.payload_types: set[int] = set()
        #: (arrival time, samples, any of them loud) per packet.
        self.arrivals: list[tuple[float, int, bool]] = []

    async def listen(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            try:
                data = await asyncio.wait_for(loop.sock_recv(self.sock, 2048), end - loop.time())
            except TimeoutError:
                return
            if len(data) <= 12:
                continue
            self.packets += 1
            self.payload_types.add(data[1] & 0x7F)
            self.payload += data[12:]
            payload = np.frombuffer(data[12:], dtype=np.uint8)
            # μ-law silence is 0xFF/0x7F; A-law's 0xD5/0x55: anything else far from them is sound.
            loud = int(np.count_nonzero((payload & 0x7F) < 0x70))
            self.loud_samples += loud
            self.arrivals.append((time.perf_counter(), len(payload), loud > 0))

    def close(self) -> None:
        self.sock.close()


async def _free(server: Any, n: int) -> bool:
    return server.pool.free == n


async def _all_ended(server: Any, n: int) -> bool:
    """Every call forgotten and ``n`` slots free: a slot comes back as its session ends, and the call is forgotten
    once its RTP is closed, just after (so one is waited for, not only the other)."""
    return await _free(server, n) and await _no_calls(server)


def test_a_call_is_answered_in_speech_and_its_slot_comes_back_when_the_caller_hangs_up(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2, sip_port=0, sip_accept=True) as server:
            assert server.phones is not None and server.phones.port
            ear = Ear()
            try:
                listening = asyncio.create_task(ear.listen(8.0))
                rc, out = await sipp(tmp_path, answered(5500, ear.port), server.phones.port, audio=_question())
                await listening
            finally:
                ear.close()
            assert rc == 0, out[-3000:]
            print(
                f"\nheard {ear.packets} RTP packets, {ear.loud_samples / 8000:.2f} s not silent, PT {ear.payload_types}"
            )
            assert ear.payload_types <= {0, 8} and ear.payload_types
            assert ear.loud_samples >= 8000 // 2  # half a second of answer at least
            assert await eventually(lambda: _all_ended(server, 2), 5), server.phones.calls

    run(scenario())


def test_nothing_of_a_phone_call_stays_referenced_after_it_ends(tmp_path: Path) -> None:
    """A phone call's session, context and call are freed by reference counting once the caller hangs up: not
    left to the cyclic collector, which the server runs seldom."""

    async def scenario() -> None:
        async with live_server(pool_size=1, sip_port=0, sip_accept=True) as server:
            held: list[Any] = []

            async def answered_call() -> bool:
                if not server.phones.calls:
                    return False
                held[:] = serving_now(server) + [weakref.ref(c) for c in server.phones.calls.values()]
                return len(held) == 3

            ear = Ear()
            try:
                with collector_off():
                    caller = asyncio.create_task(
                        sipp(tmp_path, answered(3000, ear.port), server.phones.port, audio=_question())
                    )
                    assert await eventually(answered_call, 10)
                    rc, out = await caller
                    assert rc == 0, out[-3000:]
                    assert await eventually(lambda: _free(server, 1), 5)
                    assert await eventually(lambda: _no_calls(server), 5)
                    await asyncio.sleep(0.1)
                    assert not still_held(held), still_held(held)
            finally:
                ear.close()

    run(scenario())


def test_behind_nat_the_server_names_its_advertised_address_and_is_reached_there(tmp_path: Path) -> None:
    """SIP and RTP listen on every address; the Contact and the SDP answer name 127.0.0.2 (as a public address
    mapped to a private one would be), and the caller's audio sent there is heard and answered."""

    async def scenario() -> None:
        async with live_server(
            pool_size=1, sip_port=0, sip_host="0.0.0.0", sip_advertised_host="127.0.0.2", sip_accept=True
        ) as server:
            assert server.phones is not None and server.phones.port
            ear = Ear()
            try:
                listening = asyncio.create_task(ear.listen(8.0))
                has = r"Contact: <sip:127\.0\.0\.2:[0-9]+>.*c=IN IP4 127\.0\.0\.2"
                scenario = answered(5500, ear.port, answer_has=has)
                rc, out = await sipp(tmp_path, scenario, server.phones.port, audio=_question())
                await listening
            finally:
                ear.close()
            assert rc == 0, out[-3000:]
            assert ear.loud_samples >= 8000 // 2
            assert await eventually(lambda: _free(server, 1), 5)

    run(scenario())


def test_a_reinvite_is_answered_and_moves_the_answers_audio_where_it_says(tmp_path: Path) -> None:
    """A PBX re-INVITEs to refresh a session or move its media: unanswered, it would end the call in 32 s."""

    async def scenario() -> None:
        async with live_server(pool_size=1, sip_port=0, sip_accept=True) as server:
            assert server.phones is not None and server.phones.port
            before, after = Ear(), Ear()
            try:
                listening = [asyncio.create_task(ear.listen(9.0)) for ear in (before, after)]
                calls = moved(5500, before.port, after.port)
                rc, out = await sipp(tmp_path, calls, server.phones.port, audio=_question())
                await asyncio.gather(*listening)
            finally:
                before.close()
                after.close()
            assert rc == 0, out[-3000:]
            assert after.loud_samples >= 8000 // 2 and before.packets == 0, (before.packets, after.loud_samples)
            assert await eventually(lambda: _free(server, 1), 5)

    run(scenario())


def test_a_call_over_tcp_is_answered_too(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, sip_port=0, sip_accept=True) as server:
            assert server.phones is not None
            rc, out = await sipp(tmp_path, answered(1000, 9), server.phones.port, transport="t1")
            assert rc == 0, out[-3000:]
            assert await eventually(lambda: _free(server, 1), 5)

    run(scenario())


def test_a_full_pool_answers_busy_and_no_webhook_or_setting_declines(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, sip_port=0, sip_accept=True) as server:
            assert server.phones is not None
            async with RealtimeClient.connect(server) as holder:
                await holder.until("session.created")
                rc, out = await sipp(tmp_path / "busy", refused(486), server.phones.port)
                assert rc == 0, out[-3000:]
            assert await eventually(lambda: _free(server, 1), 5)
        async with live_server(pool_size=1, sip_port=0) as server:  # neither a webhook nor sip_accept
            assert server.phones is not None
            rc, out = await sipp(tmp_path / "declined", refused(603), server.phones.port)
            assert rc == 0, out[-3000:]
            assert await eventually(lambda: _free(server, 1), 5)

    run(scenario())


class Webhook:
    """The operator's application: takes ``realtime.call.incoming`` posts (answers 200) and hands them over."""

    def __init__(self) -> None:
        self.posts: asyncio.Queue[tuple[dict[str, str], bytes]] = asyncio.Queue()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Webhook:
        self.server = await asyncio.start_server(self._one, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def rung(self, caller: asyncio.Task[tuple[int, str]]) -> tuple[dict[str, str], bytes]:
        """The next webhook post, the caller's call having rung (or the caller's output if it ended first)."""
        posted = asyncio.create_task(self.posts.get())
        await asyncio.wait((posted, caller), timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert posted.done(), caller.result() if caller.done() else "no webhook within 10 s"
        return posted.result()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        headers = {}
        for line in head.split("\r\n")[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        await self.posts.put((headers, body))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()


def test_the_webhook_is_signed_and_the_sdk_accepts_the_call(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Webhook() as hook:
            url = f"http://127.0.0.1:{hook.port}/hook"
            async with live_server(
                pool_size=1, sip_port=0, sip_webhook_url=url, sip_webhook_secret=SECRET, api_keys=["sk-test"]
            ) as server:
                assert server.phones is not None
                client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="sk-test")
                ear = Ear()
                caller = asyncio.create_task(
                    sipp(tmp_path, answered(5500, ear.port), server.phones.port, audio=_question())
                )
                listening = asyncio.create_task(ear.listen(9.0))
                headers, body = await hook.rung(caller)
                event = client.webhooks.unwrap(body, headers, secret=SECRET)  # raises if the signature is wrong
                assert event.type == "realtime.call.incoming"
                names = {h.name.lower(): h.value for h in event.data.sip_headers}
                assert names.get("x-caller-account") == "4711"
                # A wrong key may not answer it.
                stranger = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="sk-wrong")
                try:
                    await stranger.realtime.calls.accept(event.data.call_id, type="realtime")
                    raise AssertionError("accepted with a wrong key")
                except Exception as exc:
                    assert getattr(exc, "status_code", None) == 401, exc
                # A configuration a session refuses is this request's 400 (not the call's end); the call rings on.
                try:
                    await client.realtime.calls.accept(
                        event.data.call_id, type="realtime", tools=[{"type": "function", "name": ""}]
                    )
                    raise AssertionError("accepted with a tool without a name")
                except BadRequestError as exc:
                    assert "tools[0].name" in str(exc), exc
                await client.realtime.calls.accept(
                    event.data.call_id,
                    type="realtime",
                    instructions="Answer briefly.",
                    audio={"output": {"voice": "alloy"}},
                )
                rc, out = await caller
                await listening
                ear.close()
                assert rc == 0, out[-3000:]
                assert ear.loud_samples >= 8000 // 2
                assert await eventually(lambda: _free(server, 1), 5)

    run(scenario())


def test_the_sdk_rejects_a_call_with_its_status_and_an_unanswered_call_times_out(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Webhook() as hook:
            url = f"http://127.0.0.1:{hook.port}/hook"
            async with live_server(pool_size=1, sip_port=0, sip_webhook_url=url, sip_answer_timeout_s=1.5) as server:
                assert server.phones is not None
                client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")
                caller = asyncio.create_task(sipp(tmp_path / "rejected", refused(486), server.phones.port))
                _, body = await asyncio.wait_for(hook.posts.get(), 10)
                call_id = json.loads(body)["data"]["call_id"]
                await client.realtime.calls.reject(call_id, status_code=486)
                rc, out = await caller
                assert rc == 0, out[-3000:]
                # Nobody answers this one: refused with 480 once sip_answer_timeout_s has passed.
                rc, out = await sipp(tmp_path / "unanswered", refused(480), server.phones.port)
                assert rc == 0, out[-3000:]
                assert await eventually(lambda: _all_ended(server, 1), 5), server.phones.calls

    run(scenario())


def test_a_flood_of_invites_leaves_no_call_or_slot_behind() -> None:
    async def scenario() -> None:
        async with live_server(pool_size=2, sip_port=0) as server:  # no webhook, no sip_accept: each is declined
            assert server.phones is not None
            port = server.phones.port
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", 0))
            me = sock.getsockname()[1]
            for i in range(200):
                sdp = (
                    "v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
                    f"m=audio {9 + i} RTP/AVP 0\r\n"
                )
                invite = (
                    f"INVITE sip:agent@127.0.0.1:{port} SIP/2.0\r\n"
                    f"Via: SIP/2.0/UDP 127.0.0.1:{me};branch=z9hG4bK{i}\r\n"
                    f"From: <sip:x@127.0.0.1>;tag={i}\r\nTo: <sip:agent@127.0.0.1>\r\nCall-ID: flood-{i}\r\n"
                    f"CSeq: 1 INVITE\r\nContact: <sip:x@127.0.0.1:{me}>\r\nContent-Type: application/sdp\r\n"
                    f"Content-Length: {len(sdp)}\r\n\r\n{sdp}"
                )
                sock.sendto(invite.encode() if i % 3 else invite.encode()[: 40 + i], ("127.0.0.1", port))
            sock.close()
            await asyncio.sleep(1.0)
            assert await eventually(lambda: _all_ended(server, 2), 5), server.phones.calls
            assert all(not agent.active_calls for agent in server.phones._agents)
            async with RealtimeClient.connect(server) as other:  # nobody else noticed
                await other.until("session.created")

    run(scenario())


def test_the_applications_websocket_watches_the_call_hears_its_keypad_and_steers_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Webhook() as hook:
            url = f"http://127.0.0.1:{hook.port}/hook"
            async with live_server(pool_size=2, sip_port=0, sip_webhook_url=url) as server:
                assert server.phones is not None
                client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")
                caller = asyncio.create_task(sipp(tmp_path, answered(4000, 9, keys_after_ms=1500), server.phones.port))
                call_id = json.loads((await hook.rung(caller))[1])["data"]["call_id"]
                # Nobody may watch a call that does not exist.
                async with RealtimeClient.connect(server, path="/v1/realtime?call_id=rtc_nonesuch") as stranger:
                    error = await stranger.until("error")
                    assert error["error"]["code"] == "call_not_found"
                await client.realtime.calls.accept(call_id, type="realtime")
                async with RealtimeClient.connect(server, path=f"/v1/realtime?call_id={call_id}") as app:
                    await app.send("session.update", session={"type": "realtime", "instructions": "Hi."})
                    updated = await app.until("session.updated")
                    assert updated["session"]["instructions"] == "Hi."
                    pressed = await app.until("input_audio_buffer.dtmf_event_received", timeout=10)
                    assert pressed["event"] == "1" and abs(pressed["received_at"] - time.time()) < 30
                rc, out = await caller
                assert rc == 0, out[-3000:]
                assert await eventually(lambda: _free(server, 2), 5)

    run(scenario())


def test_the_sdk_transfers_a_call_and_hangs_it_up(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, sip_port=0, sip_accept=True) as server:
            assert server.phones is not None
            client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")
            caller = asyncio.create_task(
                sipp(tmp_path, transferred("sip:desk@127.0.0.1:5999"), server.phones.port, timeout=25)
            )
            assert await eventually(lambda: _answered(server), 10)
            (call_id,) = server.phones.calls
            bad = "sip:x@127.0.0.1\r\nX-Injected: 1"
            try:
                await client.realtime.calls.refer(call_id, target_uri=bad)
                raise AssertionError("a target with a line break was sent")
            except Exception as exc:
                assert getattr(exc, "status_code", None) == 400, exc
            await client.realtime.calls.refer(call_id, target_uri="sip:desk@127.0.0.1:5999")
            await asyncio.sleep(0.5)
            await client.realtime.calls.hangup(call_id)
            rc, out = await caller
            assert rc == 0, out[-3000:]
            assert await eventually(lambda: _free(server, 1), 5)

    run(scenario())


async def _answered(server: Any) -> bool:
    return any(call.media is not None for call in server.phones.calls.values())


def test_openai_agents_sip_model_drives_a_calls_session(tmp_path: Path) -> None:
    """openai-agents' SIP flow: the payload its model builds accepts the call, then its SIP model attaches."""
    from test_third_party_clients import AgentsRun, _raw_type, library_logs, needs_agents

    needs_agents()
    from agents.realtime import RealtimeAgent, RealtimeRunner
    from agents.realtime.openai_realtime import OpenAIRealtimeSIPModel

    async def scenario() -> None:
        async with Webhook() as hook:
            url = f"http://127.0.0.1:{hook.port}/hook"
            async with live_server(pool_size=1, sip_port=0, sip_webhook_url=url) as server:
                assert server.phones is not None
                client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="sk-local")
                ear = Ear()
                caller = asyncio.create_task(
                    sipp(tmp_path, answered(7000, ear.port), server.phones.port, audio=_question(), timeout=30)
                )
                listening = asyncio.create_task(ear.listen(10.0))
                call_id = json.loads((await hook.rung(caller))[1])["data"]["call_id"]
                agent = RealtimeAgent(name="phone", instructions="Answer callers in one short sentence.")
                payload = await OpenAIRealtimeSIPModel.build_initial_session_payload(agent)
                await client.realtime.calls.accept(call_id, **payload.model_dump(exclude_none=True))
                runner = RealtimeRunner(agent, model=OpenAIRealtimeSIPModel())
                with library_logs("openai.agents") as logs:
                    session = await runner.run(
                        model_config={
                            "call_id": call_id,
                            "url": f"ws://127.0.0.1:{server.port}/v1/realtime?call_id={call_id}",
                            "api_key": "sk-local",
                        }
                    )
                    async with session:
                        r = AgentsRun(session, logs)
                        try:
                            done = await r.wait_for(lambda e: _raw_type(e) == "response.done", 15)
                            assert done.data.data["response"]["status"] == "completed"
                            r.assert_clean()
                        finally:
                            r._task.cancel()
                rc, out = await caller
                await listening
                ear.close()
                assert rc == 0, out[-3000:]
                assert ear.loud_samples >= 8000 // 2
                assert await eventually(lambda: _free(server, 1), 5)

    run(scenario())


def test_a_caller_who_hangs_up_mid_answer_frees_the_slot_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, sip_port=0, sip_accept=True) as server:
            assert server.phones is not None
            ear = Ear()
            listening = asyncio.create_task(ear.listen(6.0))
            # The answer begins about 2 s in (1.2 s of question, 0.5 s of silence, the fake stack's turn).
            rc, out = await sipp(tmp_path, answered(2300, ear.port), server.phones.port, audio=_question())
            assert rc == 0, out[-3000:]
            hung_up = asyncio.get_running_loop().time()
            assert await eventually(lambda: _free(server, 1), 5)
            freed = asyncio.get_running_loop().time() - hung_up
            await listening
            ear.close()
            heard = ear.loud_samples / 8000
            print(f"\nheard {heard:.2f} s of the answer before hanging up; slot back {freed:.2f} s later")
            assert 0 < ear.loud_samples
            assert freed < 2.0

    run(scenario())


INVITE_LINES = [
    "INVITE sip:agent@127.0.0.1:{port} SIP/2.0",
    "Via: SIP/2.0/{proto} 127.0.0.1:{me};branch=z9hG4bK{n}",
    "From: <sip:fuzz@127.0.0.1>;tag={n}",
    "To: <sip:agent@127.0.0.1>",
    "Call-ID: fuzz-{n}",
    "CSeq: 1 INVITE",
    "Contact: <sip:fuzz@127.0.0.1:{me}>",
    "Content-Type: application/sdp",
]
SDP_LINES = ["v=0", "o=- 1 1 IN IP4 127.0.0.1", "s=-", "c=IN IP4 127.0.0.1", "t=0 0", "m=audio {rtp} RTP/AVP 0 8 101"]


@st.composite
def mutated_invites(draw: st.DrawFn) -> tuple[list[str], list[str], int | None, bytes]:
    """An INVITE's header lines and SDP, each perhaps dropped, repeated, cut or garbled; a Content-Length
    that may lie; trailing junk. Every address stays 127.0.0.1 (the server answers and sends media there)."""
    junk = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x2FF), max_size=40)

    def mutate(lines: list[str]) -> list[str]:
        out = []
        for line in lines:
            how = draw(st.sampled_from(["keep"] * 6 + ["drop", "twice", "cut", "junk", "empty"]))
            if how == "keep":
                out.append(line)
            elif how == "twice":
                out += [line, line]
            elif how == "cut":
                out.append(line[: draw(st.integers(0, len(line)))])
            elif how == "junk":
                out.append(line + draw(junk))
            elif how == "empty":
                out.append("")
        return out

    length = draw(st.one_of(st.none(), st.integers(-5, 100_000)))
    return mutate(INVITE_LINES), mutate(SDP_LINES), length, draw(st.binary(max_size=60))


def test_mutated_invites_over_udp_and_tcp_leave_no_call_slot_or_port_behind() -> None:
    examples: list[tuple[list[str], list[str], int | None, bytes]] = []

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(mutated_invites())
    def collect(example: tuple[list[str], list[str], int | None, bytes]) -> None:
        examples.append(example)

    collect()

    async def scenario() -> None:
        async with live_server(pool_size=2, sip_port=0, sip_accept=True, sip_media_timeout_s=1.5) as server:
            assert server.phones is not None
            port = server.phones.port
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind(("127.0.0.1", 0))
            me = udp.getsockname()[1]
            for n, (head, sdp_lines, length, tail) in enumerate(examples):
                proto = "TCP" if n % 4 == 0 else "UDP"
                fill = {"port": port, "me": me, "n": n, "proto": proto, "rtp": 9 + 2 * n}
                sdp = ("\r\n".join(_fill(line, fill) for line in sdp_lines) + "\r\n").encode()
                declared = len(sdp) if length is None else length
                text = "\r\n".join(_fill(line, fill) for line in head) + f"\r\nContent-Length: {declared}\r\n\r\n"
                message = text.encode("utf-8", "surrogatepass") + sdp + tail
                if proto == "UDP":
                    udp.sendto(message[:65000], ("127.0.0.1", port))
                else:
                    try:
                        _, writer = await asyncio.open_connection("127.0.0.1", port)
                        writer.write(message)
                        await writer.drain()
                        writer.close()
                    except OSError:
                        pass
                await asyncio.sleep(0.01)
            udp.close()
            # Answered calls that never send RTP are hung up after 1.5 s; declined and broken ones at once.
            assert await eventually(lambda: _free(server, 2), 15)
            assert await eventually(lambda: _no_calls(server), 5), list(server.phones.calls)
            assert all(not agent.active_calls for agent in server.phones._agents)
            async with RealtimeClient.connect(server) as other:  # nobody else noticed
                await other.until("session.created")

    run(scenario())


def _fill(line: str, values: dict[str, Any]) -> str:
    for key, value in values.items():
        line = line.replace("{" + key + "}", str(value))
    return line


async def _no_calls(server: Any) -> bool:
    return not server.phones.calls


def test_a_caller_who_gives_up_while_it_rings_frees_the_slot_and_cannot_be_accepted_after(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Webhook() as hook:
            url = f"http://127.0.0.1:{hook.port}/hook"
            async with live_server(pool_size=1, sip_port=0, sip_webhook_url=url) as server:
                assert server.phones is not None
                client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")
                rc, out = await sipp(tmp_path, cancelled(300), server.phones.port)
                assert rc == 0, out[-3000:]
                _, body = await asyncio.wait_for(hook.posts.get(), 5)
                call_id = json.loads(body)["data"]["call_id"]
                assert await eventually(lambda: _free(server, 1), 5)
                try:
                    await client.realtime.calls.accept(call_id, type="realtime")
                    raise AssertionError("a cancelled call was accepted")
                except Exception as exc:
                    assert getattr(exc, "status_code", None) == 404, exc
                assert await eventually(lambda: _no_calls(server), 5), server.phones.calls

    run(scenario())


def test_barge_in_on_a_call_truncates_the_answer_at_what_the_caller_heard(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Webhook() as hook:
            url = f"http://127.0.0.1:{hook.port}/hook"
            async with live_server(pool_size=1, sip_port=0, sip_webhook_url=url) as server:
                assert server.phones is not None
                client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")
                ear = Ear()
                # The caller says nothing for 3.5 s, then speaks over the answer for 0.8 s.
                words = np.frombuffer(
                    silence(3.5, rate=8000) + tone(300, 0.8, rate=8000) + silence(3.0, rate=8000), "<i2"
                )
                caller = asyncio.create_task(
                    sipp(tmp_path, answered(7500, ear.port), server.phones.port, audio=ulaw(words))
                )
                listening = asyncio.create_task(ear.listen(10.0))
                call_id = json.loads((await hook.rung(caller))[1])["data"]["call_id"]
                await client.realtime.calls.accept(call_id, type="realtime")
                async with RealtimeClient.connect(server, path=f"/v1/realtime?call_id={call_id}") as app:
                    # A long answer (120 ms of tone per word on the fake stack): about 6 s to play.
                    item = {
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "word " * 50}],
                    }
                    await app.send("conversation.item.create", item=item)
                    await app.send("response.create")
                    started = await app.until("output_audio_buffer.started", 10)
                    cleared = await app.until("output_audio_buffer.cleared", 10)
                    cleared_at = time.perf_counter()
                    truncated = await app.until("conversation.item.truncated", 5)
                    assert cleared["response_id"] == started["response_id"]
                rc, out = await caller
                await listening
                ear.close()
                assert rc == 0, out[-3000:]
                first = next(t for t, _, loud in ear.arrivals if loud)
                heard_ms = 1000 * sum(n for t, n, _ in ear.arrivals if first <= t <= cleared_at) / 8000
                print(f"\nplayed {truncated['audio_end_ms']} ms by the server's count, heard {heard_ms:.0f} ms here")
                assert 500 <= heard_ms <= 5000
                assert abs(truncated["audio_end_ms"] - heard_ms) <= 150

    run(scenario())


def test_workers_refuse_sip_rather_than_bind_one_port_twice() -> None:
    from s2s_rt.cli import main

    assert main(["serve", "--workers", "2", "--sip-port", "5099", "--stack", "fake"]) == 2


@pytest.mark.parametrize("talks_first", [False, True], ids=["never", "stops after 2 s"])
def test_a_call_whose_caller_sends_no_media_is_hung_up_and_its_slot_comes_back(
    tmp_path: Path, talks_first: bool
) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, sip_port=0, sip_accept=True, sip_media_timeout_s=1.5) as server:
            assert server.phones is not None
            began = time.monotonic()
            # SIPp fails unless the server's BYE comes within 6 s of the answer.
            calls = silent(9, bye_within_ms=6000, talks_first=talks_first)
            rc, out = await sipp(tmp_path, calls, server.phones.port, timeout=15, audio=bytes([0xFF]) * 16000)
            took = time.monotonic() - began
            assert rc == 0, out[-3000:]
            assert took >= 1.5 + (2.0 if talks_first else 0.0), took  # not while media came, nor soon after
            assert await eventually(lambda: _all_ended(server, 1), 5), server.phones.calls

    run(scenario())


def _rtp(seq: int, ssrc: int, payload: bytes) -> bytes:
    """One RTP packet of G.711 μ-law (payload type 0)."""
    head = bytes([0x80, 0x80 if seq == 0 else 0x00]) + seq.to_bytes(2, "big")
    return head + (seq * len(payload)).to_bytes(4, "big") + ssrc.to_bytes(4, "big") + payload


async def _speak_at(port: int, source: str, audio: bytes) -> None:
    """Send ``audio`` (μ-law at 8 kHz) to ``127.0.0.1:port`` from ``source``, as RTP in real time."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((source, 0))
    try:
        for seq, at in enumerate(range(0, len(audio), 160)):
            sock.sendto(_rtp(seq, 0x5EED0000 + seq // 10_000, audio[at : at + 160]), ("127.0.0.1", port))
            await asyncio.sleep(0.02)
    finally:
        sock.close()


def test_media_sprayed_at_a_call_from_another_address_is_not_heard(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, sip_port=0, sip_accept=True) as server:
            assert server.phones is not None
            # The caller says nothing (SIPp streams μ-law silence from 127.0.0.1) for 9 s.
            caller = asyncio.create_task(sipp(tmp_path, answered(9000, 9), server.phones.port))
            assert await eventually(lambda: _answered(server), 10)
            [call] = server.phones.calls.values()
            assert call.media is not None
            port = call.media.sdp_answer.audio.port
            words = ulaw(np.frombuffer(tone(300, 1.2, rate=8000) + silence(1.0, rate=8000), "<i2"))
            async with RealtimeClient.connect(server, path=f"/v1/realtime?call_id={call.id}") as app:
                # Someone else on the network (127.0.0.2) sends words to the call's media port: dropped.
                await _speak_at(port, "127.0.0.2", words)
                with pytest.raises(TimeoutError):
                    await app.until("input_audio_buffer.speech_started", 1.0)
                assert call.strays >= 100
                # The same words from the caller's address (another port: a caller may send from one) are heard.
                await _speak_at(port, "127.0.0.1", words)
                await app.until("input_audio_buffer.speech_started", 5)
            rc, out = await caller
            assert rc == 0, out[-3000:]

    run(scenario())


def test_a_caller_flooding_the_calls_media_port_is_hung_up_and_the_flood_dropped_unread(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, sip_port=0, sip_accept=True) as server:
            assert server.phones is not None
            # SIPp fails unless the server's BYE comes within 6 s of the answer (its caller sends no media).
            caller = asyncio.create_task(sipp(tmp_path, silent(9, bye_within_ms=6000), server.phones.port))
            assert await eventually(lambda: _answered(server), 10)
            [call] = server.phones.calls.values()
            assert call.media is not None
            port = call.media.sdp_answer.audio.port
            # From the caller's address, 2,000 packets a second of silence, until the server hangs up.
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", 0))
            sent = 0
            try:
                while not caller.done() and sent < 20_000:
                    for _ in range(20):
                        sock.sendto(_rtp(sent, 0x5EED, bytes([0xFF]) * 160), ("127.0.0.1", port))
                        sent += 1
                    await asyncio.sleep(0.01)
            finally:
                sock.close()
            rc, out = await caller
            assert rc == 0, out[-3000:]
            assert call.why == "flooded the call with media"
            assert server.metrics.media_dropped.get(transport="sip") > sent / 2
            assert await eventually(lambda: _free(server, 1), 5)

    run(scenario())


def test_an_offer_without_g711_or_an_ip_address_is_refused_before_it_rings(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with live_server(pool_size=1, sip_port=0, sip_accept=True) as server:
            assert server.phones is not None
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
            me = sock.getsockname()[1]
            loop = asyncio.get_running_loop()
            try:
                offers = [
                    ("127.0.0.1", "9 18"),  # G.722 and G.729
                    ("127.0.0.1", "96"),  # a dynamic type (Opus)
                    ("127.0.0.1", "101"),  # keypad events only
                    ("192.0", "0"),  # not an IP address (a resolver would read 192.0.0.0)
                    ("pbx.invalid", "0"),  # a host name: a DNS lookup, perhaps off this network
                    ("::1", "0"),  # IPv6, where the call's RTP binds IPv4 (its socket cannot send there)
                ]
                for n, (address, formats) in enumerate(offers):
                    sdp = (
                        f"v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP{6 if ':' in address else 4} {address}"
                        "\r\nt=0 0\r\n"
                        f"m=audio 4000 RTP/AVP {formats}\r\na=rtpmap:96 opus/48000/2\r\n"
                    )
                    invite = (
                        f"INVITE sip:agent@127.0.0.1:{server.phones.port} SIP/2.0\r\n"
                        f"Via: SIP/2.0/UDP 127.0.0.1:{me};branch=z9hG4bKcodec{n}\r\n"
                        f"From: <sip:x@127.0.0.1>;tag={n}\r\nTo: <sip:agent@127.0.0.1>\r\nCall-ID: codec-{n}\r\n"
                        f"CSeq: 1 INVITE\r\nContact: <sip:x@127.0.0.1:{me}>\r\nContent-Type: application/sdp\r\n"
                        f"Content-Length: {len(sdp)}\r\n\r\n{sdp}"
                    )
                    sock.sendto(invite.encode(), ("127.0.0.1", server.phones.port))
                    finals = []
                    while not finals:
                        text = (await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)).decode()
                        finals = [text] if not text.startswith(("SIP/2.0 100", "SIP/2.0 180")) else []
                    assert finals[0].startswith("SIP/2.0 488"), finals[0][:80]
            finally:
                sock.close()
            assert await eventually(lambda: _free(server, 1), 5)
            assert await eventually(lambda: _no_calls(server), 5)
            async with RealtimeClient.connect(server) as other:  # the one slot is free for someone else
                await other.until("session.created")
        faults = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not faults, [r.getMessage() for r in faults]

    run(scenario())


@pytest.mark.slow
@needs_question_voice
def test_on_the_default_stack_a_question_asked_over_a_call_is_answered_in_words_the_caller_hears(
    tmp_path: Path,
) -> None:
    """flite asks over G.711 (8 kHz μ-law, as a phone line carries it); Whisper transcribes what came back."""
    from s2s_rt import Config, Server
    from s2s_rt.audio import float_to_pcm16, pcm16_to_float, resample
    from s2s_rt.wer import word_error_rate

    question = pcm16_to_float(spoken_question("What is the capital of France?"))
    line = np.frombuffer(float_to_pcm16(resample(question, 24_000, 8_000)), "<i2")
    said_pcm = np.concatenate([np.zeros(4000, "<i2"), line, np.zeros(8000 * 30, "<i2")])

    async def scenario() -> None:
        config = Config(port=0, stack="default", pool_size=1, sip_port=0, sip_accept=True)
        async with Server(config) as server:
            assert server.phones is not None and server.stack is not None
            ear = Ear()
            caller = asyncio.create_task(sipp(tmp_path, answered(30_000, ear.port), server.phones.port,
                                              audio=ulaw(said_pcm), timeout=60))  # fmt: skip
            listening = asyncio.create_task(ear.listen(33.0))
            assert await eventually(lambda: _answered(server), 10)
            [call] = server.phones.calls.values()
            async with RealtimeClient.connect(server, path=f"/v1/realtime?call_id={call.id}") as app:
                done = await app.until("response.done", 60)
                stopped = await app.until("output_audio_buffer.stopped", 60)
            assert stopped["response_id"] == done["response"]["id"]
            said = " ".join(
                c.get("transcript") or "" for o in done["response"]["output"] if o["type"] == "message"
                for c in o["content"]
            )  # fmt: skip
            rc, out = await caller
            await listening
            ear.close()
            assert rc == 0, out[-3000:]
            answer = resample(pcm16_to_float(from_ulaw(bytes(ear.payload))), 8_000, 16_000)
            heard = server.stack.stt.transcribe(answer, language="en").text
            print(f"\nthe server said {said!r}; over the line, Whisper heard {heard!r}")
            assert re.search(r"\bParis\b", said), said
            assert re.search(r"\bParis\b", heard), heard
            assert word_error_rate(said, heard) <= 0.35, (said, heard)

    run(scenario(), timeout=180)


def test_listening_on_every_address_needs_an_address_to_name() -> None:
    from s2s_rt.config import Config, ConfigError

    with pytest.raises(ConfigError, match="sip_advertised_host"):
        Config(sip_port=5060, sip_host="0.0.0.0").validate()
    assert Config(sip_port=5060, sip_host="0.0.0.0", sip_advertised_host="203.0.113.7").validate().sip_advertised_host

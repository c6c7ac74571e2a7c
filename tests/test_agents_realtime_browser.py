"""OpenAI's Agents SDK for JavaScript (``@openai/agents-realtime``) in headless Chromium, against our server.

The page (``tests/js/index.html``, the bundle ``make agents-js`` builds from
``tests/js/entry.js``) runs a ``RealtimeSession`` of a ``RealtimeAgent`` with one
function tool, on the SDK's browser transport ``OpenAIRealtimeWebRTC`` whose
``baseUrl`` (the SDK's name for the full calls URL) is our
``POST /v1/realtime/calls``; the key is an ``ek_`` client secret minted with the
API key, as a browser app's backend would (the SDK refuses a plain key in a
browser). The page is served from another port, so the offer goes cross-origin
(a CORS preflight). Chromium's fake microphone plays a tone, then silence, in a
loop; the server is the fake stack (``s2s_rt.engines.fake``). The browser, the
DevTools driver and the server process come from :mod:`test_browser`.

On the default stack (real models, in this process), the agent is also made as
the SDK's users may make it, without instructions, and the microphone asks
aloud for the weather in Paris (issue 38): the tool must run once and the
answer use what it returned.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
import time
import urllib.request
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import requires
from mcp_host import McpHost
from test_browser import CHROMIUM, Browser, Page, ServerProcess, chromium, fake_server, write_mic_wav
from test_third_party_clients import (
    RATE,
    WEATHER,
    WEATHER_TURN_S,
    is_paris,
    needs_question_voice,
    spoken_question,
    uses_the_weather,
    weather_questions,
)

from s2s_rt import Config, Server

JS = Path(__file__).resolve().parent / "js"
BUNDLE = JS / "build" / "agents-realtime.js"
KEY = "sk-agents-js-test"


def _bundle_is_current() -> bool:
    sources = [JS / "entry.js", JS / "package-lock.json"]
    return BUNDLE.is_file() and all(BUNDLE.stat().st_mtime >= s.stat().st_mtime for s in sources)


pytestmark = [
    requires(CHROMIUM, "chromium is not installed (apt-get install chromium)"),
    requires(_bundle_is_current(), f"{BUNDLE} is missing or older than its sources: run `make agents-js` (Node, npm)"),
]


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def page_url() -> Iterator[str]:
    """``tests/js`` over HTTP on its own port of 127.0.0.1 (a secure context, another origin than the server's)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(JS)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/index.html"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def mcp_host() -> Iterator[McpHost]:
    with McpHost() as host:
        yield host


@pytest.fixture(scope="module")
def server(page_url: str, mcp_host: McpHost) -> Iterator[ServerProcess]:
    """The server, allowing the page's origin (a page of another origin may use it only when allowed)."""
    origin = page_url.rsplit("/", 1)[0]
    allowed = ("--allowed-origin", origin, "--mcp-server", mcp_host.url)
    with fake_server("--pool-size", "2", "--api-key", KEY, *allowed) as s:
        yield s


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """A microphone that says one 1 s turn every 5 s: the answer is over long before the next one."""
    wav = write_mic_wav(tmp_path_factory.mktemp("mic") / "turn.wav", lead_s=0.3, tone_s=1.0, tail_s=3.7)
    with chromium(wav) as b:
        yield b


def mint_secret(port: int) -> str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/realtime/client_secrets",
        data=json.dumps({"expires_after": {"anchor": "created_at", "seconds": 600}}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as r:
        value = str(json.load(r)["value"])
    assert value.startswith("ek_")
    return value


@contextmanager
def connected_page(browser: Browser, server: ServerProcess, page_url: str, **config: Any) -> Iterator[Page]:
    """A page whose RealtimeSession (``config`` added to the page's) is connected over WebRTC; closed after."""
    page = browser.new_page(page_url)
    config = {
        "callsUrl": f"http://127.0.0.1:{server.port}/v1/realtime/calls",
        "apiKey": mint_secret(server.port),
    } | config
    page.eval(f"window.agentsConfig = {json.dumps(config)}")
    page.click("start")
    try:
        page.wait_for("s2s.state !== 'connecting' && s2s.state !== 'idle'", timeout=20)
        assert page.eval("s2s.state") == "connected", (page.eval("s2s.error"), server.log[-20:])
        assert re.fullmatch(r"rtc_[A-Za-z0-9_-]+", page.eval("s2s.callId") or ""), page.eval("s2s.callId")
        yield page
        assert page.eval("s2s.errors") == [], server.log[-30:]
    finally:
        try:
            page.eval("window.session && window.session.close()")
        finally:
            browser.close_pages()


@pytest.fixture
def session(browser: Browser, server: ServerProcess, page_url: str) -> Iterator[Page]:
    """A page whose RealtimeSession is connected to the server over WebRTC."""
    with connected_page(browser, server, page_url) as page:
        # connect() resolved on the server's session.updated (not on the SDK's 5 s fallback), tools and all.
        update = page.eval("s2s.sent.find((e) => e.type === 'session.update' && e.session.tools)")
        assert [t["name"] for t in update["session"]["tools"]] == ["get_weather"]
        updated = page.eval("s2s.transportEvents.filter((e) => e.type === 'session.updated').map((e) => e.session)")
        assert any([t["name"] for t in s.get("tools", [])] == ["get_weather"] for s in updated), updated
        yield page


def events(page: Page, kind: str) -> list[dict[str, Any]]:
    return list(page.eval(f"s2s.transportEvents.filter((e) => e.type === {json.dumps(kind)})"))


def mute_and_settle(page: Page) -> None:
    """Mute the microphone and wait until a turn it began before the mute is over.

    The fake microphone says a tone every 5 s from the moment the page captures; one caught by the mute
    is still a turn (committed at the mute's silence, transcribed, answered), and an answer of it would
    otherwise land in the middle of the test's own turn. Frames sent before the mute reach the server
    within the pause below; after it, no speech starts, so equal counts of started and stopped speech
    and of created and done responses, held for a second (a commit's response is created just after it),
    mean nothing more comes from the microphone.
    """
    page.eval("session.mute(true)")
    time.sleep(0.5)
    count = "(t) => s2s.transportEvents.filter((e) => e.type === t).length"
    quiet = (
        f"(({count})('input_audio_buffer.speech_started') === ({count})('input_audio_buffer.speech_stopped'))"
        f" && (({count})('response.created') === ({count})('response.done'))"
    )
    deadline = time.monotonic() + 20
    quiet_since = None
    while (now := time.monotonic()) < deadline:
        quiet_since = (quiet_since or now) if page.eval(quiet) else None
        if quiet_since is not None and now - quiet_since >= 1.0:
            return
        time.sleep(0.05)
    raise AssertionError(
        f"the microphone's turn did not settle: {[e['type'] for e in page.eval('s2s.transportEvents')]}"
    )


def test_a_spoken_turn_from_the_microphone_gets_a_spoken_answer(session: Page) -> None:
    page = session
    done = page.wait_for(
        "s2s.transportEvents.find((e) => e.type === 'response.done'"
        " && e.response.output.some((o) => o.type === 'message'))",
        timeout=20,
    )
    transcript = events(page, "conversation.item.input_audio_transcription.completed")[0]["transcript"]
    assert re.fullmatch(r"heard \d+ ms crc [0-9a-f]{8}", transcript), transcript
    assert done["response"]["status"] == "completed", done
    message = next(o for o in done["response"]["output"] if o["type"] == "message")
    spoken = message["content"][0]
    assert spoken["type"] == "output_audio" and spoken["transcript"] == f"You said: {transcript}.", spoken
    # The answer played on the track: the server says it started and stopped, the SDK that its audio is done.
    response_id = done["response"]["id"]
    page.wait_for(
        "s2s.transportEvents.some((e) => e.type === 'output_audio_buffer.stopped'"
        f" && e.response_id === {json.dumps(response_id)})"
    )
    assert any(e["response_id"] == response_id for e in events(page, "output_audio_buffer.started"))
    assert page.eval("s2s.audioStopped") >= 1
    stats = page.eval("audioStats()")
    assert stats["outbound"]["packetsSent"] > 0 and stats["inbound"]["packetsReceived"] > 0, stats
    assert stats["inbound"]["totalAudioEnergy"] > 0, stats  # not only silence came back
    # The SDK's history: the user's audio item with its transcript (fetched by conversation.item.retrieve),
    # the assistant's answer with the same words as its audio.
    page.wait_for(
        "s2s.history.some((i) => i.role === 'user' && i.content.some((c) => c.type === 'input_audio' && c.transcript))"
    )
    history = page.eval("s2s.history")
    user = next(i for i in history if i.get("role") == "user")
    assert user["content"][0]["transcript"] == transcript, user
    assistant = next(i for i in history if i.get("role") == "assistant" and i["itemId"] == message["id"])
    assert assistant["content"][0]["transcript"] == f"You said: {transcript}.", assistant


def test_a_tool_call_runs_the_agents_tool_and_its_result_comes_back_in_the_answer(session: Page) -> None:
    page = session
    mute_and_settle(page)  # the microphone is out of the way: no barge-in or turn of its own on this one
    page.eval("session.sendMessage('please get_weather Paris')")
    page.wait_for("s2s.toolEnds.length > 0", timeout=20)
    assert page.eval("s2s.toolStarts") == ["get_weather"]
    assert page.eval("s2s.toolRuns") == [{"city": "Paris"}]
    assert page.eval("s2s.toolEnds") == [["get_weather", "sunny in Paris"]]
    call = next(e["item"] for e in events(page, "response.output_item.done") if e["item"]["type"] == "function_call")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}, call
    # The SDK sent the result back, and asked for the answer; the server took the item into the conversation.
    sent = page.eval("s2s.sent")
    output_at = next(i for i, e in enumerate(sent) if e.get("item", {}).get("type") == "function_call_output")
    assert sent[output_at]["type"] == "conversation.item.create", sent[output_at]
    output = {"type": "function_call_output", "output": "sunny in Paris", "call_id": call["call_id"]}
    assert sent[output_at]["item"] == output, sent[output_at]
    assert any(e["type"] == "response.create" for e in sent[output_at + 1 :]), sent[output_at:]
    page.wait_for(
        "s2s.transportEvents.some((e) => e.type === 'conversation.item.added'"
        f" && e.item.type === 'function_call_output' && e.item.call_id === {json.dumps(call['call_id'])})"
    )
    answer = "You said: the result is sunny in Paris."
    page.wait_for(f"s2s.agentEnds.includes({json.dumps(answer)})", timeout=20)
    done = page.eval(
        "s2s.transportEvents.filter((e) => e.type === 'response.done').find((e) => e.response.output.some("
        f"(o) => o.type === 'message' && o.content.some((c) => c.transcript === {json.dumps(answer)})))"
    )
    assert done is not None and done["response"]["status"] == "completed"
    page.wait_for(
        "s2s.transportEvents.some((e) => e.type === 'output_audio_buffer.stopped'"
        f" && e.response_id === {json.dumps(done['response']['id'])})"
    )
    tool_item = next(i for i in page.eval("s2s.history") if i.get("type") == "function_call")
    assert tool_item["status"] == "completed" and tool_item["output"] == "sunny in Paris", tool_item


def test_a_hosted_mcp_tool_is_listed_and_called_by_the_server_and_agents_js_asks_for_the_answer(
    browser: Browser, server: ServerProcess, page_url: str, mcp_host: McpHost
) -> None:
    hosted = {"serverLabel": "weather", "serverUrl": mcp_host.url}
    # The agent's own function is renamed: the MCP server's get_weather is another tool.
    with connected_page(browser, server, page_url, toolName="lookup_forecast", mcp=hosted) as page:
        page.wait_for("s2s.mcpTools.includes('get_weather')", timeout=20)
        mute_and_settle(page)
        page.eval("session.sendMessage('please get_weather Oslo')")
        page.wait_for("s2s.mcpCalls.length > 0", timeout=20)
        [call] = page.eval("s2s.mcpCalls")
        assert call["name"] == "get_weather" and call["output"] == "Sunny and 21 degrees in Oslo", call
        assert ("get_weather", {"city": "Oslo"}) in mcp_host.calls
        # The SDK asked for the answer on the call's conversation.item.done, and the answer used the output.
        answer = "You said: the result is Sunny and 21 degrees in Oslo."
        page.wait_for(f"s2s.agentEnds.includes({json.dumps(answer)})", timeout=20)
        assert page.eval("s2s.toolRuns") == []  # the agent's own function never ran


# --- the default stack -----------------------------------------------------------------------------


class DefaultStack:
    """The default stack's server on a thread of its own (it loads for longer than ``ServerProcess`` waits)."""

    def __init__(self, origin: str) -> None:
        self.port = 0
        self._origin = origin
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        config = Config(port=0, stack="default", pool_size=1, api_keys=[KEY], allowed_origins=[self._origin])
        try:
            async with Server(config) as server:
                self.port = server.port
                self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            self._ready.set()

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(300) and self._failed is None and self.port, self._failed

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


@contextmanager
def default_stack(origin: str) -> Iterator[DefaultStack]:
    server = DefaultStack(origin)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def write_speech_wav(path: Path, pcm: bytes, *, lead_s: float, tail_s: float) -> Path:
    """Silence, ``pcm`` (PCM16 at 24 kHz), silence: the fake microphone says it once per loop."""
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(bytes(int(RATE * lead_s) * 2) + pcm + bytes(int(RATE * tail_s) * 2))
    return path


@pytest.mark.slow
@needs_question_voice
@weather_questions
def test_default_instructions_spoken_weather_question_runs_the_tool_once_and_answers_with_it(
    page_url: str, tmp_path: Path, question: str
) -> None:
    """No instructions (the SDK sends ``instructions: ""``), the SDK's default session (``semantic_vad``, audio
    out), one ``get_weather`` tool returning an object, and the question from the microphone."""
    origin = page_url.rsplit("/", 1)[0]
    # Time to connect before the question (the fake microphone starts with the capture), and no second
    # question before the answer: the page mutes itself once the turn is committed.
    wav = write_speech_wav(tmp_path / "question.wav", spoken_question(question), lead_s=4.0, tail_s=WEATHER_TURN_S)
    with default_stack(origin) as server, chromium(wav) as browser:
        page = browser.new_page(page_url)
        config = {
            "callsUrl": f"http://127.0.0.1:{server.port}/v1/realtime/calls",
            "apiKey": mint_secret(server.port),
            "instructions": None,
            "toolResult": WEATHER,
        }
        page.eval(f"window.agentsConfig = {json.dumps(config)}")
        page.click("start")

        def what_happened() -> str:
            heard = [e["transcript"] for e in events(page, "conversation.item.input_audio_transcription.completed")]
            said = [
                c.get("transcript") or c.get("text")
                for d in events(page, "response.done")
                for o in d["response"]["output"]
                if o["type"] == "message"
                for c in o["content"]
            ]
            return f"asked {question!r}, heard {heard}, tool ran for {page.eval('s2s.toolRuns')}, said {said}"

        try:
            page.wait_for("s2s.state !== 'connecting' && s2s.state !== 'idle'", timeout=30)
            assert page.eval("s2s.state") == "connected", page.eval("s2s.error")
            updated = events(page, "session.updated")[-1]["session"]
            page.wait_for("s2s.transportEvents.some((e) => e.type === 'input_audio_buffer.committed')", timeout=60)
            page.eval("session.mute(true)")
            first = page.wait_for(
                "s2s.transportEvents.find((e) => e.type === 'response.done')", timeout=WEATHER_TURN_S / 2
            )
            assert [o["type"] for o in first["response"]["output"]] == ["function_call"], what_happened()
            page.wait_for("s2s.toolEnds.length > 0", timeout=30)
            done = page.wait_for(
                "s2s.transportEvents.find((e) => e.type === 'response.done'"
                " && e.response.output.some((o) => o.type === 'message'))",
                timeout=WEATHER_TURN_S / 2,
            )
            print(f"\n@openai/agents-realtime, instructions {updated.get('instructions')!r}: {what_happened()}")
            runs = page.eval("s2s.toolRuns")
            assert len(runs) == 1 and is_paris(runs[0]["city"]), what_happened()
            assert len(page.eval("s2s.toolEnds")) == 1, what_happened()
            [message] = [o for o in done["response"]["output"] if o["type"] == "message"]
            said = " ".join(c.get("transcript") or c.get("text") or "" for c in message["content"])
            assert uses_the_weather(said), what_happened()
            assert page.eval("s2s.errors") == []
        finally:
            try:
                page.eval("window.session && window.session.close()")
            finally:
                browser.close_pages()

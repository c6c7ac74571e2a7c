"""The browser page at ``/``, driven in headless Chromium with a fake microphone.

Chromium runs with ``--use-file-for-fake-audio-capture``: it plays a WAV
generated here as the microphone, in a loop. The page is driven over the
Chrome DevTools protocol with the ``websockets`` client we already depend
on, so no browser-automation package is needed; clicks are real input
events, so the page gets the user gesture audio needs. The server is the
fake stack, run as ``python -m s2s_rt serve`` on a free port.

The page talks over WebRTC by default (a call: the microphone on a media
track, the answer on the remote one, the events on the ``oai-events`` data
channel) and over a WebSocket when chosen; the conversation tests run over
both. The page is instrumented before it starts (``INSTRUMENT``): what it
fetches, the subprotocols it offers, the events it sends on the data channel,
and its peer connections, whose ``getStats()`` tell what audio it sent and
received.

Chromium comes from the system (Debian: ``apt-get install chromium``); the
tests skip when it is missing (and fail in CI); ``CHROMIUM=/path/to/chrome``
picks another binary. Set ``S2S_RT_SCREENSHOTS=DIR`` to keep screenshots of the page in the
middle of a conversation and after a barge-in.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import requires
from websockets.sync.client import ClientConnection, connect

from s2s_rt.protocol.config import TurnDetection

STATIC = Path(__file__).resolve().parent.parent / "s2s_rt" / "static"

CHROMIUM = next(
    (p for p in (os.environ.get("CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")) if p), None
)
pytestmark = requires(CHROMIUM, "chromium is not installed (apt-get install chromium)")

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--remote-debugging-port=0",
]


# --- the fake microphone ------------------------------------------------------


def write_mic_wav(path: Path, *, lead_s: float, tone_s: float, tail_s: float, rate: int = 48_000) -> Path:
    """Silence, a tone loud enough for the energy VAD, silence: one spoken turn per loop."""
    t = np.arange(int(rate * tone_s)) / rate
    voice = 0.3 * np.sin(2 * np.pi * 440 * t)
    samples = np.concatenate([np.zeros(int(rate * lead_s)), voice, np.zeros(int(rate * tail_s))])
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return path


# --- a server on a free port ---------------------------------------------------


class ServerProcess:
    """``s2s-rt serve --stack fake`` in a subprocess; its log is kept for failures."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "s2s_rt", "serve", "--stack", "fake", "--port", "0", "--grace-period", "1", *args]
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=os.environ | (env or {})
        )
        self.log: list[str] = []
        found = threading.Event()
        self.port = 0

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                m = re.search(r"listening on ws://[^:]+:(\d+)/", line)
                if m:
                    self.port = int(m.group(1))
                    found.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not found.wait(20):
            self.stop()
            raise RuntimeError("server did not start:\n" + "\n".join(self.log))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def fake_server(*args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """The fake-stack server with command-line ``args`` and extra environment ``env`` (``S2S_RT_…`` settings)."""
    server = ServerProcess(*args, env=env)
    try:
        yield server
    finally:
        server.stop()


# --- a minimal DevTools-protocol driver --------------------------------------------


class Page:
    """One browser tab, driven over a flattened DevTools session."""

    def __init__(self, browser: Browser, target_id: str, session_id: str) -> None:
        self.browser = browser
        self.target = target_id
        self.session = session_id
        self.console: list[str] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self.browser.call(method, params, self.session)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        app = " && window.s2s !== undefined" if url.startswith("http") else ""
        self.wait_for(f"document.readyState === 'complete'{app}", timeout=10)

    def eval(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 15.0) -> Any:
        """Poll a JavaScript condition until it is truthy; fail with the page's state."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {expression!r}\n"
                    f"window.s2s = {json.dumps(self.eval('window.s2s'), indent=1)}\n"
                    f"console: {self.console[-20:]}"
                )
            time.sleep(0.1)

    def click(self, element_id: str) -> None:
        """A real mouse click (a user gesture, so the page may start audio)."""
        x, y = self._center(element_id)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def press(self, element_id: str) -> None:
        x, y = self._center(element_id)
        self.call("Input.dispatchMouseEvent", type="mousePressed", x=x, y=y, button="left", clickCount=1)

    def release(self, element_id: str) -> None:
        x, y = self._center(element_id)
        self.call("Input.dispatchMouseEvent", type="mouseReleased", x=x, y=y, button="left", clickCount=1)

    def _center(self, element_id: str) -> tuple[float, float]:
        box = self.eval(
            f"(() => {{ const e = document.getElementById({element_id!r}); e.scrollIntoView({{block: 'center'}});"
            " const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        return float(box[0]), float(box[1])

    def text(self, element_id: str) -> str:
        return str(self.eval(f"document.getElementById({element_id!r}).textContent"))

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


class Browser:
    """Headless Chromium's DevTools endpoint: commands in order, page events logged."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self._next_id = 0
        self.pages: dict[str, Page] = {}

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        while True:
            reply = json.loads(self.ws.recv(timeout=30))
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
            self._event(reply)

    def _event(self, event: dict[str, Any]) -> None:
        page = self.pages.get(event.get("sessionId", ""))
        if page is None:
            return
        params = event.get("params", {})
        if event.get("method") == "Runtime.consoleAPICalled":
            page.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif event.get("method") == "Runtime.exceptionThrown":
            page.console.append(f"exception: {params['exceptionDetails']}")

    def new_page(self, url: str) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, target, session)
        self.pages[session] = page
        page.call("Runtime.enable")
        page.call("Page.enable")
        page.call("Emulation.setDeviceMetricsOverride", width=900, height=760, deviceScaleFactor=1, mobile=False)
        page.goto(url)
        return page

    def close_pages(self) -> None:
        for page in self.pages.values():
            self.call("Target.closeTarget", {"targetId": page.target})
        self.pages.clear()


@contextmanager
def chromium(mic_wav: Path) -> Iterator[Browser]:
    """Headless Chromium with ``mic_wav`` as its (looping) microphone, in a fresh profile."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="s2s-rt-chromium-") as profile:
        proc = subprocess.Popen(
            [
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--use-file-for-fake-audio-capture={mic_wav}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            # Chromium writes the port it picked, and the browser's path, to this file.
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 20
            while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("chromium did not open its DevTools endpoint")
                time.sleep(0.05)
            port, path = port_file.read_text().splitlines()[:2]
            with connect(f"ws://127.0.0.1:{port}{path}", max_size=64 * 1024 * 1024) as ws:
                browser = Browser(ws)
                try:
                    yield browser
                finally:
                    try:
                        browser.call("Browser.close")
                    except Exception:
                        pass  # closing: the socket may go before the answer
        finally:
            try:
                proc.wait(5)  # after Browser.close it exits by itself
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture(scope="module")
def shared_chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """One Chromium for the module; its microphone says one 1.2 s turn every 3.5 s."""
    wav = write_mic_wav(tmp_path_factory.mktemp("mic") / "turn.wav", lead_s=0.3, tone_s=1.2, tail_s=2.0)
    with chromium(wav) as b:
        yield b


@pytest.fixture
def browser(shared_chromium: Browser) -> Iterator[Browser]:
    """The shared Chromium; the test's tabs are closed after it."""
    yield shared_chromium
    shared_chromium.close_pages()


TRANSPORTS = ["webrtc", "websocket"]
#: The silence after which the server ends a turn (``server_vad``, which the page asks for without a duration).
SILENCE_MS = TurnDetection().silence_duration_ms

# Run in a page before it starts: records what it sends (fetches, WebSocket subprotocols, data-channel
# events) and keeps its peer connections, so a test can read their statistics.
INSTRUMENT = """
(() => {
  const seen = (window.seen = { fetches: [], protocols: [], sent: [], pcs: [] });
  const fetch0 = window.fetch;
  window.fetch = (url, init = {}) => {
    const headers = new Headers(init.headers || {});
    seen.fetches.push({
      url: new URL(url, location.href).href,
      method: init.method || "GET",
      authorization: headers.get("Authorization"),
      candidates: typeof init.body === "string" ? (init.body.match(/^a=candidate:/gm) || []).length : null,
    });
    return fetch0(url, init);
  };
  const WebSocket0 = window.WebSocket;
  window.WebSocket = class extends WebSocket0 {
    constructor(url, protocols) {
      super(url, protocols);
      seen.protocols.push(...[].concat(protocols || []));
    }
  };
  const PeerConnection0 = window.RTCPeerConnection;
  window.RTCPeerConnection = class extends PeerConnection0 {
    constructor(...args) {
      super(...args);
      seen.pcs.push(this);
    }
  };
  const send0 = RTCDataChannel.prototype.send;
  RTCDataChannel.prototype.send = function (data) {
    seen.sent.push({ label: this.label, type: JSON.parse(data).type });
    return send0.call(this, data);
  };
  return true;
})()
"""


def audio_stats(kind: str, *keys: str) -> str:
    """JavaScript: the ``keys`` of the page's peer connections' audio stats of ``kind`` (``getStats()``), summed."""
    return f"""
(async () => {{
  const totals = Object.fromEntries({json.dumps(keys)}.map((k) => [k, 0]));
  for (const pc of window.seen.pcs) {{
    (await pc.getStats()).forEach((r) => {{
      if (r.type === {json.dumps(kind)} && r.kind === "audio") {{
        for (const k in totals) totals[k] += r[k] || 0;
      }}
    }});
  }}
  return totals;
}})()
"""


# The answer's track as the page's peer connection received it.
INBOUND_AUDIO = audio_stats("inbound-rtp", "packetsReceived", "totalSamplesReceived", "totalAudioEnergy")
# What the page's peer connections sent of its microphone.
OUTBOUND_AUDIO = audio_stats("outbound-rtp", "packetsSent")

# What the page's microphone track gave its peer connection to send.
SENT_AUDIO = audio_stats("media-source", "totalAudioEnergy")

# The settings of the microphone track each peer connection sends.
SENT_TRACK_SETTINGS = """
window.seen.pcs.flatMap((pc) => pc.getSenders().map((s) => s.track).filter(Boolean)).map((t) => t.getSettings())
"""


def open_page(browser: Browser, server: ServerProcess, transport: str, query: str = "") -> Page:
    """The page at ``/`` with ``transport`` chosen (WebRTC: the default, nothing to choose), instrumented."""
    if transport == "webrtc":
        page = browser.new_page(server.url + (f"?{query}" if query else ""))
        assert page.eval("document.getElementById('transportWebRTC').checked")
    else:
        page = browser.new_page(server.url + f"?transport=websocket{'&' + query if query else ''}")
        assert page.eval("document.getElementById('transportWebSocket').checked")
    page.eval(INSTRUMENT)
    return page


def start_hands_free(browser: Browser, server: ServerProcess, transport: str) -> Page:
    page = open_page(browser, server, transport, "mode=handsfree")
    assert page.eval("document.getElementById('modeHandsFree').checked")
    page.click("start")
    return page


def session_log(server: ServerProcess) -> list[str]:
    """The server's "session … started" lines (they say ", WebRTC" for a call)."""
    return [line for line in server.log if re.search(r"session \S+ started on slot", line)]


def assert_carried_by(page: Page, server: ServerProcess, transport: str) -> None:
    """The page's session went over ``transport``, as the page and the server both tell."""
    assert page.eval("s2s.transport") == transport
    events = page.eval("s2s.events")
    if transport == "webrtc":
        assert page.eval("s2s.callId").startswith("rtc_")
        labels = {s["label"] for s in page.eval("seen.sent")}
        assert labels == {"oai-events"}, labels
        assert page.eval("seen.protocols") == []  # no WebSocket at all
        assert any(line.endswith(", WebRTC)") for line in session_log(server)), session_log(server)
    else:
        assert page.eval("s2s.callId") is None and page.eval("seen.pcs.length") == 0
        assert "realtime" in page.eval("seen.protocols")
        assert session_log(server) and not any("WebRTC" in line for line in session_log(server))
        assert "output_audio_buffer.started" not in events


# --- tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_hands_free_turn_shows_both_transcripts_plays_the_answer_and_its_latency(
    browser: Browser, transport: str
) -> None:
    stt_delay_ms = 400  # the least the answer can take after the end of speech
    with fake_server("--pool-size", "1", env={"S2S_RT_FAKE_STT_DELAY_MS": str(stt_delay_ms)}) as server:
        page = start_hands_free(browser, server, transport)
        page.wait_for("s2s.state === 'ready'")
        # The transport cannot be changed under a running session.
        assert page.eval("document.getElementById('transportWebSocket').disabled")
        page.wait_for("s2s.userTranscripts.length > 0")
        assert re.fullmatch(r"heard \d+ ms crc [0-9a-f]{8}", page.eval("s2s.userTranscripts[0]"))
        page.wait_for("s2s.assistantTranscripts.length > 0")
        assert page.eval("s2s.assistantTranscripts[0]").startswith("You said: heard ")
        page.wait_for("s2s.turns.length > 0")
        # From the end of speech to the first audio, as the user waits for it: the silence the server
        # waits to know the turn is over, then the STT's delay, and short of the 1.2 s the speech itself
        # lasted (a latency counted from its start would include it). What the page shows says the same.
        least_ms = SILENCE_MS + stt_delay_ms
        latency = page.eval("s2s.turns[0].latencyMs")
        assert least_ms <= latency < least_ms + 1000, f"{latency} ms shown, the user waited at least {least_ms} ms"
        shown = re.search(r"latency: last (\d+) ms", page.text("latency"))
        assert shown and int(shown.group(1)) == latency, page.text("latency")
        # The answer is 7 words of 120 ms: playback counts what the speaker really played.
        page.wait_for("s2s.playedSamples >= 0.8 * 24000")
        if transport == "webrtc":
            # The answer came on the remote track, not as audio events: the page's peer connection
            # received it, the <audio> element plays it, and the page measured its tones on it.
            page.wait_for("s2s.events['output_audio_buffer.stopped'] > 0")
            events = page.eval("s2s.events")
            assert "response.output_audio.delta" not in events and events["output_audio_buffer.started"] > 0
            page.wait_for("s2s.heardSamples >= 0.5 * 24000")
            inbound = page.eval(INBOUND_AUDIO)
            assert inbound["packetsReceived"] > 0 and inbound["totalSamplesReceived"] > 0, inbound
            assert inbound["totalAudioEnergy"] > 0, inbound
            audio = page.eval(
                "(() => { const a = document.getElementById('answer');"
                " return {stream: a.srcObject instanceof MediaStream, paused: a.paused,"
                " live: a.srcObject ? a.srcObject.getAudioTracks().map((t) => t.readyState) : []}; })()"
            )
            assert audio == {"stream": True, "paused": False, "live": ["live"]}, audio
            # The microphone went on the call's track with the browser's echo cancellation (the point of WebRTC).
            # Its offer carried its ICE candidates (the server takes no trickled ones).
            (offer,) = [f for f in page.eval("seen.fetches") if f["url"] == server.url + "v1/realtime/calls"]
            assert offer["method"] == "POST" and offer["candidates"] > 0, offer
            (settings,) = page.eval(SENT_TRACK_SETTINGS)
            assert settings["echoCancellation"] and settings["noiseSuppression"] and settings["autoGainControl"]
        assert_carried_by(page, server, transport)
        bubbles = page.eval(
            "[...document.querySelectorAll('#transcript li')].map(li => [li.className, li.textContent])"
        )
        assert any("user" in c and "heard" in t for c, t in bubbles)
        assert any("assistant" in c and "You said: heard" in t and "ms after your last word" in t for c, t in bubbles)
        assert page.eval("s2s.lastError") is None
        shots = os.environ.get("S2S_RT_SCREENSHOTS")
        if shots:
            page.screenshot(Path(shots) / f"conversation-{transport}.png")


def test_webrtc_is_the_default_and_websocket_a_choice_the_page_remembers(browser: Browser) -> None:
    with fake_server("--pool-size", "1") as server:
        page = browser.new_page(server.url)
        try:
            assert page.eval("s2s.transport") == "webrtc"
            assert page.eval("document.getElementById('transportWebRTC').checked")
            assert "/v1/realtime/calls" in page.text("endpoint")
            page.click("transportWebSocket")
            assert page.eval("s2s.transport") == "websocket"
            assert page.text("endpoint").startswith("ws://")
            page.goto(server.url)  # the choice outlives the page
            assert page.eval("document.getElementById('transportWebSocket').checked")
            page.eval(INSTRUMENT)
            page.click("start")
            page.wait_for("s2s.state === 'ready'")
            assert_carried_by(page, server, "websocket")
        finally:
            page.eval("localStorage.clear()")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_second_page_while_the_pool_is_full_says_the_server_is_full(browser: Browser, transport: str) -> None:
    with fake_server("--pool-size", "1") as server:
        first = start_hands_free(browser, server, transport)
        first.wait_for("s2s.state === 'ready'")
        second = start_hands_free(browser, server, transport)
        second.wait_for("s2s.state === 'full'")
        assert second.eval("s2s.lastError.code") == "session_limit_reached"
        assert "server is full" in second.text("error")
        assert second.text("start") == "Start"
        # The first conversation is not disturbed.
        assert first.eval("s2s.state") == "ready"
        # Stopping it gives its slot back at once: the second page gets it.
        first.click("start")
        first.wait_for("s2s.state === 'closed'")
        second.click("start")
        second.wait_for("s2s.state === 'ready'")
        assert second.eval("s2s.transport") == transport


def test_a_tab_closed_mid_call_without_a_hangup_gives_its_slot_back_within_seconds(browser: Browser) -> None:
    """Chromium says no goodbye the server hears when a tab goes: the call is noticed dead by its silence to
    ICE consent checks (about 30 s before, aioice's own timing), not left holding its slot."""
    with fake_server("--pool-size", "1") as server:
        page = start_hands_free(browser, server, "webrtc")
        page.wait_for("s2s.state === 'ready'")
        pool = json.loads(http("GET", server.url + "v1/pool")[1])
        assert pool["free"] == 0
        began = time.monotonic()
        browser.call("Target.closeTarget", {"targetId": page.target})
        browser.pages = {k: p for k, p in browser.pages.items() if p is not page}
        while time.monotonic() - began < 40 and json.loads(http("GET", server.url + "v1/pool")[1])["free"] == 0:
            time.sleep(0.2)
        took = time.monotonic() - began
        print(f"\nthe closed tab's slot came back {took:.1f} s after it closed")
        assert took < 12, (took, server.log[-10:])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wrong_api_key_says_check_the_api_key_and_the_right_one_connects(browser: Browser, transport: str) -> None:
    with fake_server("--pool-size", "1", "--api-key", "right-key") as server:
        page = open_page(browser, server, transport)
        page.eval("document.getElementById('apiKey').value = 'wrong-key'")
        page.click("start")
        page.wait_for("s2s.state === 'refused'")
        assert "check the API key" in page.text("error")
        assert page.eval("s2s.lastError.code") == "connection_refused"
        page.eval("document.getElementById('apiKey').value = 'right-key'")
        page.click("start")
        page.wait_for("s2s.state === 'ready'")
        assert page.eval("document.getElementById('error').hidden")
        assert page.eval("s2s.credential") == "pasted"
        # The page asked its server for a secret first; without --page-secrets there is none.
        assert [f["url"] for f in page.eval("seen.fetches") if "client_secret" in f["url"]] == [
            server.url + "page/client_secret"
        ] * 2


def http(method: str, url: str, key: str | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    """One HTTP request to the test's server (the standard library's client)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def assert_no_api_key_in(page: Page, key: str) -> None:
    """``key`` is nowhere in the page: its DOM, its storage, its state, what it sent."""
    held = page.eval(
        "JSON.stringify([document.documentElement.outerHTML, document.getElementById('apiKey').value,"
        " {...localStorage}, {...sessionStorage}, window.s2s, window.seen.fetches, window.seen.protocols])"
    )
    assert key not in held


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_with_page_secrets_the_page_opens_its_session_with_a_client_secret_and_holds_no_api_key(
    browser: Browser, transport: str
) -> None:
    key = "sk-long-lived-operator-key"
    with fake_server("--pool-size", "1", "--api-key", key, "--page-secrets") as server:
        page = start_hands_free(browser, server, transport)
        page.wait_for("s2s.state === 'ready'")
        assert page.eval("s2s.credential") == "page-secret"
        fetches = page.eval("seen.fetches")
        assert fetches[0] == {
            "url": server.url + "page/client_secret",
            "method": "POST",
            "authorization": None,
            "candidates": None,
        }
        # The session was opened with the secret: a keyed server opens none without one.
        if transport == "webrtc":
            (call,) = [f for f in fetches if f["url"].endswith("/v1/realtime/calls")]
            assert call["method"] == "POST" and re.fullmatch(r"Bearer ek_[\w-]+", call["authorization"]), call
        else:
            (protocol,) = [p for p in page.eval("seen.protocols") if p.startswith("openai-insecure-api-key.")]
            assert protocol.startswith("openai-insecure-api-key.ek_"), protocol
        page.wait_for("s2s.assistantTranscripts.length > 0")
        assert_carried_by(page, server, transport)
        assert_no_api_key_in(page, key)
        status, metrics = http("GET", server.url + "metrics")
        assert status == 200 and re.search(rb"^s2s_client_secrets_total 1(\.0)?$", metrics, re.M), metrics


def test_without_page_secrets_a_pasted_client_secret_opens_a_webrtc_call(browser: Browser) -> None:
    key = "sk-long-lived-operator-key"
    with fake_server("--pool-size", "1", "--api-key", key) as server:
        assert http("POST", server.url + "page/client_secret")[0] == 404
        status, body = http("POST", server.url + "v1/realtime/client_secrets", key, b"{}")
        assert status == 200, body
        secret = json.loads(body)["value"]
        page = open_page(browser, server, "webrtc", "mode=handsfree")
        page.eval("localStorage.setItem('s2s-rt.apiKey', 'left-by-an-older-page')")
        page.goto(server.url + "?mode=handsfree")
        assert page.eval("localStorage.getItem('s2s-rt.apiKey')") is None  # forgotten, not reused
        page.eval(INSTRUMENT)
        page.eval(f"document.getElementById('apiKey').value = {json.dumps(secret)}")
        page.click("start")
        page.wait_for("s2s.state === 'ready'")
        assert page.eval("s2s.credential") == "pasted"
        (call,) = [f for f in page.eval("seen.fetches") if f["url"].endswith("/v1/realtime/calls")]
        assert call["authorization"] == f"Bearer {secret}"
        page.wait_for("s2s.userTranscripts.length > 0")
        assert_carried_by(page, server, "webrtc")
        assert_no_api_key_in(page, key)
        assert page.eval("localStorage.getItem('s2s-rt.apiKey')") is None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_push_to_talk_commits_on_release_and_gets_an_answer(browser: Browser, transport: str) -> None:
    with fake_server("--pool-size", "1") as server:
        page = open_page(browser, server, transport, "mode=talk")
        page.click("start")
        page.wait_for("s2s.state === 'ready'")
        time.sleep(0.3)
        assert page.eval("s2s.sentSamples") == 0  # nothing is sent until the button is held
        if transport == "webrtc":
            # The microphone's tone plays, but the call's track is muted: it has sent no sound.
            page.wait_for("s2s.micLevel > 0.1")
            assert page.eval(SENT_AUDIO)["totalAudioEnergy"] == 0
        page.press("talk")
        page.wait_for("s2s.sentSamples >= 0.8 * 24000")
        page.release("talk")
        if transport == "webrtc":
            assert page.eval(SENT_AUDIO)["totalAudioEnergy"] > 0
        page.wait_for("s2s.assistantTranscripts.length > 0")
        heard_ms = int(page.eval("s2s.userTranscripts[0]").split()[1])
        assert 700 <= heard_ms <= 1500
        page.wait_for("s2s.turns.length > 0 && s2s.playedSamples > 0")
        assert_carried_by(page, server, transport)
        if transport == "webrtc":
            # One turn: the page committed once (after the last words had arrived), the server answered once.
            assert [s["type"] for s in page.eval("seen.sent")].count("input_audio_buffer.commit") == 1
            assert page.eval("s2s.events['input_audio_buffer.committed']") == 1


def test_pressing_talk_over_webrtc_cuts_the_answer_off_with_output_audio_buffer_clear(browser: Browser) -> None:
    with fake_server("--pool-size", "1") as server:
        page = open_page(browser, server, "webrtc", "mode=talk")
        page.click("start")
        page.wait_for("s2s.state === 'ready'")
        page.press("talk")
        page.wait_for("s2s.sentSamples >= 0.8 * 24000")
        page.release("talk")
        # The 840 ms answer plays: talking again cuts it off.
        playing = page.wait_for("s2s.playing")
        page.press("talk")
        page.wait_for(f"s2s.cleared.some((c) => c.responseId === {json.dumps(playing)})")
        item = page.eval(f"s2s.cleared.find((c) => c.responseId === {json.dumps(playing)}).itemId")
        truncated = page.wait_for(f"s2s.truncated.find((t) => t.itemId === {json.dumps(item)})")
        assert 0 <= truncated["audioEndMs"] < 840, truncated
        assert page.eval("s2s.playing") is None
        sent = [s["type"] for s in page.eval("seen.sent")]
        assert sent.count("output_audio_buffer.clear") == 1 and "conversation.item.truncate" not in sent
        page.wait_for(f"document.querySelector('li.assistant[data-item=\"{item}\"]').classList.contains('interrupted')")
        assert page.eval("s2s.lastError") is None
        page.release("talk")


def test_barge_in_stops_playback_and_truncates_to_what_was_played(tmp_path: Path) -> None:
    # The next "utterance" starts 0.3 s after the turn ends, while the 0.84 s answer plays.
    wav = write_mic_wav(tmp_path / "eager.wav", lead_s=0.2, tone_s=1.0, tail_s=0.6)
    with fake_server("--pool-size", "1") as server, chromium(wav) as browser:
        page = start_hands_free(browser, server, "websocket")
        # Cut in the middle: something was heard, not all 840 ms of the answer.
        cut = page.wait_for("s2s.bargeIns.find((b) => b.audioEndMs > 0 && b.audioEndMs < 840)")
        page.wait_for(f"s2s.truncated.some((t) => t.itemId === {json.dumps(cut['itemId'])})")
        assert cut in page.eval("s2s.truncated")  # the server confirmed the same cut
        # The transcript shows what was heard, and strikes through the rest.
        bubble = f"document.querySelector('li.assistant[data-item=\"{cut['itemId']}\"]')"
        page.wait_for(f"{bubble}.querySelector('.unheard')?.textContent.length > 0")
        heard, unheard = page.eval(f"[...{bubble}.querySelector('.text').childNodes].map(n => n.textContent)")
        assert (heard + unheard).startswith("You said: heard") and unheard.endswith(".")
        assert page.eval("s2s.lastError") is None
        shots = os.environ.get("S2S_RT_SCREENSHOTS")
        if shots:
            page.screenshot(Path(shots) / "barge-in.png")


def test_barge_in_over_webrtc_the_server_cuts_the_answer_and_the_page_shows_what_was_heard(tmp_path: Path) -> None:
    wav = write_mic_wav(tmp_path / "eager.wav", lead_s=0.2, tone_s=1.0, tail_s=0.6)
    with fake_server("--pool-size", "1") as server, chromium(wav) as browser:
        page = start_hands_free(browser, server, "webrtc")
        # The server cleared its output buffer: an answer cut off while it played.
        cut = page.wait_for("s2s.cleared.find((c) => c.itemId)")
        truncated = page.wait_for(f"s2s.truncated.find((t) => t.itemId === {json.dumps(cut['itemId'])})")
        assert 0 < truncated["audioEndMs"] < 840, truncated  # something was heard, not all of it
        # The transcript shows what was heard, and strikes through the rest.
        bubble = f"document.querySelector('li.assistant[data-item=\"{cut['itemId']}\"]')"
        page.wait_for(f"{bubble}.querySelector('.unheard')?.textContent.length > 0")
        heard, unheard = page.eval(f"[...{bubble}.querySelector('.text').childNodes].map(n => n.textContent)")
        assert (heard + unheard).startswith("You said: heard") and unheard.endswith(".")
        assert "interrupted after" in page.eval(f"{bubble}.querySelector('.meta').textContent")
        assert page.eval(f"{bubble}.classList.contains('interrupted')")
        # The page stopped showing it as playing, and left the truncation to the server.
        assert page.eval("s2s.playing") != cut["responseId"]
        sent = [s["type"] for s in page.eval("seen.sent")]
        assert "conversation.item.truncate" not in sent and page.eval("s2s.bargeIns") == []
        assert "conversation.item.retrieve" in sent
        assert_carried_by(page, server, "webrtc")
        assert page.eval("s2s.lastError") is None
        shots = os.environ.get("S2S_RT_SCREENSHOTS")
        if shots:
            page.screenshot(Path(shots) / "barge-in-webrtc.png")


def test_a_silent_microphone_on_a_call_sends_a_packet_in_400_ms_as_the_servers_answer_asks_for_dtx(
    tmp_path: Path,
) -> None:
    """The server's answer says ``usedtx=1``: Chromium's Opus encoder then sends one packet in 400 ms while the
    microphone is silent (50 a second otherwise), and the call goes on."""
    wav = write_mic_wav(tmp_path / "silent.wav", lead_s=1.0, tone_s=0.0, tail_s=1.0)
    with fake_server("--pool-size", "1") as server, chromium(wav) as browser:
        page = start_hands_free(browser, server, "webrtc")
        page.wait_for("s2s.state === 'ready'")
        time.sleep(1.0)
        first, began = page.eval(OUTBOUND_AUDIO)["packetsSent"], time.monotonic()
        time.sleep(3.0)
        rate = (page.eval(OUTBOUND_AUDIO)["packetsSent"] - first) / (time.monotonic() - began)
        assert first > 0 and rate < 10, (first, rate)
        assert page.eval("s2s.state") == "ready" and page.eval("s2s.lastError") is None
        assert_carried_by(page, server, "webrtc")


# --- the worklets alone, in Chromium's JavaScript engine -----------------------------

# Loads a worklet's source with stand-ins for the AudioWorkletGlobalScope.
LOAD_WORKLET = """
function loadWorklet(source, rate) {
  let cls = null;
  const posted = [];
  const Base = class { constructor() { this.port = { postMessage: (m) => posted.push(m) }; } };
  new Function("sampleRate", "registerProcessor", "AudioWorkletProcessor", source)(rate, (n, c) => { cls = c; }, Base);
  return { cls, posted };
}
"""


def test_capture_worklet_resamples_to_24khz_keeping_speech_and_rejecting_aliases(browser: Browser) -> None:
    page = browser.new_page("about:blank")
    source = json.dumps((STATIC / "capture-worklet.js").read_text())
    result = page.eval(
        LOAD_WORKLET
        + f"""
        [48000, 44100, 16000].map((rate) => {{
          const {{ cls, posted }} = loadWorklet({source}, rate);
          const p = new cls({{ processorOptions: {{ chunkSamples: 480 }} }});
          let n = 0;
          for (let b = 0; b < (2 * rate) / 128; b++) {{
            const block = new Float32Array(128);
            for (let i = 0; i < 128; i++, n++) {{
              block[i] = 0.3 * Math.sin((2 * Math.PI * (n < rate ? 440 : 15000) * n) / rate);
            }}
            p.process([[block]]);
          }}
          const out = posted.flatMap((m) => Array.from(new Int16Array(m.pcm), (v) => v / 32768));
          // Amplitude of 440 Hz in the first second (skipping the edges), RMS of the second.
          const first = out.slice(1200, 22800);
          let re = 0, im = 0;
          first.forEach((v, i) => {{
            re += v * Math.cos((2 * Math.PI * 440 * i) / 24000);
            im += v * Math.sin((2 * Math.PI * 440 * i) / 24000);
          }});
          // What is left once the fitted 440 Hz sine is taken away: glitches, clicks, distortion.
          const a = (2 * re) / first.length, b = (2 * im) / first.length;
          const rest = first.map((v, i) => v - a * Math.cos((2 * Math.PI * 440 * i) / 24000)
                                             - b * Math.sin((2 * Math.PI * 440 * i) / 24000));
          const rms = (x) => Math.sqrt(x.reduce((s, v) => s + v * v, 0) / x.length);
          return {{
            rate,
            samples: out.length,
            amp440: Math.hypot(a, b),
            residual: rms(rest),
            rms15k: rms(out.slice(25200, 46800)),
            levelsFinite: posted.every((m) => Number.isFinite(m.level)),
          }};
        }})
        """
    )
    for r in result:
        assert abs(r["samples"] - 48_000) <= 480, r  # 2 s at 24 kHz, in whole 20 ms chunks
        assert abs(r["amp440"] - 0.3) < 0.01, r
        assert r["residual"] < 0.003 and r["levelsFinite"], r
        if r["rate"] > 24_000:
            assert r["rms15k"] < 0.005, r  # above the new Nyquist: filtered, not folded to 9 kHz


def test_player_worklet_plays_chunks_back_to_back_and_counts_what_it_played(browser: Browser) -> None:
    page = browser.new_page("about:blank")
    source = json.dumps((STATIC / "player-worklet.js").read_text())
    result = page.eval(
        LOAD_WORKLET
        + f"""
        [48000, 44100].map((rate) => {{
          const {{ cls, posted }} = loadWorklet({source}, rate);
          const p = new cls();
          let n = 0;
          for (const size of [1000, 2400, 7, 5000, 9593]) {{
            const pcm = new Int16Array(size);
            for (let i = 0; i < size; i++, n++) pcm[i] = Math.round(9830 * Math.sin(2 * Math.PI * 300 * n / 24000));
            p.port.onmessage({{ data: {{ type: "push", item: "a", pcm: pcm.buffer }} }});
          }}
          const out = [];
          for (let q = 0; q < rate / 128; q++) {{
            const channels = [new Float32Array(128), new Float32Array(128)];
            p.process([], [channels]);
            out.push(...channels[0]);
          }}
          // 18000 samples at 24 kHz last 0.75 s: no step between output samples may exceed a 300 Hz sine's.
          let jump = 0;
          for (let i = 1; i < rate * 0.745; i++) jump = Math.max(jump, Math.abs(out[i] - out[i - 1]));
          const progress = posted.filter((m) => m.type === "progress").pop();
          const kinds = posted.filter((m) => m.type !== "progress").map((m) => m.type);

          const c = loadWorklet({source}, rate);
          const q = new c.cls();
          q.port.onmessage({{ data: {{ type: "push", item: "x", pcm: new Int16Array(24000).buffer }} }});
          const quanta = Math.round((rate * 0.25) / 128);
          for (let k = 0; k < quanta; k++) q.process([], [[new Float32Array(128)]]);
          q.port.onmessage({{ data: {{ type: "clear", item: "x" }} }});
          const cleared = c.posted.find((m) => m.type === "cleared");
          return {{ rate, played: progress.played, queued: progress.queued, jump, kinds, cleared,
                   renderedSource: (quanta * 128 * 24000) / rate }};
        }})
        """
    )
    for r in result:
        assert r["played"] == 18_000 and r["queued"] == 0, r
        assert r["kinds"] == ["started", "drained"], r
        assert r["jump"] <= 0.3 * 2 * np.pi * 300 / r["rate"] * 1.01, r
        cleared = r["cleared"]
        assert abs(cleared["itemPlayed"] - r["renderedSource"]) <= 1, r
        assert cleared["itemPlayed"] + cleared["dropped"] == 24_000, r

"""Shared test helpers: a live in-process server and a raw Realtime client.

Tests are plain functions that call :func:`run` on a coroutine; each starts
its own :class:`~s2s_rt.Server` on a free loopback port, so every test talks
to a real socket and nothing is shared between tests.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import importlib
import json
import os
import urllib.error
import urllib.request
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn, TypeVar

import numpy as np
import pytest
from conformance import validate_server_event
from websockets.asyncio.client import ClientConnection, connect

from s2s_rt import Config, Server
from s2s_rt.config import DEFAULT_SPECULATE_AFTER_MS
from s2s_rt.engines.base import Stack
from s2s_rt.models import PreparedModels
from s2s_rt.wer import word_error_rate, words  # noqa: F401 - shared with the test modules

T = TypeVar("T")


# --- what a test needs from the machine: skipped here, a failure in CI ------------------------------


def in_ci() -> bool:
    """Whether this is a CI run (``CI`` set, as CI services and ``.ci/run``'s callers set it to ``true``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(condition: object, why: str) -> None:
    """Skip the calling test unless ``condition`` holds; under CI, fail it instead.

    CI installs everything the tests need (``.ci/run``), so there a missing
    program, package or model is a broken set-up, not a reason to pass.
    """
    if condition:
        return
    if in_ci():
        pytest.fail(f"{why} (CI={os.environ.get('CI')!r}: what a test needs must be there in CI)", pytrace=False)
    pytest.skip(why)


def missing(why: str) -> NoReturn:
    """:func:`require` of something known to be missing."""
    require(False, why)
    raise AssertionError("unreachable")  # require(False, ...) always raises


def require_module(name: str, why: str) -> ModuleType:
    """Import ``name`` for the calling test; like :func:`require` when it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"{why} ({exc})")


def requires(condition: object, why: str) -> pytest.MarkDecorator:
    """A mark (for a test, a class or ``pytestmark``) that applies :func:`require` before the test's fixtures run."""
    return pytest.mark.requires(bool(condition), why)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires(condition, why): skip unless condition holds; fail under CI")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("requires"):
        require(*mark.args)


def run(coro: Awaitable[T], timeout: float = 60.0) -> T:
    """Run a test scenario with an overall deadline."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


#: What the default stack does and the fake one does not, unless asked: transcribe a turn (and begin its
#: answer) once its closing silence has lasted this long (``Config.speculate_after_ms``).
DEFAULT_STACK_SPECULATE_AFTER_MS = DEFAULT_SPECULATE_AFTER_MS

#: Config fields every :func:`live_server` of the running test gets (set by fixtures such as :func:`speculation`).
_live_defaults: dict[str, Any] = {}


@asynccontextmanager
async def live_server(engines: Stack | None = None, **overrides: Any):  # type: ignore[no-untyped-def]
    """A fake-stack server on a free port; overrides go to :class:`Config`, ``engines`` replace the fake stack's."""
    cfg = {"port": 0, "stack": "fake", "pool_size": 4, "drain_timeout_s": 2.0, "grace_period_s": 2.0}
    async with Server(Config(**cfg | _live_defaults | overrides), stack=engines) as server:
        yield server


@pytest.fixture(
    params=[0, DEFAULT_STACK_SPECULATE_AFTER_MS], ids=["fake-stack-no-speculation", "speculating-as-default-stack"]
)
def speculation(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test twice: on the fake stack as it is, and speculating as the default stack does.

    Every :func:`live_server` the test starts gets ``speculate_after_ms``
    from it, unless the test sets that field itself.
    """
    _live_defaults["speculate_after_ms"] = request.param
    try:
        yield request.param
    finally:
        _live_defaults.pop("speculate_after_ms", None)


#: ``pytestmark = both_speculation_modes``: every test of the module runs with and without speculation.
both_speculation_modes = pytest.mark.usefixtures("speculation")


@pytest.fixture(scope="session")
def shared_models_root() -> Path:
    """The model cache every real-model test shares: ``$S2S_RT_MODELS`` or the default one.

    It is the cache the server itself uses, so ``make test`` (which runs
    ``s2s-rt models prepare --llm all`` first) finds it ready.
    """
    from s2s_rt.models import CACHE_ENV, cache_root, prepare

    root = Path(os.environ.get(CACHE_ENV) or cache_root())
    prepare(root, llm="all", progress=lambda line: None)
    return root


@pytest.fixture(scope="session")
def default_models() -> PreparedModels:
    """The default stack's models from the shared cache (built on first use); without them, skip (in CI: fail)."""
    from s2s_rt.models import ModelError, ensure_prepared

    try:
        return ensure_prepared(progress=lambda _line: None)
    except ModelError as exc:
        missing(f"default models unavailable: {exc}")


def tone(freq: float, seconds: float, rate: int = 24_000, level: float = 0.3) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return (level * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes()


def silence(seconds: float, rate: int = 24_000) -> bytes:
    return bytes(int(rate * seconds) * 2)


def _offers_beta(ws: ClientConnection) -> bool:
    """Whether the client's handshake asked for the beta dialect (header or subprotocol)."""
    request = getattr(ws, "request", None)
    if request is None:
        return False
    header = ",".join(request.headers.get_all("OpenAI-Beta")).replace(" ", "").lower()
    offered = ",".join(request.headers.get_all("Sec-WebSocket-Protocol")).replace(" ", "").split(",")
    return "realtime=v1" in header.split(",") or "openai-beta.realtime-v1" in offered


class RealtimeClient:
    """A bare Realtime client over ``websockets`` that records every event.

    Every event :meth:`recv` gets is checked against the official ``openai``
    types of the client's dialect (:func:`conformance.validate_server_event`):
    beta when the handshake sent ``OpenAI-Beta: realtime=v1`` or offered the
    ``openai-beta.realtime-v1`` subprotocol, GA otherwise. A non-conformant
    event raises ``AssertionError`` from :meth:`recv`; one that a test swallows
    still fails the test when :meth:`connect`'s block ends. Only a test that
    deliberately inspects non-conformant frames passes ``conformance=False``.
    """

    def __init__(self, ws: ClientConnection, *, beta: bool | None = None, conformance: bool = True) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self.beta = _offers_beta(ws) if beta is None else beta
        self.conformance = conformance
        self.nonconformant: list[AssertionError] = []

    @classmethod
    @asynccontextmanager
    async def connect(  # type: ignore[no-untyped-def]
        cls,
        server: Server,
        *,
        beta: bool = False,
        transcribe: bool = False,
        path: str = "/v1/realtime",
        conformance: bool = True,
        **kw: Any,
    ):
        """A client; ``transcribe`` asks for input transcription events (off by default, as OpenAI)."""
        headers = {"OpenAI-Beta": "realtime=v1"} if beta else {}
        headers |= kw.pop("additional_headers", {})
        async with connect(f"ws://127.0.0.1:{server.port}{path}", additional_headers=headers, **kw) as ws:
            client = cls(ws, beta=True if beta else None, conformance=conformance)
            if transcribe:
                await client.send("session.update", session={"input_audio_transcription": {"model": "whisper-1"}})
            yield client
        if client.nonconformant:  # raised by recv() but swallowed by the test
            found = "\n".join(map(str, client.nonconformant))
            raise AssertionError(f"{len(client.nonconformant)} non-conformant server event(s):\n{found}")

    async def send(self, type: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": type, **fields}))

    async def send_raw(self, data: str | bytes) -> None:
        await self.ws.send(data)

    async def recv(self, timeout: float = 10.0) -> dict[str, Any]:
        event = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        self.events.append(event)
        if self.conformance:
            try:
                validate_server_event(event, beta=self.beta)
            except AssertionError as e:
                self.nonconformant.append(e)
                raise
        return event

    async def until(self, type: str, timeout: float = 10.0) -> dict[str, Any]:
        """Receive until an event of ``type`` arrives; returns it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            event = await self.recv(max(0.01, deadline - loop.time()))
            if event["type"] == type:
                return event

    async def append_audio(self, pcm: bytes, chunk_bytes: int = 960, pace_s: float = 0.0) -> None:
        for i in range(0, len(pcm), chunk_bytes):
            await self.send("input_audio_buffer.append", audio=base64.b64encode(pcm[i : i + chunk_bytes]).decode())
            if pace_s:
                await asyncio.sleep(pace_s)

    async def add_user_text(self, text: str, **fields: Any) -> None:
        """Add a user message with ``text`` to the conversation."""
        await self.send(
            "conversation.item.create",
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
            **fields,
        )

    async def ask(self, text: str, **response: Any) -> None:
        """Add a user message and ask for a response (with ``response`` parameters), without waiting."""
        await self.add_user_text(text)
        await self.send("response.create", **({"response": response} if response else {}))

    async def say_text(self, text: str, **response: Any) -> dict[str, Any]:
        """Add a user text item and ask for a response; returns response.done."""
        await self.ask(text, **response)
        return await self.until("response.done")

    def of_type(self, type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type]


def sdk_client(port: int) -> Any:
    """The official openai SDK's client for the server on ``port`` (``.realtime.connect(...)``, ``.beta.realtime``)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(api_key="sk-local", websocket_base_url=f"ws://127.0.0.1:{port}/v1")


async def http_get(
    server: Server, path: str, *, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, str]:
    """An HTTP request (GET by default) on the server's port, off the loop (urllib is blocking)."""

    def get() -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    return await asyncio.to_thread(get)


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> bool:
    """Wait for an asynchronous condition to hold (for state the client can only poll, like HTTP)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.02)
    return await check()


# --- what an ended session leaves behind -------------------------------------------------------


def serving_now(server: Any) -> list[weakref.ReferenceType[Any]]:
    """Weak references to the context, and its session, of every slot of ``server`` that serves one now."""
    held: list[weakref.ReferenceType[Any]] = []
    for slot in server.pool.slots:
        context = slot.serving()
        if context is not None:
            held += [weakref.ref(context), weakref.ref(context.session)]
    return held


def still_held(refs: list[weakref.ReferenceType[Any]]) -> list[str]:
    """What of ``refs`` is alive, each with the types of what refers to it (empty when all are freed)."""
    alive = [obj for obj in (ref() for ref in refs) if obj is not None]
    return [f"{type(obj).__name__} <- {[type(r).__name__ for r in gc.get_referrers(obj)]}" for obj in alive]


@contextmanager
def collector_off() -> Iterator[None]:
    """CPython's cyclic collector off (after one full pass), as the server's seldom collection nearly is:
    what is freed within the block is freed by reference counting."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()

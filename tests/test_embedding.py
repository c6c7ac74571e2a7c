"""Embedding, configuration and the CLI."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import weakref
from pathlib import Path

import pytest
from conftest import RealtimeClient, run
from websockets.exceptions import ConnectionClosed

from s2s_rt import Config, Server, load_config
from s2s_rt.config import ConfigError


def test_async_with_server_on_port_zero_serves_and_closes() -> None:
    async def scenario() -> None:
        async with Server(Config(port=0, stack="fake", pool_size=1)) as server:
            assert server.port != 0
            async with RealtimeClient.connect(server) as c:
                done = await c.say_text("embedded")
                assert done["response"]["status"] == "completed"
        # Closed: the port no longer accepts.
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=1)

    run(scenario())


def test_a_closed_server_and_the_engines_it_loaded_are_freed() -> None:
    """An application (or a test run) that starts server after server must not keep each one's models: start-up
    puts what it loaded out of the collector's reach, and closing must put it back (on the default stack each
    kept server held its LLM, 0.5-2 GB)."""
    closed: list[weakref.ref[object]] = []

    async def one() -> None:
        async with Server(Config(port=0, stack="fake", pool_size=1)) as server:
            async with RealtimeClient.connect(server) as c:
                assert (await c.say_text("kept?"))["response"]["status"] == "completed"
            assert server.stack is not None
            closed.extend((weakref.ref(server), weakref.ref(server.stack.llm)))

    async def refused() -> None:
        # One that cannot listen (its port taken) fails to start, and is let go of too.
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            server = Server(Config(port=taken.getsockname()[1], stack="fake", pool_size=1))
            failed = False
            try:
                await server.start()
            except* OSError:
                failed = True
            assert failed
            closed.append(weakref.ref(server))

    for _ in range(2):
        run(one())
    run(refused())
    gc.collect()
    assert [ref() for ref in closed] == [None] * 5


def test_close_lets_a_running_answer_go_on_for_the_grace_period_then_sends_1001() -> None:
    grace_s = 1.0

    async def scenario() -> None:
        server = Server(Config(port=0, stack="fake", pool_size=1, grace_period_s=grace_s))
        await server.start()
        async with RealtimeClient.connect(server) as c:
            # An answer of 40 one-word sentences at 100 ms a word, each long enough to be spoken once complete
            # (a clause is at least 20 characters): four seconds, a piece of speech every 100 ms.
            await c.ask("[[slow 100]] " + " ".join(f"w{i}-{'o' * 20}." for i in range(40)))
            await c.until("response.output_audio.delta")
            loop = asyncio.get_running_loop()
            closing = asyncio.create_task(server.close())
            started = loop.time()
            during = []
            with pytest.raises(ConnectionClosed):
                while True:
                    event = await c.recv(timeout=grace_s + 3)
                    during.append((loop.time() - started, event["type"]))
            closed_after = loop.time() - started
            await closing
            assert c.ws.close_code == 1001
            assert grace_s <= closed_after < grace_s + 1.0, closed_after
            # The answer went on during the grace period, and was cut by the close.
            assert any(t > grace_s / 2 and kind == "response.output_audio.delta" for t, kind in during), during
            assert "response.done" not in {kind for _, kind in during}

    run(scenario())


def test_flags_override_environment_which_overrides_file(tmp_path: Path) -> None:
    f = tmp_path / "s2s.toml"
    f.write_text('pool_size = 3\nport = 9000\nhost = "0.0.0.0"\n')
    cfg = load_config(
        f, environ={"S2S_RT_POOL_SIZE": "5", "S2S_RT_PORT": "9100"}, overrides={"port": 9200, "host": None}
    )
    assert (cfg.pool_size, cfg.port, cfg.host) == (5, 9200, "0.0.0.0")


def test_bad_config_names_the_problem(tmp_path: Path) -> None:
    f = tmp_path / "s2s.toml"
    f.write_text("pool_sise = 3\n")
    with pytest.raises(ConfigError, match="pool_sise"):
        load_config(f, environ={})
    with pytest.raises(ConfigError, match="pool_size"):
        load_config(None, environ={"S2S_RT_POOL_SIZE": "many"})
    with pytest.raises(ConfigError, match="listen_tick_ms"):
        load_config(None, environ={"S2S_RT_LISTEN_TICK_MS": "0"})
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ConfigError, match="max_listening_load"):
            load_config(None, environ={"S2S_RT_MAX_LISTENING_LOAD": bad})
    for bad in ("-1", "41", "nan"):
        with pytest.raises(ConfigError, match="media_poll_ms"):
            load_config(None, environ={"S2S_RT_MEDIA_POLL_MS": bad})
    assert load_config(None, environ={"S2S_RT_MEDIA_POLL_MS": "0"}).media_poll_ms == 0  # each as it comes


def test_cli_serve_fake_stack_starts_answers_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    env = dict(os.environ, S2S_RT_POOL_SIZE="2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "s2s_rt", "serve", "--stack", "fake", "--port", "0", "--log-level", "info"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        port = None
        deadline = time.monotonic() + 20
        assert proc.stderr is not None
        while time.monotonic() < deadline and port is None:
            line = proc.stderr.readline()
            if "listening on ws://" in line:
                port = int(line.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        assert port, "server did not report its port"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            assert r.status == 200 and b"2 of 2" in r.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

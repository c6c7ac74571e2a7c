"""The oldest ``websockets`` that ``pyproject.toml`` allows really runs the server.

The project is developed and tested on the newest ``websockets``; the lower
bound of its requirement is a promise about an older one. This test keeps the
promise honest: it installs exactly that lower bound into a directory of its
own, starts ``s2s-rt serve --stack fake`` on it in a subprocess, and drives
every HTTP endpoint (``POST /drain`` included) and one Realtime text turn.
(14.0 to 16.1.1, allowed before, answered every HTTP request 500, their
``Request`` having no ``method``, and dropped ``POST /drain`` and ``HEAD``
unanswered: they parse nothing but GET.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from conftest import RealtimeClient, http_get, require, run

from s2s_rt import Server

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 60.0


def websockets_floor() -> str:
    """The lower bound of the ``websockets`` requirement in ``pyproject.toml`` (``>=X``)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(r"websockets\s*[<>=!~ ]", d)]
    found = re.search(r">=\s*([0-9][0-9.]*)", spec)
    assert found, f"the websockets requirement has no lower bound: {spec!r}"
    return found.group(1)


PIP_INSTALL = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check"]

#: Started in the server's own process: it refuses to serve on any other ``websockets`` than the one asked for.
SERVE = """
import sys, websockets
want = sys.argv[1]
print(f"websockets {websockets.__version__} from {websockets.__file__}", file=sys.stderr, flush=True)
if websockets.__version__ != want:
    sys.exit(f"loaded websockets {websockets.__version__}, not {want}")
from s2s_rt.cli import main
sys.exit(main(["serve", "--stack", "fake", "--host", "127.0.0.1", "--port", "0", "--pool-size", "2"]))
"""


def check_server_on(version: str, target: Path, deadline_s: float = DEADLINE_S) -> None:
    """Install ``websockets==version`` into ``target``, serve on it, and drive every endpoint and a turn."""
    start = time.monotonic()
    try:
        pip = subprocess.run(
            [*PIP_INSTALL, "--target", str(target), f"websockets=={version}"],
            capture_output=True,
            text=True,
            timeout=deadline_s / 2,
        )
        failed = pip.stderr.strip()[-500:] if pip.returncode else ""
    except subprocess.TimeoutExpired:
        failed = f"no answer from the package index in {deadline_s / 2:.0f} s"
    require(not failed, f"pip could not install websockets=={version}: {failed}")

    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}
    for name in ("S2S_RT_CONFIG", "S2S_RT_PORT", "S2S_RT_HOST", "S2S_RT_API_KEYS", "S2S_RT_STACK"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, version],
        cwd=target,  # nothing of the checkout's own directory shadows the installed websockets
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    listening = threading.Event()
    port: list[int] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening on ws://[^:]+:(\d+)/v1/realtime", line)
            if m and not port:
                port.append(int(m.group(1)))
                listening.set()
        listening.set()  # the process ended: stop waiting

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        listening.wait(max(1.0, deadline_s - (time.monotonic() - start) - 20))
        log = "".join(lines)
        assert port, f"the server did not start on websockets {version}:\n{log}"
        assert f"websockets {version} from {target}" in log, log
        server = cast(Server, SimpleNamespace(port=port[0]))  # all the helpers read of it
        run(_drive(server), timeout=max(5.0, deadline_s - (time.monotonic() - start)))
        # Nothing went wrong on the server's side while it answered.
        time.sleep(0.2)
        log = "".join(lines)
        assert "Traceback" not in log and "opening handshake failed" not in log, log
    finally:
        proc.kill()
        proc.wait(10)
        reader.join(5)


async def _drive(server: Server) -> None:
    status, body = await http_get(server, "/healthz")
    assert (status, body) == (200, "ok\n"), (status, body)
    status, body = await http_get(server, "/readyz")
    assert status == 200 and body.startswith("ready"), (status, body)
    status, body = await http_get(server, "/v1/pool")
    assert status == 200 and '"draining": false' in body, (status, body)
    status, body = await http_get(server, "/metrics")
    assert status == 200 and "s2s_" in body, (status, body)
    status, body = await http_get(server, "/", method="HEAD")
    assert (status, body) == (200, ""), (status, body)

    async with RealtimeClient.connect(server) as client:
        await client.until("session.created")
        done = await client.say_text("hello floor", output_modalities=["text"])
        assert done["response"]["status"] == "completed", done
        text = "".join(e["delta"] for e in client.of_type("response.output_text.delta"))
        assert text == "You said: hello floor.", text

    status, body = await http_get(server, "/drain", method="GET", headers={"S2S-Operator": "1"})
    assert status == 405, (status, body)
    status, body = await http_get(server, "/drain", method="POST", headers={"S2S-Operator": "1"})
    assert status == 200 and body.startswith("draining"), (status, body)
    status, body = await http_get(server, "/readyz")
    assert status == 503, (status, body)


def test_oldest_allowed_websockets_serves(tmp_path: Path) -> None:
    """pyproject's ``websockets>=X``: on exactly X the server answers HTTP, drains and holds a session."""
    started = time.monotonic()
    check_server_on(websockets_floor(), tmp_path / "websockets")
    assert time.monotonic() - started < DEADLINE_S

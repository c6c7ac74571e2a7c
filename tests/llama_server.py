"""A real OpenAI-compatible LLM server for the ``--llm-url`` tests: llama.cpp's, from llama-cpp-python.

``make`` installs ``llama-cpp-python[server]`` (which compiles llama.cpp)
into a virtual environment of its own, ``.venv/llama-server``, so that its
dependencies never mix with the project's. :class:`LlamaServer` runs it as a
subprocess on a free loopback port, serving a GGUF the project already ships
(:func:`s2s_rt.models.recipes.source_gguf`).

:class:`ConnectionLog` is a TCP relay put between s2s-rt and that server: it
records when each connection opens and closes and what the client sent, so
a test can see the HTTP stream being closed and the requests s2s-rt made.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The Python of the llama.cpp server's virtual environment (``make`` builds it).
LLAMA_PYTHON = Path(os.environ.get("S2S_RT_LLAMA_SERVER_PYTHON") or ROOT / ".venv" / "llama-server" / "bin" / "python")
INSTALL_HINT = "make llama-server  (builds llama-cpp-python[server] into .venv/llama-server)"


def require_llama_cpp() -> None:
    """Skip the test where llama.cpp's server is not installed; in CI, fail it (:func:`conftest.require`)."""
    # Imported here: the benchmark script that shares this module needs none of the test helpers.
    from conftest import require

    require(LLAMA_PYTHON.is_file(), f"{LLAMA_PYTHON} is missing; run: {INSTALL_HINT}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """``python -m llama_cpp.server`` serving one GGUF on 127.0.0.1.

    Args:
        gguf: the model file.
        log: where the server's output goes.
        port: a fixed port (to restart it on the same address), else a free one.
        api_key: the key it requires, if any.
        threads: llama.cpp threads.
    """

    def __init__(
        self, gguf: Path, log: Path, *, port: int | None = None, api_key: str | None = None, threads: int = 2
    ) -> None:
        self.gguf = gguf
        self.log = log
        self.port = port or free_port()
        self.api_key = api_key
        self.threads = threads
        self.model = gguf.stem
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 120.0) -> LlamaServer:
        """Start it and return once it answers ``GET /v1/models`` (skips the test without llama.cpp)."""
        require_llama_cpp()
        command = [
            str(LLAMA_PYTHON), "-m", "llama_cpp.server",
            "--model", str(self.gguf), "--model_alias", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--n_ctx", "4096", "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
            # Queue concurrent requests instead of cutting the running one short.
            "--interrupt_requests", "False",
        ]  # fmt: skip
        if self.api_key:
            command += ["--api_key", self.api_key]
        # OpenMP threads that spin while they wait take the CPU from everything else on a
        # small machine (20 tokens took 15.8 s instead of 1.3 s on 2 busy cores).
        env = os.environ | {"OMP_WAIT_POLICY": "passive"}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the llama.cpp server exited ({self.process.returncode}): {self._log_tail()}")
            if self._answers():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the llama.cpp server did not answer within {timeout:g} s: {self._log_tail()}")

    def _answers(self) -> bool:
        request = urllib.request.Request(f"{self.url}/models")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=1) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-answer, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but sends nothing more."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Connection:
    opened: float
    #: Bytes the client (s2s-rt) sent: its HTTP requests.
    sent: bytearray = field(default_factory=bytearray)
    #: When the client closed its side (``loop.time()``), None while open.
    closed: float | None = None


class ConnectionLog:
    """A TCP relay on a free port to ``target_port`` that records each connection.

    Start it inside the test's event loop; point ``llm_url`` at :attr:`url`.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections: list[Connection] = []
        self._server: asyncio.Server | None = None
        self._closed = asyncio.Event()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def __aenter__(self) -> ConnectionLog:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def wait_closed(self, connection: Connection, timeout: float) -> float | None:
        """Wait until ``connection`` is closed by the client; returns when, or None."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while connection.closed is None and loop.time() < deadline:
            self._closed.clear()
            try:
                await asyncio.wait_for(self._closed.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                break
        return connection.closed

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        connection = Connection(opened=loop.time())
        self.connections.append(connection)
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            connection.closed = loop.time()
            self._closed.set()
            return

        async def upstream() -> None:
            try:
                while data := await client_reader.read(65536):
                    connection.sent += data
                    server_writer.write(data)
                    await server_writer.drain()
            except OSError:
                pass
            connection.closed = loop.time()
            self._closed.set()
            server_writer.close()

        async def downstream() -> None:
            try:
                while data := await server_reader.read(65536):
                    client_writer.write(data)
                    await client_writer.drain()
            except OSError:
                pass
            client_writer.close()

        await asyncio.gather(upstream(), downstream())

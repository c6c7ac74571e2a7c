"""A real MCP server (the ``mcp`` package's own) on loopback, in a thread: for the MCP tests and the fuzzer."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any


class McpHost:
    """A real MCP server (streamable HTTP at ``/mcp``) in a thread, recording the calls and headers it got."""

    def __init__(self) -> None:
        import uvicorn
        from mcp.server.mcpserver import MCPServer

        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.headers: list[dict[str, str]] = []
        mcp = MCPServer("weather", log_level="WARNING")

        @mcp.tool(description="The weather now in a city")
        def get_weather(city: str) -> str:
            self.calls.append(("get_weather", {"city": city}))
            return f"Sunny and 21 degrees in {city}"

        @mcp.tool(description="Books a table")
        def book_table(name: str) -> str:
            self.calls.append(("book_table", {"name": name}))
            raise ValueError("the restaurant is closed")

        @mcp.tool(description="Takes its time")
        async def slow_search(query: str) -> str:
            self.calls.append(("slow_search", {"query": query}))
            await asyncio.sleep(30)
            return "too late"

        @mcp.tool(description="Says a lot")
        def long_story(topic: str) -> str:
            return topic * 100_000

        app = mcp.streamable_http_app(streamable_http_path="/mcp")

        async def recording(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
            await app(scope, receive, send)

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.server = uvicorn.Server(uvicorn.Config(recording, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> McpHost:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the MCP server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

"""An MCP client for hosted MCP tools: list a server's tools, call one, bounded in time and output.

Built on the ``mcp`` package's streamable HTTP client (imported when a
session first uses an MCP server). Each listing and each call opens its own
connection, in the task that asks, and closes it before returning: a
session's MCP work holds nothing between calls, and a server that hangs is
left when the time is up. Redirects are not followed (the ``mcp`` client's
own rule), so an allowed URL cannot send the server elsewhere.

Every failure is an :class:`McpFailure` saying it as OpenAI's ``mcp_call``
errors do: ``protocol_error`` (the MCP exchange failed, or the time ran
out), ``tool_execution_error`` (the tool said it failed) or ``http_error``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from s2s_rt.protocol.mcp import McpServer, cut_output, tool_entry


class McpFailure(Exception):
    """A listing or call that did not succeed, as an ``mcp_call`` item's ``error`` says it."""

    def __init__(self, kind: str, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code

    def as_error(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.kind, "message": self.message}
        if self.kind != "tool_execution_error":
            error["code"] = self.code if self.code is not None else 0
        return error


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _failure(exc: BaseException, url: str) -> McpFailure:
    """What went wrong, from the exceptions the ``mcp`` client's task groups raise."""
    import httpx2
    from mcp.shared.exceptions import MCPError

    for leaf in _leaves(exc):
        if isinstance(leaf, McpFailure):
            return leaf
        if isinstance(leaf, httpx2.HTTPStatusError):
            return McpFailure(
                "http_error", f"{url} answered HTTP {leaf.response.status_code}", leaf.response.status_code
            )
        if isinstance(leaf, MCPError):
            return McpFailure("protocol_error", f"{url}: {leaf.error.message}", leaf.error.code)
        if isinstance(leaf, httpx2.HTTPError | OSError):
            return McpFailure("http_error", f"{url} could not be reached ({type(leaf).__name__}: {leaf})")
    return McpFailure("protocol_error", f"{url}: {type(exc).__name__}: {exc}")


@asynccontextmanager
async def _session(server: McpServer, timeout_s: float) -> AsyncIterator[Any]:
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with (
        httpx2.AsyncClient(headers=dict(server.headers), timeout=timeout_s, follow_redirects=False) as http,
        streamable_http_client(server.url, http_client=http) as streams,
    ):
        async with ClientSession(streams[0], streams[1]) as session:
            await session.initialize()
            yield session


async def _bounded(server: McpServer, timeout_s: float, work: Any) -> Any:
    try:
        async with asyncio.timeout(timeout_s):
            async with _session(server, timeout_s) as session:
                return await work(session)
    except TimeoutError:
        raise McpFailure("protocol_error", f"{server.url} did not answer within {timeout_s:g} s") from None
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # the mcp client raises ExceptionGroups
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise _failure(exc, server.url) from None


async def list_tools(server: McpServer, timeout_s: float, max_bytes: int) -> list[dict[str, Any]]:
    """The tools ``server`` lists, as an ``mcp_list_tools`` item holds them.

    Raises:
        McpFailure: unreachable, not MCP, too slow, or a listing over ``max_bytes``.
    """

    async def work(session: Any) -> list[dict[str, Any]]:
        result = await session.list_tools()
        return [
            tool_entry(
                t.name,
                t.description,
                t.input_schema,
                t.annotations.model_dump(exclude_none=True) if t.annotations is not None else None,
            )
            for t in result.tools
        ]

    tools: list[dict[str, Any]] = await _bounded(server, timeout_s, work)
    size = len(json.dumps(tools))
    if size > max_bytes:
        raise McpFailure("protocol_error", f"{server.url} listed {size} bytes of tools, more than {max_bytes}")
    return tools


async def call_tool(server: McpServer, name: str, arguments: dict[str, Any], timeout_s: float, max_bytes: int) -> str:
    """Run tool ``name`` on ``server``; its output as text (cut at ``max_bytes``).

    Raises:
        McpFailure: the tool failed (``tool_execution_error``), or the exchange did.
    """

    async def work(session: Any) -> str:
        result = await session.call_tool(name, arguments, read_timeout_seconds=timeout_s)
        texts = [getattr(part, "text", None) for part in result.content]
        text = "\n".join(t for t in texts if isinstance(t, str))
        if not text and result.structured_content is not None:
            text = json.dumps(result.structured_content)
        if result.is_error:
            raise McpFailure("tool_execution_error", cut_output(text or f"{name} failed", max_bytes))
        return text

    return cut_output(await _bounded(server, timeout_s, work), max_bytes)

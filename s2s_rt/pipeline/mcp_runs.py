"""A session's MCP work: its servers' tools listed, its answers' MCP calls run, each in the session's scope.

The order of events follows OpenAI's: a listing is an ``mcp_list_tools``
item (``conversation.item.added``, ``mcp_list_tools.in_progress``, then
``.completed`` or ``.failed`` and ``conversation.item.done``). A call the
model makes ends its response with the ``mcp_call`` item still open; it
runs then (``response.mcp_call.in_progress``, ``.completed`` or ``.failed``)
and its ``conversation.item.done`` carries the output, on which clients
(``@openai/agents-realtime``) ask for the next response. A call that needs
approval runs when the client's ``mcp_approval_response`` approves it, as
a new ``mcp_call`` item.

Every listing and call is bounded in time and output
(:class:`~s2s_rt.protocol.mcp.McpPolicy`); one that fails or hangs ends as
``failed``, never the session. At most :data:`AT_ONCE` run at once per session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from s2s_rt.engines.mcp_client import McpFailure, call_tool, list_tools
from s2s_rt.protocol import server_events as se
from s2s_rt.protocol.errors import ServerFault
from s2s_rt.protocol.mcp import McpServer, approval_request_item, arguments_object, call_item, list_tools_item
from s2s_rt.protocol.response import Response
from s2s_rt.protocol.server_events import snapshot
from s2s_rt.protocol.session import Session
from s2s_rt.scope import Scope

log = logging.getLogger(__name__)

Emit = Callable[[list[se.ServerEvent], Scope], Awaitable[None]]

#: MCP listings and calls one session may have in flight; more wait their turn.
AT_ONCE = 4


def mcp_call_events(r: Response, server: McpServer, name: str, arguments: str) -> list[se.ServerEvent]:
    """The model called tool ``name`` of ``server``: an ``mcp_call`` item in ``r`` (run once ``r`` ends), or an
    ``mcp_approval_request`` where the server's ``require_approval`` asks for one."""
    if server.needs_approval(name):
        return r.mcp_call(approval_request_item(server.label, name, arguments), approval=True)
    return r.mcp_call(call_item(server.label, name, arguments), approval=False)


class McpRuns:
    """The MCP work of one session (owned by its :class:`~s2s_rt.pipeline.context.SessionContext`)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._turns = asyncio.Semaphore(AT_ONCE)

    def list_new(self, emit: Emit) -> None:
        """List the tools of the session's new or changed MCP servers (after a ``session.update``)."""
        for server in self.session.mcp.take_unlisted():
            self.session.scope.spawn(self._list(server, emit), f"mcp list {server.label}")

    def run_calls(self, r: Response, emit: Emit) -> None:
        """Run the MCP calls response ``r`` made (it has ended)."""
        for item in r.mcp_calls:
            self.session.scope.spawn(self._call(item, r.outputs.index(item), emit), f"mcp call {item.name}")

    def answered(self, item_id: str, emit: Emit) -> None:
        """A client's item was added: if it approves an MCP call, the call runs now, as a new ``mcp_call`` item."""
        conversation = self.session.conversation
        answer = conversation.items.get(item_id)
        if answer is None or answer.type != "mcp_approval_response" or answer.approve is not True:
            return
        request = conversation.items.get(str(answer.approval_request_id))
        if request is None:
            return
        item = call_item(str(request.server_label), request.name or "", request.arguments or "{}", request.id)
        prev = conversation.insert(item, None, None)
        added: list[se.ServerEvent] = [
            self._ev(se.ItemEvent, "conversation.item.added", previous_item_id=prev, item=snapshot(item))
        ]
        self.session.scope.spawn(self._call(item, 0, emit, added), f"mcp call {item.name}")

    def _ev(self, cls: type[se.E], name: str, **fields: object) -> se.E:
        return self.session.dialect.event(cls, name, **fields)

    def _done(self, item: se.Item) -> list[se.ServerEvent]:
        conversation = self.session.conversation
        if item.id not in conversation.items:
            return []  # deleted meanwhile
        conversation.account(item.id)
        prev = conversation.previous(item.id)
        return [self._ev(se.ItemEvent, "conversation.item.done", previous_item_id=prev, item=snapshot(item))]

    async def _list(self, server: McpServer, emit: Emit) -> None:
        session = self.session
        item = list_tools_item(server)
        prev = session.conversation.insert(item, None, None)
        await emit(
            [
                self._ev(se.ItemEvent, "conversation.item.added", previous_item_id=prev, item=snapshot(item)),
                self._ev(se.McpListToolsEvent, "mcp_list_tools.in_progress", item_id=item.id),
            ],
            session.scope,
        )
        policy = session.mcp.policy
        async with self._turns:
            try:
                tools = await list_tools(server, policy.timeout_s, policy.max_output_bytes)
            except McpFailure as exc:
                log.info("MCP server %r: listing failed: %s", server.label, exc.message)
                fault = ServerFault("mcp_list_tools_failed", f"MCP server {server.label!r}: {exc.message}")
                failed = self._ev(se.McpListToolsEvent, "mcp_list_tools.failed", item_id=item.id)
                await emit([failed, *self._done(item), session.error(fault)], session.scope)
                return
        item.tools = tools
        if session.mcp.still(server):
            session.mcp.listed[server.label] = tools
        completed = self._ev(se.McpListToolsEvent, "mcp_list_tools.completed", item_id=item.id)
        await emit([completed, *self._done(item)], session.scope)

    async def _call(
        self, item: se.Item, output_index: int, emit: Emit, before: list[se.ServerEvent] | None = None
    ) -> None:
        session = self.session
        started = self._ev(se.McpCallEvent, "response.mcp_call.in_progress", item_id=item.id, output_index=output_index)
        await emit([*(before or []), started], session.scope)
        server = session.mcp.servers.get(str(item.server_label))
        policy = session.mcp.policy
        async with self._turns:
            try:
                if server is None:
                    raise McpFailure("protocol_error", f"the session has no MCP server labelled {item.server_label!r}")
                arguments = arguments_object(item.arguments or "{}")
                item.output = await call_tool(
                    server, item.name or "", arguments, policy.timeout_s, policy.max_output_bytes
                )
                name = "response.mcp_call.completed"
            except McpFailure as exc:
                log.info("MCP call %s on %r failed: %s", item.name, item.server_label, exc.message)
                item.error = exc.as_error()
                name = "response.mcp_call.failed"
        ended = self._ev(se.McpCallEvent, name, item_id=item.id, output_index=output_index)
        await emit([ended, *self._done(item)], session.scope)

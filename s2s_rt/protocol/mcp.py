"""Hosted MCP tools (``type: "mcp"``): which servers a session may use, the tools they listed, and their items.

A session names an MCP server in its tools; the server lists that server's
tools (an ``mcp_list_tools`` item), shows them to the model as functions,
and runs the model's calls of them on the MCP server (``mcp_call`` items),
after the client's approval where ``require_approval`` asks for one
(``mcp_approval_request`` and ``mcp_approval_response`` items). This module
is the protocol's side: settings checked, state kept, items made. The I/O is
:mod:`s2s_rt.engines.mcp_client`'s; the running, :mod:`s2s_rt.pipeline.mcp_runs`'s.

A client must not make the server reach any address it likes: a server URL
is taken only when the operator allowed it (:class:`McpPolicy`, the
``mcp_servers`` setting; none by default).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from s2s_rt.protocol import server_events as se
from s2s_rt.protocol.errors import ProtocolError

Fail = Callable[[str, str, str], ProtocolError]

#: How the operator allows MCP servers, named in every refusal.
SETTING = "mcp_servers (TOML), S2S_RT_MCP_SERVERS or --mcp-server URL_PREFIX"


@dataclass(frozen=True)
class McpPolicy:
    """The operator's MCP settings.

    Args:
        allowed_urls: URL prefixes a session's ``server_url`` may start with (same scheme, host and port; a
            path under the prefix's). None allowed: MCP tools are refused.
        timeout_s: the longest a listing or a call may take, connecting included.
        max_output_bytes: the most bytes of one call's output (longer is cut) or of one listing (refused).
    """

    allowed_urls: tuple[str, ...] = ()
    timeout_s: float = 20.0
    max_output_bytes: int = 64 << 10

    def allows(self, url: str) -> bool:
        """Whether ``url`` is under one of :attr:`allowed_urls` (compared parsed, not as text)."""
        try:
            got = urlsplit(url)
            where = (got.scheme, got.hostname, got.port)  # ValueError: a port out of range, or not a number
        except ValueError:
            return False
        if got.scheme not in ("http", "https") or not got.hostname or "@" in got.netloc:
            return False
        for prefix in self.allowed_urls:
            want = urlsplit(prefix)
            if (want.scheme, want.hostname, want.port) != where:
                continue
            base = want.path.rstrip("/")
            if got.path == base or got.path.startswith(base + "/") or not base:
                return True
        return False


@dataclass(frozen=True)
class McpServer:
    """One ``type: "mcp"`` tool of a session, checked."""

    label: str
    url: str
    headers: tuple[tuple[str, str], ...] = ()
    #: The tools the model may call (None: all it lists), and whether only those marked read-only.
    allowed: frozenset[str] | None = None
    read_only: bool = False
    #: Tools that need the client's approval (None: every one) and tools that never do.
    approve: frozenset[str] | None = None
    never: frozenset[str] = frozenset()

    def needs_approval(self, name: str) -> bool:
        if name in self.never:
            return False
        return self.approve is None or name in self.approve

    def offers(self, tool: dict[str, Any]) -> bool:
        """Whether a listed tool is shown to the model (``allowed_tools``)."""
        if self.allowed is not None and tool["name"] not in self.allowed:
            return False
        hints = tool.get("annotations") or {}
        return not self.read_only or bool(isinstance(hints, dict) and hints.get("readOnlyHint"))


def _names(value: Any, where: str, fail: Fail) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise fail("invalid_value", f"{where} must be a list of tool names", where)
    return frozenset(value)


def check_mcp_tool(tool: dict[str, Any], where: str, policy: McpPolicy, fail: Fail) -> McpServer:
    """A ``type: "mcp"`` tool as OpenAI defines it, checked against the operator's policy.

    Raises:
        ProtocolError: a missing label or URL, a URL the operator did not allow, bad headers or filters.
    """
    label, url = tool.get("server_label"), tool.get("server_url")
    if not isinstance(label, str) or not label.strip():
        raise fail("invalid_value", f"{where}.server_label must be a non-empty string", f"{where}.server_label")
    if not isinstance(url, str) or not url:
        kind = "a connector_id" if tool.get("connector_id") is not None else "no server_url"
        raise fail(
            "invalid_value", f"{where} has {kind}: this server reaches MCP servers by server_url", f"{where}.server_url"
        )
    if not policy.allowed_urls:
        raise fail(
            "mcp_server_not_allowed",
            f"MCP servers are off on this server: its operator allows server URLs with {SETTING}",
            f"{where}.server_url",
        )
    if not policy.allows(url):
        raise fail(
            "mcp_server_not_allowed",
            f"{where}.server_url {url!r} is not under a URL prefix the operator allowed ({SETTING})",
            f"{where}.server_url",
        )
    headers: dict[str, str] = {}
    raw_headers = tool.get("headers")
    if raw_headers is not None:
        if not isinstance(raw_headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw_headers.items()
        ):
            raise fail("invalid_value", f"{where}.headers must be an object of strings", f"{where}.headers")
        headers.update(raw_headers)
    authorization = tool.get("authorization")
    if authorization is not None:
        if not isinstance(authorization, str):
            raise fail("invalid_value", f"{where}.authorization must be a string", f"{where}.authorization")
        headers["Authorization"] = f"Bearer {authorization}"
    for k, v in headers.items():
        if not k or any(c in k + v for c in "\r\n\0") or any(c in k for c in " :"):
            raise fail("invalid_value", f"{where}.headers has a header that cannot be sent ({k!r})", f"{where}.headers")
    allowed, read_only = None, False
    filt = tool.get("allowed_tools")
    if isinstance(filt, dict):
        if filt.get("tool_names") is not None:
            allowed = _names(filt["tool_names"], f"{where}.allowed_tools.tool_names", fail)
        read_only = filt.get("read_only") is True
    elif filt is not None:
        allowed = _names(filt, f"{where}.allowed_tools", fail)
    approve: frozenset[str] | None = None
    never: frozenset[str] = frozenset()
    policy_value = tool.get("require_approval")
    if policy_value == "never":
        approve = frozenset()
    elif isinstance(policy_value, dict):
        for key in ("always", "never"):
            names = policy_value.get(key)
            if names is None:
                continue
            if not isinstance(names, dict):
                raise fail("invalid_value", f"{where}.require_approval.{key} must be an object", where)
            listed = names.get("tool_names")
            found = (
                frozenset() if listed is None else _names(listed, f"{where}.require_approval.{key}.tool_names", fail)
            )
            if key == "never":
                never = found
            elif listed is not None:
                approve = found
    elif policy_value not in (None, "always"):
        raise fail(
            "invalid_value",
            f"{where}.require_approval must be 'always', 'never' or a filter",
            f"{where}.require_approval",
        )
    return McpServer(label, url, tuple(headers.items()), allowed, read_only, approve, never)


@dataclass
class McpTools:
    """A session's MCP servers, the tools each listed, and its calls waiting for approval."""

    policy: McpPolicy = field(default_factory=McpPolicy)
    servers: dict[str, McpServer] = field(default_factory=dict)
    #: Each server's listed tools, as the ``mcp_list_tools`` item says them.
    listed: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    unlisted: list[McpServer] = field(default_factory=list)

    def check(self, tools: list[Any], fail: Fail) -> dict[str, McpServer]:
        """The MCP servers among a session's ``tools``, checked; a label used twice is refused."""
        found: dict[str, McpServer] = {}
        for i, tool in enumerate(tools):
            if isinstance(tool, dict) and tool.get("type") == "mcp":
                server = check_mcp_tool(tool, f"tools[{i}]", self.policy, fail)
                if server.label in found:
                    raise fail("invalid_value", f"two MCP tools are labelled {server.label!r}", f"tools[{i}]")
                found[server.label] = server
        return found

    def configure(self, tools: list[dict[str, Any]]) -> None:
        """The session's tools are now ``tools`` (checked): new or changed MCP servers wait to be listed."""
        servers = self.check(tools, lambda code, message, param: ProtocolError(code, message, param=param))
        fresh = [s for label, s in servers.items() if self.servers.get(label) != s]
        for label in set(self.servers) - set(servers):
            self.listed.pop(label, None)
        for server in fresh:
            self.listed.pop(server.label, None)
        self.servers = servers
        self.unlisted = [s for s in self.unlisted if servers.get(s.label) == s and s not in fresh] + fresh

    def take_unlisted(self) -> list[McpServer]:
        """The servers to list now (each returned once)."""
        taken, self.unlisted = self.unlisted, []
        return taken

    def still(self, server: McpServer) -> bool:
        """Whether ``server`` is still the session's (its settings unchanged since it was asked)."""
        return self.servers.get(server.label) == server

    def as_functions(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``tools`` as the model sees them: the MCP entries replaced by the tools their servers listed.

        A function tool's name wins over an MCP tool of the same name.
        """
        functions = [t for t in tools if t.get("type", "function") == "function"]
        if len(functions) == len(tools):
            return tools
        taken = {t.get("name") for t in functions}
        for label in self.servers:
            for tool in self.offered(label):
                if tool["name"] not in taken:
                    taken.add(tool["name"])
                    functions.append(
                        {
                            "type": "function",
                            "name": tool["name"],
                            "description": tool.get("description") or "",
                            "parameters": tool["input_schema"],  # the same object: see server_of
                        }
                    )
        return functions

    def offered(self, label: str) -> list[dict[str, Any]]:
        server = self.servers.get(label)
        return [t for t in self.listed.get(label, []) if server is not None and server.offers(t)]

    def server_of(self, name: str, offered: list[dict[str, Any]]) -> McpServer | None:
        """The MCP server whose tool the model called as ``name`` among the tools it was ``offered``.

        None: a function tool (one of the client's, which an MCP tool of its name does not shadow).
        """
        shown = next((t for t in offered if t.get("name") == name), None)
        if shown is None:
            return None
        for label, server in self.servers.items():
            if any(t["name"] == name and t["input_schema"] is shown.get("parameters") for t in self.offered(label)):
                return server
        return None


# --- items -------------------------------------------------------------------


def list_tools_item(server: McpServer) -> se.Item:
    """An ``mcp_list_tools`` item, its tools still to come."""
    return se.Item(id=se.new_id("item"), type="mcp_list_tools", server_label=server.label, tools=[])


def call_item(server_label: str, name: str, arguments: str, approval_request_id: str | None = None) -> se.Item:
    """An ``mcp_call`` item, its output still to come (``null``, as OpenAI sends it)."""
    item = se.Item(
        id=se.new_id("item"), type="mcp_call", server_label=server_label, name=name, arguments=arguments, output=None
    )
    item.error = None
    if approval_request_id is not None:
        item.approval_request_id = approval_request_id
    return item


def approval_request_item(server_label: str, name: str, arguments: str) -> se.Item:
    return se.Item(
        id=se.new_id("mcpr"), type="mcp_approval_request", server_label=server_label, name=name, arguments=arguments
    )


def tool_entry(name: str, description: str | None, schema: Any, annotations: Any) -> dict[str, Any]:
    """One tool of an ``mcp_list_tools`` item, as OpenAI's types spell it."""
    entry: dict[str, Any] = {"name": name, "input_schema": schema if isinstance(schema, dict) else {}}
    entry["description"] = description or ""
    if annotations is not None:
        entry["annotations"] = annotations
    return entry


def cut_output(text: str, limit: int) -> str:
    """``text`` within ``limit`` UTF-8 bytes, saying it was cut."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: max(0, limit - 40)].decode(errors="ignore") + f" [cut: {len(data)} bytes]"


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object an MCP server takes (a model's non-object becomes ``{}``)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}

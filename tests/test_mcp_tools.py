"""Hosted MCP tools (``type: "mcp"``) against a real MCP server on loopback (the ``mcp`` package's own).

The fake stack's LLM calls the tool the user names, so each test knows
which call the model makes; the MCP server, its transport and the server's
MCP client are real. Every event the client receives is checked against
the official ``openai`` types (:class:`conftest.RealtimeClient`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import RealtimeClient, live_server, requires, run, sdk_client
from mcp_host import McpHost

from s2s_rt.protocol.mcp import McpPolicy


@pytest.fixture(scope="module")
def host() -> Iterator[McpHost]:
    with McpHost() as h:
        yield h


def tool(host: McpHost, **fields: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "weather", "server_url": host.url, **fields}


async def listed(c: RealtimeClient) -> dict[str, Any]:
    """The ``mcp_list_tools`` item as its ``conversation.item.done`` carries it."""
    while True:
        event = await c.until("conversation.item.done", timeout=20)
        if event["item"]["type"] == "mcp_list_tools":
            return event["item"]


def test_an_mcp_server_is_refused_unless_the_operator_allowed_its_url(host: McpHost) -> None:
    async def scenario() -> None:
        async with live_server() as server, RealtimeClient.connect(server) as c:
            await c.send("session.update", session={"type": "realtime", "tools": [tool(host)]})
            error = (await c.until("error"))["error"]
            assert error["code"] == "mcp_server_not_allowed" and "mcp_servers" in error["message"]
            assert error["param"] == "session.tools[0].server_url"
        elsewhere = f"http://127.0.0.1:{host.port}/other"
        async with live_server(mcp_servers=[host.url]) as server, RealtimeClient.connect(server) as c:
            for url in (
                elsewhere,
                f"http://127.0.0.1:{host.port}/mcp-admin",
                f"http://127.0.0.1:{host.port + 1}/mcp",
                f"http://127.0.0.1:{host.port}@10.0.0.1/mcp",
                f"http://localhost:{host.port}/mcp",
            ):
                await c.send("session.update", session={"tools": [tool(host, server_url=url)]})
                error = (await c.until("error"))["error"]
                assert error["code"] == "mcp_server_not_allowed", url
            assert not c.of_type("session.updated") and not c.of_type("mcp_list_tools.in_progress")
            # Response-level MCP tools are refused (they are listed once per session, from session.update).
            await c.send("response.create", response={"tools": [tool(host)]})
            assert "session.update" in (await c.until("error"))["error"]["message"]

    run(scenario())


def test_tools_are_listed_as_an_mcp_list_tools_item(host: McpHost) -> None:
    async def scenario() -> None:
        async with live_server(mcp_servers=[host.url]) as server, RealtimeClient.connect(server) as c:
            await c.send(
                "session.update", session={"type": "realtime", "tools": [tool(host, headers={"X-Tenant": "t1"})]}
            )
            item = await listed(c)
            names = {t["name"]: t for t in item["tools"]}
            assert set(names) == {"get_weather", "book_table", "slow_search", "long_story"}
            assert names["get_weather"]["description"] == "The weather now in a city"
            assert names["get_weather"]["input_schema"]["required"] == ["city"]
            kinds = [e["type"] for e in c.events]
            added = next(i for i, e in enumerate(c.events) if e.get("item", {}).get("type") == "mcp_list_tools")
            assert kinds[added] == "conversation.item.added"
            assert kinds.index("mcp_list_tools.in_progress") > added
            assert kinds.index("mcp_list_tools.completed") < len(kinds) - 1  # then the item's done
            assert c.of_type("mcp_list_tools.completed")[0]["item_id"] == item["id"]
            assert any(h.get("x-tenant") == "t1" for h in host.headers)
            # The item is in the conversation (agents-js retrieves it on mcp_list_tools.in_progress).
            await c.send("conversation.item.retrieve", item_id=item["id"])
            assert (await c.until("conversation.item.retrieved"))["item"]["tools"] == item["tools"]

    run(scenario())


def test_a_call_runs_on_the_mcp_server_and_the_next_answer_uses_its_output(host: McpHost) -> None:
    async def scenario() -> None:
        async with live_server(mcp_servers=[host.url]) as server, RealtimeClient.connect(server) as c:
            await c.send("session.update", session={"tools": [tool(host, require_approval="never")]})
            await listed(c)
            done = await c.say_text("please get_weather Oslo")
            [call] = done["response"]["output"]
            assert call["type"] == "mcp_call" and call["name"] == "get_weather" and call["server_label"] == "weather"
            assert json.loads(call["arguments"]) == {"city": "Oslo"} and call["output"] is None
            deltas = "".join(e["delta"] for e in c.of_type("response.mcp_call_arguments.delta"))
            assert deltas == call["arguments"] == c.of_type("response.mcp_call_arguments.done")[-1]["arguments"]
            await c.until("response.mcp_call.completed", timeout=20)
            finished = await c.until("conversation.item.done")
            assert finished["item"]["id"] == call["id"]
            assert finished["item"]["output"] == "Sunny and 21 degrees in Oslo"
            assert ("get_weather", {"city": "Oslo"}) in host.calls
            assert c.of_type("response.mcp_call.in_progress")[-1]["item_id"] == call["id"]
            # One conversation.item.done, once it has run: clients ask for the next response on it.
            dones = [e for e in c.of_type("conversation.item.done") if e["item"]["id"] == call["id"]]
            assert dones == [finished]
            await c.send("response.create")
            answer = await c.until("response.done")
            assert "Sunny and 21 degrees in Oslo" in answer["response"]["output"][0]["content"][0]["transcript"]

    run(scenario())


def test_a_call_that_needs_approval_runs_only_when_approved(host: McpHost) -> None:
    async def scenario() -> None:
        async with live_server(mcp_servers=[host.url]) as server, RealtimeClient.connect(server) as c:
            await c.send("session.update", session={"tools": [tool(host)]})  # approval: OpenAI's default, always
            await listed(c)
            before = len(host.calls)
            done = await c.say_text("please get_weather Rome")
            [request] = done["response"]["output"]
            assert request["type"] == "mcp_approval_request" and request["name"] == "get_weather"
            await asyncio.sleep(0.3)
            assert len(host.calls) == before  # nothing ran
            await c.send(
                "conversation.item.create",
                item={"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True},
            )
            added = await c.until("conversation.item.added")
            while added["item"]["type"] != "mcp_call":
                added = await c.until("conversation.item.added")
            assert added["item"]["approval_request_id"] == request["id"]
            finished = await c.until("conversation.item.done", timeout=20)
            while finished["item"]["id"] != added["item"]["id"]:
                finished = await c.until("conversation.item.done", timeout=20)
            assert finished["item"]["output"] == "Sunny and 21 degrees in Rome"
            # Answered twice: refused.
            await c.send(
                "conversation.item.create",
                item={"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True},
            )
            assert (await c.until("error"))["error"]["param"] == "item.approval_request_id"
            # Denied: never run, and the model is told.
            done = await c.say_text("please get_weather Lima")
            [request] = done["response"]["output"]
            await c.send(
                "conversation.item.create",
                item={
                    "type": "mcp_approval_response",
                    "approval_request_id": request["id"],
                    "approve": False,
                    "reason": "not now",
                },
            )
            await c.send("response.create")
            answer = await c.until("response.done")
            said = answer["response"]["output"][0]["content"][0]["transcript"]
            assert "did not approve" in said and "not now" in said
            assert ("get_weather", {"city": "Lima"}) not in host.calls

    run(scenario())


def test_failing_hanging_and_unreachable_mcp_servers_fail_the_call_never_the_session(host: McpHost) -> None:
    async def scenario() -> None:
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}/mcp"
        dead.close()
        config = {"mcp_servers": [host.url, dead_url], "mcp_timeout_s": 2.0, "mcp_max_output_kib": 4}
        async with live_server(**config) as server, RealtimeClient.connect(server) as c:
            gone = {"type": "mcp", "server_label": "gone", "server_url": dead_url}
            await c.send("session.update", session={"tools": [tool(host, require_approval="never"), gone]})
            failed = await c.until("mcp_list_tools.failed", timeout=20)
            assert "gone" in (await c.until("error"))["error"]["message"]
            await c.until("mcp_list_tools.completed", timeout=20)
            assert failed["item_id"] != c.of_type("mcp_list_tools.completed")[0]["item_id"]

            async def call(words: str) -> dict[str, Any]:
                done = await c.say_text(words)
                call_id = done["response"]["output"][0]["id"]
                while True:
                    event = await c.until("conversation.item.done", timeout=20)
                    if event["item"]["id"] == call_id:
                        return event["item"]

            broken = await call("please book_table Ann")
            assert broken["error"]["type"] == "tool_execution_error" and broken["output"] is None
            assert c.of_type("response.mcp_call.failed")
            started = time.monotonic()
            slow = await call("please slow_search cats")
            assert slow["error"]["type"] == "protocol_error" and "2 s" in slow["error"]["message"]
            assert time.monotonic() - started < 10
            long = await call("please long_story ab")
            assert len(long["output"].encode()) <= 4096 and "[cut:" in long["output"]
            # The session goes on.
            answer = await c.say_text("hello there")
            assert answer["response"]["status"] == "completed"

    run(scenario())


def test_the_official_sdk_reads_the_mcp_events_as_its_own_types(host: McpHost) -> None:
    from openai.types.realtime import McpListToolsCompleted, ResponseMcpCallCompleted

    async def scenario() -> None:
        async with live_server(mcp_servers=[host.url]) as server:
            client = sdk_client(server.port)
            async with client.realtime.connect(model="s2s-rt") as conn:
                await conn.session.update(
                    session={"type": "realtime", "tools": [tool(host, require_approval="never")]}  # type: ignore[list-item]
                )
                seen: list[Any] = []
                async for event in conn:
                    seen.append(event)
                    if isinstance(event, McpListToolsCompleted):
                        break
                await conn.conversation.item.create(
                    item={
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "get_weather Oslo"}],
                    }
                )
                await conn.response.create()
                async for event in conn:
                    seen.append(event)
                    if isinstance(event, ResponseMcpCallCompleted):
                        break
                done = [e for e in seen if e.type == "response.done"][-1]
                assert done.response.output[0].type == "mcp_call"

    run(scenario())


def test_policy_compares_urls_parsed_not_as_text() -> None:
    policy = McpPolicy(("http://127.0.0.1:9000/mcp",))
    assert policy.allows("http://127.0.0.1:9000/mcp") and policy.allows("http://127.0.0.1:9000/mcp/sub")
    for url in (
        "http://127.0.0.1:9000/mcpx",
        "http://127.0.0.1:90001/mcp",
        "http://127.0.0.1:9000@evil.example/mcp",
        "https://127.0.0.1:9000/mcp",
        "file:///etc/passwd",
        "http://127.0.0.1.evil.example:9000/mcp",
    ):
        assert not policy.allows(url), url


def test_a_required_tool_choice_with_an_mcp_server_not_listed_yet_answers_in_words(host: McpHost) -> None:
    # Found by the fuzzer: the model's tools were empty until the listing came, and the turn's response
    # failed the check that 'required' needs a tool, which ended the session (1011).
    async def scenario() -> None:
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}/mcp"
        dead.close()
        async with live_server(mcp_servers=[dead_url]) as server, RealtimeClient.connect(server) as c:
            gone = {"type": "mcp", "server_label": "gone", "server_url": dead_url}
            await c.send("session.update", session={"tools": [gone], "tool_choice": "required"})
            await c.until("session.updated")
            done = await c.say_text("hello there")
            assert done["response"]["status"] == "completed"
            if not c.of_type("mcp_list_tools.failed"):
                await c.until("mcp_list_tools.failed", timeout=20)
            done = await c.say_text("hello again")
            assert done["response"]["status"] == "completed"

    run(scenario())


JS = Path(__file__).resolve().parent / "js"


@requires(
    shutil.which("node") is not None and (JS / "node_modules" / "@openai" / "agents-realtime").is_dir(),
    "node or tests/js/node_modules is missing: run `make agents-js` (Node, npm)",
)
def test_agents_realtime_in_node_lists_and_calls_a_hosted_mcp_tool_and_asks_for_the_answer(host: McpHost) -> None:
    async def scenario() -> None:
        async with live_server(mcp_servers=[host.url]) as server:
            node = await asyncio.create_subprocess_exec(
                "node",
                str(JS / "mcp_node.mjs"),
                f"ws://127.0.0.1:{server.port}/v1/realtime?model=s2s-rt",
                host.url,
                cwd=JS,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(node.communicate(), 90)
        assert node.returncode == 0, err.decode()[-2000:]
        got = json.loads(out.decode().strip().splitlines()[-1])
        assert "get_weather" in got["tools"], got
        assert got["calls"] == [{"name": "get_weather", "output": "Sunny and 21 degrees in Oslo"}], got
        # The SDK asked for the answer itself on the call's conversation.item.done, and the answer used the output.
        assert any("Sunny and 21 degrees in Oslo" in a for a in got["answers"]), got
        assert got["errors"] == [], got

    run(scenario())

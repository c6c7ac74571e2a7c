"""Log lines: one per session start and end, one per turn; content only on request."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import RealtimeClient, live_server, run

from s2s_rt.logs import JsonFormatter


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    fmt = JsonFormatter()
    return [json.loads(fmt.format(r)) for r in caplog.records if r.name.startswith("s2s_rt")]


@pytest.mark.parametrize("log_content", [False, True])
def test_session_and_turn_lines_with_latency_and_no_content_unless_asked(
    caplog: pytest.LogCaptureFixture, log_content: bool
) -> None:
    caplog.set_level(logging.INFO, logger="s2s_rt")

    async def scenario() -> None:
        async with live_server(log_content=log_content) as server:
            async with RealtimeClient.connect(server) as c:
                await c.say_text("my secret words")

    run(scenario())
    lines = _lines(caplog)
    events = [line.get("event") for line in lines]
    assert events.count("session_start") == 1 and events.count("session_end") == 1
    [turn] = [line for line in lines if line.get("event") == "turn"]
    assert turn["status"] == "completed"
    assert turn["first_token_ms"] is not None and turn["first_audio_ms"] >= turn["first_token_ms"]
    assert turn["done_ms"] >= turn["first_audio_ms"]
    [end] = [line for line in lines if line.get("event") == "session_end"]
    assert end["turns"] == 1 and end["reason"] == "client closed" and end["duration_s"] > 0
    everything = json.dumps(lines)
    assert ("secret" in everything) is log_content

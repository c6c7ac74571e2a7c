"""Log lines: one per session start and end, one per turn; content only on request."""

from __future__ import annotations

import json
import logging
import time

import pytest
from conftest import RealtimeClient, live_server, run, silence, tone

from s2s_rt.config import Config
from s2s_rt.logs import JsonFormatter
from s2s_rt.server import Server


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    fmt = JsonFormatter()
    return [json.loads(fmt.format(r)) for r in caplog.records if r.name.startswith("s2s_rt")]


@pytest.mark.parametrize(("log_content", "beta"), [(False, False), (True, False), (False, True)])
def test_session_and_turn_lines_with_latency_and_no_content_unless_asked(
    caplog: pytest.LogCaptureFixture, log_content: bool, beta: bool
) -> None:
    """The turn's line has every step, in order, in either dialect (beta names its audio deltas otherwise)."""
    caplog.set_level(logging.INFO, logger="s2s_rt")

    async def scenario() -> None:
        async with live_server(log_content=log_content) as server:
            async with RealtimeClient.connect(server, beta=beta) as c:
                await c.say_text("my secret words")

    run(scenario())
    lines = _lines(caplog)
    events = [line.get("event") for line in lines]
    assert events.count("session_start") == 1 and events.count("session_end") == 1
    [turn] = [line for line in lines if line.get("event") == "turn"]
    assert turn["status"] == "completed"
    assert turn["from"] == "response.create"
    order = ("boarded", "prompt_read", "first_clause", "synthesised", "audio_sent", "done")
    steps = [turn[f"{step}_ms"] for step in order]
    assert steps == sorted(steps) and steps[0] >= 0
    [end] = [line for line in lines if line.get("event") == "session_end"]
    assert end["turns"] == 1 and end["reason"] == "client closed" and end["duration_s"] > 0
    everything = json.dumps(lines)
    assert ("secret" in everything) is log_content


@pytest.mark.parametrize("ahead", [True, False], ids=["answered-ahead", "answered-after"])
def test_a_spoken_turn_logs_its_waterfall_from_the_last_word(caplog: pytest.LogCaptureFixture, ahead: bool) -> None:
    """Each step of a spoken turn, from the last word heard to the answer's first audio sent, in order."""
    caplog.set_level(logging.INFO, logger="s2s_rt")
    config = Config(
        port=0, stack="fake", pool_size=1, speculate_after_ms=100 if ahead else 0, fake_llm_token_delay_ms=20
    )

    async def scenario() -> str:
        async with Server(config) as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                for part in (tone(300, 0.6), silence(1.2)):  # 20 ms appends at real time, as a microphone sends
                    await c.append_audio(part, pace_s=0.02)
                await c.until("response.done", timeout=15)
                return server.metrics.render()

    metrics = run(scenario())
    [turn] = [line for line in _lines(caplog) if line.get("event") == "turn"]
    assert turn["from"] == "last_word" and turn["status"] == "completed"
    assert turn["ahead"] == int(ahead)
    # server_vad waits 500 ms of silence (real time here), then the turn ends.
    assert 450 <= turn["silence_ms"] <= 900
    order = ["transcribed", "boarded", "prompt_read", "first_clause", "synthesised", "audio_sent", "done"]
    if ahead:  # transcribed after 100 ms of silence and answered in the rest of it: begun before the turn's end
        order.insert(0, "speculated")
        assert 90 <= turn["speculated_ms"] < turn["prompt_read_ms"] < turn["silence_ms"]
    else:
        assert "speculated_ms" not in turn
        order.insert(0, "silence")
    steps = [turn[f"{step}_ms"] for step in order]
    assert steps == sorted(steps), dict(zip(order, steps, strict=True))
    assert turn["audio_sent_ms"] >= turn["silence_ms"]  # nothing is heard before the turn has ended
    assert turn["clause_tokens"] >= 1
    for step in ("silence", *order):
        assert f's2s_turn_waterfall_seconds_count{{step="{step}"}} 1' in metrics


def test_a_librarys_lines_about_hostile_input_are_short_warnings_and_a_flood_of_them_is_cut() -> None:
    from s2s_rt.logs import HostileInput

    logger = logging.getLogger("test.peer.transport")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logger.addHandler(handler)
    logger.propagate = False
    cut = HostileInput(burst=3, window_s=0.2)
    logger.addFilter(cut)
    try:
        for n in range(10):
            try:
                raise ValueError(f"bad 100% datagram {n}")
            except ValueError:
                logger.exception("Error in message callback for %s", ("10.0.0.1", 5060))
        logger.warning("Failed to parse SIP message from %s", ("10.0.0.1", 5060))  # another message: its own count
        time.sleep(0.25)
        logger.exception("Error in message callback for %s", ("10.0.0.1", 5060))
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(cut)
    lines = [(r.levelname, r.getMessage(), r.exc_info) for r in records]
    assert len(lines) == 5, lines
    assert all(level == "WARNING" and exc is None for level, _, exc in lines), lines
    assert lines[0][1] == "Error in message callback for ('10.0.0.1', 5060): ValueError('bad 100% datagram 0')"
    assert lines[3][1] == "Failed to parse SIP message from ('10.0.0.1', 5060)"
    assert lines[4][1].endswith("(7 more like it left out)"), lines[4]

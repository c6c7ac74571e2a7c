"""audio.output.speed (beta: speed): answers are spoken at the session's rate; out-of-range rates are refused."""

from __future__ import annotations

import base64

from conftest import RealtimeClient, live_server, run


def test_answers_are_spoken_at_the_sessions_speed_and_bad_rates_are_refused() -> None:
    async def scenario() -> tuple[list[float], list[dict], dict]:
        async with live_server() as server:
            seconds = []
            async with RealtimeClient.connect(server) as c:
                for speed in (1.0, 1.5):
                    await c.send("session.update", session={"type": "realtime", "audio": {"output": {"speed": speed}}})
                    updated = await c.until("session.updated")
                    assert updated["session"]["audio"]["output"]["speed"] == speed
                    done = await c.say_text("one two three four five six")
                    rid = done["response"]["id"]
                    audio = b"".join(
                        base64.b64decode(e["delta"])
                        for e in c.events
                        if e["type"] == "response.output_audio.delta" and e["response_id"] == rid
                    )
                    seconds.append(len(audio) / 2 / 24_000)
                await c.send("session.update", event_id="too-fast", session={"audio": {"output": {"speed": 3.0}}})
                err = await c.until("error")
            async with RealtimeClient.connect(server, beta=True) as b:
                await b.until("session.created")
                await b.send("session.update", session={"speed": 0.5})
                beta = await b.until("session.updated")
            return seconds, [err], beta

    (normal, fast), (err,), beta = run(scenario())
    assert fast < normal * 0.8  # the same words, said faster
    assert err["error"]["code"] == "invalid_value" and err["error"]["param"] == "session.audio.output.speed"
    assert err["error"]["event_id"] == "too-fast"
    assert beta["session"]["speed"] == 0.5

"""Turns as a client drives them: server VAD, manual commit, cancel, barge-in, truncate."""

from __future__ import annotations

import asyncio

from conftest import RealtimeClient, http_get, live_server, run, silence, tone


def test_server_vad_turn_produces_the_full_event_sequence_in_order() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.until("session.created")
                await c.append_audio(silence(0.5) + tone(440, 1.0) + silence(0.8))
                await c.until("response.done")
                types = [e["type"] for e in c.events]
                order = [
                    "input_audio_buffer.speech_started",
                    "input_audio_buffer.speech_stopped",
                    "input_audio_buffer.committed",
                    "conversation.item.input_audio_transcription.completed",
                    "response.created",
                    "response.output_item.added",
                    "response.content_part.added",
                    "response.output_audio.delta",
                    "response.output_audio_transcript.delta",
                    "response.output_audio.done",
                    "response.output_audio_transcript.done",
                    "response.content_part.done",
                    "response.output_item.done",
                    "response.done",
                ]
                positions = [types.index(t) for t in order]
                assert positions == sorted(positions)
                started = c.of_type("input_audio_buffer.speech_started")[0]
                stopped = c.of_type("input_audio_buffer.speech_stopped")[0]
                # 500 ms of silence then speech: start is 500 ms minus 300 ms padding (to a 32 ms chunk).
                assert 150 <= started["audio_start_ms"] <= 232
                # Speech ends at 1500 ms; the turn ends 500 ms of silence later.
                assert 1950 <= stopped["audio_end_ms"] <= 2050
                heard = c.of_type("conversation.item.input_audio_transcription.completed")[0]
                # Committed audio: from start-with-padding to end-with-silence.
                ms = int(heard["transcript"].split()[1])
                assert abs(ms - (stopped["audio_end_ms"] - started["audio_start_ms"])) <= 40
                assert heard["usage"]["type"] == "duration"

    run(scenario())


def test_manual_commit_when_turn_detection_is_null() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.send(
                    "session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
                )
                await c.until("session.updated")
                await c.append_audio(tone(500, 0.5) + silence(1.0))
                await c.send("input_audio_buffer.commit")
                committed = await c.until("input_audio_buffer.committed")
                heard = await c.until("conversation.item.input_audio_transcription.completed")
                assert heard["item_id"] == committed["item_id"]
                assert heard["transcript"].startswith("heard 1500 ms")
                assert not c.of_type("input_audio_buffer.speech_started")
                await c.send("response.create")
                done = await c.until("response.done")
                assert done["response"]["output"][0]["content"][0]["transcript"] == f"You said: {heard['transcript']}."

    run(scenario())


def test_clear_empties_the_buffer() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.send("session.update", session={"turn_detection": None})
                await c.append_audio(tone(500, 0.5))
                await c.send("input_audio_buffer.clear")
                await c.until("input_audio_buffer.cleared")
                await c.send("input_audio_buffer.commit")
                err = await c.until("error")
                assert err["error"]["code"] == "input_audio_buffer_commit_empty"

    run(scenario())


def test_response_cancel_ends_with_cancelled_client_cancelled_and_no_more_output() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.ask("[[slow 80]] a long answer. with many words. in it. and more words. to come.")
                created = await c.until("response.output_audio.delta")
                await c.send("response.cancel", event_id="cancel_1")
                done = await c.until("response.done")
                assert done["response"]["status"] == "cancelled"
                assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
                try:
                    while True:
                        late = await c.recv(timeout=1.0)
                        assert late.get("response_id") != created["response_id"], late["type"]
                except TimeoutError:
                    pass
                # The session goes on: a new response works.
                again = await c.say_text("after cancel")
                assert again["response"]["status"] == "completed"

    run(scenario())


def test_barge_in_cancels_with_turn_detected_and_truncate_trims_transcript() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.ask("[[slow 60]] one two three four. five six seven eight. nine ten eleven twelve.")
                first = await c.until("response.output_audio_transcript.delta")
                item_id = first["item_id"]
                # The user talks over the answer.
                await c.append_audio(tone(440, 0.5))
                done = await c.until("response.done")
                assert done["response"]["status"] == "cancelled"
                assert done["response"]["status_details"]["reason"] == "turn_detected"
                assert c.of_type("input_audio_buffer.speech_started")
                # The client heard only the first 400 ms of the answer (six words take 720 ms).
                await c.send("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=400)
                truncated = await c.until("conversation.item.truncated")
                assert truncated["audio_end_ms"] == 400
                await c.send("conversation.item.retrieve", item_id=item_id)
                item = (await c.until("conversation.item.retrieved"))["item"]
                heard = item["content"][0]["transcript"]
                assert heard and len(heard.split()) < len(first["delta"].split())
                assert first["delta"].startswith(heard)

    run(scenario())


def test_interrupt_response_false_lets_the_answer_finish() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.send(
                    "session.update",
                    session={
                        "turn_detection": {"type": "server_vad", "interrupt_response": False, "create_response": False}
                    },
                )
                await c.ask("[[slow 30]] keep talking please")
                await c.until("response.output_audio.delta")
                await c.append_audio(tone(440, 0.3))
                done = await c.until("response.done")
                assert done["response"]["status"] == "completed"

    run(scenario())


def test_idle_timeout_triggers_a_response_after_silence() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.send(
                    "session.update", session={"turn_detection": {"type": "server_vad", "idle_timeout_ms": 1000}}
                )
                await c.append_audio(silence(1.5))
                trig = await c.until("input_audio_buffer.timeout_triggered")
                assert trig["audio_end_ms"] >= 1000
                done = await c.until("response.done")
                assert done["response"]["status"] == "completed"

    run(scenario())


def test_idle_time_counts_from_the_end_of_the_last_response() -> None:
    """``idle_timeout_ms`` counts the user's silence since the answer ended, not since the audio began."""

    async def heard_so_far(c: RealtimeClient) -> None:
        # A buffer command follows the audio before it: its event means that audio was heard.
        await c.send("input_audio_buffer.clear")
        await c.until("input_audio_buffer.cleared")
        c.events.clear()

    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.send(
                    "session.update", session={"turn_detection": {"type": "server_vad", "idle_timeout_ms": 1000}}
                )
                await c.until("session.updated")
                await c.append_audio(silence(0.7))
                await heard_so_far(c)
                done = await c.say_text("Hello there")
                assert done["response"]["status"] == "completed"
                # 0.7 s of silence since the answer (1.4 s since the audio began): not idle yet.
                await c.append_audio(silence(0.7))
                await heard_so_far(c)
                assert c.of_type("input_audio_buffer.timeout_triggered") == []
                await c.append_audio(silence(0.5))
                trig = await c.until("input_audio_buffer.timeout_triggered")
                assert trig["audio_end_ms"] >= 1650  # the answer ended at 700 ms of audio, plus 1000 ms

    run(scenario())


def test_ga_and_beta_clients_get_their_own_event_names() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as ga, RealtimeClient.connect(server, beta=True) as beta:
                await asyncio.gather(ga.say_text("hi"), beta.say_text("hi"))
                ga_types = {e["type"] for e in ga.events}
                beta_types = {e["type"] for e in beta.events}
                assert {
                    "response.output_audio.delta",
                    "response.output_audio_transcript.delta",
                    "conversation.item.added",
                } <= ga_types
                assert {
                    "response.audio.delta",
                    "response.audio_transcript.delta",
                    "conversation.item.created",
                } <= beta_types
                assert not any(t.startswith("response.output_audio") for t in beta_types)
                assert "audio" in ga.of_type("session.created")[0]["session"]
                assert "input_audio_format" in beta.of_type("session.created")[0]["session"]
                part = beta.of_type("response.content_part.added")[0]["part"]["type"]
                assert part == "audio"

    run(scenario())


def test_beta_subprotocol_selects_beta_and_realtime_is_answered_only_when_offered() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server, subprotocols=["realtime", "openai-beta.realtime-v1"]) as c:
                assert c.ws.subprotocol == "realtime"
                await c.say_text("x")
                assert c.of_type("response.audio.delta")
            async with RealtimeClient.connect(server) as plain:
                assert plain.ws.subprotocol is None
                await plain.until("session.created")

    run(scenario())


def test_text_only_response_and_per_response_overrides() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with RealtimeClient.connect(server) as c:
                await c.ask(
                    "alpha beta gamma delta",
                    output_modalities=["text"],
                    max_output_tokens=3,
                    conversation="none",
                    metadata={"k": "v"},
                )
                done = await c.until("response.done")
                assert done["response"]["output"][0]["content"][0]["text"] == "You said: alpha"
                assert done["response"]["metadata"] == {"k": "v"}
                assert done["response"]["conversation_id"] is None
                assert not c.of_type("response.output_audio.delta")
                assert done["response"]["usage"]["output_tokens"] == 3

    run(scenario())


def test_g711_output_format_sends_8khz_bytes() -> None:
    async def scenario() -> None:
        import base64

        async with live_server() as server:
            async with RealtimeClient.connect(server, beta=True) as c:
                await c.send(
                    "session.update", session={"output_audio_format": "g711_ulaw", "input_audio_format": "g711_ulaw"}
                )
                await c.say_text("one two")
                audio = b"".join(base64.b64decode(e["delta"]) for e in c.of_type("response.audio.delta"))
                # "You said: one two." is four words of 120 ms each, at 8000 one-byte samples per second.
                assert abs(len(audio) - 4 * 0.12 * 8000) < 50

    run(scenario())


def test_speculative_transcription_is_used_when_silence_lasts_and_dropped_when_speech_returns() -> None:
    async def scenario() -> None:
        async with live_server(speculate_after_ms=100) as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                # A pause longer than the speculation point but shorter than the silence duration.
                await c.append_audio(tone(440, 0.4) + silence(0.25) + tone(440, 0.4) + silence(0.8))
                heard = await c.until("conversation.item.input_audio_transcription.completed")
                await c.until("response.done")
                # The transcript is of the whole turn: both tones, not the guess made in the pause.
                ms = int(heard["transcript"].split()[1])
                assert ms >= 400 + 250 + 400
                metrics = (await http_get(server, "/metrics"))[1]
                assert 's2s_speculative_stt_total{outcome="discarded"} 1' in metrics
                assert 's2s_speculative_stt_total{outcome="used"} 1' in metrics
                # Only one user turn was committed.
                assert len(c.of_type("input_audio_buffer.committed")) == 1

    run(scenario())


def test_the_words_guessed_in_a_pause_depend_on_the_audio_not_on_how_it_was_sent() -> None:
    """A speculative transcript is of the audio up to the point the pause was judged, however it was batched.

    One client sends the turn in one append, another in 20 ms appends at
    real-time pace; both are heard alike (same length, same checksum). The
    guess once took whatever audio the listening tick had brought, so the
    one-append turn was transcribed with all of its trailing silence.
    """
    audio = tone(440, 0.4) + silence(0.8)
    step = 24_000 // 50 * 2

    async def heard(server: object, paced: bool) -> str:
        async with RealtimeClient.connect(server, transcribe=True) as c:  # type: ignore[arg-type]
            if paced:
                for i in range(0, len(audio), step):
                    await c.append_audio(audio[i : i + step])
                    await asyncio.sleep(0.02)
            else:
                await c.append_audio(audio)
            done = await c.until("conversation.item.input_audio_transcription.completed")
            await c.until("response.done")
            return str(done["transcript"])

    async def scenario() -> None:
        async with live_server(speculate_after_ms=100) as server:
            at_once = await heard(server, paced=False)
            paced = await heard(server, paced=True)
            metrics = (await http_get(server, "/metrics"))[1]
        assert 's2s_speculative_stt_total{outcome="used"} 2' in metrics
        assert at_once == paced, (at_once, paced)
        # The turn's speech, its prefix padding and the pause judged: far from all 1.2 s sent.
        assert int(at_once.split()[1]) < 1000, at_once

    run(scenario())


def test_the_recogniser_hears_a_long_pause_inside_a_turn_shortened_and_the_item_keeps_it() -> None:
    """A 1.2 s pause inside one turn (server VAD waiting 2 s) reaches the STT 0.4 s long, whether the turn is
    transcribed at its end or ahead of it in its closing silence; the committed audio is the whole turn."""

    async def heard(speculate_after_ms: int) -> tuple[int, float, float, float]:
        async with live_server(speculate_after_ms=speculate_after_ms) as server:
            async with RealtimeClient.connect(server, transcribe=True) as c:
                await c.until("session.created")
                turn_detection = {"type": "server_vad", "silence_duration_ms": 2000}
                audio = {"input": {"turn_detection": turn_detection}}
                await c.send("session.update", session={"type": "realtime", "audio": audio})
                await c.until("session.updated")
                await c.append_audio(silence(0.5) + tone(440, 0.6) + silence(1.2) + tone(440, 0.6) + silence(2.6))
                done = await c.until("conversation.item.input_audio_transcription.completed")
                started = c.of_type("input_audio_buffer.speech_started")[0]
                stopped = c.of_type("input_audio_buffer.speech_stopped")[0]
                assert len(c.of_type("input_audio_buffer.speech_stopped")) == 1  # one turn, pause and all
                heard_ms, item_s = int(done["transcript"].split()[1]), done["usage"]["seconds"]
                return heard_ms, item_s, started["audio_start_ms"], stopped["audio_end_ms"]

    # At its end: the whole turn, the pause (as the VAD's 32 ms windows place it) heard 400 ms long.
    stt_ms, item_s, start_ms, end_ms = run(heard(0))
    assert end_ms - start_ms - 880 <= stt_ms <= end_ms - start_ms - 720, (stt_ms, start_ms, end_ms)
    assert abs(item_s * 1000 - (end_ms - start_ms)) <= 40  # the item's audio is the whole turn
    # Ahead of its end: up to a little after the last voice (2.9 s), the pause heard as long.
    stt_ms, item_s, start_ms, end_ms = run(heard(64))
    assert 2900 - start_ms - 800 <= stt_ms <= 2900 - start_ms - 800 + 200, (stt_ms, start_ms, end_ms)
    assert abs(item_s * 1000 - (end_ms - start_ms)) <= 40

"""The official openai SDK, GA and beta, completes text and audio turns."""

from __future__ import annotations

import base64

from conftest import live_server, run, sdk_client, silence, tone


async def _collect_until_done(conn) -> list:  # type: ignore[no-untyped-def]
    events = []
    async for event in conn:
        events.append(event)
        if event.type == "response.done":
            return events
    raise AssertionError("connection ended before response.done")


def test_sdk_ga_text_turn() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
                await conn.conversation.item.create(
                    item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello sdk"}]}
                )
                await conn.response.create()
                events = await _collect_until_done(conn)
                done = events[-1]
                assert done.response.status == "completed"
                text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
                assert text == "You said: hello sdk."
                assert done.response.output[0].content[0].text == text

    run(scenario())


def test_sdk_ga_audio_turn() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                await conn.session.update(
                    session={"type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}
                )
                pcm = silence(0.3) + tone(520, 0.8) + silence(0.8)
                for i in range(0, len(pcm), 4800):
                    await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + 4800]).decode())
                events = await _collect_until_done(conn)
                types = [e.type for e in events]
                assert "input_audio_buffer.speech_stopped" in types
                heard = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
                audio = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
                assert len(audio) > 24_000  # more than half a second of PCM16 at 24 kHz
                transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
                assert transcript == f"You said: {heard.transcript}."
                assert events[-1].response.status == "completed"

    run(scenario())


def test_sdk_beta_text_and_audio_turn() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with sdk_client(server.port).beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
                await conn.session.update(
                    session={
                        "modalities": ["text", "audio"],
                        "voice": "alloy",
                        "turn_detection": None,
                        "input_audio_transcription": {"model": "whisper-1"},
                    }
                )
                await conn.conversation.item.create(
                    item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "beta text"}]}
                )
                await conn.response.create()
                events = await _collect_until_done(conn)
                assert "response.audio.delta" in [e.type for e in events]
                transcript = "".join(e.delta for e in events if e.type == "response.audio_transcript.delta")
                assert transcript == "You said: beta text."
                # Audio turn, committed by hand.
                await conn.input_audio_buffer.append(audio=base64.b64encode(tone(610, 0.5)).decode())
                await conn.input_audio_buffer.commit()
                await conn.response.create()
                events = await _collect_until_done(conn)
                heard = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
                assert heard.transcript.startswith("heard 500 ms")
                assert events[-1].response.status == "completed"

    run(scenario())

"""The protocol layer without a socket: decoding and the session state machine."""

from __future__ import annotations

import json

import msgspec
import pytest
from conftest import RealtimeClient, live_server, run
from hypothesis import given, settings
from hypothesis import strategies as st

from s2s_rt.audio import AudioFormat
from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol.conversation import SpokenSegment, heard_text
from s2s_rt.protocol.errors import ProtocolError, RealtimeError, ServerFault
from s2s_rt.protocol.server_events import BETA, GA
from s2s_rt.protocol.session import Session


def decode(obj: object) -> ce.ClientEvent:
    return ce.decode_client_event(json.dumps(obj))


def code_of(data: str | bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        ce.decode_client_event(data)
    return info.value.code


def test_each_client_event_decodes_to_its_struct() -> None:
    assert isinstance(decode({"type": "input_audio_buffer.append", "audio": "AAA="}), ce.InputAudioBufferAppend)
    assert isinstance(decode({"type": "response.cancel"}), ce.ResponseCancel)
    ev = decode({"type": "conversation.item.truncate", "item_id": "i", "content_index": 0, "audio_end_ms": 5})
    assert isinstance(ev, ce.ConversationItemTruncate) and ev.audio_end_ms == 5


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_event"),
        ('"hello"', "invalid_event"),
        ('{"event_id": "e1"}', "missing_type"),
        ('{"type": "no.such.event"}', "unknown_event_type"),
        ('{"type": "session.update", "session": {"temperature": "warm"}}', "invalid_value"),
        ('{"type": "input_audio_buffer.append", "audio": "###"}', "invalid_base64"),
        ('{"type": "input_audio_buffer.append"}', "invalid_value"),
    ],
)
def test_bad_frames_get_a_code_naming_the_problem(frame: str, code: str) -> None:
    assert code_of(frame) == code


def test_error_echoes_client_event_id_and_names_the_field() -> None:
    with pytest.raises(ProtocolError) as info:
        decode({"type": "session.update", "event_id": "ev_7", "session": {"turn_detection": {"threshold": "x"}}})
    assert info.value.event_id == "ev_7"
    assert info.value.param == "session.turn_detection.threshold"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_decoder_never_raises_anything_but_protocol_error_on_random_input(data: bytes | str) -> None:
    try:
        ce.decode_client_event(data)
    except ProtocolError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(ce.CLIENT_EVENT_TYPES)),
    st.dictionaries(
        st.sampled_from(
            [
                "session",
                "item",
                "audio",
                "response",
                "item_id",
                "audio_end_ms",
                "event_id",
                "previous_item_id",
                "content_index",
            ]
        ),
        json_values,
        max_size=4,
    ),
)
def test_session_survives_random_events_of_every_type(kind: str, fields: dict[str, object]) -> None:
    session = Session(GA)
    try:
        ev = ce.decode_client_event(json.dumps({"type": kind, **fields}))
        if not isinstance(ev, ce.PIPELINE_EVENTS):
            session.handle(ev)
    except ProtocolError:
        pass
    # Whatever happened, the session still renders and encodes.
    msgspec.json.encode(session.render())


def test_ga_session_shape_sets_nested_audio_fields() -> None:
    s = Session(GA)
    ev = decode(
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "output_modalities": ["text"],
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": 16000},
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 700, "idle_timeout_ms": 5000},
                        "transcription": {"model": "whisper-1", "language": "de"},
                    },
                    "output": {"format": {"type": "audio/pcmu"}, "voice": "alloy"},
                },
            },
        }
    )
    [updated] = s.update(ev)  # type: ignore[arg-type]
    assert updated.type == "session.updated"
    cfg = s.config
    assert cfg.input_format == AudioFormat("audio/pcm", 16000)
    assert cfg.output_format == AudioFormat("audio/pcmu", 8000)
    assert cfg.turn_detection is not None and cfg.turn_detection.silence_duration_ms == 700
    assert cfg.turn_detection.idle_timeout_ms == 5000
    assert cfg.transcription is not None and cfg.transcription.language == "de"
    assert cfg.output_modalities == ["text"]
    rendered = updated.session  # type: ignore[attr-defined]
    assert rendered["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 16000}


def test_beta_session_shape_sets_flat_fields_and_renders_beta() -> None:
    s = Session(BETA, voices=["joe"])
    ev = decode(
        {
            "type": "session.update",
            "session": {
                "modalities": ["text", "audio"],
                "input_audio_format": "g711_alaw",
                "output_audio_format": "g711_ulaw",
                "turn_detection": None,
                "voice": "joe",
                "max_response_output_tokens": 50,
            },
        }
    )
    [updated] = s.update(ev)  # type: ignore[arg-type]
    out = updated.session  # type: ignore[attr-defined]
    assert out["input_audio_format"] == "g711_alaw" and out["output_audio_format"] == "g711_ulaw"
    assert out["turn_detection"] is None
    assert out["modalities"] == ["text", "audio"]
    assert s.config.max_output_tokens == 50


def test_unknown_voice_lists_the_available_ones() -> None:
    s = Session(GA, voices=["joe", "amy"])
    with pytest.raises(ProtocolError) as info:
        s.update(decode({"type": "session.update", "session": {"voice": "nobody"}}))  # type: ignore[arg-type]
    assert info.value.code == "unknown_voice" and "joe, amy" in info.value.message


def test_failed_update_changes_nothing() -> None:
    s = Session(GA)
    before = s.render()
    with pytest.raises(ProtocolError):
        s.update(decode({"type": "session.update", "session": {"instructions": "x", "input_audio_format": "opus"}}))  # type: ignore[arg-type]
    assert s.render() == before


def _user_text(s: Session, text: str) -> None:
    s.create_item(
        decode(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
            }
        )
    )  # type: ignore[arg-type]


def test_one_active_response_at_a_time() -> None:
    s = Session(GA)
    s.start_response(None)
    with pytest.raises(ProtocolError) as info:
        s.start_response(None)
    assert info.value.code == "conversation_already_has_active_response"


def test_cancel_without_response_is_an_error() -> None:
    with pytest.raises(ProtocolError) as info:
        Session(GA).cancel_response("client_cancelled")
    assert info.value.code == "response_cancel_not_active"


def test_prompt_holds_instructions_and_conversation_in_order() -> None:
    s = Session(GA)
    _user_text(s, "first")
    s.start_response(None)
    r = s.response
    assert r is not None
    msgs = s.prompt(r)
    assert [m.role for m in msgs] == ["system", "user"] and msgs[1].content == "first"


def test_out_of_band_response_is_not_added_to_the_conversation() -> None:
    s = Session(GA)
    ev = decode(
        {
            "type": "response.create",
            "response": {"conversation": "none", "output_modalities": ["text"], "instructions": "Be terse."},
        }
    )
    s.start_response(ev.response)  # type: ignore[union-attr]
    r = s.response
    assert r is not None and not r.params.in_conversation
    r.text_delta("Hi.")
    assert r.outputs and r.outputs[0].id not in s.conversation.items
    [done] = [e for e in s.finish_response(r) if e.type == "response.done"]
    assert done.response.conversation_id is None  # type: ignore[attr-defined]
    assert done.response.output[0].content[0].text == "Hi."  # type: ignore[attr-defined]


def test_heard_text_keeps_words_spoken_before_the_cut() -> None:
    segs = [SpokenSegment("one two three four", 0, 1000), SpokenSegment("five six", 1000, 1500)]
    assert heard_text(segs, 1500) == "one two three four five six"
    assert heard_text(segs, 500) == "one two"
    assert heard_text(segs, 1250) == "one two three four five"


def test_unknown_item_ids_are_errors_per_action() -> None:
    s = Session(GA)
    for ev, method in [
        ({"type": "conversation.item.retrieve", "item_id": "nope"}, s.retrieve_item),
        ({"type": "conversation.item.delete", "item_id": "nope"}, s.delete_item),
        ({"type": "conversation.item.truncate", "item_id": "nope", "audio_end_ms": 0}, s.truncate_item),
    ]:
        with pytest.raises(ProtocolError) as info:
            method(decode(ev))  # type: ignore[arg-type]
        assert info.value.code.endswith("_invalid_item_id")


def test_function_call_output_with_unknown_call_id_is_an_error() -> None:
    s = Session(GA)
    with pytest.raises(ProtocolError) as info:
        s.create_item(
            decode(
                {
                    "type": "conversation.item.create",
                    "item": {"type": "function_call_output", "call_id": "c1", "output": "{}"},
                }
            )
        )  # type: ignore[arg-type]
    assert info.value.code == "unknown_call_id"


def test_beta_sessions_name_a_model_the_beta_types_accept_echoing_a_known_one() -> None:
    """Strict validators of the beta session type reject any model name but OpenAI's."""
    from openai.types.beta.realtime.session import Session as BetaSession

    async def scenario() -> None:
        async with live_server() as server:
            for asked, expect in (("gpt-4o-realtime-preview", "gpt-4o-realtime-preview"), ("s2s-rt", "gpt-realtime")):
                async with RealtimeClient.connect(server, beta=True, path=f"/v1/realtime?model={asked}") as c:
                    created = await c.until("session.created")
                    assert created["session"]["model"] == expect
                    BetaSession.model_validate(created["session"], strict=True)
            async with RealtimeClient.connect(server, path="/v1/realtime?model=my-model") as c:
                assert (await c.until("session.created"))["session"]["model"] == "my-model"

    run(scenario())


def test_a_fault_of_the_server_is_never_reported_as_the_clients_mistake() -> None:
    fault = ServerFault("vad_failed", "Voice activity detection failed")
    mistake = ProtocolError("invalid_json", "not JSON")
    # Code that handles a client's mistake (``except ProtocolError``) never takes a fault of the server for one.
    assert not isinstance(fault, ProtocolError) and isinstance(fault, RealtimeError)
    session = Session(GA)
    assert session.error(fault).error.type == "server_error"
    assert session.error(mistake).error.type == "invalid_request_error"

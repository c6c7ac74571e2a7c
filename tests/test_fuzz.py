"""Fuzzing the decoder and the session state machine from a seed corpus.

``tests/fuzz_corpus/`` holds one valid frame of every client event type.
Hypothesis mutates them (dropped, swapped and retyped fields, byte flips)
and feeds them to the decoder and to one session, checking that nothing
but :class:`ProtocolError` ever escapes and the session stays renderable.
Bounded by ``max_examples`` so CI time stays fixed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.server_events import GA
from s2s_rt.protocol.session import Session

_AUDIO_EVENTS = ce.PIPELINE_EVENTS
CORPUS = sorted((Path(__file__).parent / "fuzz_corpus").glob("*.json"))
SEEDS = [p.read_text() for p in CORPUS]

scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=12)


def test_corpus_covers_every_client_event_type() -> None:
    assert {json.loads(s)["type"] for s in SEEDS} == set(ce.CLIENT_EVENT_TYPES)


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_every_seed_decodes(path: Path) -> None:
    ce.decode_client_event(path.read_text())


def _mutate(obj: Any, draw: Any) -> Any:
    if isinstance(obj, dict) and obj:
        key = draw(st.sampled_from(sorted(obj)))
        action = draw(st.sampled_from(["drop", "retype", "recurse", "add"]))
        obj = dict(obj)
        if action == "drop":
            del obj[key]
        elif action == "retype":
            obj[key] = draw(scalars | st.lists(scalars, max_size=3))
        elif action == "recurse":
            obj[key] = _mutate(obj[key], draw)
        else:
            obj[draw(st.text(max_size=8))] = draw(scalars)
    elif isinstance(obj, list) and obj:
        i = draw(st.integers(0, len(obj) - 1))
        obj = list(obj)
        obj[i] = _mutate(obj[i], draw)
    else:
        obj = draw(scalars)
    return obj


@st.composite
def mutated_frames(draw: Any) -> str | bytes:
    seed = draw(st.sampled_from(SEEDS))
    if draw(st.booleans()):
        obj = json.loads(seed)
        for _ in range(draw(st.integers(1, 3))):
            obj = _mutate(obj, draw)
        return json.dumps(obj)
    raw = bytearray(seed.encode())
    for _ in range(draw(st.integers(1, 4))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw)


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(mutated_frames(), min_size=1, max_size=8))
def test_mutated_frames_never_escape_as_anything_but_protocol_errors(frames: list[str | bytes]) -> None:
    session = Session(GA)
    for frame in frames:
        try:
            ev = ce.decode_client_event(frame)
            if not isinstance(ev, _AUDIO_EVENTS):
                session.handle(ev)
        except ProtocolError as exc:
            assert exc.code and exc.message
    msgspec.json.encode(session.render())
    for item in session.conversation.items.values():
        msgspec.json.encode(item)

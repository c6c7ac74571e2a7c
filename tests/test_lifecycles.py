"""Every lifecycle table, walked pair by pair: allowed moves reach their state, all others are refused.

The tables are the slot's (:data:`s2s_rt.slot.TRANSITIONS`), a response's
(:data:`s2s_rt.protocol.response.TRANSITIONS`) and a speculation's
(:data:`s2s_rt.pipeline.speculation.TRANSITIONS`). Each pair is also driven
through the object that owns the state, so a method that moved a state by
hand, around its table, would be caught.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from typing import Any

import pytest

from s2s_rt import slot
from s2s_rt.lifecycle import Lifecycle, LifecycleError
from s2s_rt.pipeline import speculation
from s2s_rt.protocol import response
from s2s_rt.protocol.server_events import GA
from s2s_rt.protocol.session import Session

TABLES: dict[str, tuple[Lifecycle[Any, Any], type[enum.Enum], type[enum.Enum]]] = {
    "slot": (slot.LIFECYCLE, slot.SlotState, slot.SlotEvent),
    "response": (response.LIFECYCLE, response.Phase, response.Step),
    "speculation": (speculation.LIFECYCLE, speculation.Phase, speculation.Event),
}


def _pairs() -> list[Any]:
    out = []
    for name, (_table, states, events) in TABLES.items():
        for state, event in itertools.product(states, events):
            out.append(pytest.param(name, state, event, id=f"{name}-{state.value}-{event.value}"))
    return out


@pytest.mark.parametrize(("name", "state", "event"), _pairs())
def test_every_pair_of_every_table(name: str, state: enum.Enum, event: enum.Enum) -> None:
    table, states, _ = TABLES[name]
    expected = table.table.get((state, event))
    if expected is None:
        with pytest.raises(LifecycleError, match=event.value):
            table.step(state, event)
        assert not table.allows(state, event)
    else:
        assert table.step(state, event) is expected
        assert isinstance(expected, states)


@pytest.mark.parametrize("name", list(TABLES))
def test_every_state_is_reached_and_every_event_is_used(name: str) -> None:
    table, states, events = TABLES[name]
    start = next(iter(states))
    reached = {start} | set(table.table.values())
    assert reached == set(states), f"{name}: unreachable states {set(states) - reached}"
    assert {e for _, e in table.table} == set(events), f"{name}: events never allowed"


# --- the same pairs through the objects that own the states --------------------------------------------------


def _response_in(phase: response.Phase) -> response.Response:
    session = Session(GA)
    session.start_response(None)
    resp = session.response
    assert resp is not None
    if phase is response.Phase.PART_OPEN:
        resp.text_delta("Hello")  # a message and its text part are open now
        assert resp.phase is phase
    resp.phase = phase  # placed in the phase under test; every move from here goes through its table
    return resp


@pytest.mark.parametrize("phase", list(response.Phase))
@pytest.mark.parametrize("end", ["cancel", "fail"])
def test_a_response_ends_through_its_table_from_every_phase(phase: response.Phase, end: str) -> None:
    r = _response_in(phase)
    events = r.cancel("client_cancelled") if end == "cancel" else r.fail("x", "y")
    if phase is response.Phase.DONE:
        assert events == []  # nothing after done
    else:
        assert r.phase is response.Phase.DONE
        assert events[-1 if end == "cancel" else -2].type == "response.done"


@pytest.mark.parametrize("phase", [p for p in response.Phase if p is not response.Phase.DONE])
def test_a_response_step_the_table_refuses_raises(phase: response.Phase) -> None:
    r = _response_in(phase)
    refused = [s for s in response.Step if not response.LIFECYCLE.allows(phase, s)]
    for step in refused:
        with pytest.raises(LifecycleError):
            r._step(step)
        assert r.phase is phase


def _slot_in(state: slot.SlotState) -> slot.Slot:
    s = slot.Slot.__new__(slot.Slot)
    s.index = 0
    s.state = state
    s.quarantine_reason = None
    return s


@pytest.mark.parametrize(("state", "event"), list(itertools.product(slot.SlotState, slot.SlotEvent)))
def test_a_slot_moves_only_along_its_table(state: slot.SlotState, event: slot.SlotEvent) -> None:
    s = _slot_in(state)
    expected = slot.TRANSITIONS.get((state, event))
    if expected is None:
        with pytest.raises(LifecycleError):
            s.step(event)
        assert s.state is state
    else:
        s.step(event, "because")
        assert s.state is expected
        assert (s.quarantine_reason is not None) == (expected is slot.SlotState.QUARANTINED)


def test_a_crashed_out_slot_whose_late_drain_ends_rests_then_returns() -> None:
    """Quarantined for a late drain, then crashed out: when the drain ends it rests, and the rest ends."""

    async def main() -> None:
        s = _slot_in(slot.SlotState.QUARANTINED)
        s.ctx = None
        s.crashed_out = True
        s._crashes = []
        s.on_change = []
        s.outbox = type("O", (), {"ws": None, "session": None, "timings": {}})()
        s._drained = asyncio.Event()
        loop = asyncio.get_running_loop()
        later: list[Any] = []
        loop.call_later = lambda delay, fn, *a: later.append(fn)  # type: ignore[method-assign]
        s._finish_drain()
        assert s.state is slot.SlotState.QUARANTINED
        assert len(later) == 1, "no rest was scheduled: the slot would stay quarantined for good"
        later[0]()
        assert s.state is slot.SlotState.IDLE

    asyncio.run(main())


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(speculation.Phase, speculation.Event)))
def test_a_guess_moves_only_along_its_table(phase: speculation.Phase, event: speculation.Event) -> None:
    guess = speculation.Guess.__new__(speculation.Guess)
    guess.phase = phase
    expected = speculation.TRANSITIONS.get((phase, event))
    if expected is None:
        with pytest.raises(LifecycleError):
            guess.step(event)
        assert guess.phase is phase
    else:
        guess.step(event)
        assert guess.phase is expected

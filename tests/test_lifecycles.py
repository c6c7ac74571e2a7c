"""Every lifecycle table, walked pair by pair: allowed moves reach their state, all others are refused.

The tables are the slot's (:data:`s2s_rt.slot.TRANSITIONS`), a response's
(:data:`s2s_rt.protocol.response.TRANSITIONS`) and a speculation's
(:data:`s2s_rt.pipeline.speculation.TRANSITIONS`). Each pair is also driven
through the object that owns the state, placed in the state under test by
walking its table; and nothing can move a state by hand, around its table:
the owners keep it behind a read-only property, and no code but a step
method writes it.
"""

from __future__ import annotations

import ast
import asyncio
import enum
import itertools
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from s2s_rt import slot
from s2s_rt.engines.fake import load_fake_stack
from s2s_rt.inference import StagePool
from s2s_rt.lifecycle import Lifecycle, LifecycleError
from s2s_rt.listening.clock import ListeningClock
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline import speculation
from s2s_rt.protocol import response
from s2s_rt.protocol.errors import ServerFault
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


def _path(table: Lifecycle[Any, Any], start: enum.Enum, goal: enum.Enum) -> list[Any]:
    """The shortest walk of events along ``table`` from ``start`` to ``goal``."""
    walks: dict[enum.Enum, list[Any]] = {start: []}
    todo = deque([start])
    while todo:
        state = todo.popleft()
        for (frm, event), to in table.table.items():
            if frm is state and to not in walks:
                walks[to] = [*walks[state], event]
                todo.append(to)
    return walks[goal]


def _response_in(phase: response.Phase) -> response.Response:
    """A response placed in ``phase`` by moves along its table (a message's text part open, for PART_OPEN)."""
    session = Session(GA)
    session.start_response(None)
    resp = session.response
    assert resp is not None
    if phase is response.Phase.PART_OPEN:
        resp.text_delta("Hello")  # a message and its text part are open now
    else:
        for step in _path(response.LIFECYCLE, response.Phase.CREATED, phase):
            resp._step(step)
    assert resp.phase is phase
    return resp


@pytest.mark.parametrize("phase", list(response.Phase))
@pytest.mark.parametrize("end", ["cancel", "fail"])
def test_a_response_ends_through_its_table_from_every_phase(phase: response.Phase, end: str) -> None:
    r = _response_in(phase)
    events = r.cancel("client_cancelled") if end == "cancel" else r.fail(ServerFault("x", "y"))
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


def _slot() -> slot.Slot:
    """A slot as the server builds one (on the fake stack), idle; its stages are not running."""
    stack, metrics = load_fake_stack(), Metrics(dict, lambda: 0)
    pools = {kind: StagePool(kind, 1, metrics) for kind in ("vad", "stt", "llm", "tts")}
    return slot.Slot(0, stack, pools, ListeningClock(stack.vad, pools["vad"], metrics), metrics)


def _slot_in(state: slot.SlotState, *walk: slot.SlotEvent) -> slot.Slot:
    """A slot placed in ``state`` by moves along its table: ``walk``, or the shortest one."""
    s = _slot()
    for event in walk or _path(slot.LIFECYCLE, slot.SlotState.IDLE, state):
        s.step(event, "because")
    assert s.state is state
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
        assert (s.quarantine_reason is not None) == (expected in slot.OUT_OF_SERVICE)


def test_a_crashed_out_slot_whose_late_drain_ends_rests_then_returns() -> None:
    """Quarantined for a late drain, then crashed out: when the drain ends it rests, and the rest ends."""

    async def main() -> None:
        s = _slot_in(
            slot.SlotState.CRASHED,
            slot.SlotEvent.CLAIM,
            slot.SlotEvent.END,
            slot.SlotEvent.DRAIN_LATE,
            slot.SlotEvent.CRASHED_OUT,
        )
        loop = asyncio.get_running_loop()
        later: list[Any] = []
        loop.call_later = lambda delay, fn, *a: later.append(fn)  # type: ignore[method-assign]
        s._finish_drain()
        assert s.state is slot.SlotState.RESTING
        assert len(later) == 1, "no rest was scheduled: the slot would stay quarantined for good"
        later[0]()
        assert s.state is slot.SlotState.IDLE

    asyncio.run(main())


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(speculation.Phase, speculation.Event)))
def test_a_guess_moves_only_along_its_table(phase: speculation.Phase, event: speculation.Event) -> None:
    guess = speculation.Guess(None, None, None)  # type: ignore[arg-type]
    for step in _path(speculation.LIFECYCLE, speculation.Phase.IDLE, phase):
        guess.step(step)
    assert guess.phase is phase
    expected = speculation.TRANSITIONS.get((phase, event))
    if expected is None:
        with pytest.raises(LifecycleError):
            guess.step(event)
        assert guess.phase is phase
    else:
        guess.step(event)
        assert guess.phase is expected


# --- nothing moves a state around its table -----------------------------------------------------------------


def test_a_slot_state_a_response_phase_or_a_guess_phase_set_by_hand_raises_at_once() -> None:
    s = _slot_in(slot.SlotState.DRAINING)
    with pytest.raises(AttributeError):
        s.state = slot.SlotState.IDLE  # type: ignore[misc]
    assert s.state is slot.SlotState.DRAINING
    r = _response_in(response.Phase.PART_OPEN)
    with pytest.raises(AttributeError):
        r.phase = response.Phase.DONE  # type: ignore[misc]
    assert r.phase is response.Phase.PART_OPEN
    guess = speculation.Guess(None, None, None)  # type: ignore[arg-type]
    guess.step(speculation.Event.START)
    with pytest.raises(AttributeError):
        guess.phase = speculation.Phase.USED  # type: ignore[misc]
    assert guess.phase is speculation.Phase.SPECULATING


#: The attributes that hold a lifecycle's state (the slot's, a response's, a speculation's), public or private.
_STATE_ATTRIBUTES = {"state", "_state", "phase", "_phase"}
#: The only methods that may write them: a step (along the table), and a constructor (the first state).
_WRITERS = {"step", "_step", "__init__"}
PACKAGE = Path(slot.__file__).resolve().parent


def _state_writes(source: str) -> list[str]:
    """Where ``source`` assigns a lifecycle state outside a step method: ``function:line`` each."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name)
                continue
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, ast.AugAssign | ast.AnnAssign):
                targets = [child.target]
            for target in targets:
                for t in ast.walk(target):
                    if not isinstance(t, ast.Attribute) or not isinstance(t.ctx, ast.Store):
                        continue  # a name, or an attribute read (an index in the target)
                    if t.attr in _STATE_ATTRIBUTES and function not in _WRITERS:
                        found.append(f"{function}:{t.lineno}")
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def test_the_scan_for_state_writes_finds_one() -> None:
    # A scan that found nothing would pass the test below.
    assert _state_writes("class S:\n    def end(self):\n        self.state = IDLE\n") == ["end:3"]
    assert _state_writes("def f(r):\n    r._phase, x = DONE, 1\n") == ["f:2"]
    assert _state_writes("class S:\n    def step(self, e):\n        self._state = T[self._state, e]\n") == []
    assert _state_writes("def f(s):\n    seen[s.state] = 1\n") == []  # read, not written


def test_no_code_but_a_step_method_writes_a_lifecycle_state() -> None:
    writes = {
        str(path.relative_to(PACKAGE.parent)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if (found := _state_writes(path.read_text()))
    }
    assert writes == {}, f"lifecycle states written around their tables (use the owner's step): {writes}"

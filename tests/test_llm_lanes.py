"""The LLM's lanes: ordinary calls one at a time in order, long readings beside them, waiting stopped by a cancel."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from s2s_rt.engines.llm_lanes import Lanes


def _never() -> bool:
    return False


def _hold(lanes: Lanes, long: bool, log: list[str], name: str, release: threading.Event) -> threading.Thread:
    """A call that takes its lane, notes it took it, and holds it until ``release``; started on a thread."""

    def call() -> None:
        with lanes.take(long, _never) as got:
            assert got
            log.append(name)
            release.wait(5)

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def _until(check: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_ordinary_calls_take_the_lane_one_at_a_time_in_the_order_they_came() -> None:
    lanes = Lanes()
    log: list[str] = []
    releases = [threading.Event() for _ in range(3)]
    threads = []
    for i, release in enumerate(releases):
        threads.append(_hold(lanes, False, log, f"call {i}", release))
        _until(lambda i=i: lanes.waiting(False) + lanes.running(False) == i + 1)
    time.sleep(0.05)
    assert log == ["call 0"]
    for i, release in enumerate(releases):
        release.set()
        _until(lambda i=i: len(log) >= min(i + 2, 3))
    for thread in threads:
        thread.join(5)
    assert log == ["call 0", "call 1", "call 2"]
    assert lanes.running(False) == 0


def test_a_long_reading_runs_beside_an_ordinary_call_and_the_next_long_one_waits_for_it() -> None:
    lanes = Lanes()
    log: list[str] = []
    release_long, release_ordinary = threading.Event(), threading.Event()
    first = _hold(lanes, True, log, "long", release_long)
    _until(lambda: log == ["long"])
    ordinary = _hold(lanes, False, log, "ordinary", release_ordinary)
    _until(lambda: len(log) == 2)
    second = _hold(lanes, True, log, "second long", release_long)
    time.sleep(0.05)
    assert log == ["long", "ordinary"]  # the ordinary call did not wait; the second long reading does
    assert lanes.long_readings == 1
    release_long.set()
    _until(lambda: len(log) == 3)
    assert log[-1] == "second long"
    release_ordinary.set()
    for thread in (first, ordinary, second):
        thread.join(5)
    assert lanes.long_readings == 2
    assert lanes.running(True) == lanes.running(False) == 0


def test_a_call_cancelled_while_it_waits_for_its_lane_holds_nothing_and_the_next_goes() -> None:
    lanes = Lanes()
    log: list[str] = []
    release = threading.Event()
    holder = _hold(lanes, False, log, "holder", release)
    _until(lambda: log == ["holder"])
    cancelled = threading.Event()
    outcome: list[tuple[bool, float]] = []

    def cancelled_call() -> None:
        with lanes.take(False, cancelled.is_set) as got:
            outcome.append((got, time.monotonic()))

    waiter = threading.Thread(target=cancelled_call)
    waiter.start()
    _until(lambda: lanes.waiting(False) == 1)
    after = _hold(lanes, False, log, "after", release)
    _until(lambda: lanes.waiting(False) == 2)
    stopped = time.monotonic()
    cancelled.set()
    waiter.join(5)
    ((got, at),) = outcome
    assert not got
    assert at - stopped < 0.5
    assert lanes.running(False) == 1  # still the holder's, nothing taken for the cancelled call
    release.set()
    for thread in (holder, after):
        thread.join(5)
    assert log == ["holder", "after"]

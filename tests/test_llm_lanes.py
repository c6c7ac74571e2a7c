"""The LLM's lanes: ordinary calls one at a time in order, long readings beside them, waiting stopped by a cancel;
answers waiting together decoded in one call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from s2s_rt.engines.base import LLMUsage
from s2s_rt.engines.llm_lanes import Lanes
from s2s_rt.engines.llm_turns import AnswerTurn, Turns


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


# --- answers decoded together ------------------------------------------------------------------


@dataclass
class _Step:
    step: int
    batch_id: int
    token_id: int
    is_last: bool


class _Result:
    def __init__(self, done: threading.Event, error: list[Exception]) -> None:
        self._done, self._error = done, error

    def result(self) -> None:
        self._done.wait(10)
        if self._error:
            raise self._error[0]


class _Generator:
    """CTranslate2's ``generate_batch`` as the lanes call it: each prompt decoded as an item of one call, a step
    for all at a time. An item's tokens are 100 * (its prompt's length) + 0, 1, 2 ...; it ends after ``length``
    tokens or when the callback says so."""

    def __init__(self, length: int = 5, step_s: float = 0.002) -> None:
        self.calls: list[dict[str, Any]] = []
        self.length, self.step_s = length, step_s

    def generate_batch(self, prompts: list[list[str]], **options: Any) -> list[_Result]:
        assert options["asynchronous"] and options["include_prompt_in_result"] is False
        self.calls.append({"prompts": prompts, **options})
        done, error = threading.Event(), []

        def decode() -> None:
            running = set(range(len(prompts)))
            try:
                for n in range(min(self.length, options["max_length"])):
                    for i in sorted(running):
                        last = n == self.length - 1
                        if options["callback"](_Step(n, i, 100 * len(prompts[i]) + n, last)) or last:
                            running.discard(i)
                    if not running:
                        break
                    time.sleep(self.step_s)
            except Exception as exc:
                error.append(exc)
            done.set()

        threading.Thread(target=decode).start()
        return [_Result(done, error) for _ in prompts]


def _answer(
    lanes: Lanes,
    generator: _Generator,
    words: int,
    got: dict[int, Any],
    *,
    urgent: bool = False,
    callback: Callable[[Any, threading.Event, int], bool] | None = None,
    max_length: int = 10,
    static_prompt: list[str] | None = None,
    should_stop: Callable[[], bool] = _never,
    usage: LLMUsage | None = None,
) -> threading.Thread:
    """An answer to a prompt of ``words`` tokens read on a thread: its tokens (or what it raised) in ``got``."""

    def read() -> None:
        tokens: list[int] = []
        got[words] = tokens
        try:
            for step in lanes.steps(
                generator,
                False,
                ["w"] * words,
                should_stop=should_stop,
                urgent=lambda: urgent,
                callback=callback or (lambda step, closed, beside: False),
                max_length=max_length,
                static_prompt=static_prompt,
                usage=usage,
                sampling_topk=1,
            ):
                tokens.append(step.token_id)
        except Exception as exc:
            got[words] = exc

    thread = threading.Thread(target=read)
    thread.start()
    return thread


def _held(lanes: Lanes) -> tuple[threading.Thread, threading.Event]:
    release = threading.Event()
    holder = _hold(lanes, False, [], "holder", release)
    _until(lambda: lanes.running(False) == 1)
    return holder, release


def test_answers_waiting_when_the_lane_frees_are_decoded_in_one_call_each_reading_its_own() -> None:
    lanes, generator, got = Lanes(), _Generator(), {}
    holder, release = _held(lanes)
    threads = [_answer(lanes, generator, words, got) for words in (1, 2, 3)]
    _until(lambda: lanes.waiting(False) == 3)
    release.set()
    for thread in (holder, *threads):
        thread.join(5)
    assert [len(call["prompts"]) for call in generator.calls] == [3]
    assert got == {w: [100 * w + n for n in range(5)] for w in (1, 2, 3)}
    assert lanes.answers_together == 3 and lanes.answer_calls == 1
    _until(lambda: lanes.running(False) == 0)  # let go by the call's end, after its last token
    assert lanes.running(False) == 0


def test_answers_whose_prompts_would_hold_too_much_state_together_wait_for_the_next_call() -> None:
    lanes, generator, got = Lanes(), _Generator(), {}
    lanes.call_tokens = 10
    holder, release = _held(lanes)
    threads = []
    for words in (4, 5, 6, 12):  # queued in this order
        threads.append(_answer(lanes, generator, words, got))
        _until(lambda: lanes.waiting(False) == len(threads))
    release.set()
    for thread in (holder, *threads):
        thread.join(5)
    # 4 + 5 fit in 10; 6 waits for the next call, 12 alone (a call takes its first answer whatever its length).
    assert [[len(p) for p in call["prompts"]] for call in generator.calls] == [[4, 5], [6], [12]]
    assert got == {w: [100 * w + n for n in range(5)] for w in (4, 5, 6, 12)}


def test_answers_made_differently_are_decoded_in_calls_of_their_own() -> None:
    lanes, generator, got = Lanes(), _Generator(), {}
    holder, release = _held(lanes)
    threads = [
        _answer(lanes, generator, 1, got, static_prompt=["a"]),
        _answer(lanes, generator, 2, got, static_prompt=["b"]),
        _answer(lanes, generator, 3, got, static_prompt=["a"]),
    ]
    _until(lambda: lanes.waiting(False) == 3)
    release.set()
    for thread in (holder, *threads):
        thread.join(5)
    assert [(call["static_prompt"], len(call["prompts"])) for call in generator.calls] == [(["a"], 2), (["b"], 1)]
    assert got == {w: [100 * w + n for n in range(5)] for w in (1, 2, 3)}


def test_answers_waiting_for_their_first_words_go_before_an_answer_being_heard_that_came_first() -> None:
    lanes, generator, got = Lanes(), _Generator(), {}
    holder, release = _held(lanes)
    heard = _answer(lanes, generator, 1, got)
    _until(lambda: lanes.waiting(False) == 1)
    urgent = [_answer(lanes, generator, w, got, urgent=True) for w in (2, 3)]
    _until(lambda: lanes.waiting(False) == 3)
    release.set()
    for thread in (holder, heard, *urgent):
        thread.join(5)
    assert [len(p) for p in generator.calls[0]["prompts"]] == [2, 3]
    assert [len(p) for p in generator.calls[1]["prompts"]] == [1]
    assert got == {w: [100 * w + n for n in range(5)] for w in (1, 2, 3)}


def test_an_answer_being_heard_passed_over_once_goes_in_the_next_call_with_answers_waiting_for_first_words() -> None:
    lanes, generator, got = Lanes(), _Generator(step_s=0.1), {}
    holder, release = _held(lanes)
    heard = _answer(lanes, generator, 1, got)
    _until(lambda: lanes.waiting(False) == 1)
    first = _answer(lanes, generator, 2, got, urgent=True)
    _until(lambda: lanes.waiting(False) == 2)
    release.set()
    _until(lambda: len(generator.calls) == 1)
    later = _answer(lanes, generator, 3, got, urgent=True)  # while the first call (answer 2 alone) runs, 0.5 s
    for thread in (holder, heard, first, later):
        thread.join(5)
    assert [[len(p) for p in call["prompts"]] for call in generator.calls] == [[2], [1, 3]]
    assert got == {w: [100 * w + n for n in range(5)] for w in (1, 2, 3)}


def test_an_answer_that_stops_fails_or_ends_early_ends_alone_and_the_others_in_its_call_go_on() -> None:
    lanes, generator, got = Lanes(), _Generator(length=6), {}
    holder, release = _held(lanes)

    def fails(step: Any, closed: threading.Event, beside: int) -> bool:
        if step.step == 1:
            raise RuntimeError("this session's fault")
        return False

    threads = [
        _answer(lanes, generator, 1, got, callback=lambda step, closed, beside: step.step == 2),
        _answer(lanes, generator, 2, got, callback=fails),
        _answer(lanes, generator, 3, got, max_length=3),
        _answer(lanes, generator, 4, got),
    ]
    _until(lambda: lanes.waiting(False) == 4)
    release.set()
    for thread in (holder, *threads):
        thread.join(5)
    assert len(generator.calls) == 1
    assert got[1] == [100, 101, 102]  # its callback stopped it after the token it was handed
    assert isinstance(got[2], RuntimeError)
    assert got[3] == [300, 301, 302]  # its own max_length, not the call's
    assert got[4] == [400 + n for n in range(6)]
    _until(lambda: lanes.running(False) == 0)  # let go by the call's end, after its last token
    assert lanes.running(False) == 0


def test_an_answer_not_given_way_to_answers_that_wait_for_their_first_words_in_its_own_call() -> None:
    lanes, generator, got = Lanes(), _Generator(), {}
    holder, release = _held(lanes)
    besides: list[int] = []

    def heard(step: Any, closed: threading.Event, beside: int) -> bool:
        besides.append(beside)
        return False

    threads = [_answer(lanes, generator, 1, got, urgent=True, callback=heard), _answer(lanes, generator, 2, got)]
    _until(lambda: lanes.waiting(False) == 2)
    threads.append(_answer(lanes, generator, 3, got, urgent=True))
    _until(lambda: lanes.waiting(False) == 3)
    release.set()
    for thread in (holder, *threads):
        thread.join(5)
    assert besides == [1] * 5  # answer 3 beside it, still waiting for its first words (the fake never says)
    assert [len(call["prompts"]) for call in generator.calls] == [2, 1]


def test_an_answer_cancelled_while_it_waits_for_a_call_reads_nothing_and_holds_nothing() -> None:
    lanes, generator, got = Lanes(), _Generator(), {}
    holder, release = _held(lanes)
    cancelled = threading.Event()
    waiter = _answer(lanes, generator, 1, got, should_stop=cancelled.is_set)
    _until(lambda: lanes.waiting(False) == 1)
    cancelled.set()
    waiter.join(5)
    assert got[1] == [] and lanes.waiting(False) == 0
    other = _answer(lanes, generator, 2, got)
    release.set()
    for thread in (holder, other):
        thread.join(5)
    assert [len(call["prompts"]) for call in generator.calls] == [1]
    assert got[2] == [200 + n for n in range(5)]
    _until(lambda: lanes.running(False) == 0)  # let go by the call's end, after its last token
    assert lanes.running(False) == 0


def test_an_answer_being_heard_gives_way_only_to_answers_waiting_for_their_first_words_outside_its_call() -> None:
    turns = Turns()
    heard = AnswerTurn(turns, str, [], urgent=None, pause=None, should_stop=_never)
    waiting = AnswerTurn(turns, str, [], urgent=lambda: True, pause=None, should_stop=_never)
    step, closed = _Step(0, 0, 1, False), threading.Event()
    assert turns.urgent == 1
    assert not heard.after_token(step, closed, 1)  # the one waiting is decoded beside it
    assert heard.after_token(step, closed, 0)  # it waits for the model: give way
    waiting.close()
    assert not heard.after_token(step, closed, 0)


def test_an_answer_says_when_it_took_its_place_in_a_call_and_keeps_that_time_when_read_again() -> None:
    lanes, generator, got, usage = Lanes(), _Generator(), {}, LLMUsage()
    holder, release = _held(lanes)
    reader = _answer(lanes, generator, 2, got, usage=usage)
    _until(lambda: lanes.waiting(False) == 1)
    time.sleep(0.05)
    assert usage.boarded is None  # still waiting for the lane
    freed = time.perf_counter()
    release.set()
    for thread in (holder, reader):
        thread.join(5)
    assert got[2] == [200 + n for n in range(5)]
    assert usage.boarded is not None and freed < usage.boarded < time.perf_counter()
    first = usage.boarded
    _answer(lanes, generator, 3, got, usage=usage).join(5)  # resumed after giving way: the same answer
    assert usage.boarded == first

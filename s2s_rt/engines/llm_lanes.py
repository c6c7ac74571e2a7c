"""Lanes into the one LLM: a long prompt is read beside other sessions' answers, never in front of them.

CTranslate2 reads a prompt in one call that nothing can interrupt, and it
cannot go on from a kept state it did not make itself (a ``static_prompt``
is found only whole, and read from scratch when it is not), so a long
prompt cannot be read in pieces. It is read on a replica of its own
instead: the generator has one replica more than ordinary work uses, and
the replicas share the weights (the same resident memory with one or two)
and the kept states. Ordinary work goes through its lane in order, one
call at a time, as through one replica; long readings take the other lane,
one at a time. Another session's answer then waits for at most one
ordinary reading (at most :data:`LONG_READING_TOKENS`), and shares the
cores with the long one instead of waiting for all of it.

Answers that wait for a lane when it frees take it together
(:meth:`Lanes.steps`): one ``generate_batch`` call decodes each of them as
an item of its own. A decoding step reads every weight of the model once
for one answer or for eight; on one core of the 2-core AMD EPYC a step of
the default 0.5B model took 58 ms for one answer, 59 for two, 75 for four
and 85-89 for eight (greedy, 40 tokens). Each answer still reads its own
tokens as they come and stops by itself; an answer joins a call only when
it begins (CTranslate2 cannot add an item to a decoding under way), and
only answers made of the same static prompt, sampling settings and model
go together.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from s2s_rt.engines.base import LLMUsage, StopCheck

#: A reading of at least this many tokens (past the kept state) takes the long lane. Reading costs about
#: 1.4 ms a token on the 2-core Xeon (0.7 s for this many) and about 30 ms on a 2-core AMD EPYC without
#: AVX-512 (BENCHMARKS.md, "One client cannot stall the others"); an ordinary turn reads fewer: the default
#: instructions are about 190 tokens, and with a kept state only the new user turn is read.
LONG_READING_TOKENS = 512

#: How often a call waiting for its lane looks at its stop check.
_STOP_CHECK_S = 0.05
#: The most answers decoded in one call. Eight still cost about 1.5 times one a step (see the module's text).
MOST_ANSWERS = 8
#: The most prompt tokens (kept state included) of the answers in one call, past its first: each answer's model
#: state is held for the call (168 KB a token for the default model), and what a call held stays mapped.
#: Without it, a fuzz run of hostile sessions grew the server by 310-592 MB against 131-270 MB before batching.
CALL_TOKENS = 2048

#: Runs in CTranslate2's worker after each of an answer's tokens (the token already handed over):
#: ``(step, closed, beside)``, where ``closed`` is set once its reader stops reading and ``beside`` is how many
#: other answers in the same call wait for their first words. True stops the answer's decoding; it may block,
#: which pauses the call (every answer in it).
StepCallback = Callable[[Any, threading.Event, int], bool]


@dataclass(eq=False)
class _Ride:
    """One answer's place in a call: its prompt, its own limits, and the queue its tokens come through."""

    prompt: list[str]
    max_length: int
    callback: StepCallback
    #: What the call is made of (the model, its static prompt and settings): only rides alike go together.
    key: Hashable
    urgent: Callable[[], bool]
    steps: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    closed: threading.Event = field(default_factory=threading.Event)
    #: Its decoding ended (its last token, a stop, or the call's end): nothing more comes through ``steps``.
    stopped: threading.Event = field(default_factory=threading.Event)
    aboard: bool = False
    decoded: int = 0
    #: Calls that began without it while it waited.
    passed_over: int = 0
    #: Prompt tokens, kept state included.
    tokens: int = 0
    #: ``perf_counter()`` when it took its place in a call.
    boarded: float = 0.0


class Lanes:
    """Which of the model's replicas a call may take: ordinary calls in order, long readings beside them.

    Args:
        ordinary: calls of ordinary work that run at once (the engine's
            ``inter_threads``); the generator has one replica more, for
            long readings.
    """

    def __init__(self, ordinary: int = 1) -> None:
        self._changed = threading.Condition()
        self._width = {False: ordinary, True: 1}
        self._running = {False: 0, True: 0}
        self._waiting: dict[bool, deque[object]] = {False: deque(), True: deque()}
        #: Long readings that took the long lane.
        self.long_readings = 0
        #: Calls into the model that decoded answers, and answers decoded in a call beside another.
        self.answer_calls = 0
        self.answers_together = 0
        self.most_answers = MOST_ANSWERS
        self.call_tokens = CALL_TOKENS

    def running(self, long: bool) -> int:
        """Calls in the lane now."""
        return self._running[long]

    def waiting(self, long: bool) -> int:
        """Calls waiting for a place in the lane now."""
        return len(self._waiting[long])

    @contextlib.contextmanager
    def take(self, long: bool, should_stop: StopCheck) -> Iterator[bool]:
        """Hold a place in the long or the ordinary lane for one call into the model.

        Waits, in order of arrival, for a free place. Yields True once one is
        held, or False when ``should_stop`` came true first (then no place is
        held, and the caller reads nothing).
        """
        ticket = object()
        waiting = self._waiting[long]
        got = False
        with self._changed:
            waiting.append(ticket)
            try:
                while not got and not should_stop():
                    got = waiting[0] is ticket and self._running[long] < self._width[long]
                    if not got:
                        self._changed.wait(_STOP_CHECK_S)
                if got:
                    self._running[long] += 1
                    self.long_readings += long
            finally:
                waiting.remove(ticket)
                self._changed.notify_all()  # the next in line may be first now
        if not got:
            yield False
            return
        try:
            yield True
        finally:
            with self._changed:
                self._running[long] -= 1
                self._changed.notify_all()

    def steps(
        self,
        generator: Any,
        long: bool,
        prompt: list[str],
        *,
        should_stop: StopCheck,
        urgent: Callable[[], bool],
        callback: StepCallback,
        max_length: int,
        static_prompt: list[str] | None,
        usage: LLMUsage | None = None,
        **options: Any,
    ) -> Generator[Any, None, None]:
        """The tokens of the answer after ``prompt``, decoded in a call of the lane, perhaps beside others.

        Waits, in order of arrival, for the lane; once it frees, the first
        answer waiting takes it with every answer waiting that is made
        alike (``generator``, ``static_prompt``, ``options``), at most
        :data:`MOST_ANSWERS` and :data:`CALL_TOKENS`; while any of them
        waits for its first words (``urgent``), with only those and the
        answers already passed over once. Yields nothing when
        ``should_stop`` comes true first. Each step is handed over before
        ``callback`` sees it; True from it, the answer's last token, or
        closing this generator (which waits for the answer's next token)
        ends this answer's decoding alone. The call holds the lane until
        every answer in it has ended. ``usage.boarded`` (if not set yet) becomes when this answer took its
        place in a call.
        """
        key = (id(generator), tuple(static_prompt) if static_prompt else None, _frozen(options))
        ride = _Ride(prompt, max_length, callback, key, urgent, tokens=len(prompt) + len(static_prompt or ()))
        waiting = self._waiting[long]
        with self._changed:
            waiting.append(ride)
        try:
            while not ride.aboard and not should_stop():
                board: list[_Ride] = []
                with self._changed:
                    while not ride.aboard and not board and not should_stop():
                        if waiting[0] is ride and self._running[long] < self._width[long]:
                            board = self._board(long, ride)
                        else:
                            self._changed.wait(_STOP_CHECK_S)
                if board:  # this thread starts the call, which may not take its own answer (see _board)
                    self._start(generator, long, board, static_prompt, options)
        finally:
            with self._changed:
                if ride in waiting:
                    waiting.remove(ride)
                self._changed.notify_all()  # the next in line may be first now
        if not ride.aboard:
            return
        if usage is not None and usage.boarded is None:
            usage.boarded = ride.boarded
        try:
            while (step := ride.steps.get()) is not None:
                if isinstance(step, Exception):
                    raise step
                yield step
        finally:
            ride.closed.set()
            ride.stopped.wait()

    def _board(self, long: bool, first: _Ride) -> list[_Ride]:
        """The answers that take the free lane with ``first`` (called holding ``_changed``)."""
        alike = [r for r in self._waiting[long] if isinstance(r, _Ride) and r.key == first.key]
        # Answers waiting for their first words go first, but an answer being heard is passed over once at most:
        # answers asked one after another would otherwise hold it for good (8 talkers: stalls of 4.4-7.9 s at p95).
        board: list[_Ride] = []
        tokens = 0
        for ride in [r for r in alike if r.urgent() or r.passed_over] or alike:
            if len(board) == self.most_answers or (board and tokens + ride.tokens > self.call_tokens):
                break
            board.append(ride)
            tokens += ride.tokens
        for ride in alike:
            ride.passed_over += ride not in board
        now = time.perf_counter()
        for ride in board:
            ride.aboard, ride.boarded = True, now
            self._waiting[long].remove(ride)
        self._running[long] += 1
        self.long_readings += long
        return board

    def _start(
        self, generator: Any, long: bool, board: list[_Ride], static_prompt: list[str] | None, options: dict[str, Any]
    ) -> None:
        """Start one call decoding ``board``'s answers; the lane is let go once all of them have ended."""
        self.answer_calls += 1
        self.answers_together += len(board) if len(board) > 1 else 0

        def each(step: Any) -> bool:
            ride = board[step.batch_id]
            ride.steps.put(step)
            ride.decoded += 1
            try:
                beside = sum(1 for r in board if r is not ride and not r.stopped.is_set() and r.urgent())
                stop = ride.closed.is_set() or ride.callback(step, ride.closed, beside)
            except Exception as exc:  # this answer's fault ends this answer alone, not the call beside it
                ride.steps.put(exc)
                stop = True
            if stop or step.is_last or ride.decoded >= ride.max_length:
                ride.stopped.set()
                ride.steps.put(None)
                return True
            return False

        def end(error: BaseException | None) -> None:
            for ride in board:
                if not ride.stopped.is_set():
                    if error is not None:
                        ride.steps.put(error)
                    ride.stopped.set()
                    ride.steps.put(None)
            with self._changed:
                self._running[long] -= 1
                self._changed.notify_all()

        try:
            results = generator.generate_batch(
                [ride.prompt for ride in board],
                asynchronous=True,
                beam_size=1,
                include_prompt_in_result=False,
                static_prompt=static_prompt,
                max_length=max(ride.max_length for ride in board),
                callback=each,
                **options,
            )
        except Exception as exc:
            end(exc)
            return

        def wait() -> None:
            error: BaseException | None = None
            for result in results:
                try:
                    result.result()
                except Exception as exc:  # handed to each reader still reading, which raises it
                    error = exc
            end(error)

        threading.Thread(target=wait, name="s2s-llm-call", daemon=True).start()


def _frozen(options: dict[str, Any]) -> Hashable:
    return tuple(sorted((name, tuple(v) if isinstance(v, list) else v) for name, v in options.items()))


def never() -> bool:
    """A stop check for work that is never stopped (reading ahead, the turn-end judge)."""
    return False

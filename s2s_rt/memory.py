"""Giving freed memory back to the system, and collecting cyclic garbage seldom.

glibc keeps freed heap memory for reuse, and after a large block is freed
it raises its mmap threshold, so the next large buffers (a big append, a
long answer) come from the heap too and stay resident after they are freed.
A session's big buffers would then keep the process's RSS up for good.
:func:`release_freed_memory` asks glibc to return what it can (at most once
a second); elsewhere it does nothing.

CPython's cyclic collector runs its young generation every 700 tracked
allocations. At 250 listening sessions that was ten collections a second,
each promoting the short-lived objects it caught (a tick's audio, its
results) towards the old generation, whose full pass then came every 15 s
or so and held the interpreter 30-70 ms: every session's audio waited.
:func:`collect_seldom` makes the young generation wait for
:data:`YOUNG_ALLOCATIONS`: what dies young is freed by reference counting
long before, nothing short-lived reaches the old generation, and a full
pass comes rarely. An ended session does not wait for the collector:
nothing of it is in a reference cycle, so it is freed when its slot lets go
of it (``test_nothing_of_a_session_stays_referenced_after_it_ends`` checks
it with the collector off, and the tests of WebRTC and phone calls check a
call's session, call and peer connection). What a session hands to a
library's objects that may sit in cycles of their own reaches it
:func:`weakly`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")

_libc: ctypes.CDLL | None
try:
    _name = ctypes.util.find_library("c")
    _libc = ctypes.CDLL(_name) if _name else None
    _trim = getattr(_libc, "malloc_trim", None)
except OSError:
    _libc, _trim = None, None

_last = 0.0


def release_freed_memory(min_interval_s: float = 1.0, *, background: bool = False) -> bool:
    """Return freed heap memory to the system; False when skipped (too soon, or not glibc).

    Args:
        background: trim on a thread of its own and return at once. A trim
            walks the whole heap (13 ms a second of the event loop's time
            at 300 sessions ending one after another), so the loop never
            waits for it; ctypes lets go of the GIL during the call.
    """
    global _last
    now = time.monotonic()
    if _trim is None or now - _last < min_interval_s:
        return False
    _last = now
    if background:
        threading.Thread(target=_trim, args=(0,), name="s2s-malloc-trim", daemon=True).start()
    else:
        _trim(0)
    return True


#: Tracked allocations (less those freed) between two collections of the young generation (CPython's own: 700).
#: At 250 listening sessions: 4 young collections in 45 s, 3-6 ms each, and no full pass, against some 300-700
#: young, 25-60 middle and 2-5 full passes of 30-70 ms (BENCHMARKS.md, "Where a listening tick's time goes").
YOUNG_ALLOCATIONS = 20_000

_seldom_lock = threading.Lock()
#: Who asked for seldom collections and has not given them back, and the thresholds before the first asked.
_seldom_holders = 0
_thresholds_before: tuple[int, int, int] | None = None


def collect_seldom() -> None:
    """Collect the young generation every :data:`YOUNG_ALLOCATIONS` tracked allocations (a server while it runs;
    undone by :func:`collect_as_before` once every caller has called it)."""
    global _seldom_holders, _thresholds_before
    with _seldom_lock:
        if _seldom_holders == 0:
            _thresholds_before = gc.get_threshold()
            gc.set_threshold(max(YOUNG_ALLOCATIONS, _thresholds_before[0]), *_thresholds_before[1:])
        _seldom_holders += 1


def collect_as_before() -> None:
    """Give back one :func:`collect_seldom`; the last one given back restores the thresholds it found."""
    global _seldom_holders, _thresholds_before
    with _seldom_lock:
        if _seldom_holders == 0:
            return
        _seldom_holders -= 1
        if _seldom_holders == 0 and _thresholds_before is not None:
            gc.set_threshold(*_thresholds_before)
            _thresholds_before = None


@overload
def weakly(method: Callable[P, object]) -> Callable[P, None]: ...
@overload
def weakly(method: Callable[P, R], gone: R) -> Callable[P, R]: ...


def weakly(method: Callable[P, Any], gone: Any = None) -> Callable[P, Any]:
    """``method``, called through a weak reference to its object: once the object is gone, a call returns ``gone``.

    For a callback that an object hands to objects it does not own, which may
    outlive it in reference cycles of their own (aiortc's peer connection and
    its transports are, until the collector runs): handed over strongly, the
    callback would keep its object, and all it holds, alive as long as they.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: P.args, **kwargs: P.kwargs) -> Any:
        bound = ref()
        return gone if bound is None else bound(*args, **kwargs)

    return call

"""Giving freed memory back to the system.

glibc keeps freed heap memory for reuse, and after a large block is freed
it raises its mmap threshold, so the next large buffers (a big append, a
long answer) come from the heap too and stay resident after they are freed.
A session's big buffers would then keep the process's RSS up for good.
:func:`release_freed_memory` asks glibc to return what it can (at most once
a second); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

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

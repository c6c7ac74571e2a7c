"""numpy's matrix products kept on the thread that asks for them.

OpenBLAS (bundled with numpy's wheels) splits a product above a small size
across a thread per core, and spins those threads between products: on two
cores that is more CPU for the same work, taken from the other stages. The
VAD's forward pass and the resampling (in the listening worker, on the event
loop, in the speaking stage's thread) ask for one thread wherever they run.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

import numpy as np


def _blas_local_threads() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """OpenBLAS's ``openblas_set_num_threads_local`` (0.3.27+, bundled with numpy's wheels), if loaded."""
    libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*")
    for path in sorted(glob.glob(libs)):
        try:
            function = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
        return function
    return None


_SET_LOCAL_THREADS = _blas_local_threads()
_one_thread = threading.local()


def blas_on_one_thread() -> None:
    """Keep numpy's matrix products in the calling thread to that thread (OpenBLAS would otherwise wake a
    thread per core for each product, and spin them: more CPU for the same work, taken from other stages)."""
    if _SET_LOCAL_THREADS is not None and not getattr(_one_thread, "set", False):
        _SET_LOCAL_THREADS(1)
        _one_thread.set = True

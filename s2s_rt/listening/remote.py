"""Hearing in a process of its own: the listening clock's batches decoded, resampled, denoised and scored by a
child process, under its own interpreter lock.

In one process, the VAD's thread and the event loop share one interpreter
lock. Every numpy call the thread makes lets the lock go and must win it
back from a loop that is busy with hundreds of sessions' frames; at 250
listening sessions on two cores the thread spent twice its CPU time in wall
time (BENCHMARKS.md), a late tick made the next one bigger, and the clock
fell behind. A child has a lock of its own: the clock's thread only copies
each batch's bytes into shared memory, waits on a pipe (the lock let go
once), and reads the results back.

The child keeps each session's hearing state (the resampler, the samples
not yet a whole VAD window, the VAD's state, a denoiser while asked) by a
key the parent gives each :class:`SessionAudio`; the parent tells it which
keys are gone. If the child dies or does not answer in time, the batch
fails as an engine failure (each session told, none closed for it), a new
child is started, and batches are heard in this process until it is ready:
the sessions heard meanwhile start from fresh state, as after any engine
failure. :meth:`HearingProcess.close` ends the child; so does the parent's
end (its pipe closes).
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np

from s2s_rt.audio import AudioFormat
from s2s_rt.engines.base import PIPELINE_RATE, VAD, NoiseReduction
from s2s_rt.listening.hearing import AudioBytes, Heard, Hearing, SessionAudio, Work, hear
from s2s_rt.memory import collect_seldom
from s2s_rt.scope import Scope

log = logging.getLogger(__name__)

#: Bytes of client audio one exchange with the child carries at most (a bigger batch goes in parts).
IN_BYTES = 8 << 20
#: Bytes of results (16 kHz float samples and probabilities) one exchange brings back at most.
OUT_BYTES = 24 << 20
#: Columns of a segment's row in the shared input: key, format, offset, bytes, scored, denoised.
_COLUMNS = 6
#: The most segments one exchange carries (their rows sit before the audio).
MAX_SEGMENTS = 4096
_AUDIO_AT = MAX_SEGMENTS * _COLUMNS * 8
#: How long a batch may take in the child before it counts as hung (a child is killed and started again).
REPLY_TIMEOUT_S = 10.0
#: How long a new child may take to load its models.
START_TIMEOUT_S = 60.0
#: Children started again after a failure, at most, in a process's life: past that, hearing stays in the process
#: (a child that fails again and again would otherwise cost every session a failed batch each time).
MAX_RESTARTS = 5


class ChildFailed(RuntimeError):
    """The hearing process died, did not answer in time, or could not start."""


def _shared(size: int) -> tuple[str, mmap.mmap]:
    """A file in shared memory of ``size`` bytes, mapped; its path (unlinked once the child has mapped it)."""
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="s2s-rt-hearing-", dir=where)
    try:
        os.ftruncate(fd, size)
        return path, mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _mapped(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _out_bytes(segments: list[AudioBytes], scoring: bool, chunk: int) -> int:
    """An upper bound on what hearing ``segments`` writes back: samples at 16 kHz and probabilities."""
    samples = sum(len(s.data) // s.format.bytes_per_sample * PIPELINE_RATE // s.format.rate + 64 for s in segments)
    samples += chunk  # the samples a session carries from the last tick
    return 4 * (samples + (samples // chunk + 1 if scoring else 0)) + 16  # and its two lengths


class HearingProcess:
    """:func:`~s2s_rt.listening.hearing.hear` for the clock, run in a child process.

    Args:
        vad_recipe: builds the VAD in the child (picklable: the engine's :meth:`hearing_recipe`).
        noise_recipe: builds the noise reduction in the child (None: none installed).
        local: hears in this process: while no child is ready.
        chunk_samples: the VAD's window.
    """

    def __init__(
        self,
        vad_recipe: Callable[[], VAD],
        noise_recipe: Callable[[], NoiseReduction] | None,
        local: Hearing,
        chunk_samples: int,
        *,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        self._recipes = (vad_recipe, noise_recipe)
        self._local = local
        self._chunk = chunk_samples
        self._reply_timeout_s = reply_timeout_s
        #: Keys (:attr:`SessionAudio.key`) of the sessions the child has heard.
        self._seen: set[int] = set()
        #: Keys of sessions gone since the last exchange (appended by finalizers, in any thread).
        self._forget: list[int] = []
        self._formats: dict[AudioFormat, int] = {}
        self._child: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._maps: tuple[mmap.mmap, mmap.mmap] | None = None
        #: The child is loaded and answering (False while one starts: batches are heard here meanwhile).
        self._ready = False
        self._starting: threading.Thread | None = None
        self._closed = False
        #: Orders :meth:`close` with a restart: no child starts, or is kept, once closed.
        self._lock = threading.Lock()
        #: Children started again after a failure.
        self.restarts = 0
        #: Sessions whose state the child held at its last answer.
        self.held = 0

    # --- the child's life ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start a child and wait until it has loaded its models.

        Raises:
            ChildFailed: it could not start, or did not say it was ready within :data:`START_TIMEOUT_S`.
        """
        in_path, in_map = _shared(IN_BYTES)
        out_path, out_map = _shared(OUT_BYTES)
        ours, theirs = socket.socketpair()
        try:
            # A fresh interpreter running this module alone: not multiprocessing's spawn, which would import
            # the parent's main script again (an application's own, that may start a server).
            child = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import child_main; child_main({theirs.fileno()})"],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            ours.close()
            raise ChildFailed(f"the hearing process did not start: {exc!r}") from exc
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        try:
            conn.send((in_path, out_path, *self._recipes))
            if not conn.poll(START_TIMEOUT_S):
                raise ChildFailed(f"the hearing process did not start within {START_TIMEOUT_S:.0f} s")
            ready = conn.recv()
        except (OSError, EOFError, ChildFailed) as exc:
            conn.close()
            child.kill()
            child.wait()
            raise exc if isinstance(exc, ChildFailed) else ChildFailed(f"the hearing process ended: {exc!r}") from exc
        finally:
            os.unlink(in_path)
            os.unlink(out_path)
        with self._lock:
            if ready[0] != "ready" or self._closed:
                conn.close()
                child.kill()
                child.wait(5)
                why = f"could not load its models: {ready[1]}" if ready[0] != "ready" else "was closed meanwhile"
                raise ChildFailed(f"the hearing process {why}")
            self._child, self._conn, self._maps = child, conn, (in_map, out_map)
            self._formats.clear()  # a new child knows no format and no session
            self._seen = set()
            self._forget = []
            self._ready = True
        log.info("hearing in a process of its own (pid %d): %s", child.pid, ready[1])

    def _restart_in_background(self) -> None:
        """A new child, started in a thread; batches are heard in this process until it is ready."""
        self._stop_child()

        def start() -> None:
            try:
                self.start()
            except Exception as exc:
                log.error("hearing stays in this process: %s", exc)

        with self._lock:
            if self._closed or (self._starting is not None and self._starting.is_alive()):
                return
            if self.restarts >= MAX_RESTARTS:
                log.error("the hearing process failed %d times: hearing stays in this process", self.restarts + 1)
                return
            self.restarts += 1
            self._starting = threading.Thread(target=start, name="s2s-rt hearing restart", daemon=True)
            self._starting.start()

    def _stop_child(self) -> None:
        self._ready = False
        child, conn, self._child, self._conn = self._child, self._conn, None, None
        self._maps = None  # unmapped once no exchange uses them
        if conn is not None:
            conn.close()
        if child is not None:
            child.kill()
            child.wait(5)

    def close(self) -> None:
        """End the child (the server's teardown); batches after this are heard in this process."""
        with self._lock:
            self._closed = True
            starting = self._starting
        if starting is not None:
            starting.join(START_TIMEOUT_S)
        self._stop_child()

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None and self._ready else None

    # --- the clock's thread ----------------------------------------------------------------------------

    def __call__(self, work: Work) -> list[Heard]:
        """Hear ``work`` as :func:`hear` would (in the VAD's thread).

        Raises:
            ChildFailed: the child died or hung during this batch (a new one is being started).
        """
        if not self._ready:
            return self._local(work)
        heard: list[Heard] = []
        for part in self._parts(work):
            try:
                heard += self._exchange(part)
            except (OSError, EOFError, ChildFailed) as exc:
                log.error("the hearing process failed (%r): starting another", exc)
                self._restart_in_background()
                raise ChildFailed(f"the hearing process failed: {exc!r}") from exc
        return heard

    def _gone(self, key: int) -> None:
        """A session's audio is garbage: the child may forget it (at the next exchange)."""
        if key in self._seen:
            self._seen.discard(key)
            self._forget.append(key)

    def _parts(self, work: Work) -> list[Work]:
        """``work`` in parts whose audio, results and rows each fit the shared memory."""
        parts: list[Work] = []
        start, sent, back, rows = 0, 0, 0, 0
        for i, (_, segments, scoring) in enumerate(work):
            size = sum(len(s.data) for s in segments)
            out = _out_bytes(segments, scoring, self._chunk)
            if i > start and (
                _AUDIO_AT + sent + size > IN_BYTES or back + out > OUT_BYTES or rows + len(segments) > MAX_SEGMENTS
            ):
                parts.append(work[start:i])
                start, sent, back, rows = i, 0, 0, 0
            sent, back, rows = sent + size, back + out, rows + len(segments)
        parts.append(work[start:])
        return parts

    def _exchange(self, work: Work) -> list[Heard]:
        assert self._conn is not None and self._maps is not None
        in_map, out_map = self._maps
        seen, formats = self._seen, self._formats
        rows: list[int] = []
        data: list[bytes | memoryview] = []
        new_formats: list[AudioFormat] = []
        offset = _AUDIO_AT
        for audio, segments, scoring in work:
            key = audio.key
            if key not in seen:  # the child is told when the session's audio is gone
                seen.add(key)
                weakref.finalize(audio, self._gone, key)
            denoised = audio.noise is not None
            for seg in segments:
                fmt = formats.get(seg.format)
                if fmt is None:
                    fmt = formats[seg.format] = len(formats)
                    new_formats.append(seg.format)
                size = len(seg.data)
                rows += (key, fmt, offset, size, scoring, denoised)
                data.append(seg.data)
                offset += size
        in_map[_AUDIO_AT:offset] = b"".join(data)
        table = np.array(rows, np.int64)
        in_map[: table.nbytes] = table.tobytes()
        forget, self._forget = self._forget, []
        self._conn.send((len(table) // _COLUMNS, forget, new_formats))
        if not self._conn.poll(self._reply_timeout_s):
            raise ChildFailed(f"no answer within {self._reply_timeout_s:.0f} s")
        errors, self.held = self._conn.recv()
        # The lengths, then the samples and probabilities of each session in turn: one copy out of the shared
        # memory (the next exchange writes over it), and each session gets views of it.
        lengths = np.frombuffer(out_map, np.int64, 2 * len(work))
        total = int(lengths.sum())
        results = np.frombuffer(out_map, np.float32, total, offset=lengths.nbytes).copy()
        heard = []
        at = 0
        for n_samples, n_probabilities in lengths.reshape(-1, 2).tolist():
            middle = at + n_samples
            heard.append(Heard(results[at:middle], results[middle : middle + n_probabilities]))
            at = middle + n_probabilities
        for i, exc in errors:
            heard[i].error = exc
        return heard


def child_main(fd: int) -> None:
    """The hearing process's entry point: ``fd`` is its end of the parent's socket pair."""
    conn = Connection(fd)
    try:
        in_path, out_path, vad_recipe, noise_recipe = conn.recv()
    except (EOFError, OSError):
        return
    _serve(conn, in_path, out_path, vad_recipe, noise_recipe)


def _serve(
    conn: Connection,
    in_path: str,
    out_path: str,
    vad_recipe: Callable[[], VAD],
    noise_recipe: Callable[[], NoiseReduction] | None,
) -> None:
    """The child: load the models, then hear batch after batch until the parent goes."""
    try:
        vad = vad_recipe()
        noise = noise_recipe() if noise_recipe is not None else None
        in_map, out_map = _mapped(in_path), _mapped(out_path)
    except Exception as exc:
        conn.send(("failed", repr(exc)))
        return
    collect_seldom()  # a batch's objects die young; the collector must not stall a batch for them
    describe: Callable[[], str] = getattr(vad, "describe", lambda: type(vad).__name__)
    conn.send(("ready", describe()))
    scope = Scope("hearing process")
    sessions: dict[int, SessionAudio] = {}
    formats: list[AudioFormat] = []
    while True:
        try:
            count, forget, new_formats = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        for key in forget:
            sessions.pop(key, None)
        formats += new_formats
        rows = np.frombuffer(in_map, np.int64, count * _COLUMNS).reshape(count, _COLUMNS).tolist()
        view = memoryview(in_map)
        work: list[tuple[SessionAudio, list[AudioBytes], bool]] = []
        last = -1
        for key, fmt, offset, size, scoring, denoised in rows:
            segment = AudioBytes(scope, view[offset : offset + size], formats[fmt], time.monotonic())
            if key == last:
                work[-1][1].append(segment)
                continue
            last = key
            audio = sessions.get(key)
            if audio is None:
                audio = sessions[key] = SessionAudio(scope, vad.new_state(), formats[fmt])
            audio.noise = noise if denoised else None
            work.append((audio, [segment], bool(scoring)))
        heard = hear(vad, work)
        lengths = np.array([[len(got.samples), len(got.probabilities)] for got in heard], np.int64)
        out_map[: lengths.nbytes] = lengths.tobytes()
        at = lengths.nbytes
        errors: list[tuple[int, Exception]] = []
        for i, got in enumerate(heard):
            for part in (got.samples, got.probabilities):
                out_map[at : at + 4 * len(part)] = np.ascontiguousarray(part, np.float32).tobytes()
                at += 4 * len(part)
            if got.error is not None:
                errors.append((i, _picklable(got.error)))
        del view
        conn.send((errors, len(sessions)))


def _picklable(exc: Exception) -> Exception:
    """``exc`` as it can cross to the parent: itself where it pickles, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def hearing_for(
    vad: VAD, noise: NoiseReduction | None, enabled: bool, reply_timeout_s: float = REPLY_TIMEOUT_S
) -> tuple[Hearing, HearingProcess | None]:
    """The clock's hearing: a started :class:`HearingProcess` where ``enabled`` and the VAD can be built in a
    child (its ``hearing_recipe`` gives how), else :func:`hear` in this process; and the process, to close at the
    end (None: none). Blocks while the child loads its models."""

    local: Hearing = functools.partial(hear, vad)
    recipe = getattr(vad, "hearing_recipe", None)
    made = recipe() if enabled and recipe is not None else None
    if made is None:
        return local, None
    noise_recipe = getattr(noise, "hearing_recipe", None) if noise is not None else None
    process = HearingProcess(
        made, noise_recipe() if noise_recipe else None, local, vad.chunk_samples, reply_timeout_s=reply_timeout_s
    )
    try:
        process.start()
    except ChildFailed as exc:
        log.warning("hearing in this process: %s", exc)
        return local, None
    return process, process

"""Hearing: every session's new audio decoded, resampled and scored by the VAD, in one batch per tick.

:func:`hear` runs in the VAD's worker thread on what the clock took from
each session's inbox (:class:`AudioBytes`); :class:`SessionAudio` owns one
session's audio on its way there, and what the clock keeps about it between ticks. Nothing here knows
about turns, responses or slots.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from s2s_rt.audio import AudioFormat, AudioFormatError, Resampler
from s2s_rt.budget import ByteBudget
from s2s_rt.engines.base import PIPELINE_RATE, VAD, Denoiser, Float32Array, NoiseReduction
from s2s_rt.scope import Scope

T = TypeVar("T")


@dataclass(slots=True)
class AudioBytes:
    """Input audio as the client sent it (base64 already undone), with its format and arrival time."""

    scope: Scope
    #: A large append is heard in slices: views of its bytes, never copies.
    data: bytes | memoryview
    format: AudioFormat
    received: float = field(default_factory=time.monotonic)
    #: The append's ``event_id``, for an error about it.
    event_id: str | None = None

    def seconds(self) -> float:
        return len(self.data) / (self.format.rate * self.format.bytes_per_sample)

    def split(self, seconds: float) -> tuple[AudioBytes, AudioBytes]:
        """The first ``seconds`` (whole samples, at least one) and the rest, both views of the same bytes.

        The rest counts as received now: that it waits is the slicing's doing, not lateness of the clock
        (an upload's last slice must not read as audio kept waiting since the append arrived).
        """
        step = self.format.bytes_per_sample
        cut = max(step, int(seconds * self.format.rate) * step)
        view = memoryview(self.data)
        return (
            AudioBytes(self.scope, view[:cut], self.format, self.received, self.event_id),
            AudioBytes(self.scope, view[cut:], self.format, time.monotonic(), self.event_id),
        )


_KEYS = itertools.count()


class SessionAudio:
    """One session's audio on its way to the VAD: its inbox and the budget of bytes waiting in it.

    The only owner of the inbox: the receive path puts audio and commands in
    (:meth:`put_audio`, :meth:`put_command`), the listening clock takes them
    out (:meth:`take`, :meth:`heard`, :meth:`commands`), and the session's end
    drops everything (:meth:`close`, :meth:`drop_all`). No one else touches
    the queue or its budget.

    Args:
        scope: the session's scope: once stale, nothing more is heard.
        vad_state: the VAD's state for this session's stream.
        input_format: the format audio arrives in now.
        scoring: whether the VAD scores it (turn detection is on).
        max_waiting_bytes: most bytes of raw audio waiting to be heard: a client that sends faster waits (None:
            no bound, for audio that is not a client's, as in calibration).
    """

    def __init__(
        self,
        scope: Scope,
        vad_state: Any,
        input_format: AudioFormat,
        scoring: bool = True,
        max_waiting_bytes: int | None = None,
    ) -> None:
        self.scope = scope
        #: This session's audio among all, for the hearing process (which keeps its state by it).
        self.key = next(_KEYS)
        self.vad_state = vad_state
        #: Raw audio and commands in arrival order, waiting for the clock.
        self._inbox: collections.deque[Any] = collections.deque()
        #: Bytes of raw audio in the inbox or being heard: taken when put, released when heard.
        self._budget = ByteBudget("input audio", sys.maxsize if max_waiting_bytes is None else max_waiting_bytes)
        self._closed = False
        self.scoring = scoring
        self.format = input_format
        self.resampler = Resampler(input_format.rate, PIPELINE_RATE)
        #: The noise reduction the session asks for (``noise_reduction``); None: heard as sent. Where the audio
        #: is heard (here, or the hearing process), a :attr:`denoiser` is made from it when it first denoises,
        #: kept with its state while the session still asks, and dropped when it no longer does.
        self.noise: NoiseReduction | None = None
        self.denoiser: Denoiser | None = None
        #: Samples not yet a whole VAD window, carried to the next tick.
        self.pending = np.zeros(0, np.float32)

    # --- the receive path ---------------------------------------------------------

    def put_audio(self, item: AudioBytes) -> bool:
        """Queue raw audio to be heard; False (nothing queued) when the bytes waiting are at their limit.

        Audio for a closed session is taken and dropped (True): nothing more is heard of it.
        """
        if self.closed:
            return True
        if not self._budget.try_take(len(item.data)):
            return False
        self._inbox.append(item)
        return True

    async def put_audio_when_room(self, item: AudioBytes, wait_s: float) -> bool:
        """:meth:`put_audio`, waiting up to ``wait_s`` for the audio before it to be heard; False if it was not."""
        try:
            async with asyncio.timeout(wait_s):
                await self._budget.take(len(item.data))
        except TimeoutError:
            return False
        if self.closed:
            self._budget.release(len(item.data))
            return True
        self._inbox.append(item)
        return True

    def put_command(self, item: Any) -> None:
        """Queue a command that must follow the audio before it (dropped once closed)."""
        if not self.closed:
            self._inbox.append(item)

    # --- the listening clock ----------------------------------------------------------

    @property
    def waiting(self) -> bool:
        """Audio or commands wait to be taken."""
        return bool(self._inbox)

    def take(self, allowance_s: float) -> tuple[list[AudioBytes], float]:
        """The leading audio, up to ``allowance_s`` seconds of it (an append larger than that is cut), and its seconds.

        Its bytes stay counted as waiting until :meth:`heard`.
        """
        inbox = self._inbox
        segments: list[AudioBytes] = []
        heard_s = 0.0
        while inbox and isinstance(inbox[0], AudioBytes) and heard_s < allowance_s:
            seg = inbox.popleft()
            seconds = seg.seconds()
            if heard_s + seconds > allowance_s:
                seg, rest = seg.split(allowance_s - heard_s)
                inbox.appendleft(rest)
                seconds = seg.seconds()
            segments.append(seg)
            heard_s += seconds
        return segments, heard_s

    def heard(self, segments: list[AudioBytes]) -> None:
        """``segments``, taken by :meth:`take`, were heard: their bytes no longer wait."""
        self._budget.release(sum(len(s.data) for s in segments))

    def commands(self) -> Iterator[Any]:
        """The commands at the head of the inbox, up to the next audio, each taken as it is given."""
        inbox = self._inbox
        while inbox and not isinstance(inbox[0], AudioBytes):
            yield inbox.popleft()

    def backlog_s(self, now: float) -> float:
        """How long the oldest audio not yet heard has waited."""
        for item in self._inbox:
            if isinstance(item, AudioBytes):
                return now - item.received
        return 0.0

    def inbox_audio_s(self) -> float:
        """Seconds of audio waiting in the inbox."""
        return sum(item.seconds() for item in self._inbox if isinstance(item, AudioBytes))

    # --- the end -------------------------------------------------------------------

    @property
    def waiting_bytes(self) -> int:
        """Bytes of raw audio waiting to be heard (or being heard)."""
        return self._budget.used

    @property
    def limit_bytes(self) -> int:
        return self._budget.limit

    @property
    def closed(self) -> bool:
        """Nothing more is heard: closed (for falling behind, or failing), or its session has ended."""
        return self._closed or self.scope.stale

    def close(self) -> int:
        """Hear nothing more of this session; returns how many waiting items were dropped."""
        self._closed = True
        return self.drop_all()

    def drop_all(self) -> int:
        """Drop every waiting item (a sender waiting for room is woken); returns how many."""
        dropped = len(self._inbox)
        self._inbox.clear()
        self._budget.reset()
        return dropped


class EngineUnavailable(Exception):
    """The VAD call for a whole batch failed: not any one session's doing."""


@dataclass(slots=True)
class Heard:
    """What the worker made of one session's new audio."""

    samples: Float32Array
    probabilities: Float32Array
    error: Exception | None = None


def _resample_each(audio: SessionAudio, segments: list[AudioBytes]) -> Float32Array:
    """A session's new audio whose format changed within it: each piece with the resampler of its format."""
    parts = []
    for seg in segments:
        if seg.format != audio.format:
            audio.format = seg.format
            audio.resampler = Resampler(seg.format.rate, PIPELINE_RATE)
        parts.append(audio.resampler.process(seg.format.decode(seg.data)))
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else NOTHING


NOTHING = np.zeros(0, np.float32)


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)`` and the seconds it took (in the thread that runs it)."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


#: One batch: each session's audio, the segments taken from its inbox, and whether the VAD scores them.
Work = Sequence[tuple[SessionAudio, list[AudioBytes], bool]]
#: How the clock hears a batch: :func:`hear` with a VAD, or :class:`~s2s_rt.listening.remote.HearingProcess`.
Hearing = Callable[[Work], list[Heard]]


def hear(vad: VAD, work: Work) -> list[Heard]:
    """Decode, resample and score every session's new audio (runs in the VAD worker thread).

    The work is done for groups of sessions, not one by one: sessions whose
    new audio has one format and length share one decode and one resampling
    product per phase; those whose unwindowed rest has one length share one
    cut into VAD windows; and all sessions' windows of one step go to the
    VAD in one batched call. A session's own windows are scored in order,
    since the model carries state from one to the next.
    """
    chunk = vad.chunk_samples
    heard: list[Heard | None] = [None] * len(work)
    samples: list[Float32Array] = [NOTHING] * len(work)
    # 1. Decode and resample, a group of one format and byte length at a time.
    same: dict[tuple[AudioFormat, int], list[int]] = {}
    data: list[bytes | memoryview] = [b""] * len(work)
    for i, (ls, segments, _) in enumerate(work):
        fmt = ls.format
        if all(seg.format is fmt or seg.format == fmt for seg in segments):
            data[i] = segments[0].data if len(segments) == 1 else b"".join([seg.data for seg in segments])
            same.setdefault((fmt, len(data[i])), []).append(i)
            continue
        try:
            samples[i] = _resample_each(ls, segments)
        except AudioFormatError as exc:  # checked on arrival; a bug if it happens here
            heard[i] = Heard(NOTHING, NOTHING, exc)
    for (fmt, _), members in same.items():
        try:
            block = fmt.decode(b"".join([data[i] for i in members])).reshape(len(members), -1)
        except AudioFormatError as exc:  # checked on arrival; a bug if it happens here
            for i in members:
                heard[i] = Heard(NOTHING, NOTHING, exc)
            continue
        resampled = Resampler.process_block([work[i][0].resampler for i in members], block)
        for i, out in zip(members, resampled, strict=True):
            samples[i] = out
    # 1b. Denoise, each session that asked for it with its own stream (a failure is that session's alone).
    for i, (ls, _, _) in enumerate(work):
        noise = ls.noise
        if noise is None:
            ls.denoiser = None
        elif heard[i] is None and len(samples[i]):
            try:
                if ls.denoiser is None:
                    ls.denoiser = noise.denoiser()
                samples[i] = ls.denoiser.process(samples[i])
            except Exception as exc:
                heard[i] = Heard(NOTHING, NOTHING, exc)
    # 2. Cut windows, a group of one rest length and one new length at a time.
    cuts: dict[tuple[int, int], list[int]] = {}
    for i, (ls, _, score) in enumerate(work):
        if heard[i] is not None:
            continue
        if not score:
            heard[i] = Heard(samples[i], NOTHING)
            continue
        cuts.setdefault((len(ls.pending), len(samples[i])), []).append(i)
    steps: list[tuple[list[int], Float32Array]] = []  # members, their windows (G, n, chunk)
    for (rest, new), members in cuts.items():
        joined = np.stack([samples[i] for i in members])
        if rest:
            joined = np.concatenate([np.stack([work[i][0].pending for i in members]), joined], axis=1)
        n = (rest + new) // chunk
        probabilities = np.zeros((len(members), n), np.float32)
        for row, i in enumerate(members):
            work[i][0].pending = joined[row, n * chunk :]
            heard[i] = Heard(samples[i], probabilities[row])
        if n:
            steps.append((members, joined[:, : n * chunk].reshape(len(members), n, chunk)))
    # 3. Score: step k holds the k-th window of every session that has one. If a step fails, each of its
    # sessions is scored alone: a failure that one session's audio causes is that session's alone.
    failed: set[int] = set()
    for k in range(max((w.shape[1] for _, w in steps), default=0)):
        now = [(members, w) for members, w in steps if w.shape[1] > k]
        if failed:  # sessions whose audio failed are not scored again
            now = [(m, w[[r for r, i in enumerate(m) if i not in failed]]) for m, w in now]
            now = [([i for i in m if i not in failed], w) for m, w in now if len(w)]
            if not now:
                break
        rows = [i for members, _ in now for i in members]
        chunks = np.concatenate([w[:, k] for _, w in now])
        try:
            probs = vad.speech_probabilities(chunks, [work[i][0].vad_state for i in rows])
        except Exception:
            for j, i in enumerate(rows):
                try:
                    heard[i].probabilities[k] = vad.speech_probabilities(chunks[j : j + 1], [work[i][0].vad_state])[0]  # type: ignore[union-attr]
                except Exception as exc:
                    heard[i].error = exc  # type: ignore[union-attr]
                    failed.add(i)
            continue
        for i, p in zip(rows, probs.tolist(), strict=True):
            heard[i].probabilities[k] = p  # type: ignore[union-attr]
    return heard  # type: ignore[return-value]

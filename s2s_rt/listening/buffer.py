"""A session's uncommitted input audio, held as the chunks it arrived in (views, never copies)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from s2s_rt.engines.base import Float32Array


@dataclass
class InputBuffer:
    """The session's uncommitted input audio at ``PIPELINE_RATE``, clocked from session start.

    Arrays put in are never changed afterwards, so a view of them may be
    handed to a worker thread without a copy.
    """

    start_sample: int = 0
    chunks: list[Float32Array] = field(default_factory=list)
    samples: int = 0

    @property
    def end_sample(self) -> int:
        return self.start_sample + self.samples

    def append(self, x: Float32Array) -> None:
        self.chunks.append(x)
        self.samples += len(x)

    def audio(self) -> Float32Array:
        if len(self.chunks) != 1:
            joined = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
            self.chunks = [joined]
        return self.chunks[0]

    def between(self, start: int, end: int) -> tuple[tuple[Float32Array, ...], int, int]:
        """The chunks holding audio in [start, end), with where it begins and ends in them joined: no copy."""
        return tuple(self.chunks), max(0, start - self.start_sample), max(0, end - self.start_sample)

    def drop_before(self, sample: int) -> None:
        """Forget audio before ``sample``: whole chunks are let go, the first kept one is sliced (no copy)."""
        cut = sample - self.start_sample
        if cut <= 0:
            return
        cut = min(cut, self.samples)
        chunks = self.chunks
        dropped = 0
        i = 0
        while i < len(chunks) and dropped + len(chunks[i]) <= cut:
            dropped += len(chunks[i])
            i += 1
        del chunks[:i]
        if cut > dropped:
            chunks[0] = chunks[0][cut - dropped :]
        self.samples -= cut
        self.start_sample += cut

    def take(self, start: int, end: int) -> Float32Array:
        """Audio in [start, end) (session sample clock); drops everything before ``end``."""
        a = self.audio()
        clip = a[max(0, start - self.start_sample) : max(0, end - self.start_sample)].copy()
        self.drop_before(min(end, self.end_sample))
        return clip

    def clear(self) -> None:
        self.start_sample = self.end_sample
        self.chunks, self.samples = [], 0


def join(chunks: tuple[Float32Array, ...], start: int, end: int) -> Float32Array:
    """The audio in [start, end) of ``chunks`` joined (as :meth:`InputBuffer.between` gave them)."""
    audio = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    return audio[start:end]

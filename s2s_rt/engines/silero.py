"""Silero VAD (v5/v6 ONNX) scoring one 32 ms chunk for many sessions at once."""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime

from s2s_rt.engines.base import PIPELINE_RATE, Float32Array
from s2s_rt.engines.device import CPU_PROVIDER, OnnxProviders, session_options
from s2s_rt.engines.silero_forward import SileroForward, WeightsNotFound

log = logging.getLogger(__name__)

#: Samples per chunk at 16 kHz (the model is trained on exactly this).
CHUNK_SAMPLES = 512
#: Samples of the previous chunk that Silero v5/v6 prepends to each chunk.
CONTEXT_SAMPLES = 64
#: Recurrent state per session: (layers, units); the model takes (layers, batch, units).
_LAYERS, _UNITS = 2, 128
#: The most the batched forward pass may differ from ONNX Runtime, in a probability or a state, at load.
FORWARD_TOLERANCE = 1e-4


class _StateTable:
    """Every session's Silero state in two arrays, one row per session.

    A batch gathers its rows and scatters them back in two array operations,
    whatever the number of sessions, instead of stacking and splitting one
    small array per session. Rows are handed out by :meth:`add` and come back
    when their :class:`SileroState` is garbage (its finalizer). The arrays
    double when full; a batch that gathered before a growth scatters into
    the grown arrays, where its rows keep their indexes.
    """

    def __init__(self, capacity: int = 64) -> None:
        self.recurrent = np.zeros((_LAYERS, capacity, _UNITS), dtype=np.float32)
        self.context = np.zeros((capacity, CONTEXT_SAMPLES), dtype=np.float32)
        self._free = list(range(capacity - 1, -1, -1))
        self._lock = threading.Lock()

    def add(self) -> int:
        with self._lock:
            if not self._free:
                old = len(self.context)
                recurrent = np.zeros((_LAYERS, 2 * old, _UNITS), dtype=np.float32)
                context = np.zeros((2 * old, CONTEXT_SAMPLES), dtype=np.float32)
                recurrent[:, :old] = self.recurrent
                context[:old] = self.context
                self.recurrent, self.context = recurrent, context
                self._free = list(range(2 * old - 1, old - 1, -1))
            row = self._free.pop()
            self.recurrent[:, row] = 0.0
            self.context[row] = 0.0
            return row

    def remove(self, row: int) -> None:
        with self._lock:
            self._free.append(row)

    def gather(self, rows: npt.NDArray[np.intp]) -> tuple[Float32Array, Float32Array]:
        with self._lock:
            return self.recurrent[:, rows], self.context[rows]

    def scatter(self, rows: npt.NDArray[np.intp], recurrent: Float32Array, context: Float32Array) -> None:
        with self._lock:
            self.recurrent[:, rows] = recurrent
            self.context[rows] = context


class SileroState:
    """One session's row in the engine's state table (the LSTM state and the last 64 samples heard)."""

    __slots__ = ("__weakref__", "_table", "row")

    def __init__(self, table: _StateTable) -> None:
        self._table = table
        self.row = table.add()
        weakref.finalize(self, table.remove, self.row)


class SileroVAD:
    """Speech probability per 32 ms chunk from the Silero VAD ONNX model.

    The engine holds only the model; each session keeps a :class:`SileroState`.
    Chunks of many sessions are scored in one batched inference, which costs
    little more than scoring one.

    Args:
        model_path: ``silero_vad.onnx`` (v5 or v6: inputs ``input``,
            ``state``, ``sr``).
        providers: ONNX Runtime providers, best first (CPU when None).
        intra_threads: threads one inference may use.
        batched_forward: on the CPU, score with :class:`~s2s_rt.engines.silero_forward.SileroForward`
            (about half the CPU per window in batches of 32 or more), checked against ONNX Runtime at load.
    """

    chunk_samples = CHUNK_SAMPLES

    def __init__(
        self,
        model_path: Path,
        *,
        providers: OnnxProviders | None = None,
        intra_threads: int = 1,
        batched_forward: bool = True,
    ) -> None:
        self.model_path = Path(model_path)
        self._session = onnxruntime.InferenceSession(
            str(self.model_path),
            sess_options=session_options(intra_threads),
            providers=providers or [CPU_PROVIDER],
        )
        self.providers: list[str] = self._session.get_providers()
        self._sample_rate = np.array(PIPELINE_RATE, dtype=np.int64)
        self._states = _StateTable()
        #: The batched numpy forward pass, where it runs on the CPU and agrees with ONNX Runtime.
        self._forward: SileroForward | None = None
        if self.providers == [CPU_PROVIDER] and batched_forward:
            self._forward = self._checked_forward()

    def _checked_forward(self) -> SileroForward | None:
        """:class:`SileroForward` if it reads this model's weights and scores 40 windows of a chain (noise and
        a tone, state carried) as ONNX Runtime does; None (ONNX Runtime alone, and why in the log) otherwise."""
        try:
            forward = SileroForward.from_onnx(self.model_path)
        except WeightsNotFound as exc:
            log.info("VAD: ONNX Runtime alone (%s)", exc)
            return None
        rng = np.random.default_rng(0)
        tone = np.sin(np.arange(40 * CHUNK_SAMPLES) * 0.07).reshape(40, CHUNK_SAMPLES)
        chunks = np.stack([tone * 0.5, rng.standard_normal(tone.shape) * 0.1]).astype(np.float32)  # (2, 40, 512)
        ours = theirs = np.zeros((_LAYERS, 2, _UNITS), np.float32)
        context = np.zeros((2, CONTEXT_SAMPLES), np.float32)
        worst = 0.0
        for k in range(chunks.shape[1]):
            window = np.concatenate([context, chunks[:, k]], axis=1)
            context = window[:, -CONTEXT_SAMPLES:]
            mine, ours = forward(window, ours)
            reference, theirs = self._session.run(None, {"input": window, "state": theirs, "sr": self._sample_rate})
            scale = 1.0 + np.abs(theirs)  # the cell state grows in a long tone: compared relative to its size
            worst = max(worst, float(np.abs(mine - reference).max()), float((np.abs(ours - theirs) / scale).max()))
        if worst > FORWARD_TOLERANCE:
            log.warning("VAD: ONNX Runtime alone (the batched forward pass differs by %.2g)", worst)
            return None
        return forward

    def hearing_recipe(self) -> functools.partial[SileroVAD] | None:
        """How to build this VAD again in the hearing process (:mod:`s2s_rt.listening.remote`): on the CPU only
        (a GPU's memory and streams stay with the one process that owns them); None elsewhere."""
        if self.providers != [CPU_PROVIDER]:
            return None
        return functools.partial(SileroVAD, self.model_path, batched_forward=self._forward is not None)

    def describe(self) -> str:
        """One line for the start-up log."""
        how = ", batched in numpy" if self._forward is not None else ""
        return f"VAD Silero {self.model_path} on {', '.join(self.providers)}{how}"

    def new_state(self) -> SileroState:
        """Return fresh per-session state (kept by the slot, not the engine)."""
        return SileroState(self._states)

    def speech_probabilities(self, chunks: Float32Array, states: Sequence[SileroState]) -> Float32Array:
        """Score one chunk for each of B sessions in one batched inference.

        Args:
            chunks: shape ``(B, 512)``, float32 in [-1, 1], one row per session.
            states: the B sessions' states, in the same order; updated in place.

        Returns:
            shape ``(B,)``: the probability that each chunk is speech.

        Raises:
            ValueError: the shapes of ``chunks`` and ``states`` do not match.
        """
        chunks = np.asarray(chunks, dtype=np.float32)
        if chunks.ndim != 2 or chunks.shape[1] != CHUNK_SAMPLES:
            raise ValueError(f"chunks must have shape (B, {CHUNK_SAMPLES}), got {chunks.shape}")
        batch = chunks.shape[0]
        if batch != len(states):
            raise ValueError(f"{batch} chunks but {len(states)} states")
        if batch == 0:
            return np.zeros(0, dtype=np.float32)
        rows = np.fromiter((state.row for state in states), dtype=np.intp, count=batch)
        recurrent, contexts = self._states.gather(rows)
        model_input = np.concatenate([contexts, chunks], axis=1)
        if self._forward is not None:
            probabilities, new_recurrent = self._forward(model_input, recurrent)
        else:
            probabilities, new_recurrent = self._session.run(
                None, {"input": model_input, "state": recurrent, "sr": self._sample_rate}
            )
        self._states.scatter(rows, new_recurrent, model_input[:, -CONTEXT_SAMPLES:])
        return np.asarray(probabilities, dtype=np.float32).reshape(batch)

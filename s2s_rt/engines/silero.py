"""Silero VAD (v5/v6 ONNX) scoring one 32 ms chunk for many sessions at once."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime

from s2s_rt.engines.base import PIPELINE_RATE, Float32Array
from s2s_rt.engines.device import CPU_PROVIDER, OnnxProviders, session_options

#: Samples per chunk at 16 kHz (the model is trained on exactly this).
CHUNK_SAMPLES = 512
#: Samples of the previous chunk that Silero v5/v6 prepends to each chunk.
CONTEXT_SAMPLES = 64
#: Shape of the recurrent state for one session: (layers, batch, units).
_STATE_SHAPE = (2, 1, 128)


class SileroState:
    """What one session's VAD remembers between chunks.

    Attributes:
        recurrent: the LSTM state, shape ``(2, 1, 128)``.
        context: the last 64 samples of the previous chunk.
    """

    __slots__ = ("context", "recurrent")

    def __init__(self) -> None:
        self.recurrent = np.zeros(_STATE_SHAPE, dtype=np.float32)
        self.context = np.zeros(CONTEXT_SAMPLES, dtype=np.float32)

    def reset(self) -> None:
        """Forget everything, as at the start of a new session."""
        self.recurrent.fill(0.0)
        self.context.fill(0.0)


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
    """

    chunk_samples = CHUNK_SAMPLES

    def __init__(
        self,
        model_path: Path,
        *,
        providers: OnnxProviders | None = None,
        intra_threads: int = 1,
    ) -> None:
        self.model_path = Path(model_path)
        self._session = onnxruntime.InferenceSession(
            str(self.model_path),
            sess_options=session_options(intra_threads),
            providers=providers or [CPU_PROVIDER],
        )
        self.providers: list[str] = self._session.get_providers()
        self._sample_rate = np.array(PIPELINE_RATE, dtype=np.int64)

    def describe(self) -> str:
        """One line for the start-up log."""
        return f"VAD Silero {self.model_path} on {', '.join(self.providers)}"

    def new_state(self) -> SileroState:
        """Return fresh per-session state (kept by the slot, not the engine)."""
        return SileroState()

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
        contexts = np.stack([state.context for state in states])
        model_input = np.concatenate([contexts, chunks], axis=1)
        recurrent = np.concatenate([state.recurrent for state in states], axis=1)
        probabilities, new_recurrent = self._session.run(
            None, {"input": model_input, "state": recurrent, "sr": self._sample_rate}
        )
        for i, state in enumerate(states):
            state.recurrent = np.ascontiguousarray(new_recurrent[:, i : i + 1, :])
            state.context = model_input[i, -CONTEXT_SAMPLES:].copy()
        return np.asarray(probabilities, dtype=np.float32).reshape(batch)

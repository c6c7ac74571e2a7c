"""Silero VAD's 16 kHz forward pass in numpy, batched as a few large matrix products.

ONNX Runtime runs Silero's convolutions one session at a time: each window
is four STFT frames, so every convolution is a product with four columns,
and a batch of 100 windows costs 110 µs each on an AVX2 core. Here the STFT
is a real FFT (its basis is a Hann-windowed DFT), and the frames of every
window in the batch go through each later layer as one matrix product (the
encoder's taps, the LSTM cell's gates), with the same results to about 1e-6
(checked against ONNX Runtime at every load; see
:class:`~s2s_rt.engines.silero.SileroVAD`).

The weights are read from the packaged ``silero_vad.onnx`` itself (v5/v6:
the 16 kHz branch of its top ``If``) with a small reader of protobuf's wire
format; the ``onnx`` package is not needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

from s2s_rt.blas import blas_on_one_thread

Float32Array = npt.NDArray[np.float32]

#: The 16 kHz branch's weights by the end of their names in the exported graph, and their shapes.
WEIGHTS: dict[str, tuple[int, ...]] = {
    "stft.forward_basis_buffer": (258, 1, 256),
    "encoder.0.reparam_conv.weight": (128, 129, 3),
    "encoder.0.reparam_conv.bias": (128,),
    "encoder.1.reparam_conv.weight": (64, 128, 3),
    "encoder.1.reparam_conv.bias": (64,),
    "encoder.2.reparam_conv.weight": (64, 64, 3),
    "encoder.2.reparam_conv.bias": (64,),
    "encoder.3.reparam_conv.weight": (128, 64, 3),
    "encoder.3.reparam_conv.bias": (128,),
    "decoder.rnn.weight_ih": (512, 128),
    "decoder.rnn.weight_hh": (512, 128),
    "decoder.rnn.bias_ih": (512,),
    "decoder.rnn.bias_hh": (512,),
    "decoder.decoder.2.weight": (1, 128, 1),
    "decoder.decoder.2.bias": (1,),
}
#: The prefix the exporter gave the 16 kHz branch (``sr == 16000`` selects the ``If``'s then-branch).
BRANCH_16K = "then_branch"
_FLOAT, _PAD = 1, 64
#: The STFT: frames of 256 samples every 128, 129 frequency bins.
_FRAME, _HOP, _BINS = 256, 128, 129


class WeightsNotFound(ValueError):
    """The model file does not hold the weights this forward pass expects (another Silero version)."""


# --- protobuf's wire format, as much of ONNX's ModelProto as the weights need ------------------------


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of one message: varints as ints, everything else as bytes."""
    i, end = 0, len(buf)
    while i < end:
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield number, value
        elif wire == 2:
            size, i = _varint(buf, i)
            yield number, buf[i : i + size]
            i += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            yield number, buf[i : i + width]
            i += width
        else:
            raise WeightsNotFound(f"unexpected protobuf wire type {wire}")


def _tensor(buf: bytes) -> tuple[str, Float32Array | None]:
    """A TensorProto: its name and, for float32 tensors, its values."""
    dims: list[int] = []
    name, kind, raw, floats = "", 0, b"", b""
    for number, value in _fields(buf):
        if number == 1:
            if isinstance(value, int):
                dims.append(value)
            else:  # packed
                j = 0
                while j < len(value):
                    d, j = _varint(value, j)
                    dims.append(d)
        elif number == 2 and isinstance(value, int):
            kind = value
        elif number == 4 and isinstance(value, bytes):
            floats += value
        elif number == 8 and isinstance(value, bytes):
            name = value.decode()
        elif number == 9 and isinstance(value, bytes):
            raw = value
    if kind != _FLOAT:
        return name, None
    return name, np.frombuffer(raw or floats, dtype="<f4").reshape(dims).astype(np.float32)


def _graph_tensors(buf: bytes, out: dict[str, Float32Array]) -> None:
    """Every float tensor of a GraphProto: initializers, Constant nodes' values, and those of subgraphs."""
    for number, value in _fields(buf):
        if not isinstance(value, bytes):
            continue
        if number == 5:  # initializer
            name, array = _tensor(value)
            if array is not None:
                out[name] = array
        elif number == 1:  # node
            outputs, attributes = [], []
            for n, v in _fields(value):
                if n == 2 and isinstance(v, bytes):
                    outputs.append(v.decode())
                elif n == 5 and isinstance(v, bytes):
                    attributes.append(v)
            for attribute in attributes:
                for n, v in _fields(attribute):
                    if n == 5 and isinstance(v, bytes) and outputs:  # t: a Constant's value
                        _, array = _tensor(v)
                        if array is not None:
                            out[outputs[0]] = array
                    elif n == 6 and isinstance(v, bytes):  # g: a subgraph
                        _graph_tensors(v, out)


def read_weights(model_path: Path) -> dict[str, Float32Array]:
    """The 16 kHz weights of a Silero v5/v6 ONNX file, by the names of :data:`WEIGHTS`.

    Raises:
        WeightsNotFound: one is missing or has another shape.
    """
    tensors: dict[str, Float32Array] = {}
    for number, value in _fields(Path(model_path).read_bytes()):
        if number == 7 and isinstance(value, bytes):  # ModelProto.graph
            _graph_tensors(value, tensors)
    found = {}
    for suffix, shape in WEIGHTS.items():
        names = [n for n in tensors if n.endswith(suffix) and BRANCH_16K in n]
        if len(names) != 1 or tensors[names[0]].shape != shape:
            raise WeightsNotFound(f"{model_path}: no single 16 kHz {suffix} of shape {shape}")
        found[suffix] = tensors[names[0]]
    return found


# --- the forward pass ---------------------------------------------------------------------------------


def _sigmoid(x: Float32Array) -> Float32Array:
    # Past ±80 the float32 result is 0 or 1 anyway; clipped, exp never overflows (a full-scale square wave
    # drives the LSTM's gates that far).
    np.clip(x, -80.0, 80.0, out=x)
    np.negative(x, out=x)
    np.exp(x, out=x)
    x += 1.0
    return np.reciprocal(x, out=x)


class SileroForward:
    """Silero's 16 kHz model as matrix products over a batch: ``(B, 576)`` windows with their 64-sample
    context, and states ``(2, B, 128)``, to probabilities ``(B, 1)`` and the new states."""

    def __init__(self, weights: dict[str, Float32Array]) -> None:
        # The STFT's basis is a Hann-windowed DFT (cosines, then negated sines): a real FFT computes it.
        self._window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(_FRAME) / _FRAME)).astype(np.float32)
        turns = 2 * np.pi * np.outer(np.arange(_BINS), np.arange(_FRAME)) / _FRAME
        dft = np.concatenate([np.cos(turns), -np.sin(turns)]) * self._window
        if not np.allclose(weights["stft.forward_basis_buffer"][:, 0, :], dft, atol=1e-5):
            raise WeightsNotFound("the STFT's basis is not a Hann-windowed DFT of 256 samples")

        def taps(index: int) -> Float32Array:  # (out, in, 3) -> (3 * in, out), tap by tap
            w = weights[f"encoder.{index}.reparam_conv.weight"]
            return np.ascontiguousarray(w.transpose(2, 1, 0).reshape(-1, w.shape[0]))

        self._e0 = np.ascontiguousarray(np.concatenate(np.split(taps(0), 3), axis=1))  # (129, 384): taps side by side
        self._e1 = taps(1)  # (384, 64)
        self._e2 = taps(2)[64:]  # (128, 64): a single output, whose left tap sees only padding
        self._e3 = np.ascontiguousarray(weights["encoder.3.reparam_conv.weight"][:, :, 1].T)  # (64, 128)
        self._b = [weights[f"encoder.{i}.reparam_conv.bias"] for i in range(4)]
        self._gates = np.ascontiguousarray(
            np.concatenate([weights["decoder.rnn.weight_ih"].T, weights["decoder.rnn.weight_hh"].T])
        )  # (256, 512)
        self._gate_bias = weights["decoder.rnn.bias_ih"] + weights["decoder.rnn.bias_hh"]
        self._out = np.ascontiguousarray(weights["decoder.decoder.2.weight"][0])  # (128, 1)
        self._out_bias = weights["decoder.decoder.2.bias"]

    @classmethod
    def from_onnx(cls, model_path: Path) -> SileroForward:
        return cls(read_weights(model_path))

    def __call__(self, windows: Float32Array, state: Float32Array) -> tuple[Float32Array, Float32Array]:
        blas_on_one_thread()
        b = windows.shape[0]
        padded = np.empty((b, 640), np.float32)
        padded[:, :576] = windows
        padded[:, 576:] = windows[:, -2 : -2 - _PAD : -1]  # reflected
        blocks = padded.reshape(b, 5, _HOP)
        frames = np.concatenate([blocks[:, :4], blocks[:, 1:]], axis=2)  # (b, 4, 256): blocks k and k + 1
        frames *= self._window
        magnitude = np.abs(np.fft.rfft(frames, axis=-1))  # (b, 4, 129), float32
        # Encoder 0: kernel 3, padding 1, four frames in and out.
        t = (magnitude.reshape(b * 4, 129) @ self._e0).reshape(b, 4, 3, 128)
        h0 = t[:, :, 1] + self._b[0]
        h0[:, 1:] += t[:, :-1, 0]
        h0[:, :-1] += t[:, 1:, 2]
        np.maximum(h0, 0.0, out=h0)
        # Encoder 1: stride 2, outputs centred on frames 0 and 2.
        h1 = np.empty((b, 2, 64), np.float32)
        h1[:, 0] = h0[:, :2].reshape(b, 256) @ self._e1[128:]
        h1[:, 1] = h0[:, 1:].reshape(b, 384) @ self._e1
        h1 += self._b[1]
        np.maximum(h1, 0.0, out=h1)
        # Encoder 2 (stride 2, one output) and 3 (one frame: only the centre tap sees it).
        h2 = h1.reshape(b, 128) @ self._e2
        h2 += self._b[2]
        np.maximum(h2, 0.0, out=h2)
        h3 = h2 @ self._e3
        h3 += self._b[3]
        np.maximum(h3, 0.0, out=h3)
        # The LSTM cell (gates i, f, g, o), then ReLU, a 1x1 convolution and the sigmoid.
        gates = np.concatenate([h3, state[0]], axis=1) @ self._gates
        gates += self._gate_bias
        _sigmoid(gates[:, :256])
        _sigmoid(gates[:, 384:])
        np.tanh(gates[:, 256:384], out=gates[:, 256:384])
        cell = gates[:, 128:256] * state[1]
        cell += gates[:, :128] * gates[:, 256:384]
        hidden = np.tanh(cell) * gates[:, 384:]
        new_state = np.stack([hidden, cell])
        np.maximum(hidden, 0.0, out=hidden)
        probability = hidden @ self._out
        probability += self._out_bias
        return _sigmoid(probability), new_state

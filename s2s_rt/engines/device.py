"""Where inference runs: CPU or a CUDA GPU, for ONNX Runtime and CTranslate2.

``auto`` picks CUDA only when it really works. Both runtimes advertise CUDA
more eagerly than they can deliver: ``onnxruntime-gpu`` lists
``CUDAExecutionProvider`` on machines without a GPU (and then silently runs
on the CPU), so a provider counts as working only once a session created
with it keeps it. CTranslate2 is asked how many CUDA devices it can open.

The two runtimes are judged separately: a GPU whose CUDA libraries suit
CTranslate2 but not this ONNX Runtime build still runs STT and the LLM (the
heavy stages) on CUDA, with VAD and TTS on the CPU.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import ctranslate2
import onnxruntime

from s2s_rt.cpuinfo import cpu_flags

logger = logging.getLogger(__name__)

#: What ``providers=`` of an ``onnxruntime.InferenceSession`` accepts: names,
#: or (name, options) pairs such as ``("CUDAExecutionProvider", {"device_id": "1"})``.
OnnxProviders = list[str | tuple[str, dict[str, Any]]]

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
# ONNX Runtime's own default (warnings and above); it offers no getter.
_ORT_DEFAULT_SEVERITY = 2


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    """The devices the engines will use, and why, for the start-up log."""

    #: What the configuration asked for: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    requested: str
    #: Where CTranslate2 (STT, LLM) runs: ``cpu`` or ``cuda``.
    kind: str
    #: CUDA device index (0 on the CPU).
    index: int
    #: Whether ONNX Runtime (VAD, TTS) runs on that CUDA device too.
    onnx_cuda: bool
    #: Why this was chosen (shown at start-up).
    reason: str

    @property
    def name(self) -> str:
        """``cpu`` or ``cuda:N``: where CTranslate2 runs."""
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def onnx_providers(self) -> OnnxProviders:
        """Providers for ONNX Runtime sessions, best first, CPU always last."""
        if not self.onnx_cuda:
            return [CPU_PROVIDER]
        return [(CUDA_PROVIDER, {"device_id": str(self.index)}), CPU_PROVIDER]

    @property
    def ct2_device(self) -> tuple[str, int]:
        """``(device, device_index)`` for CTranslate2 models."""
        return self.kind, self.index

    def ct2_compute_type(self, *, quantized: bool = False) -> str:
        """The CTranslate2 compute type to load weights with (see :func:`ct2_compute_type`)."""
        return ct2_compute_type(self.kind, index=self.index, quantized=quantized)

    def describe(self) -> str:
        """One line for the start-up log."""
        onnx = f"cuda:{self.index}" if self.onnx_cuda else "cpu"
        return f"device {self.requested!r}: CTranslate2 on {self.name}, ONNX Runtime on {onnx} ({self.reason})"


def resolve_device(device: str) -> DeviceChoice:
    """Decide where inference runs.

    Args:
        device: ``auto`` (CUDA if it really works, else CPU), ``cpu``,
            ``cuda`` (device 0) or ``cuda:N``.

    Returns:
        The choice, with the reason to log at start-up. On CUDA, ONNX
        Runtime falls back to the CPU alone when its CUDA provider does not
        load; CTranslate2 decides the device.

    Raises:
        ValueError: ``device`` is not one of the accepted forms.
        RuntimeError: CUDA was asked for explicitly but CTranslate2 cannot use it.
    """
    requested = device.strip().lower()
    if requested == "cpu":
        return DeviceChoice(requested, "cpu", 0, False, "CPU requested")
    index = 0 if requested == "auto" else _parse_cuda_index(requested)
    ct2_problem = _ct2_cuda_problem(index)
    if ct2_problem is not None:
        if requested == "auto":
            return DeviceChoice(requested, "cpu", 0, False, f"no usable CUDA: {ct2_problem}")
        raise RuntimeError(f"device {device!r} was requested but {ct2_problem}")
    onnx_problem = _onnx_cuda_problem(index)
    if onnx_problem is None:
        return DeviceChoice(requested, "cuda", index, True, "CUDA works in both runtimes")
    logger.warning("ONNX Runtime stays on the CPU: %s", onnx_problem)
    return DeviceChoice(requested, "cuda", index, False, f"ONNX Runtime: {onnx_problem}")


def onnx_providers(device: str) -> OnnxProviders:
    """ONNX Runtime providers for ``device`` (see :func:`resolve_device`)."""
    return resolve_device(device).onnx_providers


def ct2_device(device: str) -> tuple[str, int]:
    """CTranslate2 ``(device, device_index)`` for ``device`` (see :func:`resolve_device`)."""
    return resolve_device(device).ct2_device


def ct2_compute_type(kind: str, *, index: int = 0, quantized: bool = False) -> str:
    """The CTranslate2 compute type for a device kind (``cpu`` or ``cuda``).

    Args:
        kind: ``cpu`` or ``cuda``.
        index: the CUDA device, whose capabilities decide the fallbacks.
        quantized: the LLM's weights: on CUDA, prefer ``int8_float16`` to ``float16``; on a CPU that
            multiplies int8 slowly (:func:`multiplies_int8_fast`), ``float32``.

    Returns:
        The first of the preferred types that the device supports.
    """
    if kind == "cpu":
        preferred = ["int8", "int8_float32", "float32"]
        if quantized and not multiplies_int8_fast():
            preferred = ["float32", *preferred]
    elif quantized:
        preferred = ["int8_float16", "int8_bfloat16", "int8_float32", "float16", "float32"]
    else:
        preferred = ["float16", "bfloat16", "float32"]
    supported = ctranslate2.get_supported_compute_types(kind, index)
    return next((t for t in preferred if t in supported), "default")


#: x86 flags of an int8 dot-product instruction (AVX-512 VNNI, AVX-VNNI, AMX).
INT8_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


@functools.cache
def multiplies_int8_fast(cpuinfo: str | None = None) -> bool:
    """Whether CTranslate2's int8 matrix products pay on this CPU: not on an x86 CPU without VNNI or AMX.

    There (AVX2 only, as on many AMD EPYC cloud cores) oneDNN's int8 kernels read a prompt at half the speed of
    float32 (the default model: 23 ms a token against 12, 2-core AMD EPYC) and read it differently in pieces,
    so no model state can be kept between answers (:mod:`.kept_state`). In float32 the LLM reads only the new
    turn, for about four times the weights' memory (BENCHMARKS.md, "The LLM in float32 where int8 is slow").
    Other CPUs (ARM's own kernels) keep int8.

    Args:
        cpuinfo: ``/proc/cpuinfo``'s text (read when None).
    """
    flags = cpu_flags(cpuinfo)
    return flags is None or bool(INT8_DOT_PRODUCT_FLAGS & flags)


def session_options(intra_threads: int) -> onnxruntime.SessionOptions:
    """ONNX Runtime options for one engine's session.

    Args:
        intra_threads: threads one inference may use.

    Returns:
        Options with one inter-op thread (these graphs are sequential) and,
        when more than one intra-op thread is used, no spin-waiting: idle
        spinning threads would steal cores from the other stages.
    """
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = intra_threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if intra_threads > 1:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _parse_cuda_index(device: str) -> int:
    if device == "cuda":
        return 0
    prefix, _, number = device.partition(":")
    if prefix == "cuda" and number.isdigit():
        return int(number)
    raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")


@functools.cache
def _ct2_cuda_problem(index: int) -> str | None:
    """Why CTranslate2 cannot use CUDA device ``index``, or None when it can."""
    try:
        count = ctranslate2.get_cuda_device_count()
    except Exception as exc:  # a broken CUDA install raises rather than answering 0
        return f"CTranslate2 cannot query CUDA ({exc})"
    if count <= index:
        return f"CTranslate2 sees {count} CUDA device(s)"
    return None


@functools.cache
def _onnx_cuda_problem(index: int) -> str | None:
    """Why ONNX Runtime cannot use CUDA device ``index``, or None when it can."""
    if CUDA_PROVIDER not in onnxruntime.get_available_providers():
        return "this ONNX Runtime build has no CUDA provider"
    # A failed attempt logs errors through the default logger; the reason
    # returned here says it once, in words.
    onnxruntime.set_default_logger_severity(4)
    try:
        session = onnxruntime.InferenceSession(
            _IDENTITY_MODEL, providers=[(CUDA_PROVIDER, {"device_id": str(index)}), CPU_PROVIDER]
        )
    except Exception as exc:
        return f"its CUDA provider fails to start ({exc})"
    finally:
        onnxruntime.set_default_logger_severity(_ORT_DEFAULT_SEVERITY)
    if CUDA_PROVIDER not in session.get_providers():
        return "its CUDA provider does not load (CUDA or cuDNN libraries missing or of another version)"
    return None


def _protobuf_field(number: int, payload: bytes | int) -> bytes:
    """One protobuf field: a varint when ``payload`` is an int, else length-delimited."""

    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            byte = value & 0x7F
            value >>= 7
            out.append(byte | (0x80 if value else 0))
            if not value:
                return bytes(out)

    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def _identity_model() -> bytes:
    """A one-node ONNX model (float[1] -> Identity -> float[1]) to probe providers with.

    Written as protobuf by hand so that probing needs neither the ``onnx``
    package nor a model file on disk.
    """
    f = _protobuf_field
    tensor_type = f(1, f(1, 1) + f(2, f(1, f(1, 1))))  # elem_type FLOAT, shape [1]

    def value_info(name: bytes) -> bytes:
        return f(1, name) + f(2, tensor_type)

    node = f(1, b"x") + f(2, b"y") + f(4, b"Identity")
    graph = f(1, node) + f(2, b"probe") + f(11, value_info(b"x")) + f(12, value_info(b"y"))
    # ModelProto: ir_version 7, graph, opset_import {domain "", version 13}
    return f(1, 7) + f(7, graph) + f(8, f(1, b"") + f(2, 13))


_IDENTITY_MODEL = _identity_model()

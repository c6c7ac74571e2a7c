"""The four engine interfaces every stack implements.

Every method here is a plain blocking call. The pipeline runs them in the
shared, bounded inference executor, never on the event loop. Engines hold
model weights and are shared by every slot of the process, so they keep no
per-session state: what a session needs between calls (the VAD's recurrent
state) is created by the engine and kept by the slot.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

Float32Array = npt.NDArray[np.float32]

#: Sample rate of the audio the pipeline feeds to VAD and STT.
PIPELINE_RATE = 16_000


def ms_to_samples(ms: float) -> int:
    """Samples of pipeline audio in ``ms`` milliseconds (rounded)."""
    return round(ms * PIPELINE_RATE / 1000)


def samples_to_ms(n: int) -> float:
    """Milliseconds of ``n`` samples of pipeline audio."""
    return n * 1000 / PIPELINE_RATE


#: Returns True once the work that asked for a stream is stale
#: (cancelled, barged in, or its session ended). Streaming engines call it
#: between pieces and stop early when it answers True. Thread-safe.
StopCheck = Callable[[], bool]


class VAD(Protocol):
    """Voice activity detection over fixed-size chunks at ``PIPELINE_RATE``."""

    #: Samples per chunk (512 at 16 kHz for Silero: 32 ms).
    chunk_samples: int

    def new_state(self) -> Any:
        """Return fresh per-session state (kept by the slot, not the engine)."""
        ...

    def speech_probabilities(self, chunks: Float32Array, states: Sequence[Any]) -> Float32Array:
        """Score one chunk for each of B sessions in one batched call.

        Args:
            chunks: shape ``(B, chunk_samples)``, float32 in [-1, 1].
            states: B per-session states from :meth:`new_state`, updated in place.

        Returns:
            shape ``(B,)``: the probability that each chunk is speech.
        """
        ...


@dataclass(slots=True)
class Transcript:
    text: str
    language: str | None = None


class STT(Protocol):
    """Speech to text over a whole committed utterance."""

    def transcribe(self, audio: Float32Array, *, language: str | None = None, prompt: str | None = None) -> Transcript:
        """Transcribe float32 mono audio at ``PIPELINE_RATE``.

        ``language`` None means detect it; ``prompt`` biases the decoder.
        """
        ...


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """A function call the assistant made: which function, with what, and the id its result answers."""

    name: str
    #: The arguments as the JSON object text the call carries.
    arguments: str
    call_id: str | None = None

    def same_as(self, other: FunctionCall) -> bool:
        """Whether ``other`` asks the same function for the same thing (arguments equal as JSON;
        strings compared without case or surrounding spaces)."""
        return self.name == other.name and _comparable(self.arguments) == _comparable(other.arguments)


def _comparable(arguments: str) -> Any:
    def fold(value: Any) -> Any:
        if isinstance(value, str):
            return value.strip().casefold()
        if isinstance(value, dict):
            return {k: fold(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fold(v) for v in value]
        return value

    try:
        return fold(json.loads(arguments))
    except ValueError:
        return arguments


@dataclass(frozen=True, slots=True)
class SharedImage:
    """An image in the conversation (``input_image``): a PNG or JPEG data URI, checked, and its ``detail``."""

    url: str
    detail: str = "auto"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of the conversation a chat model reads.

    A function call is an ``assistant`` message whose content is the call
    as the model writes it (:func:`s2s_rt.toolcalls.frame`) and whose
    ``call`` says what it is; its result is a ``tool`` message whose
    ``answers`` names that call. A chat format renders the pair as suits its
    model (:mod:`s2s_rt.engines.chat_formats`); a remote endpoint gets them
    as native tool calls.
    """

    role: str  # "system" | "user" | "assistant" | "tool" (a function's result)
    content: str
    #: An assistant message that is a function call: the call.
    call: FunctionCall | None = None
    #: A tool message: the call it is the result of (None: a result whose call is gone).
    answers: FunctionCall | None = None
    #: A user message: the images shared with it (``input_image``), in order.
    images: tuple[SharedImage, ...] = ()

    def shown_without_images(self) -> str:
        """The text, telling a model that cannot see where images were shared (its system text says it cannot see)."""
        if not self.images:
            return self.content
        shared = "an image" if len(self.images) == 1 else f"{len(self.images)} images"
        note = f"[{shared} attached, which you cannot see]"
        return f"{self.content}\n\n{note}" if self.content else note


@dataclass(slots=True)
class LLMUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    #: Of the input tokens, those whose model state was kept from before (not read again).
    cached_tokens: int = 0
    #: ``perf_counter()`` when the answer first took its place in a call into the model (after its wait for a
    #: free one): the turn log's ``boarded`` step. None where the engine does not say (a remote LLM).
    boarded: float | None = None


@dataclass(frozen=True, slots=True)
class FirstWordsPause:
    """Where an answer pauses while its first words are made into speech, and until when.

    On two cores the model's threads and the speech synthesiser's would
    share the cores while the user waits for the first clause's speech; the
    model pauses instead, right after the token that ends that clause.
    Both checks are called from the model's thread.
    """

    #: Fed the answer's text piece by piece as the model writes it: True at the piece that ends the first clause.
    ends_first_clause: Callable[[str], bool]
    #: True once that clause's speech is made (or no longer wanted): the model goes on.
    spoken: Callable[[], bool]


@dataclass(frozen=True, slots=True)
class LLMRequest:
    """What a chat model is asked, as one value: every engine's ``stream`` takes it.

    Two requests are equal when they would make the same answer: an answer
    begun ahead of a turn's end is adopted only by a response whose request
    is equal (:mod:`s2s_rt.pipeline.anticipation`).
    """

    messages: tuple[ChatMessage, ...]
    #: Most tokens the answer may have.
    max_tokens: int
    temperature: float
    #: Realtime function definitions (name, description, parameters) the model may call.
    tools: tuple[dict[str, Any], ...] = ()
    #: The model must call one of ``tools`` (``tool_choice`` ``required`` or a named function).
    require_tool: bool = False

    @classmethod
    def of(
        cls,
        messages: Sequence[ChatMessage],
        *,
        max_tokens: int,
        temperature: float,
        tools: Sequence[dict[str, Any]] = (),
        require_tool: bool = False,
    ) -> LLMRequest:
        return cls(tuple(messages), max_tokens, temperature, tuple(tools), require_tool)


class LLM(Protocol):
    """A chat model that streams its answer."""

    def stream(self, request: LLMRequest, *, should_stop: StopCheck, usage: LLMUsage) -> Iterator[str]:
        """Yield the answer as text pieces (detokenised, in order).

        Checks ``should_stop`` between tokens and returns early when it is
        True. Fills ``usage`` as it goes (input tokens before the first piece).

        The request's ``tools`` are shown to the model in its chat
        template's tools section; it calls one by writing
        ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``
        (:func:`s2s_rt.toolcalls.frame`), which the server parses out of the
        stream. ``require_tool`` tells the model it must call one. A message
        with role ``tool`` carries a function's result back.
        """
        ...


@runtime_checkable
class AsyncLLM(LLM, Protocol):
    """An LLM that waits on the network: it also streams on the event loop.

    Its answers are computed elsewhere, so the LLM stage iterates
    :meth:`astream` on the event loop instead of holding an executor thread
    per answer, and cancelling the stage's task closes the connection at
    once instead of at the next piece.
    """

    def astream(self, request: LLMRequest, *, should_stop: StopCheck, usage: LLMUsage) -> AsyncGenerator[str, None]:
        """As :meth:`LLM.stream`, as an async iterator; also stops when its task is cancelled.

        Enforces its own deadline per piece (it runs in no executor).
        """
        ...


# --- powers some LLMs have (checked with isinstance) ----------------------------


@runtime_checkable
class TakesTurns(Protocol):
    """An LLM whose answers not yet heard decode before answers already being heard.

    Its ``stream`` also takes ``urgent`` (a thread-safe check: is this
    answer still waiting for its first words?) and ``pause`` (where it
    waits while its first words are made into speech); ``turns`` keeps
    count.
    """

    turns: Any

    def stream(
        self,
        request: LLMRequest,
        *,
        should_stop: StopCheck,
        usage: LLMUsage,
        urgent: Callable[[], bool] | None = None,
        pause: FirstWordsPause | None = None,
    ) -> Iterator[str]: ...


@runtime_checkable
class ReadsAhead(Protocol):
    """An LLM that can read a conversation into kept model state before the next answer asks."""

    def prime(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = ()) -> bool:
        """Read ``messages`` (as the next answer will see them, up to its user turn); True if kept."""
        ...


@runtime_checkable
class JudgesTurnEnd(Protocol):
    """An LLM that can say how likely a user's words end their turn (``semantic_vad``)."""

    def turn_end_probability(self, messages: Sequence[ChatMessage]) -> float: ...


@runtime_checkable
class CountsTokens(Protocol):
    """An LLM that knows its context's size and what a message costs in it (the server keeps conversations within)."""

    #: Tokens of prompt and answer together.
    context_tokens: int

    def message_tokens(self, message: ChatMessage) -> int:
        """What ``message`` costs in the prompt, its chat markup included (close; tool results may differ a little)."""
        ...


@runtime_checkable
class KeepsPrefixes(Protocol):
    """An LLM that keeps model states of conversations it read (its figures go to ``/metrics``)."""

    prefixes: Any
    reloads: int
    turns: Any
    lanes: Any


class LLMError(Exception):
    """An LLM failure a client can act on; ``code`` goes into the failed response.

    Args:
        code: ``llm_unavailable`` (the model cannot be reached now: retry
            later), ``llm_timeout`` (it stopped answering), ``llm_failed``
            (it refused the request).
        message: what happened, for the client and the log.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class TTS(Protocol):
    """Text to speech, one clause or sentence at a time."""

    #: Rate of the audio :meth:`synthesize` yields.
    sample_rate: int
    #: Names accepted as ``voice``; the first one is the default.
    voices: Sequence[str]

    def synthesize(
        self, text: str, *, voice: str | None, should_stop: StopCheck, speed: float = 1.0
    ) -> Iterator[Float32Array]:
        """Yield float32 mono audio at ``sample_rate`` for ``text``.

        May yield several pieces (e.g. one per sentence); checks
        ``should_stop`` between them. ``speed`` is the speaking rate (1.0
        the voice's own; the Realtime API allows 0.25-1.5).
        """
        ...


class Denoiser(Protocol):
    """One session's denoising stream: pipeline-rate samples in, as many out (a constant delay later)."""

    def process(self, samples: Float32Array) -> Float32Array: ...


class NoiseReduction(Protocol):
    """A noise-reduction model shared by the process; each session gets a stream of its own."""

    def denoiser(self) -> Denoiser: ...

    def describe(self) -> str: ...


@dataclass(slots=True)
class Stack:
    """One loaded model of each kind, shared by every slot of the process."""

    name: str
    vad: VAD
    stt: STT
    llm: LLM
    tts: TTS
    #: Human-readable lines for the start-up log (model paths, providers).
    description: list[str] = field(default_factory=list)
    #: Noise reduction, for sessions that ask for it (``audio.input.noise_reduction``); None: not installed.
    noise: NoiseReduction | None = None

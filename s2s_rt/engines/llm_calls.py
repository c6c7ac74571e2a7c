"""How likely a local model's answer begins with a call: one step of reading, no sampling."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from s2s_rt.engines.base import LLMRequest
from s2s_rt.engines.chat_formats import ChatFormat, ChatPrompt
from s2s_rt.engines.llm_lanes import Lanes, never
from s2s_rt.engines.prompt_cache import ConversationPrefixes

#: Spaces, tabs and line breaks as byte-level BPE vocabularies write them (and as they are).
_SPACES = "\u0120\u010a\u0109 \n\t\u2581"


class CallWeighing:
    """:meth:`call_probability` for :class:`~s2s_rt.engines.llm.CT2ChatLLM`, kept apart from its streaming."""

    # What it reads of the engine.
    model_dir: Path
    _generator: Any
    _chat: ChatFormat
    _vocabulary: list[str]
    _lock: threading.Lock
    prefixes: ConversationPrefixes
    min_kept_tokens: int
    lanes: Lanes
    long_reading_tokens: int
    _fit: Callable[[ChatPrompt, int], tuple[list[int], int]]
    _next_logits: Callable[[Sequence[int], Sequence[int]], np.ndarray]

    def call_probability(self, request: LLMRequest) -> float:
        """The model's probability that its answer to ``request`` begins with a call.

        Read as :meth:`~s2s_rt.engines.llm.CT2ChatLLM.stream` reads the
        request's prompt, functions in view and no call required; the
        probability is that of the first tokens a call begins with
        (:meth:`_call_openings`): the default model writes most of its
        calls bare, ``{"name": …``, not after ``<tool_call>``. Costs one
        reading of the prompt (after a kept state where one is held), no
        sampling (:mod:`s2s_rt.call_decision`).
        """
        if self._generator is None:
            raise RuntimeError(f"the LLM engine for {self.model_dir} is closed")
        chat = self._chat.encode(request.messages, request.tools)
        prompt, _ = self._fit(chat, request.max_tokens)
        held: list[int] = []
        if self.prefixes.budget_tokens:
            with self._lock:
                held = self.prefixes.find(prompt[: len(prompt) - self.min_kept_tokens + 1])
            held = held if len(held) >= self.min_kept_tokens else []
        with self.lanes.take(len(prompt) - len(held) >= self.long_reading_tokens, never):
            logits = self._next_logits(held, prompt[len(held) :])
        probabilities = np.exp(logits - logits.max())
        return float(probabilities[self._call_openings()].sum() / probabilities.sum())

    @functools.cache  # noqa: B019 (one engine per process, kept to its end)
    def _call_openings(self) -> list[int]:
        """The tokens an answer that is a call begins with, as :class:`~s2s_rt.toolcalls.CallFraming` tells them.

        A call begins with ``<tool_call>``, or bare (``{"name": …``), in a
        code fence or tags of the model's own: a token whose text, spaces
        and line breaks aside, begins with ``{``, a backquote or ``<``;
        markup (``<|im_end|>``) is not a call.
        """
        return [
            i
            for i, token in enumerate(self._vocabulary)
            if token.lstrip(_SPACES)[:1] in ("{", "`", "<") and not token.lstrip(_SPACES).startswith("<|")
        ]

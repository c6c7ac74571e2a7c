"""Copies mode (``bin/s2s-rt-model-copies``): the default stack loaded several times in one process."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Any

from s2s_rt.bench.procfs import machine_info, read_proc
from s2s_rt.speech_cache import RATE, load_questions


def run_copies(opts: argparse.Namespace) -> dict[str, Any]:
    """Load the default stack ``opts.copies`` times in this process; RSS after each copy.

    Each copy runs every engine once (a VAD batch, a transcription, a few LLM
    tokens, a sentence of speech) so buffers allocated on first use count
    too. The increment per copy is what a slot would cost if slots held
    their own models.
    """
    import numpy as np

    from s2s_rt.audio import pcm16_to_float, resample
    from s2s_rt.config import Config
    from s2s_rt.engines.base import PIPELINE_RATE, ChatMessage, LLMRequest, LLMUsage, Stack
    from s2s_rt.server.stack import load_stack

    def exercise(stack: Stack, speech: Any) -> None:
        chunks = np.zeros((4, stack.vad.chunk_samples), np.float32)
        stack.vad.speech_probabilities(chunks, [stack.vad.new_state() for _ in range(4)])
        stack.stt.transcribe(speech, language="en")
        chat = [ChatMessage("system", "Answer in one short sentence."), ChatMessage("user", "What do bees make?")]
        usage = LLMUsage()
        asked = LLMRequest.of(chat, max_tokens=8, temperature=0.0)
        for _ in stack.llm.stream(asked, should_stop=lambda: False, usage=usage):
            pass
        for _ in stack.tts.synthesize("Bees make honey.", voice=None, should_stop=lambda: False):
            pass

    clip = load_questions("piper", directory=opts.speech_cache)[0]
    speech = resample(pcm16_to_float(clip.pcm), RATE, PIPELINE_RATE)
    me = os.getpid()
    base = read_proc(me)
    assert base is not None
    rows: list[dict[str, float]] = [{"copies": 0, "rss_mb": base.rss_mb, "load_s": 0.0}]
    stacks = []
    for k in range(1, opts.copies + 1):
        t = time.perf_counter()
        stack = load_stack(Config(stack="default"))
        exercise(stack, speech)
        stacks.append(stack)  # every copy stays alive, as it would in its slot
        now = read_proc(me)
        assert now is not None
        rows.append({"copies": k, "rss_mb": now.rss_mb, "load_s": time.perf_counter() - t})
        if not opts.quiet:
            print(f"copy {k}: RSS {now.rss_mb:.1f} MB (+{now.rss_mb - rows[-2]['rss_mb']:.1f})", file=sys.stderr)
    increments = [b["rss_mb"] - a["rss_mb"] for a, b in itertools.pairwise(rows[1:])]
    return {
        "tool": "s2s-rt bench",
        "mode": "copies",
        "ok": True,
        "argv": opts.argv,
        "machine": machine_info(),
        "rows": rows,
        "first_copy_mb": rows[1]["rss_mb"] - rows[0]["rss_mb"] if len(rows) > 1 else None,
        "per_extra_copy_mb": sum(increments) / len(increments) if increments else None,
    }

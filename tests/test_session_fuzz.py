"""One client can never stop the server or touch another session: a seeded protocol fuzzer.

Hostile sessions send random sequences of valid and invalid client events
while calm sessions talk (see :mod:`fuzzing`); after each run the server must
still be healthy, every slot idle, every calm turn completed, every response
closed by exactly one ``response.done``, and every event conformant.

- ``make test`` runs a bounded fuzz (``FUZZ_SECONDS``, default 30 s of
  fuzzing across fixed seeds, under 60 s in all) and a short run on the
  default stack.
- ``make fuzz`` runs it for ten minutes on fresh seeds (``FUZZ_SECONDS=600``).
- ``FUZZ_SEED=7`` (or ``7,8,9``) replays those seeds; ``FUZZ_AVOID=huge_append,…``
  leaves a known bug's pattern out to look past it for others.

A failure prints the seed and, per finding, the events the session sent. The
bugs the fuzzer found are pinned by the regression tests at the end of this
file, each the minimal sequence that showed it.
"""

from __future__ import annotations

import base64
import os
import time

import pytest
from conftest import RealtimeClient, live_server, run
from fuzzing import AVOIDABLE, FuzzReport, avoided_from_env, check_reports, fuzz, seeds

from s2s_rt import Server

#: Seconds of fuzzing the fake-stack test spends, across its seeds (``make fuzz`` sets 600).
FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", "30"))
#: Seconds one run fuzzes before its checks; a long run makes many.
RUN_SECONDS = float(os.environ.get("FUZZ_RUN_SECONDS", "15" if FUZZ_SECONDS <= 60 else "40"))
HOSTILE = int(os.environ.get("FUZZ_HOSTILE", "4"))
CALM = int(os.environ.get("FUZZ_CALM", "2"))


def test_fuzzer_can_avoid_only_patterns_it_knows() -> None:
    assert avoided_from_env() <= AVOIDABLE


def test_hostile_sessions_never_stop_the_server_or_reach_another_session() -> None:
    avoid = avoided_from_env()
    chosen = seeds(FUZZ_SECONDS, RUN_SECONDS)
    replay = "FUZZ_SEED" in os.environ
    reports: list[FuzzReport] = []
    end = time.monotonic() + FUZZ_SECONDS
    for seed in chosen:
        left = end - time.monotonic()
        if not replay and left < min(RUN_SECONDS, 5.0):
            break
        seconds = RUN_SECONDS if replay else min(RUN_SECONDS, left)
        report = run(fuzz(seed, seconds, hostile=HOSTILE, calm=CALM, avoid=avoid), timeout=seconds + 90)
        reports.append(report)
        print(report.summary(), flush=True)
        if report.findings and os.environ.get("FUZZ_KEEP_GOING") != "1":
            break
    check_reports(reports)


@pytest.mark.slow
def test_hostile_session_cannot_stop_the_default_stack_or_its_neighbour(default_models: object) -> None:
    def speech(server: Server) -> bytes:
        from s2s_rt.audio import float_to_pcm16, resample

        assert server.stack is not None
        tts = server.stack.tts
        audio = [a for a in tts.synthesize("What is the capital of France?", voice=None, should_stop=lambda: False)]
        import numpy as np

        pcm = float_to_pcm16(resample(np.concatenate(audio), tts.sample_rate, 24_000))
        return bytes(24_000 * 2 // 5) + pcm + bytes(24_000 * 2)  # 0.2 s before, 1 s of silence after

    seed = int(os.environ.get("FUZZ_SEED", "1").split(",")[0])
    # Not here: prompts of thousands of tokens (long instructions, minutes of noise transcribed). The LLM reads a
    # prompt in one uninterruptible call, about 25 s for 3,000 tokens on 2 cores, and every session's answer
    # waits behind it: a known limit of the turn-taking (it gives way between tokens, not within a reading).
    # Nor MCP tools, for the same reason: each listing puts every listed tool's schema into the prompt (about
    # 300 tokens with the test's MCP server), and on 2 AVX2-only AMD EPYC cores reading it in int8 took 8 s and
    # the calm session's turn waited past its 10 s (CI, seed 1). The fake-stack fuzz above covers MCP in full.
    # There, too, the calm's first text turn waited past 10 s in 2 of 3 runs of seed 1 while int8 read each
    # prompt whole (23 ms a token); with the LLM in float32 and its kept state (`engines/device.py`), 4 of 4
    # passed, the calm turns taking 5-7 s.
    avoid = frozenset({"huge_append", "long_prompts", "mcp"})
    report = run(fuzz(seed, 6.0, hostile=1, calm=1, stack="default", speech=speech, avoid=avoid), timeout=120)
    print(report.summary(), flush=True)
    check_reports([report])


# --- regression tests: what the fuzzer found, each as the minimal sequence that showed it -------------


def test_a_beta_transcription_intent_session_starts_with_conformant_events() -> None:
    """Found by the fuzzer (seed 5): a beta client connecting with ``?intent=transcription`` was greeted
    with ``transcription_session.created``, which no beta ``RealtimeServerEvent`` type describes."""

    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            async with RealtimeClient.connect(server, beta=True, path="/v1/realtime?intent=transcription") as c:
                await c.recv()  # validated against the beta types on receipt
                await c.recv()

    run(scenario())


def test_an_append_that_overfills_the_buffer_gets_one_error_that_names_it() -> None:
    """Found by the fuzzer (seeds 17, 24): one G.711 append of 1000 s (more than the buffer's 900 s) was
    answered, seconds later, by dozens of ``input_audio_buffer_full`` errors (one per listening tick),
    none of them echoing the append's ``event_id``."""

    async def scenario() -> None:
        async with live_server(pool_size=1) as server:
            async with RealtimeClient.connect(server) as c:
                await c.send(
                    "session.update",
                    session={
                        "type": "realtime",
                        "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None}},
                    },
                )
                await c.until("session.updated")
                pcmu_silence = base64.b64encode(b"\xff" * 8000 * 1000).decode()
                await c.send("input_audio_buffer.append", audio=pcmu_silence, event_id="too-much")
                await c.send("input_audio_buffer.commit", event_id="commit")
                await c.until("input_audio_buffer.committed", timeout=30)
                errors = [e["error"] for e in c.of_type("error")]
                assert [(e["code"], e["event_id"]) for e in errors] == [("input_audio_buffer_full", "too-much")]

    run(scenario(), timeout=60)

"""``python -m s2s_rt.evaluation``: how well each LLM preset answers, typed and spoken.

::

    python -m s2s_rt.evaluation --llm default tiny best --out eval-results

1. **Hearing.** Every question is spoken by every voice (the project's
   Piper voice, flite, espeak-ng), transcribed by Whisper as a session
   without a transcription language is (``--detect any`` lets Whisper choose
   among all its languages, as before the served-languages setting), and
   compared with what was said: word error rate and wrong languages, per voice.
2. **Answering**, in a fresh process per preset: the default stack is loaded
   with that LLM (so its memory is the server's), each question is answered
   typed and from each transcript (as a default session answers:
   instructions, answer context, temperature), graded, and the function-calling
   set is run; first-token and first-audio times are taken on the typed
   questions.

The function-calling set is the first one (``--tool-set first``,
:mod:`~s2s_rt.evaluation.tool_requests`), the held-out one (``--tool-set
held-out``, :mod:`~s2s_rt.evaluation.held_out_tools`) or the third one
(``--tool-set third``, :mod:`~s2s_rt.evaluation.third_tools`); the last two
show whether what was tuned on the first carries over::

    python -m s2s_rt.evaluation --tools-only --tool-set held-out --llm default --out eval-held-out

Writes ``hearing.json``, ``answers-PRESET.json`` and ``report.md`` (the
tables of BENCHMARKS.md) into ``--out``. Needs ``flite`` and ``espeak-ng``
for the foreign voices (``apt-get install flite espeak-ng``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from s2s_rt.evaluation.questions import EVALUATION_NOW, QUESTIONS
from s2s_rt.evaluation.voices import ALL_VOICES, Voice, missing_programs

#: The function-calling sets, by their ``--tool-set`` name.
TOOL_SETS = ("first", "held-out", "third")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m s2s_rt.evaluation", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llm", nargs="*", default=["default"], help="LLM presets or model directories (none: hearing only)"
    )
    parser.add_argument("--out", type=Path, default=Path("eval-results"), help="directory for the results")
    parser.add_argument(
        "--voices", nargs="+", default=[v.label for v in ALL_VOICES], help="engine:name of each voice (default: all)"
    )
    parser.add_argument("--typed-only", action="store_true", help="skip the spoken questions")
    parser.add_argument("--no-tools", action="store_true", help="skip the function-calling set")
    parser.add_argument("--tools-only", action="store_true", help="only the function-calling set (typed only)")
    parser.add_argument(
        "--tool-set", choices=TOOL_SETS, default="first", help="the function-calling set (default: the first)"
    )
    parser.add_argument(
        "--no-function-choice",
        action="store_true",
        help="build the local LLM with choose_functions=False (no choice of the function by likelihood)",
    )
    parser.add_argument("--detect", choices=["served", "any"], default="served", help="languages Whisper detects among")
    parser.add_argument("--instructions", help="session instructions (default: a default session's)")
    parser.add_argument("--temperature", type=float, help="session temperature (default: the server's)")
    parser.add_argument(
        "--temperature-scale", type=float, help="the local LLM's temperature scale (default: the server's)"
    )
    parser.add_argument(
        "--no-context", action="store_true", help="answer without the answer context (date, language, examples)"
    )
    parser.add_argument("--no-examples", action="store_true", help="answer without the worked examples")
    parser.add_argument(
        "--speak-back", action="store_true", help="speak each typed answer and transcribe it back (intelligibility)"
    )
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed, reset before each answer")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one is not None:
        return _answer_one(args)
    voices = [Voice(*label.split(":", 1)) for label in args.voices]
    hearing: dict[str, Any] = {"voices": [], "clips": []}
    if args.tools_only:
        args.typed_only = True
    if not args.typed_only:
        missing = missing_programs(tuple(voices))
        if missing:
            print(f"missing synthesisers: {', '.join(missing)} (apt-get install {' '.join(missing)})")
            return 2
        hearing = _hear(voices, args.detect)
        (args.out / "hearing.json").write_text(json.dumps(hearing, indent=1))
    results = []
    for preset in args.llm:
        out = args.out / f"answers-{Path(preset).name}.json"
        command = [sys.executable, "-m", "s2s_rt.evaluation", "--one", preset, "--out", str(args.out)]
        command += [
            flag
            for flag, on in (
                ("--typed-only", args.typed_only),
                ("--no-tools", args.no_tools),
                ("--tools-only", args.tools_only),
                ("--no-function-choice", args.no_function_choice),
            )
            if on
        ]
        command += ["--tool-set", args.tool_set]
        command += ["--no-context"] if args.no_context else []
        command += ["--no-examples"] if args.no_examples else []
        command += ["--seed", str(args.seed)]
        command += ["--instructions", args.instructions] if args.instructions is not None else []
        command += ["--temperature", str(args.temperature)] if args.temperature is not None else []
        command += ["--temperature-scale", str(args.temperature_scale)] if args.temperature_scale is not None else []
        print(f"== {preset}", flush=True)
        if subprocess.run(command, check=False).returncode != 0:
            print(f"{preset}: failed (see above)")
            continue
        results.append(json.loads(out.read_text()))
    if args.speak_back:
        for result in results:
            result["speak_back"] = _speak_back([t["answer"] for t in result["typed"]])
            (args.out / f"answers-{Path(result['preset']).name}.json").write_text(json.dumps(result, indent=1))
    report = _report(hearing, results)
    (args.out / "report.md").write_text(report)
    print(report)
    return 0


# --- hearing ---------------------------------------------------------------------------------


def _hear(voices: list[Voice], detect: str) -> dict[str, Any]:
    from s2s_rt.engines.piper import PiperTTS, voice_languages
    from s2s_rt.engines.whisper import WhisperSTT
    from s2s_rt.evaluation.grading import spoken_word_error_rate
    from s2s_rt.evaluation.voices import say
    from s2s_rt.models import ensure_prepared
    from s2s_rt.wer import words

    prepared = ensure_prepared(progress=print)
    tts = PiperTTS(prepared.voices)
    served = voice_languages(prepared.voices) if detect == "served" else []
    stt = WhisperSTT(prepared.whisper, languages=served)
    print(stt.describe(), flush=True)

    def piper(text: str, name: str) -> tuple[Any, int]:
        import numpy as np

        return np.concatenate(list(tts.synthesize(text, voice=name))), tts.sample_rate

    clips, summary = [], []
    for voice in voices:
        errors, total, wrong = 0.0, 0, 0
        started = time.perf_counter()
        for q in QUESTIONS:
            heard = stt.transcribe(say(voice, q.text, piper))
            wer = spoken_word_error_rate(q.text, heard.text)
            n = len(words(q.text))
            errors, total = errors + wer * n, total + n
            wrong += heard.language != "en"
            clips.append({"voice": voice.label, "question": q.text, "heard": heard.text, "language": heard.language})
        summary.append({"voice": voice.label, "wer": errors / total, "wrong_language": wrong, "clips": len(QUESTIONS)})
        print(f"{voice.label}: WER {100 * errors / total:.1f} %, {wrong} not English, "
              f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    return {"detect": detect, "served": served, "voices": summary, "clips": clips}


def _speak_back(answers: list[str]) -> dict[str, Any]:
    """Word error rate of answers spoken by the Piper voice and transcribed back, against what it should say."""
    import numpy as np

    from s2s_rt.audio import resample
    from s2s_rt.engines.base import PIPELINE_RATE
    from s2s_rt.engines.piper import PiperTTS
    from s2s_rt.engines.whisper import WhisperSTT
    from s2s_rt.models import ensure_prepared
    from s2s_rt.speech_text import speakable
    from s2s_rt.wer import word_error_rate, words

    prepared = ensure_prepared(progress=print)
    tts, stt = PiperTTS(prepared.voices), WhisperSTT(prepared.whisper, languages=["en"])
    errors, total = 0.0, 0
    for answer in answers:
        said = speakable(answer)
        if not words(said):
            continue
        audio = np.concatenate(list(tts.synthesize(answer)))
        heard = stt.transcribe(resample(audio, tts.sample_rate, PIPELINE_RATE)).text
        n = len(words(said))
        errors, total = errors + word_error_rate(said, speakable(heard)) * n, total + n
    return {"wer": errors / max(total, 1), "words": total, "answers": len(answers)}


# --- answering (one preset per process) ---------------------------------------------------------


def _answer_one(args: argparse.Namespace) -> int:
    from s2s_rt import models
    from s2s_rt.bench.procfs import read_proc
    from s2s_rt.config import Config
    from s2s_rt.engines.default import load_default_stack
    from s2s_rt.evaluation import held_out_tools, third_tools, tool_requests
    from s2s_rt.evaluation.asking import Assistant
    from s2s_rt.evaluation.grading import is_right
    from s2s_rt.protocol.config import SessionConfig

    preset = args.one
    config = Config()
    tool_set = {"first": tool_requests, "held-out": held_out_tools, "third": third_tools}[args.tool_set]
    temperature_scale = config.llm_temperature_scale if args.temperature_scale is None else args.temperature_scale
    try:
        prepared = models.ensure_prepared(llm=preset if preset in models.LLM_PRESETS else "default", progress=print)
        llm_dir = prepared.llm if preset in models.LLM_PRESETS else models.resolve_llm_dir(preset)
    except models.ModelError as exc:
        print(f"{preset}: {exc}")
        return 1
    stack = load_default_stack(
        vad_model=prepared.vad,
        whisper_dir=prepared.whisper,
        llm_dir=llm_dir,
        llm_choose_functions=not args.no_function_choice,
        voices=prepared.voices,
        device="cpu",
        stt_threads=config.stt_threads,
        llm_threads=config.llm_threads,
        tts_threads=config.tts_threads,
        llm_temperature_scale=temperature_scale,
    )
    loaded = read_proc(os.getpid(), children=False)
    session = SessionConfig()
    instructions = session.instructions if args.instructions is None else args.instructions
    assistant = Assistant(
        stack.llm,
        stack.tts,
        instructions=instructions,
        temperature=session.temperature if args.temperature is None else args.temperature,
        now=EVALUATION_NOW,
        context=not args.no_context,
        examples=not args.no_examples,
    )
    seed = _seeder(args.seed)
    assistant.answer("Hello!")  # warm-up: first calls allocate
    typed = []
    for q in () if args.tools_only else QUESTIONS:
        seed()
        a = assistant.answer(q.text)
        typed.append({"question": q.text, "kind": q.kind, "answer": a.text, "right": is_right(q, a.text),
                      "first_token_s": a.first_token_s, "first_audio_s": a.first_audio_s,
                      "total_s": a.total_s, "tokens": a.output_tokens})  # fmt: skip
        print(("+ " if typed[-1]["right"] else "- ") + f"{q.text} => {a.text!r}", flush=True)
    spoken = []
    hearing_path = args.out / "hearing.json"
    if not args.typed_only and hearing_path.exists():
        by_text = {q.text: q for q in QUESTIONS}
        answered: dict[tuple[str, str | None], str] = {}
        for clip in json.loads(hearing_path.read_text())["clips"]:
            key = (clip["heard"], clip["language"])
            if key not in answered:
                seed()
                answered[key] = assistant.answer(clip["heard"], clip["language"]).text
            q = by_text[clip["question"]]
            spoken.append({**clip, "answer": answered[key], "right": is_right(q, answered[key])})
    calls = []
    if not args.no_tools:
        for request in tool_set.REQUESTS:
            seed()
            trip = assistant.round_trip(request.text, tool_set.TOOLS, request.output)
            first, answer = trip.first, trip.answer
            row: dict[str, Any] = {
                "request": request.text,
                "issue": request.issue,
                "expected": request.function,
                "calls": first.calls,
                "invalid": first.invalid,
                "text": first.text,
                "right": request.is_right(first),
                "dated_arguments": request.dated_arguments(first),
            }
            if request.function is not None:
                row["answer"] = None if answer is None else {"calls": answer.calls, "text": answer.text}
                row["repeated"] = trip.repeated
                row["round_trip_right"] = answer is not None and row["right"] and request.answer_uses_result(answer)
            calls.append(row)
            said = first.calls or first.text
            then = f" -> {answer.calls or answer.text!r}" if answer is not None else ""
            mark = "+ " if row.get("round_trip_right", row["right"]) else "- "
            print(mark + f"{request.text} => {said!r}{then}", flush=True)
    finished = read_proc(os.getpid(), children=False)
    result = {
        "preset": preset,
        "llm": str(llm_dir),
        "instructions": assistant.instructions,
        "temperature": assistant.temperature,
        "temperature_scale": getattr(stack.llm, "temperature_scale", 1.0),
        "context": assistant.context,
        "examples": assistant.examples,
        "seed": args.seed,
        "tool_set": args.tool_set,
        "tools": [t["name"] for t in tool_set.TOOLS],
        # None: an engine without the setting (one that never chose the function by likelihood).
        "choose_functions": getattr(stack.llm, "choose_functions", None),
        "rss_loaded_mb": loaded.rss_mb if loaded else None,
        "rss_peak_mb": finished.hwm_mb if finished else None,
        "load_average": os.getloadavg(),
        "typed": typed,
        "spoken": spoken,
        "calls": calls,
    }
    (args.out / f"answers-{Path(preset).name}.json").write_text(json.dumps(result, indent=1))
    return 0


def _seeder(seed: int) -> Any:
    """Reset CTranslate2's sampling seed before each answer, so sampled runs repeat."""
    import ctranslate2

    return lambda: ctranslate2.set_random_seed(seed)


# --- the report --------------------------------------------------------------------------------


def _median_ms(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{1000 * statistics.median(present):.0f}" if present else "-"


def _tool_set_line(result: dict[str, Any]) -> str:
    """Which function-calling set a preset's calls were graded on, and whether its LLM chose the function."""
    needing = sum(c["expected"] is not None for c in result["calls"])
    tools = result.get("tools")
    named = f"{len(tools)} tools: {', '.join(tools)}; " if tools else ""
    choice = {True: "on", False: "off", None: "not in this engine"}[result.get("choose_functions")]
    return (
        f"{result['preset']}, function calls on the {result.get('tool_set', 'first')} tool set"
        f" ({named}{needing} requests that need one, {len(result['calls']) - needing} that need none),"
        f" function choice {choice}"
    )


def _report(hearing: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = []
    if hearing["voices"]:
        lines += [
            f"Hearing (languages detected among: {', '.join(hearing['served']) or 'all of Whisper'})",
            "",
            "| voice | WER | not heard as English |",
            "|---|---|---|",
        ]
        for v in hearing["voices"]:
            lines.append(f"| {v['voice']} | {100 * v['wer']:.1f} % | {v['wrong_language']} / {v['clips']} |")
        lines.append("")
    if not results:
        return "\n".join(lines) + "\n"
    for r in results:
        if r["calls"]:
            lines.append(_tool_set_line(r))
    if any(r["calls"] for r in results):
        lines.append("")
    lines += [
        "| preset | typed right | spoken right | first call right | round trip right | repeated calls"
        " | spurious calls | invented functions | first token p50 | first audio p50 | RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        typed, spoken, calls = r["typed"], r["spoken"], r["calls"]
        needing = [c for c in calls if c["expected"] is not None]
        needless = [c for c in calls if c["expected"] is None]

        def share(rows: list[dict[str, Any]], key: str = "right") -> str:
            right = sum(bool(row.get(key)) for row in rows)
            return f"{right}/{len(rows)} ({100 * right / len(rows):.0f} %)" if rows else "-"

        spurious = sum(bool(c["calls"]) for c in needless)
        invented = sum("no function named" in why for c in calls for why in c["invalid"])
        lines.append(
            f"| {r['preset']} | {share(typed)} | {share(spoken)} | {share(needing)} |"
            f" {share(needing, 'round_trip_right')} | {sum(c.get('repeated', 0) for c in needing)} |"
            f" {spurious}/{len(needless)} | {invented} | {_median_ms([t['first_token_s'] for t in typed])} ms |"
            f" {_median_ms([t['first_audio_s'] for t in typed])} ms | {r['rss_peak_mb']:.0f} MB |"
        )
    for r in results:
        first = [c for c in r["calls"] if c["expected"] is not None and c.get("issue") is None]
        if first and len(first) < len([c for c in r["calls"] if c["expected"] is not None]):
            called = sum(bool(c["right"]) for c in first)
            trips = sum(bool(c.get("round_trip_right")) for c in first)
            lines.append(
                f"\n{r['preset']}, the first version's {len(first)} tool requests:"
                f" first call right {called}/{len(first)}, round trip right {trips}/{len(first)}"
            )
    for r in results:
        kinds = Counter(t["kind"] for t in r["typed"])
        right = Counter(t["kind"] for t in r["typed"] if t["right"])
        lines += ["", f"{r['preset']}, typed, by kind: " + ", ".join(f"{k} {right[k]}/{n}" for k, n in kinds.items())]
        if "speak_back" in r:
            back = r["speak_back"]
            lines.append(
                f"{r['preset']}, typed answers spoken and heard back: "
                f"WER {100 * back['wer']:.1f} % of {back['words']} words"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

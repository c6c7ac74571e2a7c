"""Suite mode (``make bench``): every benchmark of BENCHMARKS.md in its own process, and ``summary.md``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from s2s_rt.bench.procfs import machine_info

#: name, what it shows, arguments, and what ``--quick`` changes (shorter runs, same setup).
SUITE: tuple[tuple[str, str, list[str], list[str]], ...] = tuple(
    (name, what, args.split(), quick.split())
    for name, what, args, quick in (
        (
            "single",
            "1 session, default stack, 20 turns",
            "--spawn --stack default --sessions 1 --turns 20",
            "--turns 3",
        ),
        (
            "single-fresh",
            "1 session at a time, default stack, 20 one-question conversations (no history)",
            "--spawn --stack default --sessions 1 --turns 20 --turns-per-connection 1",
            "--turns 3",
        ),
        (
            "talk2",
            "2 sessions at once, default stack, one-question conversations",
            "--spawn --stack default --sessions 2 --turns 10 --turns-per-connection 1",
            "--turns 2",
        ),
        (
            "talk4",
            "4 sessions at once, default stack, one-question conversations",
            "--spawn --stack default --sessions 4 --turns 5 --turns-per-connection 1",
            "--turns 1",
        ),
        (
            "talk8",
            "8 sessions at once, default stack, one-question conversations",
            "--spawn --stack default --sessions 8 --turns 5 --turns-per-connection 1",
            "--turns 1",
        ),
        (
            "listen",
            "listening capacity, default stack (Silero VAD)",
            "--spawn --stack default --mode listen --steps 10,25,50,75,100,125,150,200,300 --step-s 20",
            "--steps 10,20 --step-s 8 --warmup-s 2",
        ),
        (
            "listen-rare",
            "listening capacity, default stack, a question every ~10 minutes per session",
            "--spawn --stack default --mode listen --steps 25,50,75,100,150,200,300 --step-s 20 --turn-every-s 600",
            "--steps 10,20 --step-s 8 --warmup-s 2",
        ),
        (
            "fake100",
            "100 sessions, fake stack",
            "--spawn --stack fake --sessions 100 --turns 5 --ramp-s 5 --max-duration-s 300",
            "--sessions 20 --turns 2",
        ),
        (
            "fake500",
            "500 sessions, fake stack",
            "--spawn --stack fake --sessions 500 --turns 5 --ramp-s 10 --max-duration-s 300",
            "--sessions 50 --turns 2",
        ),
        (
            "fake500-100ms",
            "500 sessions, fake stack, 100 ms appends (a fifth of the messages)",
            "--spawn --stack fake --sessions 500 --turns 5 --ramp-s 10 --max-duration-s 300 --chunk-ms 100",
            "--sessions 50 --turns 2",
        ),
        (
            "listen-100ms",
            "listening capacity, default stack, 100 ms appends",
            "--spawn --stack default --mode listen --steps 25,50,75,100,125,150,200,300 --step-s 20 --chunk-ms 100",
            "--steps 10,20 --step-s 8 --warmup-s 2",
        ),
        (
            "memory",
            "RSS with pool 1 and pool 64, default stack",
            "--mode memory --stack default --pool-sizes 1,64",
            "--pool-sizes 1,4",
        ),
        (
            "copies",
            "one model copy per slot: 4 default stacks in one process",
            "--mode copies --copies 4",
            "--copies 2",
        ),
    )
)

#: How much the RSS of two starts of the same server may differ (measured: up to ~6 MB).
RSS_NOISE_MB = 6.0

_BOOT = "import sys; from s2s_rt.bench.cli import main; sys.exit(main(sys.argv[1:]))"


def run_suite(opts: argparse.Namespace) -> dict[str, Any]:
    """Run every benchmark of :data:`SUITE` in its own process; write JSON, tables and ``summary.md``."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    only = {n for n in (opts.only or "").split(",") if n}
    results: dict[str, Any] = {}
    for name, what, args, quick in SUITE:
        if only and name not in only:
            continue
        argv = [*args, *(quick if opts.quick else []), "--json", str(out / f"{name}.json"), "--quiet"]
        if opts.speech_cache:
            argv += ["--speech-cache", opts.speech_cache]
        load = os.getloadavg()[0]
        print(f"== {name}: {what} (load {load:.2f})\n   s2s-rt bench {' '.join(argv)}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _BOOT, *argv], capture_output=True, text=True)
        (out / f"{name}.txt").write_text(done.stdout + ("\n" + done.stderr if done.returncode else ""))
        print(done.stdout, file=sys.stderr)
        if done.returncode not in (0, 1):
            print(done.stderr[-3000:], file=sys.stderr)
        report: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            report = json.loads((out / f"{name}.json").read_text())
        results[name] = {
            "what": what,
            "command": "s2s-rt bench " + " ".join(a for a in argv if a != "--quiet"),
            "exit": done.returncode,
            "seconds": time.perf_counter() - started,
            "load_before": load,
            "load_after": os.getloadavg()[0],
            "report": report,
        }
    summary = suite_summary(results)
    (out / "summary.md").write_text(summary)
    return {
        "tool": "s2s-rt bench",
        "mode": "suite",
        "ok": all(r["exit"] == 0 for r in results.values()),
        "summary": summary,
        "machine": machine_info(),
    }


def _f(v: float | None, scale: float = 1000.0, unit: str = " ms", digits: int = 0) -> str:
    return "—" if v is None else f"{v * scale:.{digits}f}{unit}"


def suite_summary(results: dict[str, Any]) -> str:
    """Markdown tables of a suite run (what BENCHMARKS.md shows)."""
    m = machine_info()
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Python {m['python']}.", ""]
    talk: list[str] = [
        n for n in ("single", "single-fresh", "talk2", "talk4", "talk8") if n in results and results[n]["report"]
    ]
    if talk:
        lines += [
            "| run | sessions × turns | answered | eos → speech_stopped p50 | eos → first audio p50 | p95 | p99"
            " | STT (stopped → transcript) p50 | created → first audio p50 | turns overlapping another's inference"
            " | server CPU s/turn | other processes (cores) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for n in talk:
            r = results[n]["report"]
            iv = r["intervals_s"]
            head = iv["END OF SPEECH → FIRST AUDIO DELTA"]
            con = r["contention"]
            st = r["settings"]
            lines.append(
                f"| {n} | {st['sessions']} × {st['turns_per_session']} | {r['counts']['turns_answered']}"
                f" | {_f(iv['end of speech → speech_stopped']['p50'])} | **{_f(head['p50'])}** | {_f(head['p95'])}"
                f" | {_f(head['p99'])} | {_f(iv['speech_stopped → transcription completed']['p50'])}"
                f" | {_f(iv['response.created → first audio delta']['p50'])}"
                f" | {con['turns_overlapping_another_sessions_inference']} of"
                f" {con['turns_overlapping_another_sessions_inference'] + con['turns_alone']}"
                f" | {_f(r['server'].get('cpu_s_per_turn'), 1, ' s', 2)}"
                f" | {_f(r.get('cpu', {}).get('other_processes_cores_busy'), 1, '', 2)} |"
            )
        lines.append("")
    for name in ("listen", "listen-100ms", "listen-rare"):
        if name not in results or not results[name]["report"]:
            continue
        r = results[name]["report"]
        lines += [
            f"`{name}`: {r['settings']['chunk_ms']} ms appends, a question every ~{r['settings']['turn_every_s']:g} s"
            f" per session ({'answered' if r['settings']['respond'] else 'transcribed, not answered'}).",
            "",
            "| sessions | probe p50 | probe p95 | probe p99 | probes | speech_started p99 | speech_stopped p99"
            " | server loop lag p99 | VAD call p99 (histogram) | VAD chunks per call | server CPU (cores)"
            " | loop thread µs per client event | other processes (cores) | ≤ target |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in r["steps"]:
            pr = s["probe_delay_s"]
            lines.append(
                f"| {s['sessions']} | {_f(pr['p50'])} | {_f(pr['p95'])} | {_f(pr['p99'])} | {pr['n']}"
                f" | {_f(s['speech_started_decision_s']['p99'])} | {_f(s['speech_stopped_decision_s']['p99'])}"
                f" | {_f(s['server']['loop_lag']['p99'])} | {_f(s['server']['stage_seconds']['vad']['p99'])}"
                f" | {_f(s.get('vad_chunks_per_call'), 1, '', 1)} | {_f(s['server'].get('cpu_cores_busy'), 1, '', 2)}"
                f" | {_f(s['server'].get('loop_thread_cpu_us_per_event_in'), 1, '', 0)}"
                f" | {_f(s['cpu'].get('other_processes_cores_busy'), 1, '', 2)} | {'yes' if s['passed'] else 'no'} |"
            )
        lines += ["", f"Knee: {r['knee_sessions']} sessions (p99 ≤ {r['settings']['target_ms']:g} ms).", ""]
    fake: list[str] = [n for n in ("fake100", "fake500", "fake500-100ms") if n in results and results[n]["report"]]
    if fake:
        lines += [
            "| run | sessions | appends | answered | server loop lag p99 | ticks ≤ 20 ms | messages/s (in+out)"
            " | server CPU (cores) | server CPU per session | eos → first audio p50 / p99 | client CPU (cores)"
            " | client append lateness p99 | loop thread µs per client event | other processes (cores) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for n in fake:
            r = results[n]["report"]
            srv = r["server"]
            lag = srv["loop_lag"]
            share = lag["share_le"].get("0.02")
            head = r["intervals_s"]["END OF SPEECH → FIRST AUDIO DELTA"]
            per = srv.get("cpu_s_per_session_second")
            lines.append(
                f"| {n} | {r['counts']['sessions_opened']} | {r['settings']['chunk_ms']} ms"
                f" | {r['counts']['turns_answered']}/{r['counts']['turns_planned']}"
                f" | {_f(lag['p99'])} | {_f(share, 100, ' %', 1)}"
                f" | {srv['messages_per_s']:.0f} | {_f(srv.get('cpu_cores_busy'), 1, '', 2)}"
                f" | {_f(per, 100, ' % of a core', 2)} | {_f(head['p50'])} / {_f(head['p99'])}"
                f" | {r['client']['cpu_cores_busy']:.2f} | {_f(r['client']['send_lateness_s']['p99'])}"
                f" | {_f(srv.get('loop_thread_cpu_us_per_event_in'), 1, '', 0)}"
                f" | {_f(r.get('cpu', {}).get('other_processes_cores_busy'), 1, '', 2)} |"
            )
        lines.append("")
    if "memory" in results and results["memory"]["report"]:
        r = results["memory"]["report"]
        lines += [
            "| pool size | RSS idle | RSS after one answered turn | RSS, every slot in a session | peak |",
            "|---|---|---|---|---|",
        ]
        for row in r["memory"]:
            lines.append(
                f"| {row['pool_size']} | {row['rss_mb_idle']:.1f} MB | {row['rss_mb_warm']:.1f} MB"
                f" | {row['rss_mb_all_slots_active']:.1f} MB | {row['rss_mb_peak']:.1f} MB |"
            )
        per = r["per_extra_slot_mb"]
        lines += ["", "Per extra slot: " + ", ".join(f"{k} {v:.2f} MB" for k, v in per.items()), ""]
        copies = results.get("copies", {}).get("report")
        if copies and copies.get("per_extra_copy_mb") and "rss_mb_all_slots_active" in per:
            pools = [row["pool_size"] for row in r["memory"]]
            # Two starts of the same server differ by a few MB of RSS: below this, a slot's cost is noise.
            floor = RSS_NOISE_MB / max(1, max(pools) - min(pools))
            slot = per["rss_mb_all_slots_active"]
            copy = copies["per_extra_copy_mb"]
            shared = f"{slot:.2f} MB" if slot > floor else f"under {floor:.2f} MB (the RSS noise floor)"
            lines.append(
                f"One model copy per slot: {copy:.1f} MB per extra copy; a shared-model slot: {shared}"
                f" → about {copy / max(slot, floor):.0f}× less per slot."
            )
            lines.append("")
    for n, res in results.items():
        lines.append(f"- `{n}`: `{res['command']}` (exit {res['exit']}, {res['seconds']:.0f} s)")
    return "\n".join(lines) + "\n"

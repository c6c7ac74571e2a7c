"""The report: its common JSON head (settings, counts, failures) and the tables printed from it."""

from __future__ import annotations

import argparse
import time
from typing import Any

from s2s_rt.bench.procfs import machine_info
from s2s_rt.bench.run import Run
from s2s_rt.bench.server import ServerHandle


def base_report(opts: argparse.Namespace, run: Run, server: ServerHandle, seconds: float) -> dict[str, Any]:
    ok = not any(
        run.counts[k]
        for k in (
            "rejections",
            "foreign_events",
            "lost_events",
            "unanswered_turns",
            "unexpected_events",
            "error_events",
            "connect_failures",
            "closed_by_server",
        )
    )
    return {
        "tool": "s2s-rt bench",
        "mode": opts.mode,
        "ok": ok,
        "argv": opts.argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": seconds,
        "machine": machine_info(),
        "settings": {
            "url": server.url,
            "spawned": server.process is not None,
            "stack": opts.stack if server.process is not None else None,
            "pool_size": opts.pool_size if server.process is not None else None,
            "sessions": opts.sessions,
            "turns_per_session": opts.turns,
            "turns_per_connection": opts.turns_per_connection or opts.turns,
            "turn_detection": opts.turn_detection,
            "eagerness": opts.eagerness if opts.turn_detection == "semantic_vad" else None,
            "paused_speech": opts.paused,
            "silence_duration_ms": opts.silence_ms,
            "prefix_padding_ms": opts.prefix_padding_ms,
            "threshold": opts.threshold,
            "chunk_ms": opts.chunk_ms,
            "slower": opts.slower,
            "speech": opts.speech,
            "pause_s": opts.pause_s,
            "ramp_s": opts.ramp_s,
            "language": opts.language,
            "temperature": opts.temperature,
            "server_env": opts.server_env,
        },
        "counts": dict(run.counts)
        | {"turns_planned": opts.sessions * opts.turns if opts.mode == "talk" else None}
        | {"turns_answered": run.answered},
        "errors_by_code": run.errors,
        "failures": run.failures,
    }


def _turn_detection(settings: dict[str, Any]) -> str:
    if settings.get("turn_detection") == "semantic_vad":
        return f"semantic_vad (eagerness {settings['eagerness']})"
    return f"server_vad silence_duration_ms {settings['silence_duration_ms']}"


def ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f} ms"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable tables."""
    if report["mode"] == "suite":
        return str(report["summary"])
    lines: list[str] = []
    m = report["machine"]
    lines.append(
        f"s2s-rt bench — mode {report['mode']}, {m['cpu']} × {m['cores']} cores, load {m['loadavg'][0]:.2f} at the end"
    )
    if report["mode"] == "transports":
        from s2s_rt.bench.transports import format_transports

        return "\n".join([*lines, *format_transports(report)])
    if report["mode"] == "copies":
        lines.append(f"{'copies':>6} {'RSS MB':>9} {'+MB':>8} {'load+run s':>11}")
        prev = None
        for r in report["rows"]:
            grew = "" if prev is None else f"{r['rss_mb'] - prev:.1f}"
            lines.append(f"{r['copies']:>6} {r['rss_mb']:>9.1f} {grew:>8} {r['load_s']:>11.1f}")
            prev = r["rss_mb"]
        lines.append(
            f"first copy {report['first_copy_mb']:.1f} MB; each further copy {report['per_extra_copy_mb']:.1f} MB"
        )
        return "\n".join(lines)
    if report["mode"] == "memory":
        lines.append(f"{'pool':>6} {'idle MB':>9} {'warm MB':>9} {'all active MB':>14} {'peak MB':>9}")
        for r in report["memory"]:
            lines.append(
                f"{r['pool_size']:>6} {r['rss_mb_idle']:>9.1f} {r['rss_mb_warm']:>9.1f}"
                f" {r['rss_mb_all_slots_active']:>14.1f} {r['rss_mb_peak']:>9.1f}"
            )
        for k, v in report["per_extra_slot_mb"].items():
            lines.append(f"per extra slot ({k}): {v:.2f} MB")
        return "\n".join(lines)
    st = report["settings"]
    lines.append(
        f"server {st['url']} (stack {st['stack'] or '?'}, pool {st['pool_size'] or '?'}),"
        f" {_turn_detection(st)}, {st['chunk_ms']} ms appends, speech: {st['speech']}"
        + (" with a pause mid-sentence" if st.get("paused_speech") else "")
        + (f", sent {st['slower']:g}x slower than real time" if st.get("slower", 1.0) != 1.0 else "")
    )
    if report["mode"] == "talk":
        c = report["counts"]
        lines.append(
            f"{st['sessions']} sessions × {st['turns_per_session']} turns: {c['turns_answered']}/{c['turns_planned']}"
            f" answered in {report['duration_s']:.1f} s"
        )
        lines.append(f"{'interval':<52} {'n':>4} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8}")
        for label, s in report["intervals_s"].items():
            lines.append(
                f"{label:<52} {s['n']:>4} {ms(s['p50']):>8} {ms(s['p95']):>8} {ms(s['p99']):>8} {ms(s['max']):>8}"
            )
        lines.append(f"turns cut off (the turn ended inside the question): {report.get('cut_off_turns', 0)}")
        gaps = report.get("answer_gaps")
        if gaps and gaps["turns"]:
            lines.append(
                f"answers with a silence heard inside (audio ran out before more came): {gaps['turns_with_a_gap']}"
                f" of {gaps['turns']}, {gaps['gaps']} gaps, per answer p95 {ms(gaps['gap_s_per_turn']['p95'])}"
                f" max {ms(gaps['gap_s_per_turn']['max'])}"
            )
        by_turn = report.get("end_of_speech_to_first_audio_by_turn_in_conversation") or {}
        if len(by_turn) > 1:
            lines.append(
                "end of speech → first audio p50 by turn in the conversation: "
                + ", ".join(f"{k}: {ms(v['p50'])}" for k, v in by_turn.items())
            )
        con = report["contention"]
        lines.append(
            f"turns whose inference overlapped another session's: {con['turns_overlapping_another_sessions_inference']}"
            f" (eos→audio p50 {ms(con['end_of_speech_to_first_audio_overlapped']['p50'])}),"
            f" alone: {con['turns_alone']} (p50 {ms(con['end_of_speech_to_first_audio_alone']['p50'])})"
        )
    else:
        lines.append(
            f"{'sessions':>8} {'probe p50':>10} {'p95':>8} {'p99':>8} {'n':>6} {'started p99':>12}"
            f" {'stopped p99':>12} {'loop lag p99':>13} {'srv CPU':>8} {'cli CPU':>8}  result"
        )
        for s in report["steps"]:
            pr = s["probe_delay_s"]
            cpu = s["server"].get("cpu_cores_busy")
            lines.append(
                f"{s['sessions']:>8} {ms(pr['p50']):>10} {ms(pr['p95']):>8} {ms(pr['p99']):>8} {pr['n']:>6}"
                f" {ms(s['speech_started_decision_s']['p99']):>12} {ms(s['speech_stopped_decision_s']['p99']):>12}"
                f" {ms(s['server']['loop_lag']['p99']):>13} {'—' if cpu is None else f'{cpu:.2f}':>8}"
                f" {s['client']['cpu_cores_busy']:>8.2f}  {'ok' if s['passed'] else 'over target'}"
            )
        lines.append(f"knee: {report['knee_sessions']} sessions with p99 ≤ {st.get('target_ms')} ms")
    srv = report.get("server")
    if srv:
        lag = srv["loop_lag"]
        lines.append(
            f"server: event-loop lag p50 {ms(lag['p50'])} p99 {ms(lag['p99'])}"
            f" (share ≤ 20 ms: {_share(lag, '0.02')}); {srv['messages_per_s'] or 0:.0f} messages/s"
            f" ({srv['events_in']} in, {srv['events_out']} out)"
        )
        if "cpu_s" in srv:
            lines.append(
                f"server: CPU {srv['cpu_s']:.1f} s ({srv['cpu_cores_busy']:.2f} cores busy),"
                f" {srv.get('cpu_s_per_turn') or 0:.3f} s per turn,"
                f" {srv.get('cpu_s_per_session_second', 0) * 1000:.2f} ms per session-second;"
                f" RSS {srv['rss_mb_before']:.0f} → {srv['rss_mb_after']:.0f} MB (peak {srv['rss_mb_peak']:.0f})"
            )
            lines.append(
                f"server event-loop thread: on a CPU {srv['loop_thread_cpu_share'] * 100:.0f} % of the time,"
                f" runnable but waiting for a CPU {srv['loop_thread_waiting_for_cpu_share'] * 100:.0f} %;"
                f" {srv.get('loop_thread_cpu_us_per_event_in', 0):.0f} µs of its CPU per client event"
            )
        breakdown = report.get("server_turn_log_s")
        if breakdown and breakdown.get("turns"):
            lines.append(
                "server waterfall from the last word heard, p50 of each step: "
                + ", ".join(f"{k} {ms(v['p50'])}" for k, v in breakdown["steps"].items())
            )
            median = breakdown["median_turn"]
            if median:
                lines.append(
                    "the median turn's waterfall: "
                    + ", ".join(f"{k.removesuffix('_ms')} {v} ms" for k, v in median.items() if k.endswith("_ms"))
                    + f"; {median.get('clause_tokens', '?')} tokens to the first clause,"
                    f" answered ahead: {'yes' if median.get('ahead') else 'no'}"
                )
            read, reused = breakdown["input_tokens"]["p50"], breakdown["cached_tokens"]["p50"]
            lines.append(
                f"answered ahead {breakdown['answered_ahead']} of {breakdown['turns']} turns; prompt tokens p50"
                f" {'?' if read is None else f'{read:.0f}'}, of them reused p50"
                f" {'?' if reused is None else f'{reused:.0f}'}"
                f" ({breakdown['turns_with_cached_tokens']} turns reused any)"
            )
        tfa = srv["turn_first_audio"]
        if tfa["count"]:
            lines.append(f"server-side speech_stopped → first audio sent: p50 {ms(tfa['p50'])} p99 {ms(tfa['p99'])}")
    cli = report.get("client")
    if cli:
        lines.append(
            f"client: CPU {cli['cpu_cores_busy']:.2f} cores, loop lag p99 {ms(cli['loop_lag_s']['p99'])},"
            f" append lateness p99 {ms(cli['send_lateness_s']['p99'])}"
        )
    cpu = report.get("cpu")
    if cpu:
        lines.append(_cpu_line(cpu))
    c = report["counts"]
    lines.append(
        f"sessions {c['sessions_opened']}, rejections {c['rejections']}, error events {c['error_events']},"
        f" foreign events {c['foreign_events']}, lost events {c['lost_events']}, unanswered {c['unanswered_turns']},"
        f" unexpected {c['unexpected_events']} → {'OK' if report['ok'] else 'FAILED'}"
    )
    for f in report["failures"][:10]:
        lines.append(f"  ! {f.get('at_s', 0):7.1f} s, session {f['session']}: {f['kind']}: {f['detail']}")
    return "\n".join(lines)


def _cpu_line(cpu: dict[str, Any]) -> str:
    def cores(key: str) -> str:
        v = cpu.get(key)
        return "?" if v is None else f"{v:.2f}"

    return (
        f"machine CPU: {cores('machine_cores_busy')} cores busy (server {cores('server_cores_busy')},"
        f" this client {cores('client_cores_busy')}, other processes {cores('other_processes_cores_busy')})"
    )


def _share(hist: dict[str, Any], bound: str) -> str:
    v = hist.get("share_le", {}).get(bound)
    return "—" if v is None else f"{v * 100:.1f} %"

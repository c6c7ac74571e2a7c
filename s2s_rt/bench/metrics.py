"""The server's ``/metrics``: parsing, the difference of two scrapes, and the server figures of a window."""

from __future__ import annotations

import math
import re
from typing import Any

from s2s_rt.bench.procfs import ProcSample

Labels = tuple[tuple[str, str], ...]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, Labels], float]:
    """Prometheus text format to ``{(name, sorted labels): value}``."""
    out: dict[tuple[str, Labels], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


class MetricsDelta:
    """The difference between two ``/metrics`` scrapes."""

    def __init__(self, before: dict[tuple[str, Labels], float], after: dict[tuple[str, Labels], float]) -> None:
        self.values = {k: v - before.get(k, 0.0) for k, v in after.items()}

    def total(self, name: str, **match: str) -> float:
        """Sum of a counter's increase over every label set containing ``match``."""
        return sum(
            v
            for (n, labels), v in self.values.items()
            if n == name and all((k, val) in labels for k, val in match.items())
        )

    def histogram(self, name: str, **match: str) -> dict[str, Any]:
        """Count, mean, p50/p95/p99 (interpolated inside buckets) and share ≤ each bound."""
        buckets: dict[float, float] = {}
        for (n, labels), v in self.values.items():
            if n != f"{name}_bucket":
                continue
            d = dict(labels)
            if any(d.get(k) != val for k, val in match.items()):
                continue
            le = math.inf if d["le"] == "+Inf" else float(d["le"])
            buckets[le] = buckets.get(le, 0.0) + v
        count = buckets.get(math.inf, 0.0)
        total = self.total(f"{name}_sum", **match)
        bounds = sorted(buckets)
        result: dict[str, Any] = {"count": int(count), "mean": total / count if count else None}
        for q in (50, 95, 99):
            result[f"p{q}"] = _bucket_quantile(bounds, buckets, q / 100)
        result["share_le"] = {f"{b:g}": (buckets[b] / count if count else None) for b in bounds if b != math.inf}
        return result


def _bucket_quantile(bounds: list[float], cumulative: dict[float, float], q: float) -> float | None:
    count = cumulative.get(math.inf, 0.0)
    if not count:
        return None
    rank = q * count
    prev_bound, prev_cum = 0.0, 0.0
    for b in bounds:
        cum = cumulative[b]
        if cum >= rank:
            if b == math.inf:
                return prev_bound  # above the last finite bound: report that bound
            if cum == prev_cum:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_cum) / (cum - prev_cum)
        prev_bound, prev_cum = b, cum
    return None


def server_figures(
    delta: MetricsDelta, proc0: ProcSample | None, proc1: ProcSample | None, seconds: float
) -> dict[str, Any]:
    """Server-side resource and latency figures over one measured window."""
    events_in = delta.total("s2s_events_in_total")
    events_out = delta.total("s2s_events_out_total")
    out: dict[str, Any] = {
        "window_s": seconds,
        "events_in": int(events_in),
        "events_out": int(events_out),
        "messages_per_s": (events_in + events_out) / seconds if seconds > 0 else None,
        "loop_lag": delta.histogram("s2s_event_loop_lag_seconds"),
        "stage_seconds": {s: delta.histogram("s2s_stage_seconds", stage=s) for s in ("vad", "stt", "llm", "tts")},
        "turn_first_audio": delta.histogram("s2s_turn_first_audio_seconds"),
        "errors": {dict(k[1]).get("code", ""): v for k, v in delta.values.items() if k[0] == "s2s_errors_total" and v},
        "rejections": delta.total("s2s_rejections_total"),
    }
    for name, metric in (
        ("speculative_transcriptions", "s2s_speculative_stt_total"),
        ("speculative_responses", "s2s_speculative_responses_total"),
        ("conversation_read_ahead", "s2s_llm_prefix_primes_total"),
    ):
        out[name] = {dict(k[1]).get("outcome", ""): v for k, v in delta.values.items() if k[0] == metric and v}
    if proc0 and proc1:
        cpu = proc1.cpu_s - proc0.cpu_s
        out |= {
            "cpu_s": cpu,
            "cpu_cores_busy": cpu / seconds if seconds > 0 else None,
            "rss_mb_before": proc0.rss_mb,
            "rss_mb_after": proc1.rss_mb,
            "rss_mb_peak": proc1.hwm_mb,
            "threads": proc1.threads,
            "loop_thread_cpu_share": (proc1.main_cpu_s - proc0.main_cpu_s) / seconds if seconds > 0 else None,
            "loop_thread_waiting_for_cpu_share": (proc1.main_wait_s - proc0.main_wait_s) / seconds
            if seconds > 0
            else None,
        }
        if events_in:
            # The event loop's own CPU per client event: what bounds messages per second.
            out["loop_thread_cpu_us_per_event_in"] = (proc1.main_cpu_s - proc0.main_cpu_s) / events_in * 1e6
            out["process_cpu_us_per_event_in"] = cpu / events_in * 1e6
    return out

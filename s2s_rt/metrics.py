"""Process metrics in the Prometheus text exposition format.

A handful of counters, gauges and histograms with labels: enough for
``/metrics`` without a client library. Updated only from the event loop
(or with the GIL's atomic int adds), read when scraped.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterable

Labels = tuple[tuple[str, str], ...]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _fmt_labels(labels: Labels, extra: Iterable[tuple[str, str]] = ()) -> str:
    pairs = list(labels) + list(extra)
    if not pairs:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def labels_key(**labels: str) -> Labels:
    """The key a metric keeps its value under for these labels."""
    return tuple(sorted(labels.items()))


class Counter:
    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = name, help
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.add(labels_key(**labels), amount)

    def add(self, key: Labels, amount: float = 1.0) -> None:
        """:meth:`inc` with the labels' key made once (:func:`labels_key`), for the hottest paths."""
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(labels_key(**labels), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        lines += [f"{self.name}{_fmt_labels(k)} {v:g}" for k, v in sorted(self.values.items())]
        return lines


class Gauge:
    """A gauge whose values are read from a callback at scrape time."""

    def __init__(self, name: str, help: str, read: Callable[[], dict[Labels, float]]) -> None:
        self.name, self.help, self.read = name, help, read

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        lines += [f"{self.name}{_fmt_labels(k)} {v:g}" for k, v in sorted(self.read().items())]
        return lines


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help, buckets
        self.series: dict[Labels, list[float]] = {}  # bucket counts…, sum, count

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [0.0] * (len(self.buckets) + 2)
        s[bisect.bisect_left(self.buckets, value)] += 1
        s[-2] += value
        s[-1] += 1

    def count(self, **labels: str) -> float:
        s = self.series.get(tuple(sorted(labels.items())))
        return s[-1] if s else 0.0

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, s in sorted(self.series.items()):
            cumulative = 0.0
            for bound, n in zip(self.buckets, s, strict=False):
                cumulative += n
                lines.append(f"{self.name}_bucket{_fmt_labels(key, [('le', f'{bound:g}')])} {cumulative:g}")
            lines.append(f"{self.name}_bucket{_fmt_labels(key, [('le', '+Inf')])} {s[-1]:g}")
            lines.append(f"{self.name}_sum{_fmt_labels(key)} {s[-2]:g}")
            lines.append(f"{self.name}_count{_fmt_labels(key)} {s[-1]:g}")
        return lines


class Metrics:
    """Every metric the server exports, by name."""

    def __init__(
        self,
        slot_states: Callable[[], dict[str, int]],
        hung_calls: Callable[[], int],
        held_bytes: Callable[[], dict[str, int]] = dict,
        llm_prefixes: Callable[[], dict[str, int]] = dict,
        listening: Callable[[], dict[str, float]] = dict,
    ) -> None:
        self.sessions_total = Counter("s2s_sessions_total", "Sessions started.")
        self.rejections = Counter("s2s_rejections_total", "Connections refused, by reason.")
        self.client_secrets = Counter("s2s_client_secrets_total", "Client secrets minted.")
        self.events_in = Counter("s2s_events_in_total", "Client events received, by type.")
        self.events_out = Counter("s2s_events_out_total", "Server events sent, by type.")
        self.errors = Counter("s2s_errors_total", "Error events sent, by code.")
        self.dropped_stale = Counter("s2s_stale_dropped_total", "Work dropped as stale, by stage.")
        self.media_dropped = Counter(
            "s2s_media_packets_dropped_total",
            "Callers' media datagrams dropped unread, past their call's budget (a flood), by transport.",
        )
        self.stage_restarts = Counter("s2s_stage_restarts_total", "Slot task groups restarted after a crash.")
        self.turns = Counter("s2s_turns_total", "Responses finished, by status.")
        self.speculations = Counter(
            "s2s_speculative_stt_total", "Transcriptions started in a turn's closing silence, by outcome."
        )
        self.primes = Counter(
            "s2s_llm_prefix_primes_total",
            "Conversations read ahead after an answer so the next reads only its new turn, by outcome.",
        )
        self.speculative_responses = Counter(
            "s2s_speculative_responses_total",
            "Answers started in a turn's closing silence, by outcome (used, or discarded when speech returned).",
        )
        self.tool_calls = Counter(
            "s2s_tool_calls_total",
            "Function calls the model made, by outcome: sent to the client, invalid (retried or told),"
            " invented (a function not offered: not sent, the answer asked again in words),"
            " or repeated (the same call as one already answered, not a retry after an error result: not sent,"
            " answered in words instead).",
        )
        self.llm_prefixes = Gauge(
            "s2s_llm_engine",
            "The local LLM: conversation state kept (prefix_tokens, prefixes), model reloads to forget it,"
            " answers resumed after giving way to one not yet heard.",
            lambda: {(("what", k),): float(v) for k, v in llm_prefixes().items()},
        )
        self.listening = Gauge(
            "s2s_listening",
            "The listening clock: busy seconds per second of one session's audio (cost), the fraction of the"
            " time it would be busy with every admitted session streaming (load), and how late its last batch"
            " started (lag_seconds).",
            lambda: {(("what", k),): v for k, v in listening().items()},
        )
        self.stage_latency = Histogram("s2s_stage_seconds", "Time per engine call, by stage.")
        self.turn_waterfall = Histogram(
            "s2s_turn_waterfall_seconds",
            "From the user's last word to each step of the answer (completed turns that ended by voice activity):"
            " silence (the turn's end decided), speculated (transcription begun in the silence), transcribed,"
            " boarded (the answer took its place in a call into the model), prompt_read (first token),"
            " first_clause (its last token), synthesised (its speech ready),"
            " audio_sent (first audio delta written), done (response.done written).",
        )
        self.turn_latency = Histogram(
            "s2s_turn_first_audio_seconds", "End of user speech to first response audio sent."
        )
        self.loop_lag = Histogram(
            "s2s_event_loop_lag_seconds",
            "Lateness of a 50 ms ticker on the event loop.",
            (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
        )
        self.sessions_active = Gauge(
            "s2s_sessions_active", "Sessions being served.", lambda: {(): slot_states().get("active", 0)}
        )
        self.slots = Gauge(
            "s2s_slots",
            "Slots by state.",
            lambda: {(("state", k),): float(v) for k, v in slot_states().items()},
        )
        self.hung = Gauge(
            "s2s_inference_calls_overdue",
            "Engine calls whose caller gave up (deadline or cancellation) still running on a thread.",
            lambda: {(): float(hung_calls())},
        )
        self.held = Gauge(
            "s2s_session_bytes",
            "Bytes sessions hold, by budget (output, input_audio, conversation; resampler_cache: plans all share).",
            lambda: {(("budget", k),): float(v) for k, v in held_bytes().items()},
        )
        self.rss = Gauge("process_resident_memory_bytes", "Resident memory of this process.", _resident_bytes)

    def render(self) -> str:
        lines: list[str] = []
        for metric in vars(self).values():
            lines += metric.render()
        return "\n".join(lines) + "\n"


def _resident_bytes() -> dict[tuple[tuple[str, str], ...], float]:
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):  # not Linux
        return {}
    return {(): float(pages * os.sysconf("SC_PAGE_SIZE"))}

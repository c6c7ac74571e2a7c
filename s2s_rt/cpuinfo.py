"""What ``/proc/cpuinfo`` says about this machine's CPU: its name and its flags.

One reader for the server's choices (:func:`s2s_rt.engines.device.multiplies_int8_fast`),
the load script's machine line and the evaluations' reports.
"""

from __future__ import annotations

import platform


def cpuinfo_field(name: str, text: str | None = None) -> str | None:
    """The first value of field ``name`` (``"model name"``, ``"flags"``) in ``text`` (``/proc/cpuinfo``'s,
    read when None); None where there is no such field or no such file."""
    if text is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
                text = file.read()
        except OSError:
            return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_name() -> str:
    """The CPU's model name, as ``/proc/cpuinfo`` gives it (else the platform's word, else "unknown")."""
    return cpuinfo_field("model name") or platform.processor() or "unknown"


def cpu_flags(text: str | None = None) -> frozenset[str] | None:
    """The x86 flags of ``/proc/cpuinfo`` (``text``, read when None); None where it lists none (ARM, no file)."""
    flags = cpuinfo_field("flags", text)
    return None if flags is None else frozenset(flags.split())

"""``s2s-rt gpu-check`` (``make gpu-check``): the GPU path proven on a machine with an NVIDIA GPU.

Each step prints what it found; the first that fails stops the check with a
message saying what is missing, and exit status 2.

1. **The GPU.** ``nvidia-smi`` names it (model, driver, memory) and
   CTranslate2 counts the CUDA devices it can open. Without one, the check
   refuses: nothing runs, and the server itself runs on the CPU
   (``--device auto`` chooses it).
2. **CUDA's libraries.** CTranslate2 (Whisper, the LLM) and ONNX Runtime
   (Silero, Piper) load cuBLAS, cuDNN 9 and the CUDA 12 runtime at run time.
   When ONNX Runtime's CUDA provider does not load, ``--install`` puts
   NVIDIA's wheels into this environment with pip and runs the check again
   with their libraries on ``LD_LIBRARY_PATH``.
3. **Each engine on the GPU.** The default stack is loaded with ``--device
   cuda``: Whisper's and the LLM's CTranslate2 models must be on ``cuda``,
   and Silero's and Piper's sessions must have ``CUDAExecutionProvider``
   first. ``--device auto`` must choose CUDA too.
4. **Load.** The load script (``s2s-rt bench --mode talk --spawn``) against a
   server on the GPU: one session alone (single fresh), then 32 talkers.
5. **The figures**, as a section of BENCHMARKS.md (``--out``, and printed).

``--cpu-rehearsal`` runs steps 3 to 5 on the CPU (fewer talkers), to try the
script on a machine without a GPU; its figures say so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: NVIDIA's wheels with the libraries CTranslate2 4.x and onnxruntime-gpu 1.2x/1.3x load (CUDA 12, cuDNN 9).
CUDA_WHEELS = (
    "nvidia-cuda-runtime-cu12",
    "nvidia-cublas-cu12",
    "nvidia-cudnn-cu12>=9,<10",
    "nvidia-cufft-cu12",
    "nvidia-curand-cu12",
)
#: Set when the check runs again after installing the wheels (it does not install twice).
AGAIN = "S2S_RT_GPU_CHECK_AGAIN"


class Refused(Exception):
    """A step found something missing: the check stops, saying what."""


def say(line: str) -> None:
    print(f"gpu-check: {line}", flush=True)


# --- 1. the GPU -----------------------------------------------------------------------------------


def find_gpu() -> str:
    """The GPU, as ``nvidia-smi`` names it; refuses when there is none CTranslate2 can open."""
    import ctranslate2

    smi = shutil.which("nvidia-smi")
    named = ""
    if smi is not None:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        named = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    count = ctranslate2.get_cuda_device_count()
    if count == 0 or not named:
        seen = f"nvidia-smi: {named or ('not found' if smi is None else 'no GPU listed')}"
        raise Refused(
            f"no NVIDIA GPU here ({seen}; CTranslate2 sees {count} CUDA devices). Nothing was run on a GPU. "
            "The server runs on the CPU on this machine (--device auto chooses it); run this check where "
            "`nvidia-smi` lists a GPU, or try the script itself with --cpu-rehearsal."
        )
    return f"{named} ({count} CUDA device{'s' if count > 1 else ''} for CTranslate2)"


# --- 2. CUDA's libraries --------------------------------------------------------------------------


def cuda_libraries(install: bool) -> str:
    """Whether both runtimes load CUDA; with ``install``, NVIDIA's wheels are installed and the check restarts."""
    from s2s_rt.engines.device import resolve_device

    choice = resolve_device("auto")
    if choice.kind == "cuda" and choice.onnx_cuda:
        return choice.describe()
    if not install or os.environ.get(AGAIN):
        raise Refused(
            f"CUDA's libraries do not load: {choice.describe()}. Install them (pip install "
            + " ".join(f"'{w}'" for w in CUDA_WHEELS)
            + ", or the CUDA 12 toolkit and cuDNN 9) and put their lib folders on LD_LIBRARY_PATH; "
            "`make gpu-check` does so itself (--install)"
        )
    say("CUDA's libraries do not load yet; installing NVIDIA's wheels: " + " ".join(CUDA_WHEELS))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *CUDA_WHEELS], check=True)
    libs = [str(p) for p in nvidia_lib_dirs()]
    env = dict(os.environ, **{AGAIN: "1"})
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])
    say(f"running again with {len(libs)} library folders on LD_LIBRARY_PATH")
    os.execve(sys.executable, [sys.executable, "-m", "s2s_rt", "gpu-check", *sys.argv[2:]], env)
    raise AssertionError("unreachable")  # execve does not return


def nvidia_lib_dirs() -> list[Path]:
    """The ``lib`` folders of NVIDIA's wheels installed in this environment."""
    import site

    roots = [Path(p) / "nvidia" for p in [*site.getsitepackages(), site.getusersitepackages()]]
    return sorted({lib for root in roots if root.is_dir() for lib in root.glob("*/lib") if lib.is_dir()})


# --- 3. each engine -----------------------------------------------------------------------------------


def engines_on(device: str) -> list[str]:
    """Load the default stack on ``device``; a line per engine saying where it runs (refused when elsewhere)."""
    from s2s_rt.config import Config
    from s2s_rt.engines.device import CPU_PROVIDER, CUDA_PROVIDER, resolve_device
    from s2s_rt.server.stack import load_stack

    started = time.perf_counter()
    stack = load_stack(Config(stack="default", device=device))
    loaded = time.perf_counter() - started
    want_ct2, want_onnx = ("cuda", CUDA_PROVIDER) if device.startswith("cuda") else ("cpu", CPU_PROVIDER)
    found = {
        "STT (Whisper, CTranslate2)": str(getattr(stack.stt, "device", "?")),
        "LLM (CTranslate2)": str(getattr(stack.llm, "device", "?")),
        "VAD (Silero, ONNX Runtime)": (getattr(stack.vad, "providers", None) or ["?"])[0],
        "TTS (Piper, ONNX Runtime)": (getattr(stack.tts, "providers", None) or ["?"])[0],
    }
    lines = [f"{name}: {where}" for name, where in found.items()]
    wrong = [line for line, where in zip(lines, found.values(), strict=True) if where not in (want_ct2, want_onnx)]
    if wrong:
        raise Refused(f"on --device {device}, these engines run elsewhere: {'; '.join(wrong)}")
    if device.startswith("cuda"):
        auto = resolve_device("auto")
        if auto.kind != "cuda" or not auto.onnx_cuda:
            raise Refused(f"--device auto does not choose CUDA: {auto.describe()}")
        lines.append(f"--device auto: {auto.describe()}")
    lines.append(f"loaded in {loaded:.1f} s")
    return lines


# --- 4. load ----------------------------------------------------------------------------------------


def load_run(device: str, stack: str, sessions: int, turns: int, folder: Path) -> dict[str, Any]:
    """One run of the load script against a spawned server on ``device``; its summary figures."""
    out = folder / f"talk-{sessions}.json"
    command = [
        sys.executable, "-m", "s2s_rt", "bench", "--mode", "talk", "--spawn", "--stack", stack,
        "--server-arg=--device", f"--server-arg={device}", "--sessions", str(sessions), "--turns", str(turns),
        "--ramp-s", "2", "--quiet", "--json", str(out),
    ]  # fmt: skip
    say(f"load: {sessions} session(s) x {turns} turns on {device}")
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if not out.is_file():
        raise Refused(f"the load script wrote no report (exit {done.returncode}): {done.stderr[-2000:]}")
    report = json.loads(out.read_text())
    first = report["intervals_s"]["END OF SPEECH → FIRST AUDIO DELTA"]
    answered = sum(1 for t in report["turns"] if not t.get("failure"))
    return {
        "sessions": sessions,
        "turns": len(report["turns"]),
        "answered": answered,
        "p50_ms": _ms(first["p50"]),
        "p95_ms": _ms(first["p95"]),
        "max_ms": _ms(first["max"]),
        "seconds": round(time.perf_counter() - started, 1),
        "ok": bool(report.get("ok")),
    }


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


# --- 5. the figures ---------------------------------------------------------------------------------


def figures(hardware: str, engines: list[str], runs: list[dict[str, Any]], rehearsal: bool) -> str:
    """The check's figures as a BENCHMARKS.md section."""
    title = "GPU check" + (" (a rehearsal on the CPU: no GPU figures)" if rehearsal else "")
    lines = [
        f"## {title}",
        "",
        f"`s2s-rt gpu-check`, {time.strftime('%Y-%m-%d')}, on {hardware}; Python {platform.python_version()}.",
        "",
        *[f"- {line}" for line in engines],
        "",
        "| sessions | turns answered | end of speech → first audio p50 | p95 | max | run |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['sessions']} | {r['answered']}/{r['turns']} | {r['p50_ms']} ms | {r['p95_ms']} ms"
            f" | {r['max_ms']} ms | {r['seconds']} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="s2s-rt gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", action="store_true", help="pip-install NVIDIA's CUDA wheels when needed")
    parser.add_argument("--cpu-rehearsal", action="store_true", help="run steps 3-5 on the CPU (no GPU needed)")
    parser.add_argument("--stack", default="default", choices=["default", "fake"], help="the load's stack (default)")
    parser.add_argument("--talkers", type=int, default=32, help="concurrent talkers of the second run (32)")
    parser.add_argument("--turns", type=int, default=4, help="spoken turns per session (4)")
    parser.add_argument("--out", default="gpu-check.md", help="where the BENCHMARKS.md section is written")
    opts = parser.parse_args(sys.argv[2:] if argv is None else argv)
    try:
        if opts.cpu_rehearsal:
            device, hardware = "cpu", f"{os.cpu_count()} CPU cores, no GPU (a rehearsal of the script)"
            say("rehearsal on the CPU: steps 1 and 2 (the GPU, CUDA's libraries) are skipped")
        else:
            hardware = find_gpu()
            say(f"1. the GPU: {hardware}")
            say(f"2. CUDA's libraries: {cuda_libraries(opts.install)}")
            device = "cuda"
        engines = engines_on(device) if opts.stack == "default" else [f"{opts.stack} stack: no engines to place"]
        for line in engines:
            say(f"3. {line}")
        with tempfile.TemporaryDirectory(prefix="s2s-rt-gpu-check-") as tmp:
            runs = [load_run(device, opts.stack, n, opts.turns, Path(tmp)) for n in (1, opts.talkers)]
        for r in runs:
            say(f"4. {r['sessions']} session(s): {r['answered']}/{r['turns']} answered, p50 {r['p50_ms']} ms")
        text = figures(hardware, engines, runs, opts.cpu_rehearsal)
        Path(opts.out).write_text(text)
        say(f"5. figures written to {opts.out}:\n\n{text}")
        unanswered = [r for r in runs if r["answered"] < r["turns"]]
        if unanswered:
            raise Refused(f"turns went unanswered: {unanswered}")
    except Refused as exc:
        print(f"gpu-check: refused: {exc}", file=sys.stderr)
        return 2
    return 0

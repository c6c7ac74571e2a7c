"""``s2s-rt gpu-check`` (issue 42): refuses clearly without a GPU, places each engine, and runs as a rehearsal here.

No GPU is lent to these machines: what needs one is the script's own run on a
GPU machine (``make gpu-check``). What can be shown here is that it refuses
without one, saying so; that its engine check refuses an engine left on the
CPU when CUDA was asked for; and that the rest of it (the load, the figures)
runs end to end on the CPU (``--cpu-rehearsal``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import ctranslate2
import pytest

from s2s_rt.bench import gpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(ctranslate2.get_cuda_device_count() > 0, reason="this machine has a GPU")
def test_without_a_gpu_the_check_refuses_saying_what_is_missing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "s2s_rt", "gpu-check"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "gpu-check: refused: no NVIDIA GPU here" in done.stderr, done.stderr
    assert "CTranslate2 sees 0 CUDA devices" in done.stderr and "--cpu-rehearsal" in done.stderr
    assert not (ROOT / "gpu-check.md").exists() or "rehearsal" in (ROOT / "gpu-check.md").read_text()


def test_an_engine_left_on_the_cpu_when_cuda_was_asked_for_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    stack = SimpleNamespace(
        stt=SimpleNamespace(device="cuda"),
        llm=SimpleNamespace(device="cpu"),  # CTranslate2 on the CPU
        vad=SimpleNamespace(providers=["CUDAExecutionProvider", "CPUExecutionProvider"]),
        tts=SimpleNamespace(providers=["CPUExecutionProvider"]),  # ONNX Runtime's CUDA provider did not load
    )
    monkeypatch.setattr("s2s_rt.server.stack.load_stack", lambda config: stack)
    with pytest.raises(gpu.Refused) as refused:
        gpu.engines_on("cuda")
    assert "LLM (CTranslate2): cpu" in str(refused.value) and "TTS (Piper, ONNX Runtime): CPUExecutionProvider" in str(
        refused.value
    )
    assert "STT" not in str(refused.value) and "VAD" not in str(refused.value)


def test_the_rehearsal_runs_the_load_and_writes_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.md"
    done = subprocess.run(
        [sys.executable, "-m", "s2s_rt", "gpu-check", "--cpu-rehearsal", "--stack", "fake", "--talkers", "3",
         "--turns", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    text = out.read_text()
    assert text.startswith("## GPU check (a rehearsal on the CPU: no GPU figures)"), text
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert [r.split(" | ")[1] for r in rows] == ["2/2", "6/6"], text
    assert all(" ms |" in r and "None" not in r for r in rows), text

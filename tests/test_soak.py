"""The soak script itself works (the 10-minute run is `make soak`, outside the suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_short_soak_leaves_every_slot_idle_and_no_descriptor_open(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bin" / "s2s-rt-soak"),
            "--minutes",
            "0.25",
            "--sessions",
            "10",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(out.read_text())
    assert proc.returncode == 0, (result["checks"], proc.stderr[-2000:])
    assert all(result["checks"].values())
    assert result["stats"]["completed"] > 10 and result["stats"]["client_errors"] == 0

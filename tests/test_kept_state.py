"""The start-up check of the kept model state: used only where a prompt read after it is read as one read whole."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from s2s_rt.engines.kept_state import KEPT_STATE_TOLERANCE, MIN_KEPT_TOKENS, check_kept_state

PROBE = list(range(100, 140))
WHOLE = np.linspace(-20.0, 30.0, 50)


def reader(differ_at: dict[int, float]) -> tuple[list[int], Callable[[Sequence[int], Sequence[int]], np.ndarray]]:
    """Fake ``next_logits``: the whole reading's logits, moved by ``differ_at[k]`` when ``k`` tokens are kept."""
    splits: list[int] = []

    def next_logits(kept: Sequence[int], rest: Sequence[int]) -> np.ndarray:
        assert [*kept, *rest] == PROBE
        if kept:
            splits.append(len(kept))
        logits = WHOLE.copy()
        logits[3] += differ_at.get(len(kept), 0.0)
        return logits

    return splits, next_logits


def test_logits_that_match_within_float_rounding_are_trusted_after_three_splits() -> None:
    splits, next_logits = reader({k: 1e-5 for k in range(1, len(PROBE))})
    check = check_kept_state(next_logits, PROBE)
    assert check.trusted and check.max_difference == pytest.approx(1e-5)
    assert check.tolerance == pytest.approx(KEPT_STATE_TOLERANCE * 30.0)
    assert splits == list(check.splits) and len(splits) == 3
    # Each probe keeps, and then reads, no fewer tokens than an answer would keep or read.
    assert all(MIN_KEPT_TOKENS <= k <= len(PROBE) - MIN_KEPT_TOKENS for k in splits)
    assert "checked" in check.describe()


@pytest.mark.parametrize("difference", [0.5, float("nan")])
def test_one_split_that_differs_beyond_rounding_turns_the_kept_state_off(difference: float) -> None:
    splits, next_logits = reader({20: difference})  # the middle split only (as AVX2's int8 kernels do, now and then)
    check = check_kept_state(next_logits, PROBE)
    # Each piece size stops at its first split that differs; 24 tokens on either side do not fit 40.
    assert not check.trusted and splits == [8, 20, 16, 20] and check.splits == (8, 20, 16, 20)
    assert check.min_tokens == 0 and "kept model state off" in check.describe()


def test_where_short_pieces_are_read_otherwise_the_shortest_exact_size_is_trusted() -> None:
    """As oneDNN's int8 kernels at AVX-512 VNNI read them: pieces under 24 tokens differ, longer ones match."""
    probe = list(range(100, 172))
    whole = np.linspace(-20.0, 30.0, 50)
    splits: list[int] = []

    def next_logits(kept: Sequence[int], rest: Sequence[int]) -> np.ndarray:
        if kept:
            splits.append(len(kept))
        logits = whole.copy()
        if kept and min(len(kept), len(rest)) < 24:
            logits[3] += 0.8
        return logits

    check = check_kept_state(next_logits, probe)
    assert check.trusted and check.min_tokens == 24
    assert splits == [8, 16, 24, 36, 48]  # each size stops at its first split that differs
    assert "pieces of 24 tokens or more" in check.describe()


def _verdict(env: dict[str, str]) -> dict[str, Any]:
    """The start-up check of the tiny model in a fresh process with ``env`` added, and the engine after it."""
    script = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from s2s_rt.engines.default import _default_instructions
from s2s_rt.engines.llm import CT2ChatLLM
from s2s_rt.models import ensure_prepared
llm = CT2ChatLLM(ensure_prepared(llm="tiny", progress=lambda _l: None).llm,
                 cached_system_prompts=_default_instructions(), prefix_cache_tokens=1000)
check = llm.kept_state
print(json.dumps({"trusted": check.trusted, "difference": check.max_difference, "static": len(llm._static.prefixes),
                  "min_tokens": check.min_tokens,
                  "budget": llm.prefixes.budget_tokens, "describe": llm.describe()}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "log": done.stderr}


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 instruction sets")
def test_the_check_turns_the_kept_state_off_on_avx2_int8_kernels_and_only_there(default_models: object) -> None:
    """On an AMD EPYC (AVX2, no AVX-512) CTranslate2 multiplies int8 with oneDNN's AVX2 kernels; here they are
    forced (CT2_USE_MKL=0 ONEDNN_MAX_CPU_ISA=AVX2): a prompt read after a kept state got logits 0.9-2.8 away from
    reading it whole, and the tiny model another greedy answer. CT2_FORCE_CPU_ISA=AVX2 changes nothing:
    CTranslate2's own kernels are AVX2 on every x86 CPU unless AVX512 is asked for; the int8 products are not
    its own."""
    here = _verdict({})
    # This machine's verdict, whatever it is, is applied: the kept state is used exactly when it is trusted.
    assert (here["static"] == 2 and here["budget"] == 1000) == here["trusted"]
    assert ("kept model state off" in here["log"]) != here["trusted"]

    amd = _verdict({"CT2_USE_MKL": "0", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not amd["trusted"] and amd["static"] == 0 and amd["budget"] == 0
    assert float(amd["difference"]) > 0.1
    assert "kept model state off" in amd["log"] and "kept model state off" in str(amd["describe"])

    if "avx512_vnni" in open("/proc/cpuinfo").read():
        # oneDNN at this CPU's own ISA (CTranslate2's choice on AMD CPUs; on an AVX-512 VNNI EPYC, and on a Xeon
        # told CT2_USE_MKL=0): short pieces are read otherwise, pieces of 24 tokens exactly.
        onednn = _verdict({"CT2_USE_MKL": "0"})
        assert onednn["trusted"] and onednn["min_tokens"] > 8 and onednn["budget"] == 1000

    forced = _verdict({"CT2_FORCE_CPU_ISA": "AVX2"})
    assert forced["trusted"] == here["trusted"] and forced["static"] == here["static"]

"""The start-up check of kept model states: is a prompt read after one read as the whole prompt?"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from s2s_rt.engines.base import ChatMessage

#: A kept model state is used only when it, and what is read after it, are at least this many tokens.
#: CTranslate2's int8 matrix products on the CPU compute a block of one to three rows differently from a
#: taller one: on an AVX-512 VNNI Xeon a kept prefix of 2-3 tokens, or 1-2 tokens read after one, moved
#: the next token's logits by 0.7-3, where longer pieces matched a whole reading exactly.
MIN_KEPT_TOKENS = 8
#: How far a kept state's next-token logits may be from a whole reading's, as a fraction of the largest
#: logit: float rounding only. Measured on the CPU: 2e-7 of it (int8 with VNNI, or float32); int8 on AVX2
#: without VNNI, 3-10 %. On a GPU, 16-bit rounding may exceed it; the cache is then off, which costs
#: little there, where reading a prompt is fast.
KEPT_STATE_TOLERANCE = 1e-3
#: The start-up check's prompt: about 40 tokens, long enough for three splits with
#: :data:`MIN_KEPT_TOKENS` on either side, short enough to cost about 0.2 s on two cores.
PROBE = (
    ChatMessage("system", "You are a helpful voice assistant. Answer in one short, friendly sentence."),
    ChatMessage("user", "How many legs does a spider have, and why?"),
)


@dataclass(frozen=True, slots=True)
class KeptStateCheck:
    """Whether a prompt read after a kept model state is read as the whole prompt read at once.

    CTranslate2 computes a token's state in one matrix product with the
    other tokens read in the same pass. Where its int8 kernels give a row a
    result that depends on how many rows are multiplied with it (int8 on
    AVX2 without VNNI: oneDNN, CTranslate2's choice on AMD CPUs, and Intel
    MKL limited to AVX2 both do), a prompt read in two parts, as from a kept
    state, gets other logits than the same prompt read whole, and greedy
    answers differ: the cache would change what a user hears.
    """

    #: Every probe matched within float rounding: the kept state may be used.
    trusted: bool
    #: The largest difference of a next-token logit between the two readings.
    max_difference: float
    #: The largest difference allowed (float rounding).
    tolerance: float
    #: Tokens of the probe kept before the rest was read, one probe each.
    splits: tuple[int, ...]

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.trusted:
            return f"kept model state checked (next-token logits {self.max_difference:.1g} from a whole reading's)"
        return (
            f"kept model state off: a prompt read after a kept state got next-token logits "
            f"{self.max_difference:.2f} away from reading it whole (float rounding: at most {self.tolerance:.2g}; "
            f"CTranslate2's int8 kernels on this CPU depend on how many tokens are read together); "
            f"every answer reads its whole prompt"
        )


def check_kept_state(
    next_logits: Callable[[Sequence[int], Sequence[int]], np.ndarray], probe: Sequence[int]
) -> KeptStateCheck:
    """Compare a probe prompt read after kept states of its first tokens with the probe read whole.

    Args:
        next_logits: the logits of the token that follows ``kept + rest``,
            reading ``kept`` first as a kept state (nothing kept when empty),
            then ``rest``.
        probe: a prompt's token ids; at least ``2 * MIN_KEPT_TOKENS + 1``.

    Returns:
        the verdict, after up to three splits (it stops at the first that
        differs beyond float rounding).
    """
    whole = np.asarray(next_logits([], probe), dtype=np.float64)
    n = len(probe)
    splits = tuple(sorted({min(max(MIN_KEPT_TOKENS, n * i // 4), n - MIN_KEPT_TOKENS) for i in (1, 2, 3)}))
    tolerance = KEPT_STATE_TOLERANCE * max(1.0, float(np.abs(whole).max()))
    difference = 0.0
    for tried, k in enumerate(splits, 1):
        kept = np.asarray(next_logits(probe[:k], probe[k:]), dtype=np.float64)
        split_difference = float(np.abs(kept - whole).max())
        if not split_difference <= tolerance:  # NaN too
            return KeptStateCheck(False, split_difference, tolerance, splits[:tried])
        difference = max(difference, split_difference)
    return KeptStateCheck(True, difference, tolerance, splits)

"""The start-up check of kept model states: is a prompt read after one read as the whole prompt?"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from s2s_rt.engines.base import ChatMessage

#: A kept model state is used only when it, and what is read after it, are at least this many tokens: the
#: smallest of these sizes at which the start-up check finds every reading exact. CTranslate2's int8 matrix
#: products on the CPU may compute a short block of rows differently from a taller one. Measured on the
#: default model with a 72-token probe: on an AVX-512 VNNI Xeon with Intel MKL, every split matched (even 4
#: tokens); with oneDNN at the same ISA (CTranslate2's choice on AMD CPUs: ``CT2_USE_MKL=0`` on the Xeon, and
#: as seen on an AMD EPYC), pieces of 12 tokens or fewer moved the next token's logits by 0.8-1.1, and a
#: 16-token rest as much, while pieces of 24 and more matched exactly; with oneDNN limited to AVX2, no split
#: matched (0.8-1.0 at random sizes).
KEPT_PIECE_SIZES = (8, 16, 24, 32)
MIN_KEPT_TOKENS = KEPT_PIECE_SIZES[0]
#: How far a kept state's next-token logits may be from a whole reading's, as a fraction of the largest
#: logit: float rounding only. Measured on the CPU: 2e-7 of it (int8 with VNNI, or float32); int8 on AVX2
#: without VNNI, 3-10 %. On a GPU, 16-bit rounding may exceed it; the cache is then off, which costs
#: little there, where reading a prompt is fast.
KEPT_STATE_TOLERANCE = 1e-3
#: The start-up check's prompt: about 70 tokens, long enough for splits with the largest of
#: :data:`KEPT_PIECE_SIZES` on either side, short enough to cost about 0.1 s a reading on two cores.
PROBE = (
    ChatMessage(
        "system",
        "You are a helpful voice assistant. Answer in one short, friendly sentence, and never use lists, markdown"
        " or emoji: everything you say is read aloud by a speech synthesiser.",
    ),
    ChatMessage(
        "user", "How many legs does a spider have, and why do spiders have more legs than insects, which have six?"
    ),
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

    #: Every probe of some piece size matched within float rounding: the kept state may be used.
    trusted: bool
    #: The largest difference of a next-token logit between the two readings (of the size trusted, if any).
    max_difference: float
    #: The largest difference allowed (float rounding).
    tolerance: float
    #: Tokens of the probe kept before the rest was read, one probe each, of every size tried.
    splits: tuple[int, ...]
    #: The fewest tokens a kept state, and what is read after it, may have (0: none is used).
    min_tokens: int = 0

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.trusted:
            return (
                f"kept model state checked (next-token logits {self.max_difference:.1g} from a whole reading's,"
                f" in pieces of {self.min_tokens} tokens or more)"
            )
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

    Each piece size of :data:`KEPT_PIECE_SIZES` that fits the probe is
    tried in turn, smallest first: the probe is split so that the kept
    part, then the rest, has exactly that many tokens, and in the middle.
    The first size whose three splits all match is the one trusted.

    Args:
        next_logits: the logits of the token that follows ``kept + rest``,
            reading ``kept`` first as a kept state (nothing kept when empty),
            then ``rest``.
        probe: a prompt's token ids; at least ``2 * MIN_KEPT_TOKENS + 1``.

    Returns:
        the verdict (each size stops at its first split that differs beyond float rounding).
    """
    whole = np.asarray(next_logits([], probe), dtype=np.float64)
    n = len(probe)
    tolerance = KEPT_STATE_TOLERANCE * max(1.0, float(np.abs(whole).max()))
    tried: list[int] = []
    worst = 0.0
    for size in KEPT_PIECE_SIZES:
        if 2 * size + 1 > n:
            break
        difference = 0.0
        for k in sorted({size, n // 2, n - size}):
            tried.append(k)
            kept = np.asarray(next_logits(probe[:k], probe[k:]), dtype=np.float64)
            split_difference = float(np.abs(kept - whole).max())
            if not split_difference <= tolerance:  # NaN too
                worst = split_difference if np.isnan(split_difference) else max(worst, split_difference)
                break
            difference = max(difference, split_difference)
        else:
            return KeptStateCheck(True, difference, tolerance, tuple(tried), size)
    return KeptStateCheck(False, worst, tolerance, tuple(tried))

"""Word error rate: how far a transcript is from what was said.

Used by the load script to report transcription quality and by the tests
that check the real models.
"""

from __future__ import annotations

import re


def words(text: str) -> list[str]:
    """Lower-case words without punctuation, for comparing transcripts."""
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level edit distance over the reference's length (case and punctuation ignored)."""
    ref, hyp = words(reference), words(hypothesis)
    d = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, d[0] = d[0], i
        for j, h in enumerate(hyp, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r != h))
    return d[len(hyp)] / max(len(ref), 1)

"""Grading: is an answer right, and how far is a transcript from what was said."""

from __future__ import annotations

import re

from s2s_rt.evaluation.questions import TOLD_NOW, Question
from s2s_rt.speech_text import speakable
from s2s_rt.wer import word_error_rate


def is_right(question: Question, answer: str) -> bool:
    """Whether ``answer`` says every fact ``question`` asks for, and nothing it rules out.

    Patterns are matched on the answer as written and as it is spoken
    (numbers in words), so "56" and "fifty-six" are the same answer. Only a
    question about time may be answered with the date or the clock time.
    """
    spoken = speakable(answer)
    texts = (answer, spoken)
    if not all(any(re.search(p, t, re.IGNORECASE) for t in texts) for p in question.must):
        return False
    if question.kind != "time" and any(re.search(TOLD_NOW, t, re.IGNORECASE) for t in texts):
        return False
    return not any(re.search(p, spoken, re.IGNORECASE) for p in question.must_not)


def spoken_word_error_rate(reference: str, hypothesis: str) -> float:
    """Word error rate with numbers and symbols in words on both sides.

    Whisper writes "twenty" as "20"; counted as written, every number in a
    question would be an error although nothing was misheard.
    """
    return word_error_rate(speakable(reference), speakable(hypothesis))

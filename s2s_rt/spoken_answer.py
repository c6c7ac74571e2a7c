"""What the LLM is told besides the conversation, so that its answer suits a voice assistant.

A voice assistant is asked what day it is, and is spoken to in the language
the speech recogniser heard. The model knows neither: the user's words are
followed by the date when they ask for it and by the clock time when they
ask for that, and, when the user did not speak English, the system message
ends with the language to answer in; a default session's
instructions get worked examples. The server adds this to every answer
(:mod:`s2s_rt.pipeline.responding`), and the evaluation
(:mod:`s2s_rt.evaluation`) asks its questions the same way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime

from s2s_rt.engines.base import ChatMessage
from s2s_rt.engines.languages import language_code, language_name
from s2s_rt.protocol.config import SessionConfig
from s2s_rt.written_numbers import written

#: The longest user turn whose numbers are written in digits: this runs on the event loop, at about 1 µs a
#: character (0.2-0.5 s for a 200-350 kB message); a spoken request is a few hundred characters.
WRITTEN_MAX_CHARS = 4000
#: How much of the end of the user's last words is searched for a question about the date or the time: the
#: search runs on the event loop at 1.5-3 µs a character (a 200 kB typed message held the loop 0.59 s).
ASKS_MAX_CHARS = 1000

#: The instructions of a session whose client gives none.
DEFAULT_INSTRUCTIONS = SessionConfig().instructions
#: Worked examples that follow :data:`DEFAULT_INSTRUCTIONS` when no functions
#: are offered: short exact answers, and "I don't know" for what the model
#: cannot know. Measured on the evaluation (BENCHMARKS.md, "How good are the answers"): the
#: default model answered 39 of 52 questions right with them, 34 without;
#: with functions offered they made it answer "It is sunny in Paris" instead
#: of calling ``get_weather``, so they are left out then.
ANSWER_EXAMPLES = (
    "Examples:\n"
    "User: How many wheels does a bicycle have?\nAssistant: A bicycle has two wheels.\n"
    "User: What is nine times six?\nAssistant: Nine times six is fifty-four.\n"
    "User: Who won the game last night?\nAssistant: I'm sorry, I don't have the latest news or sports results.\n"
    "User: What is my favorite color?\nAssistant: I don't know that, you haven't told me."
)


_WEEKDAY = r"(monday|tuesday|wednesday|thursday|friday|saturday|sunday)"
_NUMBER = (
    r"(\d+|a|an|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|fifteen|twenty|thirty|forty|fifty"
    r"|sixty|ninety|a few|few|several|half an?)"
)
#: Words that ask for the date (the day, the month, the year, how far away a day is).
_ASKS_DATE = re.compile(
    r"\b(what|which|tell me)('s| is| was| will)?( the| today's| tomorrow's| yesterday's)? (date|day|year|month)\b"
    r"(?! (comes|came|is (after|before)|has|have|of the (month|year)\b(?! is)|are|do|does|did)\b)"
    r"|\b(today's|tomorrow's|yesterday's|the current|current) (date|day|year|month)\b"
    r"|\bday of the week (is (it|today|tomorrow)|today|tomorrow)\b|\bwhat day\b.*\b(today|tomorrow|yesterday)\b"
    rf"|\b(is|was|will) (it|today|tomorrow|yesterday)( be)? (a )?{_WEEKDAY}\b"
    r"|\bhow (many|much) (days|weeks|months|years|time)( are| is)?( (there|left))?"
    r" (until|till|to go|before|since|left)\b"
    r"|\bhow long (until|till|ago|since|before)\b|\bhow long is it (until|till|since)\b"
    r"|\bwhat('s| is) today\b|\bwhat date\b",
    re.IGNORECASE,
)
#: Words that ask for the clock time, or a time reckoned from it ("in twenty minutes", "an hour from now").
_ASKS_TIME = re.compile(
    r"\b(what|tell me)('s| is)?( the)?( current| exact)? time\b(?! (zone|does|do|did|of|for|to)\b)"
    r"|\btime is it\b|\bthe time (now|right now|here)\b|\bcurrent time\b|\bwhat hour\b"
    rf"|(?<!there )(?<!are )\bin {_NUMBER}( and a half)? (minutes?|hours?|mins?)\b"
    rf"|\b{_NUMBER} (minutes?|hours?) from now\b"
    r"|\bhow (long|many (minutes|hours)) (until|till|since|before|ago)\b",
    re.IGNORECASE,
)


def asks_date(words: str) -> bool:
    """Whether the user's words (their last :data:`ASKS_MAX_CHARS` characters) ask for today's date, or for a day
    reckoned from it (a weekday, days until…)."""
    return _ASKS_DATE.search(words[-ASKS_MAX_CHARS:]) is not None


def asks_time(words: str) -> bool:
    """Whether the user's words (their last :data:`ASKS_MAX_CHARS` characters) ask for the clock time, or for a time
    reckoned from it ("in twenty minutes")."""
    return _ASKS_TIME.search(words[-ASKS_MAX_CHARS:]) is not None


def date_context(now: datetime, *, date: bool = True, clock: bool = True) -> str:
    """The sentence that tells the model today's date, the clock time, or both (the server's local time)."""
    day = f"Today is {now:%A}, {now:%B} {now.day}, {now.year}"
    time = f"{now.hour % 12 or 12}:{now:%M} {now:%p}"
    if date and clock:
        return f"{day}, and the time is {time}."
    return f"{day}." if date else f"The time is {time}."


def language_context(language: str | None) -> str:
    """The sentence that ends the system message when the user spoke another language than English ("" for English)."""
    if not language or language_code(language) == "en":
        return ""
    name = language_name(language)
    return f"The user speaks {name}: answer in {name}."


def with_answer_context(
    messages: Sequence[ChatMessage],
    *,
    now: datetime | None = None,
    language: str | None = None,
    tools: bool = False,
    examples: bool = True,
) -> list[ChatMessage]:
    """``messages`` with the date after the user's last words and the language at the end of the system message.

    The date follows the user's words when the answer is to them (the last
    message) and they ask for it, in their last :data:`ASKS_MAX_CHARS`
    characters ("What day is it?", "how many days until…"), the clock time
    when they ask for that ("What time is it?",
    "in twenty minutes"); words that only mention time ("right now",
    "tomorrow") get neither, since the model repeats what it is told. The language to answer in ends the
    system message when it is not English. The server's default instructions get
    :data:`ANSWER_EXAMPLES` before the context when no functions are
    offered; a client's own instructions are left as they are. A
    conversation without a system message gets one only for a context.

    Args:
        messages: the conversation as the protocol builds it, system message first if any.
        now: the moment of the answer; None means now, in the server's local time.
        language: the language the user spoke, if known.
        tools: functions are offered to the model: the user's last words are shown with numbers and
            clock times said in words written in digits (:func:`s2s_rt.written_numbers.written`).
        examples: add :data:`ANSWER_EXAMPLES` where they belong (off only to measure them).
    """
    words = messages[-1].content if messages and messages[-1].role == "user" else ""
    date, clock = asks_date(words), asks_time(words)
    if words and tools and len(words) <= WRITTEN_MAX_CHARS and (digits := written(words)) != words:
        # A function's arguments want digits: "a quarter to six" is shown as "5:45" (s2s_rt.written_numbers).
        words = digits
        messages = [*messages[:-1], ChatMessage("user", words)]
    if date or clock:
        # After the question, not in the system message, which then stays the same from one answer to
        # the next (the server keeps the model state of the conversation so far: CT2ChatLLM.prime).
        dated = f"{words}\n\n({date_context(now or datetime.now(), date=date, clock=clock)})"
        messages = [*messages[:-1], ChatMessage("user", dated)]
    context = language_context(language)
    system = messages[0].content if messages and messages[0].role == "system" else None
    if system is None:
        return [ChatMessage("system", context), *messages] if context else list(messages)
    if examples and system == DEFAULT_INSTRUCTIONS and not tools:
        system = f"{system}\n\n{ANSWER_EXAMPLES}"
    return [ChatMessage("system", f"{system}\n\n{context}" if context else system), *messages[1:]]

"""What the LLM is told besides the conversation, so that its answer suits a voice assistant.

A voice assistant is asked what day it is, and is spoken to in the language
the speech recogniser heard. The model knows neither: the system message
gets the date and time, and, when the user did not speak English, the
language to answer in. The server adds this to every answer
(:mod:`s2s_rt.pipeline.responding`), and the evaluation
(:mod:`s2s_rt.evaluation`) asks its questions the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from s2s_rt.engines.base import ChatMessage
from s2s_rt.engines.languages import language_code, language_name
from s2s_rt.protocol.config import SessionConfig

#: The instructions of a session whose client gives none.
DEFAULT_INSTRUCTIONS = SessionConfig().instructions
#: Worked examples that follow :data:`DEFAULT_INSTRUCTIONS` when no functions
#: are offered: short exact answers, and "I don't know" for what the model
#: cannot know. Measured on the evaluation (BENCHMARKS.md, "Answers"): the
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


def answer_context(now: datetime, language: str | None = None) -> str:
    """The sentences added to the system message: the time, and the language to answer in.

    Args:
        now: the moment of the answer (the server's local time).
        language: the language the user spoke (ISO 639-1), if known.
    """
    hour = now.hour % 12 or 12
    context = f"Today is {now:%A}, {now:%B} {now.day}, {now.year}, and the time is {hour}:{now:%M} {now:%p}."
    if language and language_code(language) != "en":
        name = language_name(language)
        context += f" The user speaks {name}: answer in {name}."
    return context


def with_answer_context(
    messages: Sequence[ChatMessage],
    *,
    now: datetime | None = None,
    language: str | None = None,
    tools: bool = False,
    examples: bool = True,
) -> list[ChatMessage]:
    """``messages`` with :func:`answer_context` at the end of the system message (one is added if none).

    The server's default instructions get :data:`ANSWER_EXAMPLES` before the
    context when no functions are offered; a client's own instructions are
    left as they are.

    Args:
        messages: the conversation as the protocol builds it, system message first if any.
        now: the moment of the answer; None means now, in the server's local time.
        language: the language the user spoke, if known.
        tools: functions are offered to the model.
        examples: add :data:`ANSWER_EXAMPLES` where they belong (off only to measure them).
    """
    context = answer_context(now or datetime.now(), language)
    if messages and messages[0].role == "system":
        system = messages[0].content
        if examples and system == DEFAULT_INSTRUCTIONS and not tools:
            system = f"{system}\n\n{ANSWER_EXAMPLES}"
        return [ChatMessage("system", f"{system}\n\n{context}"), *messages[1:]]
    return [ChatMessage("system", context), *messages]

"""Known system prompts are read once: later answers start from the model state after them."""

from __future__ import annotations

import pytest

from s2s_rt.engines.base import ChatMessage, LLMUsage
from s2s_rt.engines.prompt_cache import StaticPrefixes


def render(text: str) -> list[int]:
    """A toy chat format: a token per word, a system marker, an end marker, then the user turn."""
    return [1, *(hash(w) % 1000 + 10 for w in text.split()), 2, 3, 99, 2]


def test_a_prompt_that_starts_with_a_known_system_prompt_is_split_after_it() -> None:
    static = StaticPrefixes(render, ["Be brief."])
    prompt = render("Be brief.\n\nToday is Thursday.")
    prefix, rest = static.split(prompt)
    assert prefix == render("Be brief.")[:3] and prefix + rest == prompt


def test_other_system_prompts_are_not_split() -> None:
    static = StaticPrefixes(render, ["Be brief."])
    prompt = render("Be long.")
    assert static.split(prompt) == ([], prompt)


def test_the_longest_known_prefix_wins() -> None:
    static = StaticPrefixes(render, ["Be", "Be brief."])
    assert len(static.split(render("Be brief. Today"))[0]) == 3


def test_the_rest_is_never_empty() -> None:
    static = StaticPrefixes(render, ["Be brief."])
    prefix = static.prefixes[0]
    assert static.split(prefix) == ([], prefix)


@pytest.mark.slow
def test_answers_from_the_kept_state_are_the_answers_without_it(default_models: object) -> None:
    from s2s_rt.engines.llm import CT2ChatLLM
    from s2s_rt.models import ensure_prepared
    from s2s_rt.spoken_answer import ANSWER_EXAMPLES, DEFAULT_INSTRUCTIONS, with_answer_context

    directory = ensure_prepared(llm="tiny", progress=lambda _line: None).llm
    assert directory is not None
    plain = CT2ChatLLM(directory)
    cached = CT2ChatLLM(
        directory, cached_system_prompts=[DEFAULT_INSTRUCTIONS, f"{DEFAULT_INSTRUCTIONS}\n\n{ANSWER_EXAMPLES}"]
    )
    assert len(cached._static.prefixes) == 2 and len(cached._static.prefixes[0]) > 100  # with the examples
    for question in ("What is the capital of France?", "How many legs does a spider have?"):
        messages = with_answer_context([ChatMessage("system", DEFAULT_INSTRUCTIONS), ChatMessage("user", question)])
        answers = [
            "".join(llm.stream(messages, max_tokens=30, temperature=0.0, should_stop=lambda: False, usage=LLMUsage()))
            for llm in (plain, cached, cached)
        ]
        assert answers[0] == answers[1] == answers[2]

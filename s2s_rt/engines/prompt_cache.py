"""Known system prompts read once: CTranslate2 keeps the model state after them.

Every answer starts with the session's instructions. Reading ("prefilling")
them again for every answer costs about 1.4 ms a token on two cores: 190 ms
for the server's default instructions with their examples. CTranslate2 can
keep the decoder state after a fixed prefix (``generate_tokens(...,
static_prompt=...)``) and start the next answer from it; its cache keeps
every prefix it is given for the life of the model, so only prefixes the
server knows in advance (its default instructions) are given to it, never a
client's text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StaticPrefixes:
    """The token prefixes of known system prompts, and finding one at the start of a prompt.

    Args:
        render: the prompt's token ids for a conversation of one system
            message (the given text) and one user message, as the model's
            chat format writes it.
        texts: the system prompts to keep the state of.
    """

    def __init__(self, render: Callable[[str], list[int]], texts: Sequence[str]) -> None:
        prefixes = []
        for text in dict.fromkeys(texts):
            # The prefix is what stays the same when more text follows the
            # instructions (the server appends the date and the tools).
            alone, followed = render(text), render(f"{text}\n\nToday")
            n = next((i for i, (a, b) in enumerate(zip(alone, followed, strict=False)) if a != b), len(alone))
            if n:
                prefixes.append(alone[:n])
        #: Longest first, so that a prompt gets the longest prefix it starts with.
        self.prefixes = sorted(prefixes, key=len, reverse=True)

    def split(self, prompt: list[int]) -> tuple[list[int], list[int]]:
        """The known prefix ``prompt`` starts with (empty if none), and the rest of it (never empty)."""
        for prefix in self.prefixes:
            if len(prompt) > len(prefix) and prompt[: len(prefix)] == prefix:
                return prefix, prompt[len(prefix) :]
        return [], prompt

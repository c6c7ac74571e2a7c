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


#: Bytes of kept state per token of the default model (Qwen2.5-0.5B in CTranslate2: 24 layers x 14 heads x 64
#: dimensions x keys and values x float32; measured 33 MB per 200-token prefix).
DEFAULT_MODEL_STATE_BYTES_PER_TOKEN = 24 * 14 * 64 * 2 * 4


class ConversationPrefixes:
    """The conversation prefixes whose model state CTranslate2 holds, and what they cost.

    After each answer the server reads the conversation so far once more, in
    the background, as a ``static_prompt`` (:meth:`CT2ChatLLM.prime
    <s2s_rt.engines.llm.CT2ChatLLM.prime>`): CTranslate2 keeps the decoder
    state after it, and the next answer, whose prompt starts with it, reads
    only the new user turn. CTranslate2 keeps every such state until the
    model is reloaded (it has no way to forget one), so this class keeps the
    accounts in tokens: which prefixes are held, and how many tokens of state
    all of them hold — a conversation's older prefixes and those of sessions
    that ended stay held, unused, until the next reload. A token of state is
    the keys and values of every layer: 168 KB for Qwen2.5-0.5B (24 layers ×
    14 heads × 64 dimensions × 2 × float32; measured 33 MB per 200 tokens).

    Args:
        budget_tokens: the most tokens all held prefixes may hold; past it the
            engine reloads the model, which forgets them all.
        session_tokens: the longest prefix kept for one conversation; a longer
            conversation is read whole for each answer, as without the cache.
    """

    def __init__(self, budget_tokens: int, session_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.session_tokens = session_tokens
        self._held: set[tuple[int, ...]] = set()
        self._lengths: set[int] = set()
        #: Tokens of state held now.
        self.held_tokens = 0

    def __len__(self) -> int:
        return len(self._held)

    def find(self, prompt: Sequence[int]) -> list[int]:
        """The longest held prefix of ``prompt`` shorter than it (empty if none)."""
        for n in sorted(self._lengths, reverse=True):
            if n < len(prompt) and tuple(prompt[:n]) in self._held:
                return list(prompt[:n])
        return []

    def holds(self, prefix: Sequence[int]) -> bool:
        return tuple(prefix) in self._held

    def worth_keeping(self, prefix: Sequence[int]) -> bool:
        """Whether a conversation's prefix is short enough to keep."""
        return 0 < len(prefix) <= self.session_tokens

    def fits(self, prefix: Sequence[int]) -> bool:
        """Whether holding ``prefix`` too stays within the budget."""
        return self.held_tokens + len(prefix) <= self.budget_tokens

    def add(self, prefix: Sequence[int]) -> None:
        """CTranslate2 holds the state after ``prefix`` now."""
        key = tuple(prefix)
        if key not in self._held:
            self._held.add(key)
            self._lengths.add(len(key))
            self.held_tokens += len(key)

    def clear(self) -> None:
        """The model was reloaded: nothing is held."""
        self._held.clear()
        self._lengths.clear()
        self.held_tokens = 0

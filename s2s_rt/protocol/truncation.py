"""``truncation``: which of a conversation's items the model still reads once the conversation outgrows its context.

As OpenAI's Realtime API does, items left out of the model's context stay in
the conversation (no ``conversation.item.deleted``); the model no longer
reads them. The cut is kept: once items are left out they stay out, so the
conversation the model reads begins at the same item from one answer to the
next, and the model state kept for it (the local LLM's prefix cache) is read
from again instead of the whole prompt each turn.

- ``auto``: when the conversation (after the instructions and tools) no
  longer fits the model's input limit, the oldest items are left out until
  what remains fills :data:`AUTO_RETENTION` of it. Leaving out just enough
  would leave out one more item at every later turn, and each time the model
  would read the whole conversation again (seconds on a CPU).
- ``retention_ratio``: the same with the client's fraction and, optionally,
  its own limit (``token_limits.post_instructions``).
- ``disabled``: nothing is left out; a response whose conversation does not
  fit fails with ``context_length_exceeded``.

The input limit is the model's context less the answer's room
(:data:`ANSWER_ROOM` tokens, or ``max_output_tokens`` if smaller) and less
the instructions and tools.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from s2s_rt.engines.base import ChatMessage
from s2s_rt.protocol import server_events as se
from s2s_rt.protocol.errors import ProtocolError

#: ``auto``: the share of the input limit the conversation fills after items are left out.
AUTO_RETENTION = 0.8
#: Tokens kept free for the answer when ``max_output_tokens`` is larger (or ``inf``).
ANSWER_ROOM = 512
#: Longer texts are not tokenised to be counted (that runs on the event loop, about a microsecond a character):
#: they are taken to cost a token per :data:`CHARS_PER_TOKEN` characters, more than any tokenizer makes of
#: text, so a long message is never thought to fit when it does not.
COUNTED_CHARS = 4000
CHARS_PER_TOKEN = 2


@dataclass(frozen=True, slots=True)
class Truncation:
    """A session's ``truncation`` setting."""

    #: ``auto``, ``disabled`` or ``retention_ratio``.
    type: str = "auto"
    #: ``retention_ratio``: the share of the limit kept when items are left out.
    retention_ratio: float = AUTO_RETENTION
    #: ``retention_ratio``: the client's own limit on the conversation's tokens after the instructions.
    post_instructions: int | None = None

    def render(self) -> str | dict[str, Any]:
        """As ``session.created`` / ``session.updated`` show it."""
        if self.type != "retention_ratio":
            return self.type
        shown: dict[str, Any] = {"type": "retention_ratio", "retention_ratio": self.retention_ratio}
        if self.post_instructions is not None:
            shown["token_limits"] = {"post_instructions": self.post_instructions}
        return shown


def parse_truncation(value: Any, event_id: str | None) -> Truncation:
    """A ``truncation`` value as a client sends it (OpenAI's types: a string or a retention-ratio object).

    Raises:
        ProtocolError: anything else, naming what is wrong.
    """

    def fail(message: str, param: str = "session.truncation") -> ProtocolError:
        return ProtocolError("invalid_value", message, param=param, event_id=event_id)

    if value in ("auto", "disabled"):
        return Truncation(value)
    if not isinstance(value, dict):
        raise fail(f"truncation must be 'auto', 'disabled' or a retention_ratio object, not {value!r}")
    if value.get("type") != "retention_ratio":
        raise fail(f"truncation.type must be 'retention_ratio', not {value.get('type')!r}", "session.truncation.type")
    unknown = set(value) - {"type", "retention_ratio", "token_limits"}
    if unknown:
        raise fail(f"truncation has unknown fields: {', '.join(sorted(unknown))}")
    ratio = value.get("retention_ratio")
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 <= ratio <= 1.0:
        raise fail(
            f"truncation.retention_ratio must be a number from 0 to 1, not {ratio!r}",
            "session.truncation.retention_ratio",
        )
    limits = value.get("token_limits")
    post = None
    if limits is not None:
        param = "session.truncation.token_limits.post_instructions"
        if not isinstance(limits, dict) or set(limits) - {"post_instructions"}:
            raise fail("truncation.token_limits may hold only post_instructions", "session.truncation.token_limits")
        post = limits.get("post_instructions")
        if post is not None and (not isinstance(post, int) or isinstance(post, bool) or post < 1):
            raise fail(f"token_limits.post_instructions must be a whole number of tokens, not {post!r}", param)
    return Truncation("retention_ratio", float(ratio), post)


class Asks(Protocol):
    """What of a response's parameters its context depends on (``ResponseParams`` has them)."""

    instructions: str
    tools: list[dict[str, Any]]

    @property
    def token_limit(self) -> int: ...


class ContextFull(ProtocolError):
    """``truncation: disabled`` and the conversation does not fit the model's context: the response fails."""

    def __init__(self, needed: int, limit: int) -> None:
        super().__init__(
            "context_length_exceeded",
            f"The conversation needs {needed} tokens after the instructions and the model takes {limit}; "
            "truncation is 'disabled', so nothing is left out: delete items or set truncation to 'auto'",
            param="session.truncation",
        )


class ContextWindow:
    """What one session's model reads of its conversation: the items left out so far, and what each costs.

    Args:
        context_tokens: the model's context (prompt and answer).
        message_tokens: what one chat message costs in it (the LLM's :class:`~s2s_rt.engines.base.CountsTokens`).
    """

    def __init__(self, context_tokens: int, message_tokens: Callable[[ChatMessage], int]) -> None:
        self.context_tokens = context_tokens
        self._message_tokens = message_tokens
        #: Items the model no longer reads (they stay in the conversation).
        self.left_out: set[str] = set()
        #: An item's cost, with the text it was counted for (an item's words can change: a transcript arrives).
        self._costs: dict[str, tuple[tuple[tuple[int, int, int], ...], int]] = {}
        self._instructions: tuple[str | None, int] = (None, 0)

    def limit(self, setting: Truncation, answer_tokens: int, instruction_tokens: int) -> int:
        """Tokens the conversation may have after the instructions."""
        limit = self.context_tokens - min(answer_tokens, ANSWER_ROOM) - instruction_tokens
        if setting.post_instructions is not None:
            limit = min(limit, setting.post_instructions)
        return max(limit, 0)

    def instruction_tokens(self, text: str) -> int:
        """Tokens the instructions and tools (as ``text``) cost; counted once while they stay the same."""
        if self._instructions[0] != text:
            self._instructions = (text, self._tokens(ChatMessage("system", text)))
        return self._instructions[1]

    def _tokens(self, message: ChatMessage) -> int:
        if len(message.content) > COUNTED_CHARS:
            return len(message.content) // CHARS_PER_TOKEN + 8
        return self._message_tokens(message)

    def cost(self, item: se.Item, messages: Sequence[ChatMessage]) -> int:
        """Tokens ``item`` costs, as the chat ``messages`` it becomes (counted once per text)."""
        texts = tuple((len(m.content), hash(m.content), len(m.images)) for m in messages)  # not the text: no copy kept
        known = self._costs.get(item.id or "")
        if known is not None and known[0] == texts:
            return known[1]
        tokens = sum(self._tokens(m) for m in messages)
        if item.id:
            self._costs[item.id] = (texts, tokens)
        return tokens

    def read(
        self,
        items: list[se.Item],
        setting: Truncation,
        asks: Asks,
        messages_of: Callable[[se.Item], Sequence[ChatMessage]],
    ) -> list[se.Item]:
        """What a response that ``asks`` reads of the conversation's ``items`` (:meth:`fit` within its limit).

        Raises:
            ContextFull: ``disabled``, and they do not fit.
        """
        shown = asks.instructions + (json.dumps(asks.tools) if asks.tools else "")
        limit = self.limit(setting, asks.token_limit, self.instruction_tokens(shown))
        return self.fit(items, messages_of, setting, limit)

    def fit(
        self,
        items: list[se.Item],
        messages_of: Callable[[se.Item], Sequence[ChatMessage]],
        setting: Truncation,
        limit: int,
    ) -> list[se.Item]:
        """The items the model reads: ``items`` less those left out, leaving out more if they do not fit.

        Never leaves out the last item (what the answer answers), and never
        a function's result without its call or a call without its result.

        Raises:
            ContextFull: ``disabled``, and they do not fit.
        """
        if len(self._costs) > 2 * len(items) + 16:  # items deleted from the conversation
            present = {item.id for item in items}
            self._costs = {k: v for k, v in self._costs.items() if k in present}
            self.left_out &= present
        kept = [item for item in items if item.id not in self.left_out]
        costs = [self.cost(item, messages_of(item)) for item in kept]
        total = sum(costs)
        if total <= limit:
            return kept
        if setting.type == "disabled":
            raise ContextFull(total, limit)
        target = limit * (AUTO_RETENTION if setting.type == "auto" else setting.retention_ratio)
        first = 0
        # A function's result whose call is left out goes with it.
        while first < len(kept) - 1 and (total > target or kept[first].type == "function_call_output"):
            total -= costs[first]
            self.left_out.add(kept[first].id or "")
            first += 1
        return kept[first:]

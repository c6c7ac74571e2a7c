"""The chat messages the LLM sees for a response: instructions, then the conversation's items."""

from __future__ import annotations

import json
from typing import Any

from s2s_rt.engines.base import ChatMessage
from s2s_rt.protocol import server_events as se
from s2s_rt.protocol.conversation import Conversation
from s2s_rt.toolcalls import frame


def build_prompt(instructions: str, items: list[se.Item], conversation: Conversation) -> list[ChatMessage]:
    """Chat messages for ``items`` in order, after the system ``instructions``.

    User audio is represented by the words heard in it (kept whether or not
    the client asked for transcription events); an item still being
    generated (``in_progress``) is left out.
    """
    messages = [ChatMessage("system", instructions)] if instructions else []
    for item in items:
        if item.status == "in_progress":
            continue
        if item.type == "message" and item.role is not None:
            text = " ".join(t for t in _item_words(item, conversation) if t)
            if text:
                messages.append(ChatMessage(item.role, text))
        elif item.type == "function_call":
            call = json.dumps({"name": item.name, "arguments": _json_or_text(item.arguments or "{}")})
            messages.append(ChatMessage("assistant", frame(call)))
        elif item.type == "function_call_output":
            messages.append(ChatMessage("tool", item.output or ""))
    return messages


def _item_words(item: se.Item, conversation: Conversation) -> list[str | None]:
    heard = conversation.heard.get(item.id)
    words: list[str | None] = []
    for part in item.content or []:
        if part.type == "input_audio" and heard is not None:
            words.append(heard)
        else:
            words.append(part.words)
    return words


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments

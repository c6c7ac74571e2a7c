"""The chat messages the LLM sees for a response: instructions, then the conversation's items."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from s2s_rt.engines.base import ChatMessage, FunctionCall, SharedImage
from s2s_rt.protocol import server_events as se
from s2s_rt.protocol.conversation import Conversation
from s2s_rt.toolcalls import frame, is_error_result


def build_prompt(instructions: str, items: list[se.Item], conversation: Conversation) -> list[ChatMessage]:
    """Chat messages for ``items`` in order, after the system ``instructions``.

    User audio is represented by the words heard in it (kept whether or not
    the client asked for transcription events); an item still being
    generated (``in_progress``) is left out.
    """
    messages = [ChatMessage("system", instructions)] if instructions else []
    calls: dict[str | None, se.Item] | None = None  # the conversation's function calls by id, once needed
    for item in items:
        if item.status == "in_progress":
            continue
        if item.type == "message" and item.role is not None:
            text = " ".join(t for t in _item_words(item, conversation) if t)
            images = tuple(
                SharedImage(p.image_url, p.detail if isinstance(p.detail, str) else "auto")
                for p in item.content or []
                if p.type == "input_image" and isinstance(p.image_url, str)
            )
            if text or images:
                messages.append(ChatMessage(item.role, text, images=images))
        elif item.type == "function_call":
            messages.append(call_message(_call_of(item)))
        elif item.type == "function_call_output":
            if calls is None:
                # A response's own input (``conversation: "none"``) may hold calls the conversation does not.
                known = [*conversation.items.values(), *items]
                calls = {i.call_id: i for i in known if i.type == "function_call"}
            answered = calls.get(item.call_id)
            answers = _call_of(answered) if answered is not None else None
            messages.append(ChatMessage("tool", item.output or "", answers=answers))
        elif item.type in ("mcp_call", "mcp_approval_request"):
            messages += _mcp_messages(item, items)
    return messages


def _mcp_messages(item: se.Item, items: list[se.Item]) -> list[ChatMessage]:
    """An MCP tool's call and what came of it, as a function call and its result; nothing while it waits."""
    result: str | None
    if item.type == "mcp_call":
        error = item.error if isinstance(item.error, dict) else None
        result = item.output if isinstance(item.output, str) else None
        if error is not None:
            result = f"Error: {error.get('message') or error.get('type')}"
    else:  # a request: the model sees a refusal; an approved call is its own mcp_call item
        answer = next(
            (i for i in items if i.type == "mcp_approval_response" and i.approval_request_id == item.id), None
        )
        if answer is None or answer.approve is not False:
            return []
        why = f" ({answer.reason})" if isinstance(answer.reason, str) and answer.reason else ""
        # Not worded as an error: an error's call may be made again (repeats_answered); a refusal's is not.
        result = f"The user did not approve this call{why}. Do not call it again; answer without it."
    if result is None:
        return []
    call = FunctionCall(item.name or "", item.arguments or "{}", item.id)
    return [call_message(call), ChatMessage("tool", result, answers=call)]


def call_message(call: FunctionCall) -> ChatMessage:
    """The assistant's function call as a message: the call as the model writes it, and what it is."""
    text = json.dumps({"name": call.name, "arguments": _json_or_text(call.arguments or "{}")})
    return ChatMessage("assistant", frame(text), call=call)


#: How many times a call is sent again while every result it got is an error (:func:`is_error_result`).
RETRIES_AFTER_ERROR = 2


def repeats_answered(call: FunctionCall, messages: Sequence[ChatMessage]) -> bool:
    """Whether ``call`` repeats one whose results came back since the user last spoke: made again, it is not sent.

    A call the model makes again with the same arguments while answering
    its result would be run again by the client, and answered again, until
    the client's turn limit. The same question in a later turn is a new
    call. A repeat of a call whose every result was an error
    (:func:`is_error_result`) is a retry, as the error often asks for
    ("… call get_weather again"): it is sent, at most
    :data:`RETRIES_AFTER_ERROR` times.
    """
    since = max((n for n, m in enumerate(messages) if m.role == "user"), default=-1)
    results = [m.content for m in messages[since + 1 :] if m.answers is not None and call.same_as(m.answers)]
    if not results:
        return False
    return len(results) > RETRIES_AFTER_ERROR or not all(is_error_result(output) for output in results)


def _call_of(item: se.Item) -> FunctionCall:
    return FunctionCall(item.name or "", item.arguments or "{}", item.call_id)


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

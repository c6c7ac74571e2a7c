"""``truncation``: what the model reads once a conversation outgrows its context, as a client observes it.

The fake LLM counts a word a token (and four for each message's markup) and
reports what it read as the response's ``usage.input_tokens``; its context
is set small here, so that a few turns fill it.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from conftest import live_server, run, sdk_client

from s2s_rt.engines.fake import EchoLLM, load_fake_stack

#: The fake model's context in these tests, and the answer's room (``max_output_tokens``).
CONTEXT, ANSWER = 700, 60


def _stack():  # type: ignore[no-untyped-def]
    stack = load_fake_stack()
    return dataclasses.replace(stack, llm=EchoLLM(context_tokens=CONTEXT))


async def _until(conn, *types: str):  # type: ignore[no-untyped-def]
    async for event in conn:
        if event.type in types:
            return event
    raise AssertionError(f"connection ended before {types}")


async def _setup(conn, truncation: object) -> object:  # type: ignore[no-untyped-def]
    await conn.session.update(
        session={
            "type": "realtime",
            "output_modalities": ["text"],
            "max_output_tokens": ANSWER,
            "instructions": "Answer.",
            "truncation": truncation,
        }
    )
    return await _until(conn, "session.updated", "error")


async def _turn(conn, n: int, words: int = 50) -> tuple[list, object]:  # type: ignore[no-untyped-def]
    """A user message of ``words`` words and its response; the events from the response on, and response.done."""
    text = " ".join(f"w{n}x{i}" for i in range(words))
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    await conn.response.create()
    events = []
    async for event in conn:
        events.append(event)
        if event.type == "response.done":
            return events, event
    raise AssertionError("connection ended")


def test_auto_leaves_the_oldest_items_out_of_what_the_model_reads_and_keeps_them_in_the_conversation() -> None:
    async def scenario() -> None:
        async with live_server(_stack()) as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                updated = await _setup(conn, "auto")
                assert updated.type == "session.updated" and updated.session.truncation == "auto"
                read = []
                first_item = None
                for n in range(10):
                    events, done = await _turn(conn, n)
                    assert done.response.status == "completed"
                    assert not any(e.type == "conversation.item.deleted" for e in events)
                    read.append(done.response.usage.input_tokens)
                    if first_item is None:
                        first_item = next(e.item.id for e in events if e.type == "conversation.item.added")
                # Each turn adds about 120 tokens (a 50-word question, its echoed answer); the model's input
                # limit is 700 - 60 - the instructions: past it, the oldest are left out, down to 80 % of it.
                limit = CONTEXT - ANSWER - 6
                assert max(read) <= limit + 10, read
                drops = [n for n in range(1, len(read)) if read[n] < read[n - 1]]
                assert drops, f"never truncated: {read}"
                first = drops[0]
                assert read[first] <= 0.8 * limit + 120, read
                # The cut is kept: the turn after a truncation reads what it read plus the new turn.
                assert read[first + 1] - read[first] >= 100, read
                # The items left out are still in the conversation.
                await conn.conversation.item.retrieve(item_id=first_item)
                retrieved = await _until(conn, "conversation.item.retrieved", "error")
                assert retrieved.type == "conversation.item.retrieved" and retrieved.item.id == first_item

    run(scenario())


def test_disabled_fails_the_response_that_does_not_fit_with_openais_error_and_auto_then_answers() -> None:
    async def scenario() -> None:
        async with live_server(_stack()) as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                updated = await _setup(conn, "disabled")
                assert updated.type == "session.updated" and updated.session.truncation == "disabled"
                statuses = []
                for n in range(8):
                    _, done = await _turn(conn, n)
                    statuses.append(done.response.status)
                    if done.response.status == "failed":
                        error = done.response.status_details.error
                        assert error.type == "invalid_request_error" and error.code == "context_length_exceeded"
                        told = await _until(conn, "error")  # right after response.done
                        assert told.error.code == "context_length_exceeded"
                        assert told.error.param == "session.truncation"
                        break
                assert statuses[-1] == "failed" and set(statuses[:-1]) == {"completed"}, statuses
                again = await _setup(conn, "auto")
                assert again.type == "session.updated"
                _, done = await _turn(conn, 99)
                assert done.response.status == "completed"

    run(scenario())


def test_retention_ratio_with_its_own_limit() -> None:
    async def scenario() -> None:
        async with live_server(_stack()) as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                setting = {
                    "type": "retention_ratio",
                    "retention_ratio": 0.5,
                    "token_limits": {"post_instructions": 300},
                }
                updated = await _setup(conn, setting)
                assert updated.type == "session.updated"
                shown = updated.session.truncation
                assert shown.type == "retention_ratio" and shown.retention_ratio == 0.5
                assert shown.token_limits.post_instructions == 300
                read = [(await _turn(conn, n))[1].response.usage.input_tokens for n in range(6)]
                instructions = 6  # "Answer." as the fake model counts it
                assert max(read) <= 300 + instructions + 10, read
                after_cut = [b for a, b in itertools.pairwise(read) if b < a]
                assert after_cut and min(after_cut) <= 150 + 120 + instructions, read

    run(scenario())


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ("sometimes", "session.truncation"),
        ({"type": "retention_ratio"}, "session.truncation.retention_ratio"),
        ({"type": "retention_ratio", "retention_ratio": 1.5}, "session.truncation.retention_ratio"),
        ({"type": "ratio", "retention_ratio": 0.5}, "session.truncation.type"),
        (
            {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": -3}},
            "session.truncation.token_limits.post_instructions",
        ),
    ],
)
def test_a_bad_truncation_is_refused_naming_the_field_and_changes_nothing(value: object, param: str) -> None:
    async def scenario() -> None:
        async with live_server(_stack()) as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                refused = await _setup(conn, value)
                assert refused.type == "error" and refused.error.code == "invalid_value"
                assert refused.error.param == param
                await conn.session.update(session={"type": "realtime", "instructions": "Answer."})
                unchanged = await _until(conn, "session.updated")
                assert unchanged.session.truncation == "auto"

    run(scenario())


def test_a_long_message_is_estimated_not_tokenised_on_the_event_loop() -> None:
    """Counting runs on the event loop: a long text is taken at a token per two characters, never tokenised."""
    from s2s_rt.engines.base import ChatMessage
    from s2s_rt.protocol import server_events as se
    from s2s_rt.protocol.truncation import COUNTED_CHARS, ContextWindow

    tokenised: list[int] = []

    def count(message: ChatMessage) -> int:
        tokenised.append(len(message.content))
        return len(message.content.split())

    window = ContextWindow(4096, count)
    short = se.Item(id="a", object="realtime.item", type="message", status="completed", role="user")
    long = se.Item(id="b", object="realtime.item", type="message", status="completed", role="user")
    assert window.cost(short, [ChatMessage("user", "a few words here")]) == 4
    assert window.cost(long, [ChatMessage("user", "word " * 400_000)]) >= 1_000_000
    assert tokenised == [len("a few words here")] and max(tokenised) <= COUNTED_CHARS
    # Counted once per text.
    window.cost(short, [ChatMessage("user", "a few words here")])
    assert len(tokenised) == 1

"""``input_image`` items: checked, kept in the conversation, echoed as OpenAI does, and shown to the model.

Through the official openai SDK on real sockets. The fake LLM echoes what
it was told, so the note a model that cannot see gets is heard in its
answer; with ``--llm-url`` the image goes to the endpoint as an
``image_url`` part (a recording endpoint here: no OpenAI-compatible server
that takes images installs offline).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import struct
import zlib
from typing import Any

import pytest
from conftest import live_server, run, sdk_client
from PIL import Image

from s2s_rt.engines.base import ChatMessage, SharedImage
from s2s_rt.engines.chat_formats import ChatFormat
from s2s_rt.engines.remote_llm import chat_messages


def _png(width: int = 32, height: int = 24, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def _jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40, 30), (20, 120, 220)).save(out, format="JPEG")
    return out.getvalue()


def _uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _claims_huge_size(png: bytes) -> bytes:
    """A small PNG whose header says it is 100000 x 100000 pixels (checksum fixed, so only the size is wrong)."""
    ihdr = bytearray(png[12:29])  # b"IHDR" + 13 bytes of data
    ihdr[4:12] = struct.pack(">II", 100_000, 100_000)
    return png[:12] + bytes(ihdr) + struct.pack(">I", zlib.crc32(bytes(ihdr))) + png[33:]


async def _send_item(conn, content: list[dict[str, Any]]) -> Any:  # type: ignore[no-untyped-def]
    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": content})
    async for event in conn:
        if event.type in ("conversation.item.done", "error"):
            return event
    raise AssertionError("connection ended")


async def _answer(conn) -> str:  # type: ignore[no-untyped-def]
    await conn.response.create(response={"output_modalities": ["text"]})
    text = []
    async for event in conn:
        if event.type == "response.output_text.delta":
            text.append(event.delta)
        if event.type == "response.done":
            assert event.response.status == "completed", event.response.status_details
            return "".join(text)
    raise AssertionError("connection ended")


QUESTION = {"type": "input_text", "text": "What colour is this?"}


def test_an_image_is_kept_echoed_and_a_model_that_cannot_see_is_told_so() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                png = _uri(_png())
                image = {"type": "input_image", "image_url": png, "detail": "low"}
                done = await _send_item(conn, [QUESTION, image])
                assert done.type == "conversation.item.done"
                parts = done.item.content
                assert [p.type for p in parts] == ["input_text", "input_image"]
                assert parts[1].image_url == png and parts[1].detail == "low"
                # Kept in the conversation as sent.
                await conn.conversation.item.retrieve(item_id=done.item.id)
                async for event in conn:
                    if event.type == "conversation.item.retrieved":
                        assert event.item.content[1].image_url == png
                        break
                # The fake model answers with what it was told: the words, and that it cannot see the image.
                said = await _answer(conn)
                assert "What colour is this?" in said and "[an image attached, which you cannot see]" in said
                # A JPEG alone, without words, and no detail.
                alone = await _send_item(conn, [{"type": "input_image", "image_url": _uri(_jpeg(), "image/jpeg")}])
                assert alone.type == "conversation.item.done" and alone.item.content[0].detail is None
                assert "an image attached" in await _answer(conn)

    run(scenario())


@pytest.mark.parametrize(
    ("image_url", "detail", "complaint", "field"),
    [
        ("https://example.com/cat.png", None, "never fetched", "image_url"),
        ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", None, "PNG or JPEG", "image_url"),
        ("data:image/png;base64,!!!not-base64!!!", None, "not valid base64", "image_url"),
        (_uri(_png(), "image/jpeg"), None, "not a readable JPEG", "image_url"),
        (_uri(_png()[:-30]), None, "not a readable PNG", "image_url"),
        (_uri(_claims_huge_size(_png())), None, "pixels", "image_url"),
        (_uri(_png()), "medium", "detail must be one of auto, low, high", "detail"),
        (None, None, "needs 'image_url'", "image_url"),
    ],
)
def test_a_bad_image_is_refused_naming_what_is_wrong_and_the_session_goes_on(
    image_url: str | None, detail: str | None, complaint: str, field: str
) -> None:
    async def scenario() -> None:
        async with live_server() as server:
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                image: dict[str, Any] = {"type": "input_image"}
                if image_url is not None:
                    image["image_url"] = image_url
                if detail is not None:
                    image["detail"] = detail
                refused = await _send_item(conn, [QUESTION, image])
                assert refused.type == "error" and refused.error.code == "invalid_value"
                assert refused.error.param == f"item.content[1].{field}"
                assert complaint in refused.error.message
                done = await _send_item(conn, [QUESTION])
                assert done.type == "conversation.item.done"
                assert "cannot see" not in await _answer(conn)

    run(scenario())


def test_an_image_counts_in_the_conversations_memory_budget() -> None:
    async def scenario() -> None:
        noise = Image.frombytes("RGB", (200, 200), random.Random(7).randbytes(200 * 200 * 3))
        out = io.BytesIO()
        noise.save(out, format="PNG")
        big = _uri(out.getvalue())
        assert len(big) > 60_000
        async with live_server(max_conversation_mib=0.05) as server:  # 52 kB
            async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                refused = await _send_item(conn, [{"type": "input_image", "image_url": big}])
                assert refused.type == "error" and refused.error.code == "conversation_item_too_large"
                kept = await _send_item(conn, [{"type": "input_image", "image_url": _uri(_png())}])
                assert kept.type == "conversation.item.done"

    run(scenario())


def test_the_beta_interface_refuses_images_its_types_do_not_have() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            client = sdk_client(server.port)
            async with client.beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
                image = {"type": "input_image", "image_url": _uri(_png())}
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [image]})
                async for event in conn:
                    if event.type in ("conversation.item.created", "error"):
                        break
                assert event.type == "error" and event.error.param == "item.content[0].type"
                assert "GA interface" in event.error.message

    run(scenario())


def test_an_endpoint_gets_images_as_image_url_parts() -> None:
    png = _uri(_png())
    message = ChatMessage("user", "What colour?", images=(SharedImage(png, "high"),))
    assert chat_messages([message]) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What colour?"},
                {"type": "image_url", "image_url": {"url": png, "detail": "high"}},
            ],
        }
    ]


class RecordingEndpoint:
    """An OpenAI-compatible chat completions endpoint on loopback that records each request and says one sentence."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.port = 0

    async def __aenter__(self) -> RecordingEndpoint:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                length = next((int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length:")), 0)
                body = json.loads(await reader.readexactly(length)) if length else {}
                self.requests.append(body)
                chunk = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": "recorder",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "A red square."}}],
                }
                events = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    + f"Content-Length: {len(events)}\r\n\r\n".encode()
                    + events
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_with_llm_url_the_image_reaches_the_endpoint() -> None:
    async def scenario() -> None:
        async with RecordingEndpoint() as endpoint:
            url = f"http://127.0.0.1:{endpoint.port}/v1"
            async with live_server(llm_url=url, llm_model="recorder") as server:
                async with sdk_client(server.port).realtime.connect(model="gpt-realtime") as conn:
                    png = _uri(_png())
                    await _send_item(conn, [QUESTION, {"type": "input_image", "image_url": png}])
                    assert await _answer(conn) == "A red square."
        sent = endpoint.requests[-1]["messages"][-1]
        assert sent["role"] == "user"
        assert sent["content"] == [
            {"type": "text", "text": "What colour is this?"},
            {"type": "image_url", "image_url": {"url": png, "detail": "auto"}},
        ]

    run(scenario())


def test_a_local_chat_format_tells_the_model_it_cannot_see(default_models) -> None:  # type: ignore[no-untyped-def]
    from s2s_rt.engines.tokenizing import load_tokenizer

    model = default_models.llm
    tokenizer = load_tokenizer(model)
    template = json.loads((model / "tokenizer_config.json").read_text()).get("chat_template")
    chat = ChatFormat.from_template(template, tokenizer, model)
    message = ChatMessage("user", "What colour is this?", images=(SharedImage(_uri(_png())),))
    shown = tokenizer.decode([t for turn in chat.encode([message]).turns for t in turn])
    assert "What colour is this?" in shown and "You cannot see images" in shown and "which you cannot see" in shown
    assert "base64" not in shown

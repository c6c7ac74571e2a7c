"""The conversation's items, in order, and what clients may do to them.

Items are kept as the server events show them (``se.Item``); events that
carry an item always carry a :func:`~s2s_rt.protocol.server_events.snapshot`
of it. Besides the items, the conversation keeps what the pipeline learnt
about them: the words heard in a user's audio (for the prompt, whether or
not the client asked for transcription events) and the spoken segments of
an assistant's audio (for truncation).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass

from msgspec import UNSET, UnsetType

from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol import server_events as se
from s2s_rt.protocol.errors import ProtocolError
from s2s_rt.protocol.images import DETAILS, ImageError, check_image
from s2s_rt.protocol.server_events import Dialect, new_id


@dataclass(slots=True)
class SpokenSegment:
    """A piece of an assistant item's audio and the words it speaks."""

    text: str
    start_ms: float
    end_ms: float


def heard_text(segments: list[SpokenSegment], audio_end_ms: float) -> str:
    """The words of ``segments`` spoken before ``audio_end_ms``.

    A segment cut in the middle keeps the share of its words that fits in
    the share of its audio that was played.
    """
    words: list[str] = []
    for s in segments:
        if s.end_ms <= audio_end_ms:
            words += s.text.split()
        elif s.start_ms < audio_end_ms:
            seg_words = s.text.split()
            share = (audio_end_ms - s.start_ms) / max(s.end_ms - s.start_ms, 1e-9)
            words += seg_words[: int(len(seg_words) * share)]
    return " ".join(words)


#: Content types a client may put in a message of each role, and the type each is kept as.
_CONTENT_TYPES = {
    "user": {
        "input_text": "input_text",
        "text": "input_text",
        "input_audio": "input_audio",
        "input_image": "input_image",
    },
    "system": {"input_text": "input_text", "text": "input_text"},
    "assistant": {
        "output_text": "output_text",
        "text": "output_text",
        "output_audio": "output_audio",
        "audio": "output_audio",
    },
}


def _given(value: object) -> bool:
    return value is not UNSET and value is not None


#: What an item costs besides its text (ids, type, status, structure).
ITEM_OVERHEAD = 256


class Conversation:
    """Ordered items of one session, bounded in bytes.

    Past ``max_bytes`` the oldest items are dropped (see :meth:`trim`), as
    OpenAI truncates a conversation that outgrows its context; one item
    larger than the whole budget is refused.

    Args:
        dialect: how content types are named for this client.
        max_bytes: most bytes of item text, transcripts, audio and arguments kept.
    """

    def __init__(self, dialect: Dialect, max_bytes: int = 16 << 20) -> None:
        self.dialect = dialect
        self.id = new_id("conv")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._sizes: dict[str, int] = {}
        self.items: dict[str, se.Item] = {}
        self.order: list[str] = []
        #: Words heard in user audio items, by item id (the prompt reads these).
        self.heard: dict[str, str] = {}
        #: Spoken audio of assistant items, by item id, for truncation.
        self.spoken: dict[str, list[SpokenSegment]] = {}
        #: Items whose transcript a truncation fixed; later audio does not extend it.
        self.truncated: set[str] = set()

    def insert(self, item: se.Item, previous_item_id: str | None, event_id: str | None) -> str | None:
        """Insert an item; returns the id of the item now before it.

        Raises:
            ProtocolError: the id exists, or ``previous_item_id`` does not.
        """
        if item.id in self.items:
            raise ProtocolError(
                "item_id_already_exists", f"Item {item.id!r} already exists", param="item.id", event_id=event_id
            )
        if previous_item_id is None:
            prev = self.order[-1] if self.order else None
            self.order.append(item.id)
        elif previous_item_id == "root":
            prev = None
            self.order.insert(0, item.id)
        else:
            if previous_item_id not in self.items:
                raise ProtocolError(
                    "previous_item_not_found",
                    f"previous_item_id {previous_item_id!r} is not in the conversation",
                    param="previous_item_id",
                    event_id=event_id,
                )
            prev = previous_item_id
            self.order.insert(self.order.index(previous_item_id) + 1, item.id)
        self.items[item.id] = item
        self.account(item.id)
        return prev

    def size(self, item: se.Item) -> int:
        """Bytes ``item`` holds (its strings, what was heard in it, and a fixed overhead)."""
        n = ITEM_OVERHEAD + len(self.heard.get(item.id, ""))
        for value in (item.arguments, item.output, item.name, item.call_id):
            n += len(value or "")
        for part in item.content or []:
            for text in (part.text, part.transcript, part.audio, part.image_url):
                if isinstance(text, str):
                    n += len(text)
        return n

    def check_fits(self, item: se.Item, event_id: str | None) -> None:
        """Raises:
        ProtocolError: ``conversation_item_too_large`` when one item outgrows the whole budget.
        """
        size = self.size(item)
        if size > self.max_bytes:
            raise ProtocolError(
                "conversation_item_too_large",
                f"The item holds {size} bytes; a conversation holds at most {self.max_bytes}",
                param="item",
                event_id=event_id,
            )

    def account(self, item_id: str) -> None:
        """Count an item's bytes again (after its text grew or was cut)."""
        item = self.items.get(item_id)
        if item is None:
            return
        size = self.size(item)
        self.bytes += size - self._sizes.get(item_id, 0)
        self._sizes[item_id] = size

    def trim(self, keep: set[str]) -> list[str]:
        """Drop the oldest items (but those in ``keep``) until the conversation fits; returns their ids."""
        dropped: list[str] = []
        for item_id in list(self.order):
            if self.bytes <= self.max_bytes:
                break
            if item_id not in keep:
                self.delete(item_id)
                dropped.append(item_id)
        return dropped

    def previous(self, item_id: str) -> str | None:
        i = self.order.index(item_id) if item_id in self.order else 0
        return self.order[i - 1] if i > 0 else None

    def find(self, item_id: str, event_id: str | None, action: str) -> se.Item:
        """The item with ``item_id``.

        Raises:
            ProtocolError: ``item_<action>_invalid_item_id`` when there is none.
        """
        item = self.items.get(item_id)
        if item is None:
            raise ProtocolError(
                f"item_{action}_invalid_item_id",
                f"No item with id {item_id!r} in the conversation",
                param="item_id",
                event_id=event_id,
            )
        return item

    def delete(self, item_id: str) -> None:
        self.bytes -= self._sizes.pop(item_id, 0)
        del self.items[item_id]
        self.order.remove(item_id)
        self.spoken.pop(item_id, None)
        self.heard.pop(item_id, None)
        self.truncated.discard(item_id)

    def _image(
        self, c: ce.ContentIn, fail: Callable[[str, str], ProtocolError], where: str
    ) -> tuple[str, str | UnsetType]:
        """An ``input_image`` part's ``image_url`` (checked) and ``detail``.

        Raises:
            ProtocolError: the beta interface (its types have no images), a bad image, or a bad ``detail``.
        """
        if self.dialect.beta:
            raise fail("input_image content needs the GA interface (the beta one has no images)", f"{where}.type")
        try:
            url = check_image(c.image_url)
        except ImageError as exc:
            raise fail(str(exc), f"{where}.image_url") from None
        if c.detail not in (UNSET, None, *DETAILS):
            raise fail(f"detail must be one of {', '.join(DETAILS)}, not {c.detail!r}", f"{where}.detail")
        return url, c.detail if isinstance(c.detail, str) else UNSET

    def item_from_client(self, src: ce.ItemIn, event_id: str | None) -> se.Item:
        """A conversation item made from a client's ``item``.

        Raises:
            ProtocolError: a bad role, content or missing field.
        """
        item_id = src.id if isinstance(src.id, str) else new_id("item")
        kind = src.type if isinstance(src.type, str) else "message"

        def fail(message: str, param: str) -> ProtocolError:
            return ProtocolError("invalid_value", message, param=f"item.{param}", event_id=event_id)

        if kind == "message":
            role = src.role if isinstance(src.role, str) else None
            if role not in _CONTENT_TYPES:
                raise fail(f"A message item needs role user, assistant or system, not {role!r}", "role")
            if not isinstance(src.content, list) or not src.content:
                raise fail("A message item needs at least one content part", "content")
            allowed = _CONTENT_TYPES[role]
            parts = []
            for i, c in enumerate(src.content):
                if c.type not in allowed:
                    raise fail(f"A {role} message cannot hold {c.type!r} content", f"content[{i}].type")
                ga_type = allowed[c.type]
                part = se.ContentPart(type=self.dialect.part(ga_type))
                if ga_type in ("input_text", "output_text"):
                    if not isinstance(c.text, str):
                        raise fail(f"{c.type!r} content needs 'text'", f"content[{i}].text")
                    part.text = c.text
                elif ga_type == "input_image":
                    part.image_url, part.detail = self._image(c, fail, f"content[{i}]")
                else:
                    part.transcript = c.transcript if isinstance(c.transcript, str) else None
                    if isinstance(c.audio, bytes):
                        part.audio = base64.b64encode(c.audio).decode()
                parts.append(part)
            return se.Item(
                id=item_id, object="realtime.item", type="message", status="completed", role=role, content=parts
            )
        if kind == "function_call_output":
            if not _given(src.call_id) or not _given(src.output):
                raise fail("A function_call_output item needs 'call_id' and 'output'", "call_id")
            known = {i.call_id for i in self.items.values() if i.type == "function_call" and i.call_id is not None}
            if src.call_id not in known:
                raise ProtocolError(
                    "unknown_call_id",
                    f"No function_call item has call_id {src.call_id!r}",
                    param="item.call_id",
                    event_id=event_id,
                )
            return se.Item(
                id=item_id,
                object="realtime.item",
                type="function_call_output",
                status="completed",
                call_id=str(src.call_id),
                output=str(src.output),
            )
        if kind == "function_call":
            if not _given(src.call_id) or not _given(src.name):
                raise fail("A function_call item needs 'call_id' and 'name'", "call_id")
            return se.Item(
                id=item_id,
                object="realtime.item",
                type="function_call",
                status="completed",
                call_id=str(src.call_id),
                name=str(src.name),
                arguments=src.arguments if isinstance(src.arguments, str) else "{}",
            )
        if kind.startswith("mcp_") and not self.dialect.beta:
            return self._mcp_item(src, item_id, kind, fail)
        raise fail(f"Unknown item type {kind!r}; use message, function_call or function_call_output", "type")

    def _mcp_item(self, src: ce.ItemIn, item_id: str, kind: str, fail: Callable[[str, str], ProtocolError]) -> se.Item:
        """An MCP item from a client: an approval's answer, or history (a call, a listing, a request)."""
        if kind == "mcp_approval_response":
            asked = self.items.get(src.approval_request_id) if isinstance(src.approval_request_id, str) else None
            if asked is None or asked.type != "mcp_approval_request":
                raise fail("approval_request_id names no mcp_approval_request item", "approval_request_id")
            if any(i.approval_request_id == asked.id for i in self.items.values() if i.type == kind):
                raise fail(f"mcp_approval_request {asked.id!r} was answered already", "approval_request_id")
            if not isinstance(src.approve, bool):
                raise fail("An mcp_approval_response needs 'approve' (true or false)", "approve")
            item = se.Item(id=item_id, type=kind, approval_request_id=asked.id, approve=src.approve)
            if isinstance(src.reason, str):
                item.reason = src.reason
            return item
        if kind not in ("mcp_call", "mcp_list_tools", "mcp_approval_request"):
            raise fail(f"Unknown item type {kind!r}", "type")
        if not isinstance(src.server_label, str):
            raise fail(f"An {kind} item needs 'server_label'", "server_label")
        if kind == "mcp_list_tools":
            tools = src.tools if isinstance(src.tools, list) else []
            return se.Item(id=item_id, type=kind, server_label=src.server_label, tools=tools)
        if not isinstance(src.name, str) or not isinstance(src.arguments, str):
            raise fail(f"An {kind} item needs 'name' and 'arguments'", "name")
        item = se.Item(id=item_id, type=kind, server_label=src.server_label, name=src.name, arguments=src.arguments)
        if kind == "mcp_call":
            item.output = src.output if isinstance(src.output, str) else None
            item.error = src.error if isinstance(src.error, dict) else None
            if isinstance(src.approval_request_id, str):
                item.approval_request_id = src.approval_request_id
        return item

    def user_audio(self, item_id: str) -> se.Item:
        """A user item for committed input audio, awaiting its transcript."""
        return se.Item(
            id=item_id,
            object="realtime.item",
            type="message",
            status="completed",
            role="user",
            content=[se.ContentPart(type="input_audio", transcript=None)],
        )

    def truncate(self, ev: ce.ConversationItemTruncate) -> None:
        """Trim an assistant item's audio transcript to what was heard; it stays so.

        Raises:
            ProtocolError: not an assistant audio item, or ``audio_end_ms``
                beyond the audio it has.
        """
        item = self.find(ev.item_id, ev.event_id, "truncate")
        parts = item.content or []
        index = ev.content_index or 0
        if item.role != "assistant" or not (0 <= index < len(parts)):
            raise ProtocolError(
                "invalid_value",
                "Only the audio content of an assistant message can be truncated",
                param="content_index",
                event_id=ev.event_id,
            )
        part = parts[index]
        segments = self.spoken.get(item.id, [])
        played = segments[-1].end_ms if segments else 0.0
        if part.type not in ("output_audio", "audio"):
            raise ProtocolError(
                "invalid_value", "That content part holds no audio", param="content_index", event_id=ev.event_id
            )
        if ev.audio_end_ms < 0 or ev.audio_end_ms > played + 1:
            raise ProtocolError(
                "invalid_value",
                f"audio_end_ms {ev.audio_end_ms} is beyond the item's {int(played)} ms of audio",
                param="audio_end_ms",
                event_id=ev.event_id,
            )
        part.transcript = heard_text(segments, ev.audio_end_ms)
        part.audio = UNSET
        self.spoken[item.id] = [s for s in segments if s.start_ms < ev.audio_end_ms]
        self.truncated.add(item.id)
        self.account(item.id)

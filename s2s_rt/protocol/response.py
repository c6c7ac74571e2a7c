"""One response's lifecycle, as a table of states and the events each step emits.

A response moves through these phases, and only along these edges::

    CREATED ──add item──► ITEM_OPEN ──add part──► PART_OPEN ──delta──► PART_OPEN
       │                     │  ▲                     │
       │                     │  └─────close part──────┘
       │                     └──close item──► ITEM_CLOSED ──add item──► ITEM_OPEN
       └──────────────finish────────────────────┴──finish──► DONE

``cancel`` and ``fail`` are allowed from every phase but DONE: they close
what is open (content part, then item, marked ``incomplete``) and end in
DONE, exactly as a finish would. Nothing is emitted after DONE: every method
returns no events once the response is done, so whatever a stage still holds
of a cancelled or failed response cannot reach the client.

Events carry snapshots of the items they show; later changes to an item
cannot reach an event already made.
"""

from __future__ import annotations

import enum
from typing import Any

from s2s_rt.lifecycle import Lifecycle
from s2s_rt.protocol import server_events as se
from s2s_rt.protocol.conversation import Conversation, SpokenSegment
from s2s_rt.protocol.errors import RealtimeError
from s2s_rt.protocol.response_params import ResponseParams
from s2s_rt.protocol.server_events import Dialect, new_id, snapshot
from s2s_rt.scope import Scope


class Phase(enum.Enum):
    CREATED = "created"
    ITEM_OPEN = "item_open"
    PART_OPEN = "part_open"
    ITEM_CLOSED = "item_closed"
    DONE = "done"


class Step(enum.Enum):
    ADD_ITEM = "add_item"
    ADD_PART = "add_part"
    DELTA = "delta"
    CLOSE_PART = "close_part"
    CLOSE_ITEM = "close_item"
    FINISH = "finish"
    CANCEL = "cancel"
    FAIL = "fail"


#: Every allowed (phase, step) and the phase it leads to. Anything else is a bug.
TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    **{(phase, end): Phase.DONE for phase in Phase if phase is not Phase.DONE for end in (Step.CANCEL, Step.FAIL)},
    (Phase.CREATED, Step.ADD_ITEM): Phase.ITEM_OPEN,
    (Phase.CREATED, Step.FINISH): Phase.DONE,
    (Phase.ITEM_OPEN, Step.ADD_PART): Phase.PART_OPEN,
    (Phase.ITEM_OPEN, Step.DELTA): Phase.ITEM_OPEN,  # function-call arguments
    (Phase.ITEM_OPEN, Step.CLOSE_ITEM): Phase.ITEM_CLOSED,
    (Phase.PART_OPEN, Step.DELTA): Phase.PART_OPEN,
    (Phase.PART_OPEN, Step.CLOSE_PART): Phase.ITEM_OPEN,
    (Phase.ITEM_CLOSED, Step.ADD_ITEM): Phase.ITEM_OPEN,
    (Phase.ITEM_CLOSED, Step.FINISH): Phase.DONE,
}


LIFECYCLE = Lifecycle("response", TRANSITIONS)


class Response:
    """One response: its phase, its output items, and the events each step emits.

    Args:
        params: what to produce.
        dialect: the client's event naming.
        conversation: where in-conversation output items go.
        scope: the response's cancellation scope; closed when it is cancelled
            or fails, released when it completes.
    """

    def __init__(self, params: ResponseParams, dialect: Dialect, conversation: Conversation, scope: Scope) -> None:
        self.id = new_id("resp")
        self.params = params
        self.dialect = dialect
        self.conversation = conversation
        self.scope = scope
        self._phase = Phase.CREATED
        self.status = "in_progress"
        self.outputs: list[se.Item] = []
        #: The open assistant message, while one is.
        self.message: se.Item | None = None
        self.text = ""
        self.audio_ms = 0.0
        self.input_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        #: Its ``mcp_call`` items, to run once it is done.
        self.mcp_calls: list[se.Item] = []

    # --- properties ---------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Where the response is in its lifecycle: read-only, moved by :meth:`_step` alone, along its table."""
        return self._phase

    @property
    def audio(self) -> bool:
        return "audio" in self.params.modalities

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def token_limit(self) -> int:
        return self.params.token_limit

    def _step(self, step: Step) -> None:
        self._phase = LIFECYCLE.step(self._phase, step, self.id)

    def _ev(self, cls: type[se.E], ga_name: str, **fields: Any) -> se.E:
        return self.dialect.event(cls, ga_name, **fields)

    # --- steps --------------------------------------------------------------

    def created(self) -> se.ServerEvent:
        return self._ev(se.ResponseEvent, "response.created", response=self.render())

    def text_delta(self, delta: str) -> list[se.ServerEvent]:
        """A piece of a text answer."""
        if self.done or not delta:
            return []
        events = self._open_message()
        self._step(Step.DELTA)
        self.text += delta
        self._set_words(self.text)
        events.append(self._ev(se.DeltaEvent, "response.output_text.delta", delta=delta, **self._ids()))
        return events

    def audio_segment(self, chunks: list[bytes], text: str, ms: float) -> list[se.ServerEvent]:
        """Audio deltas of one spoken segment, then the words it speaks."""
        if self.done:
            return []
        events = self._open_message()
        assert self.message is not None
        ids = self._ids()
        for chunk in chunks:
            self._step(Step.DELTA)
            events.append(self._ev(se.AudioDelta, "response.output_audio.delta", delta=chunk, **ids))
        segment = SpokenSegment(text, self.audio_ms, self.audio_ms + ms)
        self.audio_ms += ms
        if self.params.in_conversation:
            self.conversation.spoken.setdefault(self.message.id, []).append(segment)
        if text:
            delta = text if not self.text else " " + text
            self.text += delta
            self._set_words(self.text)
            events.append(self._ev(se.DeltaEvent, "response.output_audio_transcript.delta", delta=delta, **ids))
        return events

    def function_call(self, name: str, arguments: str) -> list[se.ServerEvent]:
        """The model called a tool: a ``function_call`` output item, streamed and closed."""
        if self.done:
            return []
        events = self._close_message("completed")
        call_id = new_id("call")
        item = se.Item(
            id=new_id("item"),
            object="realtime.item",
            type="function_call",
            status="in_progress",
            call_id=call_id,
            name=name,
            arguments="",
        )
        events += self._add_item(item)
        output_index = len(self.outputs) - 1
        common = {"response_id": self.id, "item_id": item.id, "output_index": output_index, "call_id": call_id}
        self._step(Step.DELTA)
        events.append(
            self._ev(se.FunctionCallArgumentsDelta, "response.function_call_arguments.delta", delta=arguments, **common)
        )
        item.arguments = arguments
        events.append(
            self._ev(
                se.FunctionCallArgumentsDone,
                "response.function_call_arguments.done",
                arguments=arguments,
                **common,
                **({} if self.dialect.beta else {"name": name}),  # beta's event has no name
            )
        )
        events += self._close_item(item, "completed")
        return events

    def mcp_call(self, item: se.Item, approval: bool) -> list[se.ServerEvent]:
        """The model called a tool of an MCP server: ``item`` (an ``mcp_call``, or with ``approval`` an
        ``mcp_approval_request``) in the output, its arguments streamed, closed.

        An ``mcp_call``'s ``conversation.item.done`` waits until it has run (:attr:`mcp_calls`): clients ask
        for the next response on it.
        """
        if self.done:
            return []
        events = self._close_message("completed")
        events += self._add_item(item)
        output_index = len(self.outputs) - 1
        if not approval:
            arguments = item.arguments or "{}"
            common = {"response_id": self.id, "item_id": item.id, "output_index": output_index}
            self._step(Step.DELTA)
            events.append(
                self._ev(se.McpCallArgumentsDelta, "response.mcp_call_arguments.delta", delta=arguments, **common)
            )
            events.append(
                self._ev(se.McpCallArgumentsDone, "response.mcp_call_arguments.done", arguments=arguments, **common)
            )
            self.mcp_calls.append(item)
        events += self._close_item(item, None, announce=approval)
        return events

    def finish(self) -> list[se.ServerEvent]:
        """Everything was produced: close what is open and end ``completed``."""
        if self.done:
            return []
        events = self._close_message("completed")
        self._step(Step.FINISH)
        self.status = "completed"
        self.scope.release()
        events.append(self._ev(se.ResponseEvent, "response.done", response=self.render()))
        return events

    def cancel(self, reason: str) -> list[se.ServerEvent]:
        """End ``cancelled`` (client or turn detection): its queued work becomes stale."""
        return self._end(Step.CANCEL, "cancelled", {"type": "cancelled", "reason": reason})

    def fail(self, error: RealtimeError) -> list[se.ServerEvent]:
        """End ``failed``; an ``error`` event tells the client why."""
        details = {"type": "failed", "error": {"type": error.type, "code": error.code}}
        events = self._end(Step.FAIL, "failed", details)
        if events:
            events.append(
                self._ev(
                    se.Error,
                    "error",
                    error=se.ErrorDetail(
                        type=error.type, code=error.code, message=error.message, param=error.param, event_id=None
                    ),
                )
            )
        return events

    def _end(self, step: Step, status: str, details: dict[str, Any]) -> list[se.ServerEvent]:
        if self.done:
            return []
        # The scope closes first: nothing a stage still holds may follow response.done.
        self.scope.close(status)
        events = self._close_message("incomplete")
        self._step(step)
        self.status = status
        events.append(self._ev(se.ResponseEvent, "response.done", response=self.render(details)))
        return events

    # --- items ----------------------------------------------------------------

    def _add_item(self, item: se.Item) -> list[se.ServerEvent]:
        self._step(Step.ADD_ITEM)
        output_index = len(self.outputs)
        self.outputs.append(item)
        events: list[se.ServerEvent] = [
            self._ev(
                se.OutputItemEvent,
                "response.output_item.added",
                response_id=self.id,
                output_index=output_index,
                item=snapshot(item),
            )
        ]
        if self.params.in_conversation:
            prev = self.conversation.insert(item, None, None)
            events.append(self._ev(se.ItemEvent, "conversation.item.added", previous_item_id=prev, item=snapshot(item)))
        return events

    def _close_item(self, item: se.Item, status: str | None, announce: bool = True) -> list[se.ServerEvent]:
        self._step(Step.CLOSE_ITEM)
        if status is not None:  # MCP items have none
            item.status = status
        self.conversation.account(item.id)
        events: list[se.ServerEvent] = [
            self._ev(
                se.OutputItemEvent,
                "response.output_item.done",
                response_id=self.id,
                output_index=self.outputs.index(item),
                item=snapshot(item),
            )
        ]
        if announce and self.params.in_conversation and not self.dialect.beta and item.id in self.conversation.items:
            prev = self.conversation.previous(item.id)
            events.append(self._ev(se.ItemEvent, "conversation.item.done", previous_item_id=prev, item=snapshot(item)))
        return events

    def _open_message(self) -> list[se.ServerEvent]:
        """Open the assistant message (item, then its one content part) on the first text or audio."""
        if self.message is not None:
            return []
        self.text = ""
        self.message = se.Item(
            id=new_id("item"),
            object="realtime.item",
            type="message",
            status="in_progress",
            role="assistant",
            content=[],
        )
        events = self._add_item(self.message)
        part = (
            se.ContentPart(type=self.dialect.part("output_audio"), transcript="")
            if self.audio
            else se.ContentPart(type=self.dialect.part("output_text"), text="")
        )
        self._step(Step.ADD_PART)
        assert self.message.content is not None
        self.message.content.append(part)
        events.append(
            self._ev(se.ContentPartEvent, "response.content_part.added", part=se.event_part(part), **self._ids())
        )
        return events

    def _close_message(self, status: str) -> list[se.ServerEvent]:
        message = self.message
        if message is None:
            return []
        events: list[se.ServerEvent] = []
        ids = self._ids()
        part = (message.content or [se.ContentPart(type="output_text")])[0]
        if self.phase is Phase.PART_OPEN:
            if self.audio:
                events.append(self._ev(se.AudioDone, "response.output_audio.done", **ids))
                events.append(
                    self._ev(se.TranscriptDone, "response.output_audio_transcript.done", transcript=self.text, **ids)
                )
            else:
                events.append(self._ev(se.TextDone, "response.output_text.done", text=self.text, **ids))
            self._step(Step.CLOSE_PART)
            events.append(self._ev(se.ContentPartEvent, "response.content_part.done", part=se.event_part(part), **ids))
        events += self._close_item(message, status)
        self.message = None
        return events

    def _set_words(self, words: str) -> None:
        """Keep the open message's content current (unless a truncation fixed it)."""
        message = self.message
        if message is None or not message.content or message.id in self.conversation.truncated:
            return
        if self.audio:
            message.content[0].transcript = words
        else:
            message.content[0].text = words

    def _ids(self) -> dict[str, Any]:
        assert self.message is not None
        return {
            "response_id": self.id,
            "item_id": self.message.id,
            "output_index": self.outputs.index(self.message),
            "content_index": 0,
        }

    # --- rendering --------------------------------------------------------------

    def render(self, details: dict[str, Any] | None = None) -> se.Response:
        """The response object as ``response.created``/``response.done`` carry it."""
        usage = None
        if self.status != "in_progress":
            usage = se.Usage(
                total_tokens=self.input_tokens + self.output_tokens,
                input_tokens=self.input_tokens,
                output_tokens=self.output_tokens,
                input_token_details={
                    "text_tokens": self.input_tokens,
                    "audio_tokens": 0,
                    "cached_tokens": self.cached_tokens,
                },
                output_token_details={"text_tokens": self.output_tokens, "audio_tokens": 0},
            )
        p = self.params
        response = se.Response(
            id=self.id,
            object="realtime.response",
            status=self.status,
            status_details=details,
            output=[snapshot(o) for o in self.outputs] if self.status != "in_progress" else [],
            conversation_id=self.conversation.id if p.in_conversation else None,
            max_output_tokens=p.max_output_tokens,
            usage=usage,
            metadata=p.metadata,
        )
        if self.dialect.beta:
            response.modalities = ["text", "audio"] if self.audio else ["text"]
        else:
            response.output_modalities = p.modalities
        return response

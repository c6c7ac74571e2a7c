"""A chat LLM behind an OpenAI-compatible chat completions endpoint.

vLLM, llama.cpp's server, Ollama, TGI and hosted APIs all speak this
protocol, so a server that already runs one can answer for s2s-rt, and many
s2s-rt processes can share it: that is how the LLM scales past one machine.

:class:`RemoteChatLLM` streams on the event loop (:meth:`~RemoteChatLLM.astream`):
waiting on a socket needs no thread, so no executor thread is held per
answer, and cancelling the stage's task closes the HTTP stream at once
(barge-in never waits for the remote model's next token). All sessions of an
event loop share one ``openai`` client and so one connection pool.

Tools are passed as native ``tools``; the calls the endpoint streams back
(``delta.tool_calls``) come out as the same ``<tool_call>{json}</tool_call>``
text the in-process model writes, so :mod:`s2s_rt.toolcalls` checks both the
same way. A model that writes its calls as text in the content instead (a
server that does not parse them) works too: the text goes through the same
filter.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from s2s_rt.engines.base import ChatMessage, LLMError, LLMRequest, LLMUsage, StopCheck
from s2s_rt.toolcalls import Call, ToolCallFilter, chat_tool, frame

if TYPE_CHECKING:
    from openai import AsyncOpenAI

#: Seconds to wait for a TCP connection to the endpoint (a down host fails
#: fast instead of using the whole per-piece deadline).
CONNECT_TIMEOUT_S = 5.0


class RemoteChatLLM:
    """A chat model served by an OpenAI-compatible endpoint (implements ``base.AsyncLLM``).

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8080/v1``.
        model: the model name to ask for; None asks the endpoint for its
            models (``GET /models``) at the first answer and takes the first.
        api_key: sent as ``Authorization: Bearer``; None sends none.
        timeout_s: the longest wait for the response to start and then for
            each streamed chunk; past it the answer fails with
            ``llm_timeout``.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        import openai  # a dependency only of this engine: imported when it is used

        self._openai = openai
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self._api_key = api_key
        # An httpx connection belongs to the event loop that opened it: one
        # client (one pool) per loop, shared by every session on it.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncOpenAI] = weakref.WeakKeyDictionary()

    def describe(self) -> str:
        """One line for the start-up log."""
        model = self.model or "the first it lists"
        return (
            f"LLM {self.base_url} (OpenAI-compatible chat completions, model {model}, "
            f"{self.timeout_s:g} s per piece, native tools)"
        )

    async def astream(
        self, request: LLMRequest, *, should_stop: StopCheck, usage: LLMUsage
    ) -> AsyncGenerator[str, None]:
        """Yield the answer to ``request`` as pieces of text, on the event loop.

        Arguments as for ``base.LLM.stream``. Usage comes from the endpoint's
        final usage chunk when it sends one, else output tokens count the
        content chunks (one token each on the common servers); input tokens
        are known only at the end.

        Cancelling the task that iterates this, or closing the iterator,
        closes the HTTP stream at once.

        Raises:
            LLMError: ``llm_unavailable`` (cannot connect, the connection
                broke, 429 or 5xx), ``llm_timeout`` (nothing arrived in
                ``timeout_s``), ``llm_failed`` (the endpoint refused the
                request: bad model name, key or parameters).
        """
        usage.input_tokens = usage.output_tokens = 0
        if request.max_tokens <= 0 or should_stop():
            return
        client = self._client()
        calls = _StreamedCalls()
        reported = False
        try:
            async with asyncio.timeout(self.timeout_s):
                model = self.model or await self._first_model(client)
                stream = await client.chat.completions.create(**_request(request, model))
            async with stream:  # leaving it, however, closes the HTTP response
                chunks = aiter(stream)
                while True:
                    async with asyncio.timeout(self.timeout_s):
                        chunk = await anext(chunks, None)
                    if chunk is None or should_stop():
                        break
                    if chunk.usage is not None:
                        usage.input_tokens = chunk.usage.prompt_tokens
                        usage.output_tokens = chunk.usage.completion_tokens
                        reported = True
                    if not chunk.choices:
                        continue
                    delta = chunk.choices[0].delta
                    if delta.tool_calls:
                        calls.add(delta.tool_calls)
                    if delta.content:
                        if not reported:
                            usage.output_tokens += 1
                        yield delta.content
        except TimeoutError:
            raise LLMError("llm_timeout", f"{self.base_url} sent nothing for {self.timeout_s:g} s") from None
        except self._openai.APIError as exc:
            raise self._error(exc) from exc
        if should_stop():
            return
        for call in calls.texts():
            yield call

    def stream(self, request: LLMRequest, *, should_stop: StopCheck, usage: LLMUsage) -> Iterator[str]:
        """The blocking form of :meth:`astream` (``base.LLM``), for callers off the event loop.

        Runs :meth:`astream` on a private event loop (with a connection of
        its own) in the calling thread.
        """
        loop = asyncio.new_event_loop()
        pieces = self.astream(request, should_stop=should_stop, usage=usage)
        try:
            while True:
                try:
                    yield loop.run_until_complete(anext(pieces))
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(pieces.aclose())
            loop.run_until_complete(self.aclose())
            loop.close()

    async def aclose(self) -> None:
        """Close the running event loop's connections to the endpoint (a later answer opens new ones)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    def _client(self) -> AsyncOpenAI:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = self._openai.AsyncOpenAI(
                base_url=self.base_url,
                # The openai client insists on a key; servers without auth ignore it.
                api_key=self._api_key or "none",
                timeout=self._openai.Timeout(self.timeout_s, connect=min(self.timeout_s, CONNECT_TIMEOUT_S)),
                # A voice turn cannot wait through back-off: the answer fails and the client may ask again.
                max_retries=0,
            )
            self._clients[loop] = client
        return client

    async def _first_model(self, client: AsyncOpenAI) -> str:
        async for model in await client.models.list():
            self.model = model.id
            return model.id
        raise LLMError("llm_failed", f"{self.base_url}/models lists no model; set llm_model")

    def _error(self, exc: Exception) -> LLMError:
        """Name an ``openai`` exception by what a client can do about it."""
        openai = self._openai
        if isinstance(exc, openai.APITimeoutError):
            return LLMError("llm_timeout", f"{self.base_url} timed out")
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__ or exc
            return LLMError("llm_unavailable", f"cannot reach {self.base_url} ({type(cause).__name__}: {cause})")
        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            code = "llm_unavailable" if status == 429 or status >= 500 else "llm_failed"
            return LLMError(code, f"{self.base_url} answered {status}: {_error_message(exc)}")
        return LLMError("llm_failed", f"{self.base_url}: {exc}")


def _error_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        detail = body.get("message") or body.get("detail") or body.get("error")
        if isinstance(detail, dict):
            detail = detail.get("message")
        if detail:
            return str(detail)[:300]
    return str(exc)[:300]


# --- the request -------------------------------------------------------------


def _request(asked: LLMRequest, model: str) -> dict[str, Any]:
    """The chat completions request body for ``asked``."""
    tools = asked.tools
    request: dict[str, Any] = {
        "model": model,
        "messages": chat_messages(asked.messages),
        "max_tokens": asked.max_tokens,
        "temperature": asked.temperature,
        "stream": True,
        # Servers that know it send a last chunk with the usage; others ignore it.
        "stream_options": {"include_usage": True},
    }
    if tools:
        request["tools"] = [chat_tool(tool) for tool in tools]
        if asked.require_tool:
            # A named choice where one tool is offered: servers that cannot
            # force "a call" (llama-cpp-python) can force "this call".
            only = tools[0].get("name") if len(tools) == 1 else None
            request["tool_choice"] = {"type": "function", "function": {"name": only}} if only else "required"
        else:
            request["tool_choice"] = "auto"
    return request


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation in chat completions form, with native tool calls.

    The prompt writes a function call the way the in-process model does
    (an assistant ``<tool_call>{"name": …, "arguments": …}</tool_call>``
    whose ``call`` names it) and its result as a ``tool`` message whose
    ``answers`` names the call. Here a call becomes an entry of the
    assistant message's ``tool_calls`` with its call id, and each result
    answers the call it names, in whatever order the results came (a result
    that names none answers the oldest unanswered call), as the API requires.
    Consecutive assistant messages (a response's text and its calls) become
    one. A call that never got its result is left out (endpoints refuse an
    unanswered call), and a result with no call to answer (its call was
    deleted) is shown as a user message.
    """
    out: list[dict[str, Any]] = []
    unanswered: list[str] = []
    answered: set[str] = set()
    turn: dict[str, Any] | None = None  # the last assistant message, while it may grow
    count = 0

    def close_turn() -> None:
        nonlocal turn
        if turn is not None and "tool_calls" in turn:
            turn["tool_calls"] = [c for c in turn["tool_calls"] if c["id"] in answered]  # only answered calls stay
            if not turn["tool_calls"]:
                del turn["tool_calls"]
                if not turn["content"]:
                    out.remove(turn)
        turn = None
        unanswered.clear()
        answered.clear()

    for message in messages:
        if message.role == "tool":
            named = message.answers.call_id if message.answers is not None else None
            call_id = named if named in unanswered else unanswered[0] if unanswered else None
            if call_id is not None:
                unanswered.remove(call_id)
                answered.add(call_id)
                out.append({"role": "tool", "tool_call_id": call_id, "content": message.content})
            else:
                close_turn()
                out.append({"role": "user", "content": f"Function result: {message.content}"})
            continue
        if message.role == "assistant" and turn is not None and not answered:
            target = turn  # more of the same response: text and calls of one turn
        else:
            close_turn()
            if message.role != "assistant":
                out.append({"role": message.role, "content": _content(message)})
                continue
            # "" rather than null: some servers (llama-cpp-python) refuse a null content.
            target = turn = {"role": "assistant", "content": ""}
            out.append(turn)
        text, calls = _split_calls(message.content)
        if text.strip():
            target["content"] = f"{target['content']} {text.strip()}" if target["content"] else text.strip()
        own = message.call.call_id if message.call is not None and len(calls) == 1 else None
        for name, arguments in calls:
            count += 1
            call_id = own or f"call_{count}"
            target.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
            unanswered.append(call_id)
    close_turn()
    return out


def _split_calls(content: str) -> tuple[str, list[tuple[str, str]]]:
    """Separate an assistant message's text from its ``<tool_call>`` blocks.

    A block that is not a JSON call (a malformed call being retried) stays
    in the text, as the model wrote it.
    """
    splitter = ToolCallFilter()
    text: list[str] = []
    calls: list[tuple[str, str]] = []
    for part in [*splitter.feed(content), *splitter.flush()]:
        if not isinstance(part, Call):
            text.append(part.text)
            continue
        try:
            call = json.loads(part.raw)
        except ValueError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            text.append(frame(part.raw))
            continue
        arguments = call.get("arguments", {})
        calls.append((call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return "".join(text), calls


# --- the answer --------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class _StreamedCalls:
    """Tool calls assembled from streamed ``delta.tool_calls`` fragments, by index."""

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}

    def add(self, fragments: Sequence[Any]) -> None:
        for fragment in fragments:
            call = self._calls.setdefault(fragment.index or 0, _Call())
            function = fragment.function
            if function is None:
                continue
            # The name comes whole, in the first fragment (llama-cpp-python repeats it in every one).
            if function.name and not call.name:
                call.name = function.name
            if function.arguments:
                call.arguments.append(function.arguments)

    def texts(self) -> list[str]:
        """Each call as ``<tool_call>`` text, in index order."""
        out = []
        for _, call in sorted(self._calls.items()):
            arguments = "".join(call.arguments) or "{}"
            try:
                value: Any = json.loads(arguments)
            except ValueError:
                value = arguments  # parse_call reports it as invalid JSON, and the model may retry
            out.append(frame(json.dumps({"name": call.name, "arguments": value})))
        return out


def _content(message: ChatMessage) -> str | list[dict[str, Any]]:
    """A message's content as OpenAI's chat API takes it: its text, with its images as ``image_url`` parts."""
    if not message.images:
        return message.content
    parts: list[dict[str, Any]] = [{"type": "text", "text": message.content}] if message.content else []
    for image in message.images:
        parts.append({"type": "image_url", "image_url": {"url": image.url, "detail": image.detail}})
    return parts

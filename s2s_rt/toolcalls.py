"""Function calls in the LLM's output: found as the tokens stream, checked against the tool's schema.

The models call tools the way Qwen2.5's chat template teaches (and the
prompt teaches models whose template has no tools section)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:class:`ToolCallFilter` splits streamed text into what may be spoken and the
calls, holding back anything that might be the start of a ``<tool_call>``
tag, so raw JSON is never spoken. :func:`parse_call` turns one call into a
name and JSON arguments, validated by :func:`schema_errors`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def frame(call: str) -> str:
    """A call (its JSON, ``{"name": …, "arguments": …}``) as the model writes it: between the tags."""
    return f"{OPEN}\n{call}\n{CLOSE}"


@dataclass(slots=True)
class Text:
    text: str


@dataclass(slots=True)
class Call:
    raw: str


class ToolCallFilter:
    """Separates speakable text from ``<tool_call>`` blocks in a token stream."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False

    def feed(self, piece: str) -> list[Text | Call]:
        self._buf += piece
        out: list[Text | Call] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                out.append(Call(self._buf[:end].strip()))
                self._buf = self._buf[end + len(CLOSE) :]
                self._in_call = False
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append(Text(self._buf[:start]))
                self._buf = self._buf[start + len(OPEN) :]
                self._in_call = True
                continue
            # Keep back a tail that could still become "<tool_call>".
            keep = _partial_tag_length(self._buf)
            if len(self._buf) > keep:
                out.append(Text(self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
            return out

    def flush(self) -> list[Text | Call]:
        """The end of the stream: an unclosed call is still a call; a partial tag is text."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return [Call(rest.strip())] if rest.strip() else []
        return [Text(rest)] if rest else []


def _partial_tag_length(text: str) -> int:
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallError(ValueError):
    """A call the model made that cannot be sent: says what is wrong with it."""


class UnknownFunction(ToolCallError):
    """A call to a function that is not offered: one the model made up."""


def parse_call(raw: str, tools: list[dict[str, Any]]) -> tuple[str, str]:
    """Check one call against the tools offered.

    Returns:
        The function's name and its arguments as a JSON object string.

    Raises:
        UnknownFunction: a function not among ``tools``.
        ToolCallError: not JSON, or arguments that do not match the
            function's parameter schema.
    """
    try:
        call = json.loads(raw)
    except ValueError as exc:
        raise ToolCallError(f"the call is not valid JSON ({exc})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('the call must be a JSON object {"name": ..., "arguments": {...}}')
    name = call["name"]
    tool = next((t for t in tools if t.get("name") == name), None)
    if tool is None:
        raise UnknownFunction(f"there is no function named {name!r}")
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ToolCallError("the arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise ToolCallError("the arguments must be a JSON object")
    schema = tool.get("parameters") or {"type": "object"}
    args = undeclared_dropped(args, schema)
    problems = schema_errors(args, schema)
    if problems:
        raise ToolCallError(f"invalid arguments for {name}: " + "; ".join(problems))
    return name, json.dumps(args)


def undeclared_dropped(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` without the properties a schema that forbids others (``additionalProperties: false``) does not declare.

    Small models add what the schema never asked for (a ``"time"`` beside
    the ``"city"`` of a weather call); where the function forbids it, the
    call is sent without it rather than refused.
    """
    if isinstance(value, dict):
        props = schema.get("properties", {})
        closed = schema.get("additionalProperties") is False
        return {
            key: undeclared_dropped(sub, props[key]) if isinstance(props.get(key), dict) else sub
            for key, sub in value.items()
            if key in props or not closed
        }
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [undeclared_dropped(sub, schema["items"]) for sub in value]
    return value


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def schema_errors(value: Any, schema: dict[str, Any], path: str = "arguments") -> list[str]:
    """The ways ``value`` breaks a JSON schema (the subset tools use: types, properties, required, enum, items).

    Properties a closed schema does not declare are not checked here: :func:`parse_call` drops them first
    (:func:`undeclared_dropped`).
    """
    errors: list[str] = []
    expected = schema.get("type")
    if expected is not None:
        kinds = expected if isinstance(expected, list) else [expected]
        ok = any(
            isinstance(value, _TYPES.get(k, (object,))) and not (k in ("integer", "number") and isinstance(value, bool))
            for k in kinds
        )
        if not ok:
            return [f"{path} must be {' or '.join(kinds)}, not {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path} must be one of {schema['enum']!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for req in schema.get("required", []):
            if req not in value:
                errors.append(f"{path}.{req} is required")
        for key, sub in value.items():
            if key in props:
                errors += schema_errors(sub, props[key], f"{path}.{key}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            errors += schema_errors(sub, schema["items"], f"{path}[{i}]")
    return errors


#: Plain-text results that read as a failure: they begin with "error", "exception" or "failed"
#: ("Error: service unavailable", "ERROR 503", "Failed to reach the weather service"), or say that an
#: error occurred (openai-agents' default: "An error occurred while running the tool. Please try
#: again."; LiveKit Agents' for an unexpected exception: "An internal error occurred").
_ERROR_TEXT = re.compile(r"\W*(error|exception|failed|failure)\b|\W*an? (internal )?error (has )?occurred\b", re.I)
#: A JSON object result reports a failure with one of these keys: ``{"error": …}`` (any value but
#: null, false or empty), ``{"status": "error"}``, ``{"ok": false}``, ``{"success": false}``.
_ERROR_STATUSES = {"error", "failed", "failure"}


def is_error_result(output: str) -> bool:
    """Whether a function's output reports that the function failed (see :data:`_ERROR_TEXT`, :data:`_ERROR_STATUSES`).

    Only the client knows for sure; the Realtime protocol's
    ``function_call_output`` has no error flag, so the output is read the
    way the model reads it. A result that merely mentions an error later
    on ("no errors found") is not one.
    """
    try:
        value = json.loads(output)
    except ValueError:
        value = output
    if isinstance(value, dict):
        status = value.get("status")
        return (
            bool(value.get("error") or value.get("errors"))
            or (isinstance(status, str) and status.casefold() in _ERROR_STATUSES)
            or value.get("ok") is False
            or value.get("success") is False
        )
    return isinstance(value, str) and _ERROR_TEXT.match(value) is not None


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Realtime tool (flat: ``{"type": "function", "name": …}``) in chat completions form.

    Chat templates and chat completions endpoints both take
    ``{"type": "function", "function": {"name", "description", "parameters"}}``.
    """
    nested = tool.get("function")
    function: dict[str, Any] = nested if isinstance(nested, dict) else tool
    return {
        "type": "function",
        "function": {key: function[key] for key in ("name", "description", "parameters") if key in function},
    }


def offered_tools(tools: list[dict[str, Any]], tool_choice: Any) -> tuple[list[dict[str, Any]], bool]:
    """The tools to show the model for ``tool_choice``, and whether it must call one."""
    if tool_choice == "none" or not tools:
        return [], False
    if isinstance(tool_choice, dict):
        name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") == "mcp" and not name:
            return tools, True  # any tool (the server's tools are not told apart from the others here)
        chosen = [t for t in tools if t.get("name") == name]
        return chosen, bool(chosen)
    return tools, tool_choice == "required"


class CallFraming:
    """Puts ``<tool_call>`` tags around a call the model wrote without them.

    Small models offered tools often answer a call as bare JSON
    (``{"name": "get_weather", "arguments": {…}}``), in a code fence, in
    bold, or in tags of their own (``<tools>``); the server finds calls by
    their tags. An answer that starts like JSON or markup (or is a required
    call, begun in the prompt) is held back to its end and, if it holds a
    JSON object with a ``name`` (closing braces the model forgot are
    added), sent as one tagged call; any other answer streams through
    untouched.
    """

    def __init__(self, required: bool) -> None:
        self._required = required
        self._held: list[str] = []
        self._holding = required
        self._passing = False

    def feed(self, piece: str) -> str:
        """Take one piece of the answer; return what may be sent now."""
        if self._passing:
            return piece
        self._held.append(piece)
        if self._holding:
            return ""
        start = "".join(self._held).lstrip()
        if not start:
            return ""
        if start[0] in "{`<":
            self._holding = True
            return ""
        self._passing = True
        return self._release()

    def finish(self) -> str:
        """The answer ended: return what is still held, framed if a call."""
        if not self._holding:
            return self._release()
        text = self._release()
        if OPEN in text:
            return text  # tagged already
        call = json_object(text)
        if call is not None and "name" in call[0]:
            return frame(call[1])
        # Not a call after all; a required one is still reported as a call, so
        # the server can tell the model what is wrong with it.
        return f"{OPEN}\n{text}" if self._required else text

    def _release(self) -> str:
        text, self._held = "".join(self._held), []
        return text


def json_object(text: str) -> tuple[dict[str, Any], str] | None:
    """Return the first JSON object in ``text`` and its source, if any.

    An object the text leaves open (a small model's call often lacks its
    last brace, or ends it with a stray character) is closed.
    """
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            source = closed(re.sub(r"[^\w\]}\"]+$", "", text[start:].rstrip().removesuffix("```")))
            try:
                value = json.loads(source)
            except ValueError:
                start = text.find("{", start + 1)
                continue
            return (value, source) if isinstance(value, dict) else None
        if isinstance(value, dict):
            return value, text[start:end]
        start = text.find("{", end)
    return None


def closed(text: str) -> str:
    """``text`` with the brackets it leaves open closed (strings are skipped)."""
    opened: list[str] = []
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            opened.append("}" if char == "{" else "]")
        elif char in "}]" and opened:
            opened.pop()
    return text + ('"' if in_string else "") + "".join(reversed(opened))

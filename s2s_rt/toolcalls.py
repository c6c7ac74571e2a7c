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
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


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


def parse_call(raw: str, tools: list[dict[str, Any]]) -> tuple[str, str]:
    """Check one call against the tools offered.

    Returns:
        The function's name and its arguments as a JSON object string.

    Raises:
        ToolCallError: not JSON, an unknown function, or arguments that do
            not match the function's parameter schema.
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
        raise ToolCallError(f"there is no function named {name!r}")
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ToolCallError("the arguments are not valid JSON") from None
    if not isinstance(args, dict):
        raise ToolCallError("the arguments must be a JSON object")
    problems = schema_errors(args, tool.get("parameters") or {"type": "object"})
    if problems:
        raise ToolCallError(f"invalid arguments for {name}: " + "; ".join(problems))
    return name, json.dumps(args)


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
    """The ways ``value`` breaks a JSON schema (the subset tools use: types, properties, required, enum, items)."""
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
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}.{key} is not allowed")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            errors += schema_errors(sub, schema["items"], f"{path}[{i}]")
    return errors


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
        return [t for t in tools if t.get("name") == name], True
    return tools, tool_choice == "required"

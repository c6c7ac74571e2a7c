"""Strict OpenAI-conformance checks for server events, against the official ``openai`` package.

:func:`validate_server_event` checks one decoded server event against the
``openai`` package's own pydantic types: GA ``openai.types.realtime`` or beta
``openai.types.beta.realtime`` (``RealtimeServerEvent`` in each). It is
stricter than the SDK itself, in three ways:

1. **The event type must exist in that dialect.** The ``type`` is looked up in
   the variants of the dialect's ``RealtimeServerEvent`` union; an event type
   the package does not define for that dialect (a GA name sent to a beta
   client, say) fails instead of being accepted as an unknown event.
2. **Validation is strict.** The event is validated as JSON in pydantic's
   strict mode (``model_validate_json(..., strict=True)``), so a wrong type is
   not coerced (``"3"`` is not an ``int``), literals must match exactly
   (content part ``type``, ``status``, ``role`` …) and required fields must be
   present.
3. **Nothing is silently ignored.** The package's models allow extra fields
   (``extra="allow"``), so pydantic alone accepts misspelt or invented keys.
   After validation, the validated model and the input are walked together,
   recursively (items, content parts, response objects, usage, session
   configuration …), and every input key a model does not declare is a failure.

Every failure is an :class:`AssertionError` naming the dialect, the event type,
the JSON path and the problem.
"""

from __future__ import annotations

import copy
import json
import types
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pydantic
from openai.types.beta.realtime import realtime_server_event as _beta_events
from openai.types.realtime import realtime_server_event as _ga_events

__all__ = ["ConformanceError", "event_types", "validate_server_event"]

_UNIONS = (Union, types.UnionType)

#: The most problems listed in one failure message.
_MAX_PROBLEMS = 12


class ConformanceError(AssertionError):
    """A server event that does not conform to the ``openai`` package's types."""

    def __init__(self, dialect: str, event_type: object, problems: list[str], event: object) -> None:
        self.dialect = dialect
        self.event_type = event_type
        self.problems = problems
        self.event = event
        shown = problems[:_MAX_PROBLEMS]
        more = f"\n  … and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        body = json.dumps(event, default=repr)
        if len(body) > 2000:
            body = body[:2000] + "…"
        super().__init__(
            f"non-conformant {dialect} server event {event_type!r}:\n  "
            + "\n  ".join(shown)
            + more
            + f"\n  event: {body}"
        )


def _union_variants(alias: Any) -> tuple[type[pydantic.BaseModel], ...]:
    """The model classes of a (possibly ``Annotated``) union type alias."""
    args = get_args(alias)
    # Annotated[Union[...], PropertyInfo(...)] -> (Union[...], PropertyInfo(...))
    if args and get_origin(args[0]) is Union:
        args = get_args(args[0])
    variants = tuple(a for a in args if isinstance(a, type) and issubclass(a, pydantic.BaseModel))
    assert variants, f"could not read the variants of {alias!r}"
    return variants


def _type_literal(model: type[pydantic.BaseModel]) -> str:
    field = model.model_fields["type"]
    (literal,) = get_args(field.annotation)
    assert isinstance(literal, str)
    return literal


@cache
def event_types(beta: bool) -> dict[str, type[pydantic.BaseModel]]:
    """Every server event type of a dialect, mapped to the ``openai`` model that describes it."""
    module = _beta_events if beta else _ga_events
    table: dict[str, type[pydantic.BaseModel]] = {}
    for model in _union_variants(module.RealtimeServerEvent):
        name = _type_literal(model)
        assert name not in table, f"two {('beta' if beta else 'GA')} models for {name!r}"
        table[name] = model
    return table


def _path(loc: tuple[int | str, ...]) -> str:
    out = "$"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _pydantic_problems(err: pydantic.ValidationError) -> list[str]:
    problems = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        where = _path(loc)
        got = e.get("input")
        shown = json.dumps(got, default=repr) if got is not None or e["type"] != "missing" else ""
        if len(shown) > 120:
            shown = shown[:120] + "…"
        suffix = f" (got {shown})" if shown and e["type"] != "missing" else ""
        problems.append(f"{where}: {e['msg']}{suffix}")
    return problems


def _unknown_keys(value: Any, raw: Any, path: str, problems: list[str]) -> None:
    """Walk a validated value and its raw JSON together; report raw keys no model declares."""
    if isinstance(value, pydantic.BaseModel):
        if not isinstance(raw, dict):
            return  # validated from something else (cannot happen from JSON objects)
        model = type(value)
        wire = {(field.alias or name): name for name, field in model.model_fields.items()}
        for key, sub in raw.items():
            if key not in wire:
                problems.append(f"{path}.{key}: field not defined by {model.__module__}.{model.__qualname__}")
            else:
                _unknown_keys(getattr(value, wire[key]), sub, f"{path}.{key}", problems)
        # belt and braces: whatever pydantic itself kept as an extra
        for key in value.model_extra or {}:
            if key not in raw:
                problems.append(f"{path}.{key}: extra field kept by {model.__qualname__}")
    elif isinstance(value, (list, tuple)) and isinstance(raw, list):
        for i, (v, r) in enumerate(zip(value, raw, strict=False)):
            _unknown_keys(v, r, f"{path}[{i}]", problems)
    elif isinstance(value, dict) and isinstance(raw, dict):
        # a mapping field (free-form metadata, or a dict of models): recurse where the value is a model
        for key, sub in raw.items():
            if key in value:
                _unknown_keys(value[key], sub, f"{path}.{key}", problems)


def _wire_fields(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """A model's fields by their JSON name."""
    return {(field.alias or name): field for name, field in model.model_fields.items()}


def _strip_optional(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _literal_fields_match(model: type[pydantic.BaseModel], raw: dict[str, Any]) -> bool:
    """Whether every ``Literal`` field present in ``raw`` has an allowed value (a discriminator match)."""
    matched = False
    for key, field in _wire_fields(model).items():
        tp = _strip_optional(field.annotation)
        options = [a for a in (get_args(tp) if get_origin(tp) in _UNIONS else (tp,)) if get_origin(a) is Literal]
        if not options or key not in raw:
            continue
        allowed = {v for lit in options for v in get_args(lit)}
        if raw[key] not in allowed:
            return False
        matched = True
    return matched


def _pick_variant(variants: list[Any], raw: Any) -> Any:
    """The union variant a raw value means: one that validates it, else one its literal fields name."""
    models = [v for v in variants if isinstance(v, type) and issubclass(v, pydantic.BaseModel)]
    if not isinstance(raw, dict):
        others = [v for v in variants if v not in models]
        return others[0] if len(others) == 1 else None
    valid = []
    for model in models:
        try:
            model.model_validate_json(json.dumps(raw), strict=True)
        except pydantic.ValidationError:
            continue
        valid.append(model)
    candidates = valid or [m for m in models if _literal_fields_match(m, raw)]
    if not candidates:
        return None
    # as pydantic's smart union does: the variant that accounts for the most of the input
    return min(candidates, key=lambda m: len(set(raw) - set(_wire_fields(m))))


def _unknown_keys_by_type(tp: Any, raw: Any, path: str, problems: list[str]) -> None:
    """Like :func:`_unknown_keys`, for an input that did not validate: walk the declared types instead."""
    tp = _strip_optional(tp)
    origin = get_origin(tp)
    if raw is None:
        return
    if origin in _UNIONS:
        variants = [_strip_optional(a) for a in get_args(tp) if a is not type(None)]
        chosen = variants[0] if len(variants) == 1 else _pick_variant(variants, raw)
        if chosen is not None:
            _unknown_keys_by_type(chosen, raw, path, problems)
    elif origin in (list, tuple) and isinstance(raw, list):
        (item, *_) = get_args(tp) or (Any,)
        for i, r in enumerate(raw):
            _unknown_keys_by_type(item, r, f"{path}[{i}]", problems)
    elif origin is dict and isinstance(raw, dict):
        args = get_args(tp)
        for key, sub in raw.items():
            _unknown_keys_by_type(args[1] if len(args) == 2 else Any, sub, f"{path}.{key}", problems)
    elif isinstance(tp, type) and issubclass(tp, pydantic.BaseModel) and isinstance(raw, dict):
        wire = _wire_fields(tp)
        for key, sub in raw.items():
            if key not in wire:
                problems.append(f"{path}.{key}: field not defined by {tp.__module__}.{tp.__qualname__}")
            else:
                _unknown_keys_by_type(wire[key].annotation, sub, f"{path}.{key}", problems)


#: The only ways our events may differ from the package's types, each named with its reason.
#: (GA) ``session.id`` and ``session.object``: OpenAI's own server sends them; the package does not declare them.
#: (beta) ``session.model``: the package allows only OpenAI's model names; ours is not one.
#: (GA) ``audio/pcm`` at 16 or 48 kHz: a rate the client asked for (DESIGN.md); the package knows only 24 kHz.
def _documented_deviations(event: dict[str, Any], *, beta: bool) -> dict[str, Any]:
    if event.get("type") not in ("session.created", "session.updated") or not isinstance(event.get("session"), dict):
        return event
    event = copy.deepcopy(event)
    session = event["session"]
    if beta:
        if isinstance(session.get("model"), str):
            session["model"] = "gpt-realtime"
        return event
    session.pop("id", None)
    session.pop("object", None)
    audio = session.get("audio")
    for side in ("input", "output"):
        fmt = audio.get(side, {}).get("format") if isinstance(audio, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "audio/pcm" and fmt.get("rate") in (16000, 48000):
            fmt["rate"] = 24000
    return event


def validate_server_event(event: dict[str, Any], *, beta: bool) -> None:
    """Check one server event against the official ``openai`` types of its dialect; raise if it does not conform.

    ``beta`` picks ``openai.types.beta.realtime`` (a client that sent
    ``OpenAI-Beta: realtime=v1`` or offered ``openai-beta.realtime-v1``);
    otherwise ``openai.types.realtime`` (GA). Raises :class:`ConformanceError`
    (an ``AssertionError``) naming the event type, the JSON path and every
    problem found.
    """
    dialect = "beta" if beta else "GA"
    if not isinstance(event, dict):
        raise ConformanceError(
            dialect, None, [f"$: a server event must be a JSON object, got {type(event).__name__}"], event
        )
    event_type = event.get("type")
    if not isinstance(event_type, str):
        raise ConformanceError(dialect, event_type, [f"$.type: missing or not a string ({event_type!r})"], event)
    table = event_types(beta)
    model = table.get(event_type)
    if model is None:
        other = event_types(not beta).get(event_type)
        hint = f"; it is a {'GA' if beta else 'beta'} event type" if other is not None else ""
        raise ConformanceError(
            dialect,
            event_type,
            [
                f"$.type: {event_type!r} is not a server event type of the {dialect} dialect "
                f"(openai.types.{'beta.' if beta else ''}realtime.RealtimeServerEvent){hint}"
            ],
            event,
        )
    event = _documented_deviations(event, beta=beta)
    problems: list[str] = []
    try:
        validated = model.model_validate_json(json.dumps(event), strict=True)
    except pydantic.ValidationError as err:
        # report the unknown fields too, found from the declared types since nothing validated
        problems = _pydantic_problems(err)
        _unknown_keys_by_type(model, event, "$", problems)
    else:
        _unknown_keys(validated, event, "$", problems)
    if problems:
        raise ConformanceError(dialect, event_type, problems, event)

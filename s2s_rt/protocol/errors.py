"""The errors that become ``error`` events, by side: a client's mistake, or a fault of the server.

As h11 separates the peer's protocol errors from its own, the two sides are
different types here: :class:`ProtocolError` is what the client sent wrong
(it may fix it and send again; ``invalid_request_error``), and
:class:`ServerFault` is what went wrong inside the server (the client did
nothing wrong; ``server_error``). Both are :class:`RealtimeError`, which is
what an ``error`` event is made from.
"""

from __future__ import annotations


class RealtimeError(Exception):
    """What an ``error`` event says: either side's (use :class:`ProtocolError` or :class:`ServerFault`).

    Args:
        code: machine-readable name of the problem (e.g. ``invalid_json``).
        message: what was wrong, for a person.
        param: the offending field, dotted (``session.temperature``), if any.
        event_id: the client event's ``event_id``, echoed back.
        type: the OpenAI error type.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        event_id: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.type = type


class ProtocolError(RealtimeError):
    """A client event that cannot be honoured: the client's mistake (``invalid_request_error`` unless told)."""


class ServerFault(RealtimeError):
    """Something the server could not do, through no fault of the client (``server_error``).

    Args:
        code: machine-readable name of the fault (e.g. ``vad_failed``).
        message: what went wrong, for a person.
        event_id: the client event it concerns, if any.
    """

    def __init__(self, code: str, message: str, *, event_id: str | None = None) -> None:
        super().__init__(code, message, event_id=event_id, type="server_error")

"""The one exception the protocol layer raises for a client's mistake."""

from __future__ import annotations


class ProtocolError(Exception):
    """A client event that cannot be honoured; becomes an ``error`` event.

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

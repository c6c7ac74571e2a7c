"""What the HTTP routes and the connection loop may ask of the running server."""

from __future__ import annotations

from typing import Protocol


class Serving(Protocol):
    """The server as its parts see it: whether it takes new sessions, and the operator's switch."""

    #: Shutting down: no new sessions, running turns finish within the grace period.
    closing: bool
    #: Drained by an operator: no new sessions, running ones carry on.
    draining: bool

    def admits(self) -> bool:
        """Whether listening can take one more session."""
        ...

    def drain(self) -> None: ...

    def undrain(self) -> None: ...

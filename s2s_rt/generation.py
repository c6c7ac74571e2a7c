"""A slot's generation scope: which work is still wanted.

Every piece of work in a slot carries the generation it was made under.
Work for a response carries the response's own generation and is stale as
soon as the scope moves on (``response.cancel``, barge-in, the next
response, the end of the session). Work for the session as a whole (speech
events, transcripts) stays wanted until the session ends. Stages and the send
loop ask :meth:`Generation.is_stale` and drop what it says; streamed work asks
between pieces. Reads of two ints are atomic under the GIL, so executor
threads may ask too.
"""

from __future__ import annotations


class Generation:
    def __init__(self) -> None:
        self.current = 0
        #: First generation of the session the slot serves now.
        self.session_floor = 0

    def advance(self) -> int:
        """Move on: all response work made so far becomes stale."""
        self.current += 1
        return self.current

    def new_session(self) -> int:
        """Move on and make every earlier session's work stale too."""
        self.session_floor = self.advance()
        return self.current

    def is_stale(self, generation: int, *, response: bool) -> bool:
        if response:
            return generation != self.current
        return generation < self.session_floor

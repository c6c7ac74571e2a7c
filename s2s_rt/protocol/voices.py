"""Voices a session may ask for: installed Piper voices, the operator's names for them, and OpenAI's names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from s2s_rt.protocol import client_events as ce
from s2s_rt.protocol.errors import ProtocolError

#: Voice names of the hosted service; accepted, and spoken by the voice the operator maps each to (default: the
#: default voice).
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar"})


@dataclass(frozen=True, slots=True)
class Voices:
    """The voices a session may ask for: the installed ones and the operator's names for them.

    A request names an installed voice, a name the operator mapped to one
    (``voice_names``: ``ash`` -> ``en_US-ryan-medium``), or, in the newest
    types, a custom voice object ``{"id": ...}`` whose id is either. OpenAI's
    names the operator did not map are spoken by the default voice, so clients
    written for the hosted service work unchanged; any other name is an error.
    """

    #: The installed voices; the first speaks when none is asked for.
    installed: tuple[str, ...] = ("default",)
    #: The operator's names: requested name -> installed voice.
    names: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, installed: Iterable[str], names: Mapping[str, str] | None = None) -> Voices:
        """The voices for ``installed`` and the operator's ``names``.

        Raises:
            ValueError: a name maps to a voice that is not installed.
        """
        voices = tuple(installed) or ("default",)
        mapped = dict(names or {})
        for name, target in mapped.items():
            if target not in voices:
                installed_list = ", ".join(voices)
                raise ValueError(f"voice_names: {name!r} maps to {target!r}, which is not installed ({installed_list})")
        return cls(voices, mapped)

    @property
    def default(self) -> str:
        return self.installed[0]

    def pick(self, voice: str | ce.VoiceIdIn, event_id: str | None, param: str) -> str:
        """The installed voice that speaks for a request.

        Raises:
            ProtocolError: a name or id that is neither installed, mapped, nor one of OpenAI's.
        """
        custom = isinstance(voice, ce.VoiceIdIn)
        name = voice.id if isinstance(voice, ce.VoiceIdIn) else voice
        if name in self.installed:
            return name
        if name in self.names:
            return self.names[name]
        if name in OPENAI_VOICES and not custom:
            return self.default
        offered = ", ".join([*self.installed, *self.names])
        what = f"Unknown custom voice id {name!r}" if custom else f"Unknown voice {name!r}"
        raise ProtocolError("unknown_voice", f"{what}; available: {offered}", param=param, event_id=event_id)

"""The surface fuzzer: the other ways in than a WebSocket session, the POST routes, preflights and WebRTC calls.

:func:`surface_fuzz` runs the server as its own process (``s2s-rt serve --stack fake``, JSON log
lines on stderr), so that its event loop, its UDP sockets, its log and its exit status are its own,
and a SIGTERM is a real one. Hostile clients post mutated SDP offers, multipart forms and JSON
bodies, preflights and cross-site requests from foreign origins, hangups of any id, offers in
bursts from one address, and make real aiortc calls that never connect, drop mid-answer, vanish,
flood or overfill their data channel; SIP callers, strangers on the media ports and a hostile
application behind the webhook come from :mod:`sip_fuzzing`; calm WebSocket sessions and a calm
call talk meanwhile.

Everything stays on this machine. Every address an offer names (connection lines, candidates,
anything shaped like an address) is loopback, unspecified or one of this host's own
(:class:`Here`, checked by :func:`stray_addresses` before each offer leaves), and the candidates
the fuzzer adds point at UDP sinks it holds open: the server sends connectivity checks to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiortc.mediastreams import MediaStreamTrack
from conformance import validate_server_event
from fuzzing import CALM_TURN_S, TOOL, Finding, FuzzReport, Run, _last_frames, _transcript, calm_worker

from s2s_rt.audio import AudioFormat

#: The API key of a run with keys on.
SURFACE_KEY = "sk-fuzz-key"
#: An origin the server is started with (``allowed_origins``): its pages may use the server.
ALLOWED_ORIGIN = "https://app.example"
#: Origins of pages elsewhere (``{port}``: the server's): none may reach an operator route or read an answer.
FOREIGN_ORIGINS = (
    "http://evil.example",
    "https://evil.example:8443",
    "null",
    "http://localhost:{port}",
    "http://127.0.0.1:1",
    "http://127.0.0.1:{port}.evil.example",
    "http://app.example",
    "https://app.example.evil.example",
    "file://",
    "chrome-extension://abcdefghijklmnop",
)
#: A run's server (``Config`` fields); calm clients hold 3 slots, the hostile ones share the rest.
SURFACE_CONFIG: dict[str, Any] = {
    "pool_size": 10,
    "call_timeout_s": 2.0,
    "drain_timeout_s": 3.0,
    "grace_period_s": 2.0,
    "send_timeout_s": 2.0,
    "max_connections_per_ip": 2,
}
#: Lag of the server's loop (a 50 ms ticker, ``s2s_event_loop_lag_seconds``) above this, and above
#: :data:`LAG_FACTOR` times the quiet figure, while this machine was not itself busy, is a finding.
LAG_FLOOR_S = 0.25
LAG_FACTOR = 5.0
#: How long after the hostile clients stop every slot and UDP port must be back.
SURFACE_SETTLE_S = 15.0
#: The designed refusals a 503 may carry (the pool is full, the server drains or shuts down).
DESIGNED_503 = (b"session_limit_reached", b"draining", b"shutting down", b"not ready")


#: The most a mutation adds to an offer by copying: four times the server's body limit (256 KiB).
OFFER_GROWTH_CHARS = 1 << 20
#: A tick of the fuzzer's own loop this late is a finding of the fuzzer's: its calm call answers the
#: server's ICE consent checks on that loop (a 4.4 s stall at the least misses the 4 that end it).
SELF_STALL_S = 2.0


# --- where an offer may point ------------------------------------------------------------------


@dataclass(frozen=True)
class Here:
    """This machine's addresses an offer may name, and UDP sinks (address, port) for the candidates it adds."""

    hosts: frozenset[str]
    sinks: tuple[tuple[str, int], ...]
    _seen: dict[str, bool | None] = field(default_factory=dict, compare=False, repr=False)

    def allows(self, token: str) -> bool | None:
        """Whether an address-shaped ``token`` is on this machine; None: it is no address."""
        if "." not in token and ":" not in token:
            return None
        seen = self._seen.get(token, ...)
        if seen is ...:
            if len(self._seen) > 200_000:
                self._seen.clear()
            seen = self._seen[token] = self._allows(token)
        return seen

    def _allows(self, token: str) -> bool | None:
        import ipaddress

        from aioice.mdns import is_mdns_hostname

        if is_mdns_hostname(token):
            return False  # resolving it would ask the network (multicast DNS)
        try:
            ip = ipaddress.ip_address(token)
        except ValueError:
            if not re.fullmatch(r"\d+(\.\d+){1,3}", token):
                return None
            # inet_aton's short forms, which a resolver reads as addresses (127.1 is 127.0.0.1, 192.0 is 192.0.0.0)
            try:
                ip = ipaddress.IPv4Address(socket.inet_aton(token))
            except OSError:
                return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
            return False
        return ip.is_loopback or ip.is_unspecified or str(ip) in self.hosts

    def sink(self, rng: random.Random) -> tuple[str, int]:
        return rng.choice(self.sinks)


def host_addresses() -> list[str]:
    """This host's own addresses, as aiortc finds them for its candidates (aioice; loopback left out)."""
    from aioice.ice import get_host_addresses

    return get_host_addresses(use_ipv4=True, use_ipv6=True)


_ADDRESSY = re.compile(r"[^\s/]+")


def stray_addresses(sdp: str, here: Here) -> list[str]:
    """The tokens of ``sdp`` that name an address off this machine (none may leave the fuzzer).

    Tokens are what aioice reads a candidate with (``str.split()``, which ``\\s`` matches), cut at
    ``/`` as well (``c=IN IP4 ADDR/TTL``).
    """
    return [m.group() for m in _ADDRESSY.finditer(sdp) if here.allows(m.group()) is False]


def keep_local(sdp: str, here: Here) -> str:
    """``sdp`` with every address off this machine replaced by loopback."""

    def local(m: re.Match[str]) -> str:
        token = m.group()
        return token if here.allows(token) is not False else ("::1" if ":" in token else "127.0.0.1")

    return _ADDRESSY.sub(local, sdp)


class _Sink(asyncio.DatagramProtocol):
    def datagram_received(self, data: bytes, addr: Any) -> None:
        pass  # connectivity checks sent to a candidate the fuzzer made up end here


async def open_sinks(addresses: Sequence[str]) -> tuple[list[asyncio.DatagramTransport], tuple[tuple[str, int], ...]]:
    """A UDP socket on loopback and on each of ``addresses`` that swallows what it is sent."""
    loop = asyncio.get_running_loop()
    transports, sinks = [], []
    for address in ["127.0.0.1", *addresses]:
        try:
            transport, _ = await loop.create_datagram_endpoint(_Sink, local_addr=(address, 0))
        except OSError:
            continue
        transports.append(transport)
        sinks.append((address, int(transport.get_extra_info("sockname")[1])))
    return transports, tuple(sinks)


# --- mutated SDP -------------------------------------------------------------------------------

SdpMutation = Callable[[random.Random, list[str], Here], str]


def _sections(lines: list[str]) -> list[tuple[int, int]]:
    starts = [i for i, line in enumerate(lines) if line.startswith("m=")]
    return [(s, (starts[k + 1] if k + 1 < len(starts) else len(lines))) for k, s in enumerate(starts)]


def _candidate(rng: random.Random, here: Here, *, broken: bool = False) -> str:
    host, port = here.sink(rng)
    fields = [
        str(rng.randrange(1, 10**9)),
        rng.choice(["1", "1", "1", "2", "0", "256", "x"]),
        rng.choice(["udp", "udp", "UDP", "tcp", "sctp"]),
        rng.choice([str(rng.randrange(1, 2**31)), "0", "-5", str(2**64), "p"]),
        host,
        rng.choice([str(port)] * 5 + ["0", "65536", "-1", "99999", "port"]),
        "typ",
        rng.choice(["host", "host", "srflx", "relay", "prflx", "bogus"]),
    ]
    if rng.random() < 0.3:
        rhost, rport = here.sink(rng)
        fields += ["raddr", rhost, "rport", rng.choice([str(rport), "x"])]
    if rng.random() < 0.2:
        fields += ["generation", rng.choice(["0", "x", "-1"])]
    if broken:
        drop = rng.choice(["typ", "type", "port", "all-but-two", "address"])
        if drop == "typ":
            fields = fields[:6]
        elif drop == "type":
            fields = fields[:7]
        elif drop == "port":
            fields[5] = rng.choice(["", "nine", "9.5"])
        elif drop == "all-but-two":
            fields = fields[:2]
        else:
            del fields[4]
    return "a=candidate:" + " ".join(f for f in fields if f)


def _m_duplicate_sections(rng: random.Random, lines: list[str], here: Here) -> str:
    sections = _sections(lines)
    if not sections:
        return "no section to copy"
    start, end = rng.choice(sections)
    n = rng.choice([1, 2, 7, 8, 9, 50, 150])
    copy = lines[start:end]
    # Past the body limit every size is refused alike; a section with thousands of candidates copied
    # 150 times made 30 MB, which took the fuzzer's own loop 9 s to check (its calm call went unanswered).
    n = max(1, min(n, OFFER_GROWTH_CHARS // max(1, sum(len(line) + 1 for line in copy))))
    lines[end:end] = copy * n
    return f"{lines[start].split()[0]} section copied {n}x"


def _m_many_sections(rng: random.Random, lines: list[str], here: Here) -> str:
    """Many small audio sections (2,400 of them fit in 170 KB)."""
    n = rng.choice([9, 100, 600, 1200, 2400])
    at = rng.randrange(len(lines) + 1)
    lines[at:at] = [
        line
        for i in range(n)
        for line in ("m=audio 9 UDP/TLS/RTP/SAVPF 111", f"a=mid:s{i}", "a=rtpmap:111 opus/48000/2")
    ]
    return f"{n} small audio sections"


def _m_drop_section(rng: random.Random, lines: list[str], here: Here) -> str:
    sections = _sections(lines)
    if not sections:
        return "no section to drop"
    start, end = rng.choice(sections)
    kind = lines[start].split()[0]
    del lines[start:end]
    return f"{kind} section dropped"


def _m_media_line(rng: random.Random, lines: list[str], here: Here) -> str:
    line = rng.choice(
        [
            "m=audio",
            "m=audio 9",
            "m=audio x UDP/TLS/RTP/SAVPF 111",
            "m=audio 9 UDP/TLS/RTP/SAVPF",
            "m=audio -1 UDP/TLS/RTP/SAVPF 111",
            "m=audio 9 RTP/AVP 0",
            "m=",
            "m=video 9 UDP/TLS/RTP/SAVPF 96",
            "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
            "m=application 9 DTLS/SCTP 5000",
            "m=text 9 RTP/AVP 98",
            "m=audio 9 UDP/TLS/RTP/SAVPF " + " ".join(str(i) for i in range(300)),
        ]
    )
    sections = _sections(lines)
    if sections and rng.random() < 0.5:
        start, _ = rng.choice(sections)
        lines[start] = line
        return f"a media line replaced by {line[:40]!r}"
    lines.insert(rng.randrange(len(lines) + 1), line)
    return f"media line {line[:40]!r} inserted"


def _m_candidates(rng: random.Random, lines: list[str], here: Here) -> str:
    n = rng.choice([1, 3, 20, 64, 65, 600, 3000])
    broken = rng.random() < 0.3
    new = [_candidate(rng, here, broken=broken) for _ in range(n)]
    sections = _sections(lines)
    at = rng.choice(sections)[1] if sections else len(lines)
    lines[at:at] = new
    return f"{n} {'broken ' if broken else ''}candidates added"


def _m_drop_candidates(rng: random.Random, lines: list[str], here: Here) -> str:
    lines[:] = [line for line in lines if not line.startswith("a=candidate")]
    return "every candidate dropped"


def _m_setup(rng: random.Random, lines: list[str], here: Here) -> str:
    role = rng.choice(["actpass", "active", "passive", "holdconn", "bogus", "", None, "twice"])
    kept = [line for line in lines if not line.startswith("a=setup")]
    if role is None:
        lines[:] = kept
        return "a=setup removed"
    if role == "twice":
        for i, line in enumerate(lines):
            if line.startswith("a=setup"):
                lines.insert(i + 1, "a=setup:passive")
                break
        return "a second, conflicting a=setup"
    lines[:] = [f"a=setup:{role}" if line.startswith("a=setup") else line for line in lines]
    return f"a=setup:{role}"


def _m_connection_line(rng: random.Random, lines: list[str], here: Here) -> str:
    host, _ = here.sink(rng)
    line = rng.choice(
        [
            "c=IN IP4 127.0.0.1",
            f"c=IN {'IP6' if ':' in host else 'IP4'} {host}",
            "c=IN IP6 ::1",
            "c=IN",
            "c=IN IP4",
            "c=",
            "c=IN IP7 127.0.0.1",
            "c=IN IP4 127.0.0.1/127/3",
            "c=IN IP4 ::1",
        ]
    )
    lines[:] = [line if old.startswith("c=") else old for old in lines]
    return f"connection lines {line!r}"


def _m_attribute(rng: random.Random, lines: list[str], here: Here) -> str:
    """One attribute set to an odd value in a section (sizes, ports, credentials, codecs, directions)."""
    name, values = rng.choice(
        [
            ("max-message-size", ["0", "1", "1000", "65536", "262144", str(2**40), "-1", "abc", ""]),
            ("sctp-port", ["0", "-1", "70000", "abc", ""]),
            ("sctpmap", ["5000 webrtc-datachannel 1024", "x", ""]),
            ("ice-ufrag", ["", "a", "x" * 300, "bad ufrag!", "\u00e9\u00e9\u00e9\u00e9"]),
            ("ice-pwd", ["", "short", "y" * 300]),
            ("fingerprint", ["", "sha-1024 AB:CD", "sha-256", "sha-256 zz", "sha-256 " + "AB:" * 200]),
            ("rtpmap", ["111 opus/48000/2", "111 opus", "x opus/48000/2", "300 opus/48000/2", "111 opus/x/2", ""]),
            ("fmtp", ["111 minptime=10;useinbandfec=1", "111", "x y", "111 " + "a=b;" * 500]),
            ("mid", ["0", "", "x" * 500, "dup"]),
            ("group", ["BUNDLE", "BUNDLE 0 1 2 3 4 5", "BUNDLE x", "LS 0", ""]),
            ("rtcp", ["9 IN IP4 127.0.0.1", "x", "9 IN", ""]),
            ("rtcp-mux", [""]),
            ("sendrecv", [""]),
            ("inactive", [""]),
            ("ssrc", ["1 cname:x", "x", "4294967296 cname:y", ""]),
            ("extmap", ["1 urn:ietf:params:rtp-hdrext:ssrc-audio-level", "x", "99999 y", ""]),
            ("msid", ["a b", "", "x" * 1000]),
            ("ice-lite", [""]),
            ("end-of-candidates", [""]),
            ("ice-options", ["trickle", "x" * 100]),
        ]
    )
    value = rng.choice(values)
    line = f"a={name}:{value}" if value else f"a={name}"
    replaced = False
    for i, old in enumerate(lines):
        if old.startswith(f"a={name}") and rng.random() < 0.7:
            lines[i] = line
            replaced = True
    if not replaced:
        sections = _sections(lines)
        at = rng.randrange(sections[0][0], len(lines) + 1) if sections else len(lines)
        lines.insert(at, line)
    return f"{line[:60]!r}{' (replacing)' if replaced else ''}"


def _m_size(rng: random.Random, lines: list[str], here: Here) -> str:
    kind = rng.choice(["long line", "many lines", "long line", "many lines", "huge"])
    if kind == "long line":
        n = rng.choice([1000, 16_000, 100_000, 200_000])
        lines.insert(rng.randrange(len(lines) + 1), "a=x-junk:" + "A" * n)
        return f"an attribute of {n} characters"
    if kind == "many lines":
        n = rng.choice([500, 1024, 1025, 5000, 20_000])
        at = rng.randrange(len(lines) + 1)
        lines[at:at] = [f"a=x-pad:{i}" for i in range(n)]
        return f"{n} more lines"
    n = rng.choice([300_000, 1 << 20])
    lines.append("a=x-huge:" + "B" * n)
    return f"{n} characters more (above the body limit)"


def _m_session_lines(rng: random.Random, lines: list[str], here: Here) -> str:
    kind = rng.choice(["no v", "v=1", "no o", "no s", "no t", "v last", "empty lines", "spaces"])
    if kind == "no v":
        lines[:] = [line for line in lines if not line.startswith("v=")]
    elif kind == "v=1":
        lines[:] = ["v=1" if line.startswith("v=") else line for line in lines]
    elif kind in ("no o", "no s", "no t"):
        lines[:] = [line for line in lines if not line.startswith(kind[-1] + "=")]
    elif kind == "v last":
        lines[:] = [line for line in lines if not line.startswith("v=")] + ["v=0"]
    elif kind == "empty lines":
        for _ in range(5):
            lines.insert(rng.randrange(len(lines) + 1), "")
    else:
        lines[:] = [" " + line if rng.random() < 0.2 else line for line in lines]
    return f"session lines: {kind}"


def _m_characters(rng: random.Random, lines: list[str], here: Here) -> str:
    """Characters flipped, cut or added anywhere (the addresses are put back on this machine afterwards)."""
    text = "\n".join(lines)
    kind = rng.choice(["flip", "truncate", "nul", "non-ascii", "invalid utf-8", "bom"])
    if kind == "flip" and text:
        chars = list(text)
        for _ in range(rng.choice([1, 5, 50])):
            chars[rng.randrange(len(chars))] = chr(rng.choice([0x20, 0x3A, 0x3D, 0x30 + rng.randrange(10), 0x61]))
        text = "".join(chars)
    elif kind == "truncate":
        text = text[: rng.randrange(len(text) + 1)]
    elif kind == "nul":
        at = rng.randrange(len(text) + 1)
        text = text[:at] + "\x00" + text[at:]
    elif kind == "non-ascii":
        at = rng.randrange(len(text) + 1)
        text = text[:at] + rng.choice(["\u00e9", "\u2028", "\u0085", "\U0001f600", "\x1c"]) + text[at:]
    elif kind == "invalid utf-8":
        at = rng.randrange(len(text) + 1)
        text = text[:at] + "\udcff\udcfe" + text[at:]  # raw bytes 0xff 0xfe once encoded (surrogateescape)
    else:
        text = "\ufeff" + text
    lines[:] = text.split("\n")
    return f"characters: {kind}"


#: Every mutation of an offer, by name.
SDP_MUTATIONS: dict[str, SdpMutation] = {
    "duplicate_sections": _m_duplicate_sections,
    "many_sections": _m_many_sections,
    "drop_section": _m_drop_section,
    "media_line": _m_media_line,
    "candidates": _m_candidates,
    "drop_candidates": _m_drop_candidates,
    "setup": _m_setup,
    "connection_line": _m_connection_line,
    "attribute": _m_attribute,
    "size": _m_size,
    "session_lines": _m_session_lines,
    "characters": _m_characters,
}
#: Mutations an offer of a call that should still connect may get.
MILD_MUTATIONS = ("setup", "attribute", "candidates")


def mutate_offer(
    rng: random.Random, sdp: str, here: Here, steps: Sequence[tuple[str, int]] | None = None
) -> tuple[bytes, list[str]]:
    """An offer mutated by 1-3 random mutations (or by ``steps``: (name, seed) each), kept on this machine.

    Returns:
        The body (UTF-8; raw bytes where a mutation put them) and what was done to it.
    """
    if steps is None:
        names = list(SDP_MUTATIONS)
        steps = [(rng.choice(names), rng.randrange(2**32)) for _ in range(rng.choice([1, 1, 2, 3]))]
    lines = sdp.replace("\r\n", "\n").split("\n")
    done = []
    for name, step_seed in steps:
        done.append(SDP_MUTATIONS[name](random.Random(step_seed), lines, here))
    ending = rng.choice(["\r\n", "\r\n", "\r\n", "\n", "\r"])
    text = keep_local(ending.join(lines), here)
    assert not stray_addresses(text, here), "the fuzzer made an offer that names another machine"
    return text.encode("utf-8", "surrogateescape"), done


# --- JSON bodies and multipart forms -----------------------------------------------------------

SESSION_TEMPLATE: dict[str, Any] = {
    "type": "realtime",
    "instructions": "Be brief.",
    "output_modalities": ["audio"],
    "audio": {
        "input": {"format": {"type": "audio/pcm", "rate": 24_000}, "turn_detection": {"type": "server_vad"}},
        "output": {"voice": "tone"},
    },
    "tools": [TOOL],
    "tool_choice": "auto",
}
ODD_VALUES: tuple[Any, ...] = (None, 0, -1, 1.5, 1e308, 10**40, "", "x" * 3000, [], {}, True, [[]], {"type": 7})


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _set(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    value[path[0]] = _set(value[path[0]], path[1:], new)
    return value


def hostile_json(rng: random.Random, *, field: str = "body") -> tuple[bytes, str]:
    """A JSON body (a ``client_secrets`` body, or a call's ``session`` field) of some hostile kind.

    Returns:
        The bytes and what they are.
    """
    import copy

    session = copy.deepcopy(SESSION_TEMPLATE)
    template: Any = {"expires_after": {"anchor": "created_at", "seconds": 600}, "session": session}
    if field == "session":
        template = session
    kind = rng.choice(["valid", "nested", "surrogate", "wrong type", "wrong type", "garbage", "number", "huge"])
    if kind == "valid":
        if rng.random() < 0.5 and isinstance(template, dict) and "session" in template:
            template = {"session": {"type": "realtime"}} if rng.random() < 0.5 else {}
        return json.dumps(template).encode(), "valid"
    if kind == "nested":
        depth = rng.choice([50, 200, 1000, 10_000, 100_000])
        shape = rng.choice(["[", "{", "in session"])
        if shape == "[":
            text = "[" * depth + "]" * depth
        elif shape == "{":
            text = '{"a":' * depth + "1" + "}" * depth
        else:
            inner = '{"x":' * depth + "1" + "}" * depth
            text = '{"type":"realtime","tools":[{"type":"function","name":"f","parameters":' + inner + "}]}"
            if field != "session":
                text = '{"session":' + text + "}"
        return text.encode(), f"nested {depth} deep ({shape})"
    if kind == "surrogate":
        paths = [p for p in _paths(template) if p and isinstance(_get(template, p), str)]
        path = rng.choice(paths)
        lone = rng.choice(["\ud800", "\udfff", "\ud83d", "a\udc00b", "\ud800\ud800"])
        raw = rng.random() < 0.3
        _set(template, path, lone)
        if raw:  # the surrogate's UTF-8 bytes (invalid UTF-8), not an escape
            return json.dumps(template, ensure_ascii=False).encode("utf-8", "surrogatepass"), f"raw surrogate at {path}"
        return json.dumps(template).encode(), f"escaped lone surrogate at {path}"
    if kind == "wrong type":
        path = rng.choice(_paths(template))
        new = rng.choice(ODD_VALUES)
        template = _set(template, path, new)
        return json.dumps(template).encode(), f"{path} = {json.dumps(new)[:40]}"
    if kind == "garbage":
        text = rng.choice(
            [
                "",
                " ",
                "{",
                "}",
                "null",
                "[]",
                "[1,2]",
                '"x"',
                "1e999999",
                "NaN",
                "-Infinity",
                '{"a":1}{"b":2}',
                "\ufeff{}",
                '{"session": {"type": "realtime"}} garbage',
                '{"session": {"type": "realtime", "type": "transcription"}}',
                "{'a': 1}",
                '{"session": {"type": "realtime", "instructions": "\\u00"}}',
            ]
        )
        if rng.random() < 0.1:
            return "{}".encode("utf-16"), "UTF-16"
        return text.encode(), f"garbage {text[:30]!r}"
    if kind == "number":
        literal = rng.choice(
            ["0", "9", "10", "86400", "86401", "-1", "1e308", "1e309", "1" + "0" * 400, "1.5", '"600"']
        )
        text = '{"expires_after": {"anchor": "created_at", "seconds": ' + literal + "}}"
        if field == "session":
            text = '{"type": "realtime", "max_output_tokens": ' + literal + "}"
        return text.encode(), f"number {literal[:20]}"
    n = rng.choice([50_000, 200_000])
    big = rng.choice(["instructions", "tools", "description"])
    if big == "instructions":
        session["instructions"] = "x" * n
    elif big == "tools":
        session["tools"] = [TOOL | {"name": f"t{i}"} for i in range(n // 200)]
    else:
        session["tools"] = [TOOL | {"description": "d" * n}]
    return json.dumps(template).encode(), f"huge {big} ({n})"


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def hostile_form(rng: random.Random, sdp: bytes, session: bytes | None) -> tuple[str, bytes, str]:
    """A multipart form carrying an offer, of some hostile shape.

    Returns:
        Its Content-Type, its body and what it is.
    """
    boundary = rng.choice(["fuzzbound", "fuzzbound", "b" * 70, "b" * 71, "x" * 300, "a b", "==?", "\u00e9t\u00e9", ""])
    crlf = b"\r\n" if rng.random() < 0.9 else b"\n"
    parts: list[bytes] = []
    what = [f"boundary {boundary[:12]!r}"]

    def part(name: str | None, data: bytes, headers: Sequence[str] = ()) -> bytes:
        lines = [f'Content-Disposition: form-data; name="{name}"' if name is not None else "Content-Disposition: x"]
        lines += list(headers)
        return crlf.join(line.encode("utf-8", "surrogateescape") for line in lines) + crlf + crlf + data

    sdp_headers: list[str] = []
    if rng.random() < 0.15:
        sdp_headers.append("Content-Transfer-Encoding: " + rng.choice(["base64", "quoted-printable", "x-bogus"]))
        what.append(sdp_headers[-1])
    if rng.random() < 0.2:
        sdp_headers.append("Content-Type: " + rng.choice(["application/sdp", "text/plain; charset=utf-16", "x/y"]))
    if rng.random() < 0.9:
        parts.append(part("sdp", sdp, sdp_headers))
    else:
        what.append("no sdp part")
    if session is not None:
        parts.append(part("session", session))
    extra = rng.choice([0, 0, 0, 1, 7, 8, 9, 100, 2000, 5000])
    if extra:
        name = rng.choice(["extra", None, "sdp", "session"])
        parts += [part(name, b"x") for _ in range(extra)]
        what.append(f"{extra} more parts named {name}")
    delimiter = b"--" + boundary.encode("utf-8")
    body = b"".join(delimiter + crlf + p + crlf for p in parts)
    if rng.random() < 0.9:
        body += delimiter + b"--" + crlf
    else:
        what.append("no closing delimiter")
    if rng.random() < 0.1:
        body = b"preamble " * rng.choice([1, 1000]) + crlf + body
        what.append("preamble")
    kind = rng.choice(
        [
            f"multipart/form-data; boundary={boundary}",
            f"multipart/form-data; boundary={boundary}",
            f'multipart/form-data; boundary="{boundary}"',
            "multipart/form-data",
            f"multipart/mixed; boundary={boundary}",
            f"multipart/form-data; boundary={boundary}; boundary=other",
            f"Multipart/Form-Data; BOUNDARY={boundary}",
        ]
    )
    return kind, body, ", ".join(what)


# --- HTTP by hand ------------------------------------------------------------------------------


@dataclass
class Answer:
    """An HTTP answer as it arrived; ``status`` 0 when the connection ended without one."""

    status: int
    head: list[tuple[str, str]]
    body: bytes
    seconds: float
    error: str = ""

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.head if k.lower() == name.lower()]


def http_request(
    method: str,
    target: str,
    port: int,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes | None = None,
    *,
    host: str | None = "",
) -> bytes:
    """A request's bytes; ``host`` "": the server's own Host, None: none."""
    lines = [f"{method} {target} HTTP/1.1"]
    if host == "":
        host = f"127.0.0.1:{port}"
    if host is not None:
        lines.append(f"Host: {host}")
    lines += [f"{k}: {v}" for k, v in headers]
    if body is not None and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers):
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + (body or b"")


def parse_answer(data: bytes, seconds: float, error: str = "") -> Answer:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/") else 0
    except (IndexError, ValueError):
        status = 0
    pairs = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]) if k]
    return Answer(status, pairs, body, seconds, error)


async def exchange(port: int, raw: bytes, *, source: str = "127.0.0.1", timeout: float = 15.0) -> Answer:
    """Send ``raw`` on a new connection from ``source`` and read the answer until the server closes."""
    started = time.monotonic()
    writer: asyncio.StreamWriter | None = None
    data = b""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0), limit=1 << 20)
            writer.write(raw)
            with contextlib.suppress(ConnectionError):
                await writer.drain()  # a refusal may come (and the connection close) before the body is all sent
            while chunk := await reader.read(1 << 16):
                data += chunk
    except (ConnectionError, OSError) as exc:
        return parse_answer(data, time.monotonic() - started, f"{type(exc).__name__}: {exc}")
    except TimeoutError:
        return parse_answer(data, time.monotonic() - started, f"no end within {timeout:g} s")
    finally:
        if writer is not None:
            writer.close()
    return parse_answer(data, time.monotonic() - started)


def exchange_blocking(port: int, raw: bytes, *, timeout: float = 15.0) -> Answer:
    """:func:`exchange` for code without a loop (hypothesis tests)."""
    import socket

    started = time.monotonic()
    data = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            with contextlib.suppress(ConnectionError):
                sock.sendall(raw)
            while chunk := sock.recv(1 << 16):
                data += chunk
    except OSError as exc:
        return parse_answer(data, time.monotonic() - started, f"{type(exc).__name__}: {exc}")
    return parse_answer(data, time.monotonic() - started)


def is_fault(answer: Answer) -> bool:
    """A 5xx that is not a designed refusal (full pool, draining, shutting down)."""
    if answer.status < 500:
        return False
    return not (answer.status == 503 and any(word in answer.body for word in DESIGNED_503))


# --- the server as a process -------------------------------------------------------------------


def _toml(settings: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        return "[" + ", ".join(value(x) for x in v) + "]"

    return "".join(f"{k} = {value(v)}\n" for k, v in settings.items())


@dataclass
class LogLine:
    at: float  # time.monotonic() when it was read
    text: str
    record: dict[str, Any] | None  # the JSON record (None: a line that is none)

    def fault(self) -> str | None:
        """What is wrong with this line, if anything: an error, a traceback, an unhandled exception."""
        rec = self.record
        if rec is None:
            if "Traceback" in self.text or "Error" in self.text or "Task was destroyed" in self.text:
                return f"stderr: {self.text[:300]}"
            return None
        level = str(rec.get("level", ""))
        if level in ("error", "critical") or rec.get("exception"):
            exc = str(rec.get("exception") or "").strip().splitlines()
            tail = f" [{exc[-1][:200]}]" if exc else ""
            return f"{level} {rec.get('logger')}: {str(rec.get('message'))[:300]}{tail}"
        return None


class ServerProcess:
    """``s2s-rt serve`` on a free loopback port, its JSON log read as it comes.

    Args:
        settings: :class:`Config` fields (written to a TOML file in ``folder``).
    """

    def __init__(self, settings: dict[str, Any], folder: Path) -> None:
        import subprocess

        folder.mkdir(parents=True, exist_ok=True)
        self.config_path = folder / "server.toml"
        self.config_path.write_text(_toml({"host": "127.0.0.1", "port": 0, "stack": "fake"} | settings))
        env = {k: v for k, v in os.environ.items() if not k.startswith("S2S_RT_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "s2s_rt", "serve", "--config", str(self.config_path), "--log-format", "json"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=folder,  # not the checkout: the installed s2s_rt (or PYTHONPATH's) serves
        )
        self.lines: list[LogLine] = []
        self.port = 0
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True, name="fuzz-server-log")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for text in self.proc.stderr:
            text = text.rstrip("\n")
            try:
                record = json.loads(text)
                record = record if isinstance(record, dict) else None
            except ValueError:
                record = None
            self.lines.append(LogLine(time.monotonic(), text, record))
            message = str((record or {}).get("message", ""))
            if not self.port and "listening on ws://" in message:
                self.port = int(message.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
                self._listening.set()

    def wait_listening(self, timeout: float = 30.0) -> int:
        if not self._listening.wait(timeout):
            self.kill()
            tail = "\n".join(line.text for line in self.lines[-20:])
            raise RuntimeError(f"the server did not start within {timeout:g} s:\n{tail}")
        return self.port

    def udp_ports(self) -> list[int]:
        """The local ports of the process's UDP sockets (its calls' ICE sockets)."""
        pid = self.proc.pid
        inodes = set()
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
        ports = []
        for table in ("udp", "udp6"):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    cols = line.split()
                    if len(cols) > 9 and cols[9] in inodes:
                        ports.append(int(cols[1].rsplit(":", 1)[1], 16))
        return sorted(ports)

    def terminate(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM; the exit status (None: still running after ``timeout``) and how long it took."""
        import signal
        import subprocess

        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def finish(self) -> None:
        self.kill()
        self._reader.join(5)


class LoadControl:
    """A 50 ms ticker in its own process: when it is late too, this machine was busy, not the server alone."""

    def __init__(self) -> None:
        import subprocess

        code = (
            "import time\n"
            "while True:\n"
            "    t = time.monotonic(); time.sleep(0.05); late = time.monotonic() - t - 0.05\n"
            "    if late > 0.02: print(f'{time.monotonic():.3f} {late:.3f}', flush=True)\n"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        self.late: list[tuple[float, float]] = []
        threading.Thread(target=self._read, daemon=True, name="fuzz-load-control").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            at, late = line.split()
            self.late.append((float(at), float(late)))

    def worst(self, start: float, end: float) -> float:
        return max((late for at, late in self.late if start - 0.5 <= at <= end + 0.5), default=0.0)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


def _lag_counts(metrics: str) -> dict[float, float]:
    """``s2s_event_loop_lag_seconds``'s cumulative counts by bucket bound (inf for +Inf)."""
    counts = {}
    for m in re.finditer(r'^s2s_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', metrics, re.M):
        counts[float("inf") if m.group(1) == "+Inf" else float(m.group(1))] = float(m.group(2))
    return counts


def _above(before: dict[float, float], after: dict[float, float], bound: float) -> float:
    """Ticks later than ``bound`` (a bucket bound) between two snapshots."""
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    return total - (after.get(bound, 0.0) - before.get(bound, 0.0))


def _worst_bucket(before: dict[float, float], after: dict[float, float]) -> float:
    """The highest bucket bound any tick between two snapshots reached."""
    worst = 0.0
    previous = 0.0
    for bound in sorted(after):
        n = (after[bound] - before.get(bound, 0.0)) - previous
        if n > 0:
            worst = bound
        previous = after[bound] - before.get(bound, 0.0)
    return worst


# --- one hostile request or call, and what was sent -----------------------------------------------


@dataclass
class Sent:
    """One hostile request: what it was, its bytes (kept while it may explain a finding), its answer."""

    n: int
    who: str
    what: str
    source: str
    raw: bytes
    started: float
    ended: float | None = None
    answer: Answer | None = None

    def line(self, origin: float) -> str:
        took = f"{self.ended - self.started:.2f} s" if self.ended is not None else "unanswered"
        status = self.answer.status if self.answer is not None else "-"
        size = f"{len(self.raw)} B"
        who = f"[{self.who} from {self.source}]"
        return f"{self.started - origin:7.2f} #{self.n} {who} {self.what} ({size}) -> {status} in {took}"


class SurfaceRun(Run):
    """One run of :func:`surface_fuzz`: the server process, what was sent, and the checks on each answer."""

    def __init__(
        self, server: ServerProcess, report: FuzzReport, deadline: float, here: Here, folder: Path, keys: bool
    ) -> None:
        super().__init__(server, report, deadline, avoid=frozenset())
        self.process = server
        self.here = here
        self.folder = folder
        self.keys = keys
        self.origin = time.monotonic()
        self.sent_log: deque[Sent] = deque(maxlen=400)
        self.count = 0
        self.saved = 0
        #: Calls answered 201 (id -> the label of the worker that made it), for hangups of others' calls.
        self.call_ids: dict[str, str] = {}
        self.calm_call_id: str | None = None
        self.secrets: list[str] = []
        self.shutting_down = False
        self.base_offers: list[str] = []
        self.next_source = 0
        self.hostile_deadline = deadline
        self.log_seen = 0
        self.log_kinds: set[str] = set()
        if keys:
            self.headers = {"Authorization": f"Bearer {SURFACE_KEY}"}

    @property
    def port(self) -> int:
        return self.process.port

    def hostile_over(self) -> bool:
        """Whether the hostile clients stop (:meth:`over`, with :attr:`deadline`, is the calm clients')."""
        gone = self.shutting_down and self.process.proc.poll() is not None
        return gone or time.monotonic() >= self.hostile_deadline

    def check_log(self) -> None:
        """The server's log lines since the last look: an error or a traceback is a finding."""
        lines = self.process.lines
        new, self.log_seen = lines[self.log_seen : len(lines)], len(lines)
        for line in new:
            fault = line.fault()
            if fault is None:
                continue
            self.report.stats["log faults"] += 1
            kind = re.sub(r"rtc_[0-9a-f]+|sess_[0-9a-f]+|Task-\d+|0x[0-9a-f]+|\d+(\.\d+)?", "#", fault)
            if kind in self.log_kinds:
                continue
            self.log_kinds.add(kind)
            self.find_with(f"the server logged {fault}", self.recent(line.at - 3.0, line.at))

    def fresh_source(self) -> str:
        """A loopback address no client has used this run (for bursts from one address)."""
        self.next_source += 1
        n = self.next_source
        return f"127.1.{n // 250}.{n % 250 + 1}"

    def save(self, sent: Sent) -> Path:
        """The request's bytes in a file, to replay it (``python tests/surface_fuzzing.py replay FILE PORT``)."""
        self.saved += 1
        path = self.folder / f"request-{sent.n}.http"
        path.write_bytes(sent.raw)
        return path

    def recent(self, start: float, end: float) -> list[Sent]:
        """Requests in flight at some time between ``start`` and ``end``."""
        return [s for s in self.sent_log if s.started <= end and (s.ended is None or s.ended >= start)]

    def find_with(self, what: str, suspects: Sequence[Sent], received: Sequence[str] = ()) -> None:
        lines = []
        for s in suspects[-12:]:
            lines.append(s.line(self.origin))
            if s.raw and len(lines) < 40:
                lines.append(f"    replay: .venv/bin/python tests/surface_fuzzing.py replay {self.save(s)} PORT")
        self.report.findings.append(Finding("server", what, lines, list(received)))

    async def send(
        self, who: str, what: str, raw: bytes, *, source: str = "127.0.0.1", timeout: float = 15.0
    ) -> Answer:
        """Send one hostile request and check its answer: no 5xx, nothing cross-site."""
        self.count += 1
        sent = Sent(self.count, who, what, source, raw, time.monotonic())
        self.sent_log.append(sent)
        self.report.stats["requests"] += 1
        answer = await exchange(self.port, raw, source=source, timeout=timeout)
        sent.ended, sent.answer = time.monotonic(), answer
        kind = what.split(":", 1)[0]
        self.report.stats[f"{kind} -> {answer.status or answer.error.split(':', 1)[0] or 'nothing'}"] += 1
        if is_fault(answer) and not self.shutting_down:
            self.find_with(f"{kind} answered {answer.status}: {answer.body[:200]!r}", [sent])
        self.check_cross_site(sent, raw, answer)
        return answer

    def check_cross_site(self, sent: Sent, raw: bytes, answer: Answer) -> None:
        """A foreign page may neither reach ``/drain`` nor read any answer; no page may send ``S2S-Operator``."""
        head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        method, target = [*head[0].split(), "", ""][:2]
        fields = [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in head[1:])]
        origins = [v for k, v in fields if k == "origin"]
        hosts = [v for k, v in fields if k == "host"]
        asked = ",".join(v for k, v in fields if k == "access-control-request-headers").lower()
        path = target.split("?", 1)[0].rstrip("/")
        own = f"http://127.0.0.1:{self.port}"
        foreign = bool(origins) and any(o not in (own, ALLOWED_ORIGIN) for o in origins)
        if hosts != [f"127.0.0.1:{self.port}"]:
            foreign = False  # a Host of the page's own (DNS rebinding): the server cannot tell; not judged here
        ok = 200 <= answer.status < 300
        allow = [v.lower() for v in answer.header("Access-Control-Allow-Origin")]
        if path in ("/drain", "/undrain") and origins and ok:
            self.find_with(f"{method} {path} from a page ({origins}) answered {answer.status}", [sent])
        approved = ",".join(answer.header("Access-Control-Allow-Headers")).lower()
        if method == "OPTIONS" and "s2s-operator" in asked and (ok or "s2s-operator" in approved):
            self.find_with(f"a preflight for the S2S-Operator header was approved ({answer.status}, {origins})", [sent])
        if method == "OPTIONS" and path in ("/drain", "/undrain") and ok:
            self.find_with(f"a preflight for {path} was approved ({answer.status}, {origins})", [sent])
        if foreign and any(a == "*" or a in (o.lower() for o in origins) for a in allow):
            self.find_with(f"{method} {path} lets a foreign page ({origins}) read its answer ({answer.status})", [sent])
        if foreign and ok:
            self.find_with(f"{method} {path} from a foreign page ({origins}) answered {answer.status}", [sent])

    async def get(self, path: str) -> Answer:
        headers = [("Authorization", f"Bearer {SURFACE_KEY}")] if self.keys else []
        return await exchange(self.port, http_request("GET", path, self.port, headers), timeout=10)

    def credentials(self, rng: random.Random) -> list[tuple[str, str]]:
        """What a hostile client authenticates with: the key, a secret it minted, a wrong one, or nothing."""
        choices = ["none", "wrong", "key", "key", "secret"] if self.keys else ["none", "none", "wrong", "secret"]
        pick = rng.choice(choices)
        if pick == "key":
            return [("Authorization", f"Bearer {SURFACE_KEY}")]
        if pick == "secret" and self.secrets:
            return [("Authorization", f"Bearer {rng.choice(self.secrets[-20:])}")]
        if pick == "wrong":
            return [("Authorization", rng.choice(["Bearer sk-wrong", "Bearer ek_made_up", "Basic eA==", "Bearer "]))]
        return []

    def some_origin(self, rng: random.Random) -> str | None:
        roll = rng.random()
        if roll < 0.45:
            return rng.choice(FOREIGN_ORIGINS).format(port=self.port)
        if roll < 0.6:
            return f"http://127.0.0.1:{self.port}"
        if roll < 0.7:
            return ALLOWED_ORIGIN
        return None


# --- what hostile clients do -----------------------------------------------------------------------

ROUTES = (
    "/v1/realtime/calls",
    "/v1/realtime/client_secrets",
    "/page/client_secret",
    "/v1/realtime/calls/rtc_00000000000000000000/hangup",
    "/drain",
    "/undrain",
    "/v1/realtime",
    "/",
    "/healthz",
    "/v1/pool",
    "/nope",
    "/v1/realtime/calls/",
    "/v1/realtime/calls?x=1",
)


async def post_worker(run: SurfaceRun, index: int, seed: int) -> None:
    """Hostile requests one after another: offers, forms, bodies, preflights, cross-site posts, hangups."""
    rng = random.Random(f"{seed}:post{index}")
    who = f"p{index}"
    actions = {
        "offer": 8,
        "form": 6,
        "secret": 6,
        "page_secret": 2,
        "preflight": 6,
        "cross_site": 4,
        "hangup": 4,
        "malformed_http": 2,
        "pause": 3,
    }
    port = run.port
    while not run.hostile_over():
        action = rng.choices(list(actions), weights=list(actions.values()))[0]
        source = f"127.0.{20 + index}.{rng.randrange(1, 9)}"
        origin = run.some_origin(rng) if rng.random() < 0.3 else None
        extra = [("Origin", origin)] if origin else []
        if action == "offer":
            body, done = mutate_offer(rng, rng.choice(run.base_offers), run.here)
            kind = rng.choice(["application/sdp"] * 6 + ["text/plain", "application/json", "", "application/SDP; x=y"])
            headers = [*run.credentials(rng), *extra, *([("Content-Type", kind)] if kind else [])]
            if rng.random() < 0.15:
                headers.append(("OpenAI-Beta", "realtime=v1"))
            raw = http_request("POST", "/v1/realtime/calls", port, headers, body)
            answer = await run.send(who, f"offer: {'; '.join(done)}", raw, source=source)
            _remember_call(run, who, answer)
        elif action == "form":
            sdp, done = (
                mutate_offer(rng, rng.choice(run.base_offers), run.here)
                if rng.random() < 0.5
                else (
                    rng.choice(run.base_offers).encode(),
                    ["valid offer"],
                )
            )
            session, what = hostile_json(rng, field="session") if rng.random() < 0.7 else (None, "no session")
            kind, body, form = hostile_form(rng, sdp, session)
            headers = [*run.credentials(rng), *extra, ("Content-Type", kind)]
            raw = http_request("POST", "/v1/realtime/calls", port, headers, body)
            answer = await run.send(who, f"form: {form}; sdp {'; '.join(done)}; session {what}", raw, source=source)
            _remember_call(run, who, answer)
        elif action in ("secret", "page_secret"):
            body, what = hostile_json(rng) if action == "secret" else (b"", "empty")
            path = "/v1/realtime/client_secrets" if action == "secret" else "/page/client_secret"
            kind = rng.choice(["application/json"] * 5 + ["text/plain", ""])
            headers = [*run.credentials(rng), *extra, *([("Content-Type", kind)] if kind else [])]
            raw = http_request("POST", path, port, headers, body)
            answer = await run.send(who, f"{action}: {what}", raw, source=source)
            if answer.status == 200:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    run.secrets.append(json.loads(answer.body)["value"])
        elif action == "preflight":
            path = rng.choice(ROUTES)
            headers = []
            origin = run.some_origin(rng)
            if origin is not None:
                headers.append(("Origin", origin))
                if rng.random() < 0.05:
                    headers.append(("Origin", "http://evil.example"))
            if rng.random() < 0.9:
                headers.append(("Access-Control-Request-Method", rng.choice(["POST", "POST", "GET", "PUT", "X"])))
            if rng.random() < 0.8:
                names = ["authorization", "content-type", "s2s-operator", "S2S-Operator", "openai-beta", "x-any"]
                asked = rng.sample(names, rng.randrange(0, len(names) + 1))
                if rng.random() < 0.05:
                    asked = [f"x-h{i}" for i in range(1500)]
                headers.append(("Access-Control-Request-Headers", ", ".join(asked)))
            raw = http_request("OPTIONS", path, port, headers)
            await run.send(who, f"preflight: {path} from {origin}", raw, source=source)
        elif action == "cross_site":
            path = rng.choice(ROUTES)
            origin = rng.choice([*FOREIGN_ORIGINS, "http://127.0.0.1:{port}", ALLOWED_ORIGIN]).format(port=port)
            headers = [("Origin", origin)]
            if rng.random() < 0.7:
                headers.append(("S2S-Operator", "1"))
            headers += run.credentials(rng)
            kind = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b"])
            headers.append(("Content-Type", kind))
            body = rng.choice([b"", b"a=1", rng.choice(run.base_offers).encode()])
            raw = http_request("POST", path, port, headers, body)
            await run.send(who, f"cross_site: POST {path} from {origin}", raw, source=source)
        elif action == "hangup":
            await _hangup(run, rng, who, source)
        elif action == "malformed_http":
            raw, what = _malformed_http(rng, port, rng.choice(run.base_offers).encode())
            await run.send(who, f"malformed_http: {what}", raw, source=source, timeout=12)
        else:
            await asyncio.sleep(rng.choice([0.0, 0.05, 0.2, 0.5]))


def _remember_call(run: SurfaceRun, who: str, answer: Answer) -> None:
    if answer.status == 201:
        run.report.stats["calls answered"] += 1
        location = (answer.header("Location") or [""])[0]
        if location:
            run.call_ids[location.rsplit("/", 1)[-1]] = who


async def _hangup(run: SurfaceRun, rng: random.Random, who: str, source: str) -> None:
    """A hangup of an unknown id, of a malformed one, of another's call, or (with keys on) of the calm call."""
    pick = rng.random()
    headers = run.credentials(rng)
    if pick < 0.35 and run.call_ids:
        call_id = rng.choice(list(run.call_ids)[-20:])
        what = f"hangup: a call of {run.call_ids[call_id]}"
    elif pick < 0.5 and run.keys and run.calm_call_id:
        call_id = run.calm_call_id
        headers = [h for h in headers if SURFACE_KEY not in h[1]]  # anyone but an operator
        what = "hangup: the calm call, without the key"
    elif pick < 0.8:
        call_id = "rtc_" + "".join(rng.choice("0123456789abcdef") for _ in range(20))
        what = "hangup: an unknown id"
    else:
        call_id = rng.choice(["", "..", "%2e%2e%2fdrain", "x" * 65, "rtc_\u00e9", "a/b", "rtc_1?x=1", "rtc_1%00"])
        what = f"hangup: id {call_id[:20]!r}"
    if rng.random() < 0.2:
        headers.append(("Origin", run.some_origin(rng) or "http://evil.example"))
    raw = http_request("POST", f"/v1/realtime/calls/{call_id}/hangup", run.port, headers, b"")
    answer = await run.send(who, what, raw, source=source)
    if call_id == run.calm_call_id and 200 <= answer.status < 300:
        run.find_with("the calm call was hung up by someone without the key or its secret", run.recent(0, 1e18)[-1:])


def _malformed_http(rng: random.Random, port: int, sdp: bytes) -> tuple[bytes, str]:
    host = f"Host: 127.0.0.1:{port}\r\n".encode()
    kind = rng.choice(
        [
            "no host",
            "two lengths",
            "bad length",
            "chunked",
            "bad chunk",
            "long header",
            "many headers",
            "non-ascii target",
            "absolute target",
            "asterisk",
            "bare lf",
            "short body",
            "http/1.0",
            "two authorizations",
        ]
    )
    post = b"POST /v1/realtime/calls HTTP/1.1\r\n"
    raw = {
        "no host": post + b"Content-Type: application/sdp\r\nContent-Length: 3\r\n\r\nv=0",
        "two lengths": post + host + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nv=0\n",
        "bad length": post + host + b"Content-Length: -3\r\n\r\n",
        "chunked": post
        + host
        + b"Content-Type: application/sdp\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(sdp)
        + sdp
        + b"\r\n0\r\n\r\n",
        "bad chunk": post + host + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n0\r\n\r\n",
        "long header": post + host + b"X-Long: " + b"a" * 20_000 + b"\r\n\r\n",
        "many headers": post + host + b"".join(b"X-%d: y\r\n" % i for i in range(3000)) + b"\r\n",
        "non-ascii target": b"POST /v1/realtime/calls\xff\xfe HTTP/1.1\r\n" + host + b"Content-Length: 0\r\n\r\n",
        "absolute target": b"POST http://127.0.0.1/v1/realtime/calls HTTP/1.1\r\n"
        + host
        + b"Content-Type: application/sdp\r\nContent-Length: %d\r\n\r\n" % len(sdp)
        + sdp,
        "asterisk": b"OPTIONS * HTTP/1.1\r\n" + host + b"Origin: http://evil.example\r\n\r\n",
        "bare lf": b"POST /v1/realtime/client_secrets HTTP/1.1\n"
        + host.replace(b"\r", b"")
        + b"Content-Length: 2\n\n{}",
        "short body": post + host + b"Content-Type: application/sdp\r\nContent-Length: 5000\r\n\r\nv=0\r\n",
        "http/1.0": b"POST /v1/realtime/client_secrets HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
        "two authorizations": b"POST /v1/realtime/client_secrets HTTP/1.1\r\n"
        + host
        + b"Authorization: Bearer a\r\nAuthorization: Bearer b\r\nContent-Length: 2\r\n\r\n{}",
    }[kind]
    if kind == "short body":
        raw += b""  # the connection is closed by the client's timeout or the server's
    return raw, kind


# --- real calls -------------------------------------------------------------------------------------


async def make_offer(shape: str = "call") -> tuple[Any, str]:
    """A peer connection and its offer: ``call`` (microphone and events, as a browser), ``audio``, ``video``."""
    from aiortc import RTCPeerConnection

    from s2s_rt.server.webrtc import EVENTS_LABEL
    from s2s_rt.server.webrtc_audio import Playback

    pc = RTCPeerConnection()
    if shape in ("call", "video"):
        pc.createDataChannel(EVENTS_LABEL)
    pc.addTrack(Playback())
    if shape == "video":
        pc.addTransceiver("video")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, str(pc.localDescription.sdp)


class _Mute:
    """A datagram transport that sends nothing (the rest of it as it was)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def sendto(self, data: bytes, addr: Any = None) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def vanish(pc: Any, *, silently: bool) -> None:
    """The peer goes away without a word: its ICE sockets closed under it (a closed tab: the host answers
    with ICMP), or, ``silently``, kept open but deaf and mute (a lost network: nothing answers at all)."""
    for transport in list(getattr(pc, "_RTCPeerConnection__iceTransports", ())):
        connection = getattr(transport, "_connection", None)
        for protocol in list(getattr(connection, "_protocols", ())):
            with contextlib.suppress(Exception):
                if silently:
                    protocol.datagram_received = lambda data, addr: None
                    protocol.transport = _Mute(protocol.transport)
                else:
                    protocol.transport.close()


class HostileCall:
    """One real call of a hostile client: its peer connection, its channel, the events it got, checked."""

    def __init__(self, run: SurfaceRun, label: str, pc: Any, beta: bool) -> None:
        self.run, self.label, self.pc, self.beta = run, label, pc, beta
        self.channel: Any = None
        self.events: list[dict[str, Any]] = []
        self.opened = asyncio.Event()
        self.call_id: str | None = None

    def attach(self, channel: Any) -> None:
        self.channel = channel
        channel.on("open", self.opened.set)
        channel.on("message", self._message)

    def _message(self, data: str | bytes) -> None:
        run = self.run
        run.report.stats["call events received"] += 1
        if isinstance(data, bytes):
            data = data.decode("utf-8", "replace")
        for marker in run.calm_marker.findall(data):
            run.find(None, f"words of calm session {marker} reached hostile call {self.label}")
        try:
            event = json.loads(data)
            validate_server_event(event, beta=self.beta)
        except (ValueError, AssertionError) as exc:
            run.find(None, f"hostile call {self.label} got a non-conformant event: {str(exc)[:300]}")
            return
        self.events.append(event)

    def send(self, event: dict[str, Any] | str) -> None:
        if self.channel is None or self.channel.readyState != "open":
            return
        text = event if isinstance(event, str) else json.dumps(event)
        with contextlib.suppress(Exception):  # aiortc refuses what is above the server's message limit
            self.channel.send(text)
            self.run.report.stats["call events sent"] += 1


#: The lies a :class:`LyingMicrophone` tells, and how often each, against a packet sent as a microphone would.
LIES = {
    "steady": 60,
    "jump": 5,
    "back": 5,
    "wrap": 2,
    "race": 5,
    "repeat": 5,
    "garbage": 5,
    "stall": 2,
    "burst": 3,
    "flood": 1,
}


class LyingMicrophone(MediaStreamTrack):
    """A caller's microphone whose RTP lies (an aiortc track: ``recv`` gives its next Opus packet).

    Its RTP time jumps ahead or back, wraps, or runs ahead of real time; packets come twice, in bursts, in a
    flood, after a stall, or carry what Opus cannot decode; between lies, a tone and silence in real time.
    The server must hear no faster than its budget allows, end the call if it floods, and stay well.
    """

    kind = "audio"

    def __init__(self, rng: random.Random) -> None:
        from s2s_rt.server.webrtc_audio import OPUS_FRAME

        super().__init__()
        self.rng = rng
        self.frame = OPUS_FRAME
        self.payloads = _opus_stream(rng)
        self.pts = rng.randrange(2**32)
        self.sent = 0
        self.moves: dict[str, int] = dict.fromkeys(LIES, 0)
        self._owed = 0
        self._step = OPUS_FRAME

    async def recv(self) -> Any:
        from av import Packet

        from s2s_rt.server.webrtc_audio import OPUS_TIME_BASE

        rng, payload = self.rng, self.payloads[self.sent % len(self.payloads)]
        if self._owed:
            self._owed -= 1
        else:
            move = rng.choices(list(LIES), weights=list(LIES.values()))[0]
            self.moves[move] += 1
            self._step = self.frame
            if move == "jump":
                self._step = rng.choice([2, 10, 49, 50, 51, 200, 180_000]) * self.frame  # 180,000: an hour
            elif move == "back":
                self._step = -rng.choice([1, 2, 50, 3000]) * self.frame
            elif move == "wrap":
                self._step = 2**32 - rng.randrange(1, 5) * self.frame - self.pts  # just short of the wrap
            elif move == "repeat":
                self._step = 0
            elif move == "garbage":
                payload = rng.randbytes(rng.choice([1, 2, 3, 40, 400, 1000]))
            elif move in ("race", "burst", "flood"):
                self._owed = {"race": 10, "burst": 150, "flood": 3000}[move]
            if move == "stall":
                await asyncio.sleep(rng.uniform(0.2, 1.5))
            elif not self._owed:
                await asyncio.sleep(0.02)
        if self._owed and self._owed % 200 == 0:
            await asyncio.sleep(0)  # a flood, not a frozen loop: the fuzzer's own calm call answers ICE here
        self.pts = (self.pts + self._step) % 2**32
        packet = Packet(payload)
        packet.pts, packet.time_base = self.pts, OPUS_TIME_BASE
        self.sent += 1
        return packet


def _opus_stream(rng: random.Random) -> list[bytes]:
    """Opus packets of a second of a tone and a second of silence (24 kHz mono, 20 ms each)."""
    import numpy as np
    from av import AudioFrame

    from s2s_rt.server.webrtc_audio import PLAY_RATE, opus_encoder

    encoder = opus_encoder()
    t = np.arange(PLAY_RATE) / PLAY_RATE
    samples = np.concatenate([np.sin(2 * np.pi * rng.uniform(150, 600) * t) * 8000, np.zeros(PLAY_RATE)])
    out = []
    for i in range(0, len(samples), 480):
        frame = AudioFrame.from_ndarray(samples[i : i + 480].astype(np.int16).reshape(1, -1), layout="mono")
        frame.sample_rate, frame.pts = PLAY_RATE, i
        out += [bytes(p) for p in encoder.encode(frame)]
    return out


async def call_worker(run: SurfaceRun, index: int, seed: int) -> None:
    """Real calls one after another, each with a fate: never connects, drops mid-answer, vanishes, overfills…"""
    from aiortc import RTCSessionDescription

    from s2s_rt.server.webrtc import EVENTS_LABEL
    from s2s_rt.server.webrtc_audio import Playback

    rng = random.Random(f"{seed}:caller{index}")
    generation = 0
    keep: list[Any] = []  # vanished calls' peer connections: closed at the end (their sockets are gone already)
    try:
        while not run.hostile_over():
            generation += 1
            label = f"k{index}.{generation}"
            from aiortc import RTCPeerConnection

            pc = RTCPeerConnection()
            fate = rng.choice(
                [
                    *("never_connect", "drop_mid_answer", "vanish", "oversized", "flood", "hangup", "talk"),
                    *("small_limit", "lying_mic"),
                ]
            )
            mic: Any
            if fate == "lying_mic":
                mic = LyingMicrophone(rng)
            else:
                # Some microphones fall silent on the wire altogether, some send Opus DTX, some silence.
                send_silence = rng.random() < 0.7
                mic = Playback(send_silence=send_silence, dtx=send_silence and rng.random() < 0.5)
            call = HostileCall(run, label, pc, beta=rng.random() < 0.2)
            call.attach(pc.createDataChannel(EVENTS_LABEL))
            pc.addTrack(mic)
            try:
                await pc.setLocalDescription(await pc.createOffer())
                sdp = str(pc.localDescription.sdp)
                what = [fate]
                if fate == "small_limit":
                    sdp = re.sub(r"a=max-message-size:\d+", f"a=max-message-size:{rng.choice([1, 600, 2000])}", sdp)
                elif rng.random() < 0.3:
                    name = rng.choice(MILD_MUTATIONS)
                    body, done = mutate_offer(rng, sdp, run.here, [(name, rng.randrange(2**32))])
                    sdp = body.decode("utf-8", "replace")
                    what += done
                headers = [*run.credentials(rng), ("Content-Type", "application/sdp")]
                if run.keys and not any("Bearer" in v for _, v in headers):
                    headers.append(("Authorization", f"Bearer {SURFACE_KEY}"))
                if call.beta:
                    headers.append(("OpenAI-Beta", "realtime=v1"))
                source = f"127.0.{40 + index}.{rng.randrange(1, 5)}"
                body = keep_local(sdp, run.here).encode()
                raw = http_request("POST", "/v1/realtime/calls", run.port, headers, body)
                answer = await run.send(label, f"call: {'; '.join(what)}", raw, source=source)
                _remember_call(run, label, answer)
                if answer.status != 201:
                    continue
                run.report.stats["calls"] += 1
                run.report.stats[f"call {fate}"] += 1
                call.call_id = (answer.header("Location") or ["/"])[0].rsplit("/", 1)[-1]
                if fate == "never_connect":
                    await asyncio.sleep(rng.uniform(0.0, 3.0))
                    continue
                await pc.setRemoteDescription(RTCSessionDescription(answer.body.decode("utf-8", "replace"), "answer"))
                try:
                    await asyncio.wait_for(call.opened.wait(), 10)
                except TimeoutError:
                    run.report.stats["hostile call never opened"] += 1
                    continue
                await _call_fate(run, rng, call, mic, fate, keep, source)
            except Exception as exc:  # the client's own failure (aiortc on a refused or odd answer)
                run.report.stats[f"hostile call client error {type(exc).__name__}"] += 1
            finally:
                if fate != "vanish":
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(pc.close(), 5)
                else:
                    keep.append(pc)
    finally:
        for pc in keep:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pc.close(), 5)


async def _call_fate(
    run: SurfaceRun, rng: random.Random, call: HostileCall, mic: Any, fate: str, keep: list[Any], source: str
) -> None:
    long_answer = {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "[[slow 30]] " + " ".join(["word"] * 60)}],
        },
    }
    if fate in ("drop_mid_answer", "vanish", "hangup", "small_limit"):
        call.send(long_answer)
        call.send({"type": "response.create"})
        await asyncio.sleep(rng.uniform(0.0, 2.0))
        if fate == "drop_mid_answer":
            how = rng.choice(["peer", "channel", "stop"])
            if how == "channel" and call.channel is not None:
                call.channel.close()
            elif how == "peer":
                await asyncio.wait_for(call.pc.close(), 5)
        elif fate == "vanish":
            silently = rng.random() < 0.5
            run.report.stats[f"call vanished {'silently' if silently else 'closing its sockets'}"] += 1
            vanish(call.pc, silently=silently)
        elif fate == "hangup" and call.call_id:
            headers = [("Authorization", f"Bearer {SURFACE_KEY}")] if run.keys else []
            raw = http_request("POST", f"/v1/realtime/calls/{call.call_id}/hangup", run.port, headers, b"")
            await run.send(call.label, "hangup: its own call", raw, source=source)
        else:
            await asyncio.sleep(rng.uniform(0.5, 2.0))
    elif fate == "oversized":
        kind = rng.choice(["echo", "echo", "item", "near limit"])
        if kind == "echo":
            # The session.updated that echoes these is larger than the peer's data-channel message limit.
            call.send({"type": "session.update", "session": {"type": "realtime", "instructions": "i" * 150_000}})
            await asyncio.sleep(0.3)
            tool = TOOL | {"description": "d" * 120_000}
            call.send({"type": "session.update", "session": {"type": "realtime", "tools": [tool]}})
        elif kind == "item":
            text = "w " * 100_000
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
            call.send({"type": "conversation.item.create", "item": item})
            call.send({"type": "response.create"})
        else:
            call.send(json.dumps({"type": "session.update", "x": "y" * (262_144 - 40)}))
        await asyncio.sleep(rng.uniform(0.5, 2.0))
    elif fate == "flood":
        frame = json.dumps({"type": "conversation.item.retrieve", "item_id": "nope"})
        for i in range(rng.choice([100, 1000, 5000])):
            call.send(frame if i % 7 else "{not json")
            if i % 500 == 0:
                await asyncio.sleep(0)
        await asyncio.sleep(rng.uniform(0.2, 1.5))
    elif fate == "lying_mic":
        # Its microphone lies meanwhile (LyingMicrophone); it asks for an answer now and then.
        for _ in range(rng.randrange(1, 4)):
            await asyncio.sleep(rng.uniform(0.3, 1.5))
            call.send({"type": "response.create"})
        run.report.stats["lying mic packets"] += mic.sent
        for move, n in mic.moves.items():
            run.report.stats[f"lying mic {move}"] += n
    else:  # talk a little, then leave
        from conftest import silence, tone

        mic.play("mic", "mic", tone(rng.uniform(200, 800), 0.6) + silence(1.0), AudioFormat())
        call.send({"type": "response.create"})
        await asyncio.sleep(rng.uniform(0.5, 3.0))


async def burst_worker(run: SurfaceRun, seed: int) -> None:
    """Offers sent together from one new address: no more may be answered than the per-address limit."""
    rng = random.Random(f"{seed}:burst")
    limit = int(SURFACE_CONFIG["max_connections_per_ip"])
    while not run.hostile_over():
        await asyncio.sleep(rng.uniform(0.5, 2.5))
        if run.hostile_over():
            break
        source = run.fresh_source()
        n = rng.choice([2, 3, 5, 8])
        pc, sdp = await make_offer()
        try:
            headers = [("Content-Type", "application/sdp")]
            if run.keys:
                headers.append(("Authorization", f"Bearer {SURFACE_KEY}"))
            raw = http_request("POST", "/v1/realtime/calls", run.port, headers, sdp.encode())
            answers = await asyncio.gather(
                *(run.send("burst", f"burst: {n} offers at once from {source}", raw, source=source) for _ in range(n))
            )
            run.report.stats["bursts"] += 1
            for answer in answers:
                _remember_call(run, "burst", answer)
            created = sum(a.status == 201 for a in answers)
            if created > limit:
                run.find_with(
                    f"{created} of {n} offers sent together from one address were answered 201 (limit {limit})",
                    [s for s in run.sent_log if s.source == source],
                )
        finally:
            await asyncio.wait_for(pc.close(), 5)


# --- calm clients beside them -------------------------------------------------------------------


async def calm_call_worker(run: SurfaceRun, seed: int, up: asyncio.Event) -> None:
    """A well-behaved call: typed and spoken turns, each of which must complete; it must never end by itself."""
    from conftest import silence, tone

    from s2s_rt.bench.call import CallClient

    rng = random.Random(f"{seed}:calmcall")
    label = "c9"
    key = SURFACE_KEY if run.keys else "unused"
    call: CallClient | None = None
    give_up = time.monotonic() + 20
    while call is None:
        try:
            call = await CallClient.open(f"http://127.0.0.1:{run.port}/v1", key, timeout=10)
        except Exception as exc:  # the machine may be busy: try again, for a while
            if time.monotonic() > give_up:
                run.find(None, f"the calm call could not be opened: {exc!r}")
                up.set()
                return
            await asyncio.sleep(0.5)
    run.calm_call_id = call.call_id
    closing = False
    ended: list[str] = []

    def message(data: str | bytes) -> None:
        text = data if isinstance(data, str) else data.decode("utf-8", "replace")
        for marker in run.calm_marker.findall(text):
            if marker != label:
                run.find(None, f"words of calm session {marker} reached the calm call")
        try:
            event = json.loads(text)
            validate_server_event(event, beta=False)
        except (ValueError, AssertionError) as exc:
            run.find(None, f"the calm call got a non-conformant event: {str(exc)[:300]}")
            return
        if event.get("type") == "error":
            run.find(None, f"the calm call got an error: {event.get('error')}")

    def gone(why: str) -> None:
        if not closing and not ended:
            ended.append(why)
            run.find(None, f"the calm call ended by itself ({why})")

    call.channel.on("message", message)
    call.channel.on("close", lambda: gone("its data channel closed"))
    call.pc.on(
        "connectionstatechange",
        lambda: call.pc.connectionState in ("failed", "closed") and gone(call.pc.connectionState),
    )
    up.set()
    turn = 0
    try:
        await call.next_event("session.created", 10)
        while not run.over() and not ended:
            turn += 1
            spoken = turn % 3 == 0
            word = f"calmword{label}x{turn}"
            if spoken:
                call.speak(tone(300 + 7 * (turn % 20), 0.6) + silence(1.0))
            else:
                call.ask(f"please repeat {word}")
            t0 = time.monotonic()
            try:
                done = await call.next_event("response.done", CALM_TURN_S)
                await call.next_event("output_audio_buffer.stopped", CALM_TURN_S)
            except TimeoutError:
                run.find(
                    None,
                    f"the calm call's {'spoken' if spoken else 'typed'} turn {turn} got no answer"
                    f" within {CALM_TURN_S:.0f} s",
                )
                return
            run.report.calm_latencies.append(time.monotonic() - t0)
            run.report.stats["calm call turns"] += 1
            status = done["response"].get("status")
            if status != "completed":
                run.find(None, f"the calm call's turn {turn} ended {status}: {done['response'].get('status_details')}")
            elif not spoken and _transcript(done) != f"You said: please repeat {word}.":
                run.find(None, f"the calm call's turn {turn} answered {_transcript(done)!r}")
            await asyncio.sleep(rng.uniform(0.0, 0.3))
    finally:
        closing = True
        await call.close()


async def _lag_watch(run: SurfaceRun, control: LoadControl, bound: float, quiet: float) -> None:
    """Every half second: did the server's loop tick later than ``bound`` while this machine was not busy?"""
    before = _lag_counts((await run.get("/metrics")).body.decode())
    last = time.monotonic()
    while not run.hostile_over():
        await asyncio.sleep(0.5)
        run.check_log()
        answer = await run.get("/metrics")
        now = time.monotonic()
        after = _lag_counts(answer.body.decode())
        if not after:
            continue
        late = _above(before, after, bound)
        if late:
            busy = control.worst(last, now)
            worst = _worst_bucket(before, after)
            if busy > bound / 2:
                run.report.stats["loop lag while this machine was busy (not judged)"] += int(late)
            else:
                run.find_with(
                    f"the server's loop lagged beyond {bound:g} s ({int(late)} tick(s), up to the {worst:g} s bucket;"
                    f" quiet {quiet:g} s) between {last - run.origin:.1f} s and {now - run.origin:.1f} s",
                    [s for s in run.recent(last - 0.5, now) if len(s.raw) > 2000] or run.recent(last - 0.5, now),
                )
        pool = await run.get("/v1/pool")
        with contextlib.suppress(ValueError):
            if json.loads(pool.body).get("draining"):
                run.find_with("the server is draining: a request reached /drain", run.recent(last - 1, now))
                await exchange(
                    run.port,
                    http_request(
                        "POST", "/undrain", run.port, [("S2S-Operator", "1"), *run.credentials(random.Random(0))]
                    ),
                )
        before, last = after, now


async def _self_watch(run: SurfaceRun) -> None:
    """The fuzzer's own loop, every 0.1 s: a stall starves its calm clients, and what they then miss is
    not the server's doing, so the stall itself is the finding (with the requests around it)."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(0.1)
        late = time.monotonic() - before - 0.1
        if late > SELF_STALL_S:
            suspects = [s.line(run.origin) for s in run.recent(before, before + late + 0.5)[-8:]]
            run.report.findings.append(
                Finding(
                    "fuzzer",
                    f"its own loop stalled {late:.1f} s at {before - run.origin:.1f} s: its calm clients could"
                    " not answer, and what they missed then is not the server's",
                    suspects,
                )
            )


async def _pool_settles(run: SurfaceRun, active: int, udp: list[int], timeout: float) -> tuple[bool, str]:
    """Wait until ``active`` slots are active and the rest idle, with the UDP ports ``udp`` held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    state = ""
    while True:
        pool = await run.get("/v1/pool")
        ports = run.process.udp_ports()
        try:
            states = json.loads(pool.body)["states"]
        except (ValueError, KeyError):
            states = {}
        idle = SURFACE_CONFIG["pool_size"] - active
        state = f"slots {states}, UDP ports {len(ports)} (expected {len(udp)})"
        if states.get("active", 0) == active and states.get("idle", 0) == idle and len(ports) <= len(udp):
            return True, state
        if loop.time() > deadline:
            return False, state
        await asyncio.sleep(0.25)


async def surface_fuzz(
    seed: int,
    seconds: float,
    *,
    posters: int = 3,
    callers: int = 2,
    calm: int = 2,
    sip_callers: int = 2,
    folder: Path | None = None,
) -> FuzzReport:
    """One seeded run against the POST routes and WebRTC calls of a server process, then SIGTERM.

    Phases: calm clients alone (the quiet loop lag and UDP ports); hostile clients beside them for
    ``seconds``; the hostile ones stop and every slot and UDP port must come back within
    :data:`SURFACE_SETTLE_S`; the calm ones stop; hostile clients again, and SIGTERM at a random
    moment: the process must exit 0 within its grace period and a second.

    Args:
        seed: drives every client's generator, the server's settings (keys on for odd seeds) and the SIGTERM moment.
        seconds: how long the hostile clients run beside the calm ones.
        posters, callers: hostile clients sending requests / making real calls.
        sip_callers: hostile SIP callers (:mod:`sip_fuzzing`; its application answers the webhook).
        calm: calm WebSocket sessions (beside one calm call).
        folder: where the server's settings and the requests behind findings are written.

    Returns:
        The report; ``findings`` are empty when every check held.
    """
    import tempfile

    from sip_fuzzing import SipSide, sip_worker

    rng = random.Random(f"{seed}:run")
    keys = seed % 2 == 1
    report = FuzzReport(seed, seconds, f"fake, {'keys on' if keys else 'no keys'}", test="tests/test_surface_fuzz.py")
    folder = folder or Path(os.environ.get("FUZZ_OUT") or tempfile.gettempdir()) / "s2s-rt-fuzz" / f"seed-{seed}"
    settings = SURFACE_CONFIG | {"allowed_origins": [ALLOWED_ORIGIN]}
    if keys:
        settings |= {"api_keys": [SURFACE_KEY], "page_secrets": True}
    hosts = host_addresses()
    sinks_open, sinks = await open_sinks(hosts)
    here = Here(frozenset(hosts), sinks)
    sip = await SipSide.open(seed, keys)
    settings |= sip.settings()
    server = ServerProcess(settings, folder)
    control = LoadControl()
    base_pcs: list[Any] = []
    run = SurfaceRun(server, report, time.monotonic() + 3600, here, folder, keys)
    sip.app.run = run
    watch = asyncio.create_task(_self_watch(run), name="fuzzer-self-watch")
    try:
        await asyncio.to_thread(server.wait_listening)
        for shape in ("call", "audio", "video"):
            pc, sdp = await make_offer(shape)
            base_pcs.append(pc)
            run.base_offers.append(sdp)
        udp_idle = server.udp_ports()
        # Calm clients first, alone: the quiet figures.
        run.sources = {f"c{i}": f"127.0.1.{i + 1}" for i in range(calm)}
        call_up = asyncio.Event()
        calm_tasks = [
            asyncio.create_task(calm_worker(run, i, seed, b"", fake=True), name=f"calm{i}") for i in range(calm)
        ]
        calm_tasks.append(asyncio.create_task(calm_call_worker(run, seed, call_up), name="calm-call"))
        await asyncio.wait_for(call_up.wait(), 30)
        await asyncio.sleep(1.0)
        quiet_before = _lag_counts((await run.get("/metrics")).body.decode())
        await asyncio.sleep(2.0)
        quiet_after = _lag_counts((await run.get("/metrics")).body.decode())
        quiet = _worst_bucket(quiet_before, quiet_after)
        bounds = sorted(b for b in quiet_after if b != float("inf"))
        bound = next((b for b in bounds if b >= max(LAG_FLOOR_S, LAG_FACTOR * quiet)), bounds[-1] if bounds else 1.0)
        udp_calm = server.udp_ports()
        report.stats["quiet loop lag bucket (ms)"] = int(quiet * 1000)
        # Hostile clients beside them.
        run.hostile_deadline = time.monotonic() + seconds
        hostile = [
            *(post_worker(run, i, seed) for i in range(posters)),
            *(call_worker(run, i, seed) for i in range(callers)),
            *(sip_worker(run, i, seed, sip.port, sip.media) for i in range(sip_callers)),
            burst_worker(run, seed),
            _lag_watch(run, control, bound, quiet),
        ]
        await asyncio.gather(*hostile)
        settled, state = await _pool_settles(run, calm + 1, udp_calm, SURFACE_SETTLE_S)
        if not settled:
            run.find_with(
                f"{SURFACE_SETTLE_S:.0f} s after the hostile clients stopped, not every slot and UDP port"
                f" is back: {state}",
                list(run.sent_log)[-8:],
            )
        # The calm clients end their turns and leave: every slot and port back.
        run.deadline = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*calm_tasks), CALM_TURN_S + 15)
        settled, state = await _pool_settles(run, 0, udp_idle, SURFACE_SETTLE_S)
        if not settled:
            run.find(None, f"after the calm clients left, not every slot and UDP port is back: {state}")
        metrics = (await run.get("/metrics")).body.decode()
        restarts = re.search(r"^s2s_stage_restarts_total (\d+)", metrics, re.M)
        if restarts and int(restarts.group(1)):
            run.find(None, f"{restarts.group(1)} slot stage crash(es) (s2s_stage_restarts_total)")
        run.check_log()
        # SIGTERM at a random moment of a hostile burst.
        run.hostile_deadline = time.monotonic() + 10
        tail = [
            asyncio.create_task(post_worker(run, 100, seed)),
            asyncio.create_task(call_worker(run, 100, seed)),
            asyncio.create_task(call_worker(run, 101, seed)),
            asyncio.create_task(burst_worker(run, seed + 1)),
            asyncio.create_task(sip_worker(run, 100, seed, sip.port, sip.media)),
        ]
        await asyncio.sleep(rng.uniform(0.2, 4.0))
        run.shutting_down = True
        grace = float(SURFACE_CONFIG["grace_period_s"])
        signalled = time.monotonic()
        code, took = await asyncio.to_thread(server.terminate, grace + 5)
        report.stats["SIGTERM after (ms)"] = int(1000 * (signalled - run.hostile_deadline + 10))
        if code != 0 or took > grace + 1.0:
            run.find_with(
                f"SIGTERM: the process exited {code} after {took:.2f} s (must be 0 within {grace + 1:g} s)",
                run.recent(signalled - 3, signalled),
            )
        run.hostile_deadline = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tail, return_exceptions=True), 30)
    except Exception as exc:
        report.findings.append(Finding("fuzzer", f"the run failed: {_last_frames(exc)}"))
    finally:
        run.deadline = run.hostile_deadline = time.monotonic()
        watch.cancel()
        server.finish()
        control.stop()
        await sip.app.close()
        for pc in base_pcs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pc.close(), 5)
        for transport in sinks_open:
            transport.close()
    run.check_log()
    (folder / "server.log").write_text("\n".join(line.text for line in server.lines) + "\n")
    report.stats["sessions"] = report.stats.get("sessions", 0)
    report.stats["requests saved for findings"] = run.saved
    return report


def replay(path: str, port: int) -> None:
    """Send a saved request to a server on ``port`` and print its answer (``... replay FILE PORT``)."""
    answer = exchange_blocking(port, Path(path).read_bytes())
    print(f"{answer.status or answer.error} in {answer.seconds:.3f} s")
    for k, v in answer.head:
        print(f"{k}: {v}")
    print()
    print(answer.body[:2000].decode("utf-8", "replace"))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "replay":
        replay(sys.argv[2], int(sys.argv[3]))
    else:
        print("usage: python tests/surface_fuzzing.py replay FILE PORT", file=sys.stderr)
        sys.exit(2)

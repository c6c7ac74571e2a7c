"""No web page, hostile client or broken call can hurt the server: the POST routes and WebRTC, fuzzed.

Hostile clients post mutated SDP offers (sections, candidates, setup roles,
sizes), multipart forms and JSON bodies (nesting, surrogates, wrong types),
send preflights and cross-site posts from foreign origins with any headers,
hang up others' calls and unknown ids, send offers in bursts from one
address, and make real calls that never connect, drop mid-answer, vanish,
flood or overfill their data channel; phone callers send INVITEs over SIP
(mutated, in floods, over UDP and TCP), talk, vanish or hang up, strangers
spray the calls' media ports, and the application behind the webhook answers
late, badly or not at all (:mod:`sip_fuzzing`); all beside calm WebSocket
sessions and a calm call (see :func:`surface_fuzzing.surface_fuzz`). Checked on every answer and
event: no 5xx (but the designed 503s), nothing cross-site (``/drain`` never
reachable, no foreign page reads an answer), no traceback or error in the
server's log, its loop's lag within a bound of the quiet figure, the calm
clients never notice; at the end every slot and UDP port is back, and a
SIGTERM at a random moment exits 0 within the grace period and a second.

Every address an offer names stays on this machine (loopback, or the host's
own, where aiortc gathers its candidates): the server sends connectivity
checks to the candidates it is given.

- ``make test`` runs a bounded fuzz (``FUZZ_SECONDS``, default 20 s of hostile
  traffic, about 45 s in all) and a hypothesis search of the request bodies.
- ``make fuzz`` runs it for ten minutes on fresh seeds, beside the WebSocket fuzzer.
- ``FUZZ_SEED=7`` (or ``7,8``) replays those seeds (odd seeds run with API keys on);
  a finding prints the requests in flight around it, each saved to a file that
  ``python tests/surface_fuzzing.py replay FILE PORT`` sends again.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run
from fuzzing import check_reports, seeds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from surface_fuzzing import (
    SDP_MUTATIONS,
    SELF_STALL_S,
    SURFACE_CONFIG,
    FuzzReport,
    Here,
    ServerProcess,
    _self_watch,
    exchange_blocking,
    host_addresses,
    http_request,
    is_fault,
    make_offer,
    mutate_offer,
    stray_addresses,
    surface_fuzz,
)

#: Seconds of hostile traffic the bounded test spends, across its seeds (``make fuzz`` sets 600).
FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", "20"))
#: Seconds one run's hostile clients run before the checks and the SIGTERM; a long run makes many.
RUN_SECONDS = float(os.environ.get("FUZZ_RUN_SECONDS", "20" if FUZZ_SECONDS <= 60 else "60"))


def test_hostile_requests_and_calls_never_hurt_the_server_or_the_calm_clients() -> None:
    chosen = seeds(FUZZ_SECONDS, RUN_SECONDS)
    replay = "FUZZ_SEED" in os.environ
    reports: list[FuzzReport] = []
    end = time.monotonic() + FUZZ_SECONDS
    for seed in chosen:
        left = end - time.monotonic()
        if not replay and left < min(RUN_SECONDS, 5.0):
            break
        seconds = RUN_SECONDS if replay else min(RUN_SECONDS, left)
        report = run(surface_fuzz(seed, seconds), timeout=seconds + 150)
        reports.append(report)
        print(report.summary(), flush=True)
        if report.findings and os.environ.get("FUZZ_KEEP_GOING") != "1":
            break
    check_reports(reports)


# --- the offers it makes stay on this machine ------------------------------------------------------


@pytest.fixture(scope="module")
def here() -> Here:
    return Here(frozenset(host_addresses()), (("127.0.0.1", 9), ("::1", 9)))


@pytest.fixture(scope="module")
def offer() -> str:
    async def made() -> str:
        pc, sdp = await make_offer("video")
        await pc.close()
        return sdp

    return asyncio.run(made())


def test_every_address_a_mutated_offer_names_is_on_this_machine(here: Here, offer: str) -> None:
    assert not stray_addresses(offer, here), "aiortc's own offer names only this host's addresses"
    for seed in range(200):
        rng = random.Random(seed)
        body, done = mutate_offer(rng, offer, here)
        assert not stray_addresses(body.decode("utf-8", "surrogateescape"), here), (seed, done)


def test_no_chain_of_mutations_makes_an_offer_too_big_for_the_fuzzer_to_check(here: Here, offer: str) -> None:
    """3,000 candidates, then their section copied 150 times, once made a 30 MB offer whose address check
    stalled the fuzzer's loop for 9 s, and its calm call, unable to answer, was ended by the server."""
    many = next(s for s in range(1000) if random.Random(s).choice([1, 3, 20, 64, 65, 600, 3000]) == 3000)
    biggest = 0
    for copy_seed in range(12):
        steps = [("candidates", many), ("duplicate_sections", copy_seed), ("duplicate_sections", copy_seed + 1)]
        body, done = mutate_offer(random.Random(copy_seed), offer, here, steps)
        biggest = max(biggest, len(body))
        assert len(body) <= 4 << 20, (len(body), done)  # 16 times the body limit
    assert biggest > 1 << 20, "some chain still goes far past the server's body limit"


def test_a_stall_of_the_fuzzers_own_loop_is_its_own_finding() -> None:
    """Its calm call answers the server's consent checks on that loop: a stall is the fuzzer's fault."""

    async def watched(stall: float) -> list[str]:
        report = FuzzReport(0, 1.0, "none")
        run = SimpleNamespace(report=report, origin=time.monotonic(), recent=lambda start, end: [])
        watch = asyncio.create_task(_self_watch(run))  # type: ignore[arg-type]
        await asyncio.sleep(0.3)
        time.sleep(stall)  # what a 30 MB offer's address check did
        await asyncio.sleep(0.3)
        watch.cancel()
        return [f"{f.who}: {f.what}" for f in report.findings]

    assert asyncio.run(watched(0.3)) == []
    (finding,) = asyncio.run(watched(SELF_STALL_S + 0.3))
    assert finding.startswith(f"fuzzer: its own loop stalled {SELF_STALL_S + 0.3:.1f} s")


def test_the_fuzzer_reads_a_sip_messages_headers_as_the_server_does() -> None:
    """A re-INVITE whose From, To and Call-ID lines had lost their CR (the fuzzer's own rewriting did that) was
    read by the server, which then answered its CSeq, out of order, with RFC 3261's 500; the fuzzer, reading
    CRLF lines only, saw no CSeq and called the 500 a fault."""
    from aiosipua.message import SipMessage
    from sip_fuzzing import _header

    raw = (
        "INVITE sip:agent@127.0.0.1:5060 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.40.1:45625;branch=z9hG4bKe5\r\n"
        "From: <sip:fuzz@127.0.40.1>;tag=600c\nTo: <sip:agent@127.0.0.1>;tag=6d59\nCall-ID: fuzz-600c@127.0.40.1\n"
        "CSeq: 1\r\nMax-Forwards: 70\r\nContent-Length: 9\r\n\r\nCSeq: 7\r\n"
    )
    server = SipMessage.parse(raw)
    for name in ("cseq", "call-id", "from", "to", "via"):
        assert _header(raw, name) == [server.headers.get_first(name)], name
    assert _header(raw, "cseq") == ["1"]  # the body's line is not a header


def test_an_address_elsewhere_is_recognised_and_never_sent(here: Here) -> None:
    for elsewhere in (
        "10.9.8.7",
        "8.8.8.8",
        "224.0.0.251",
        "fe80::1%eth0",
        "2001:db8::1",
        "host.local",
        "::ffff:10.0.0.1",
    ):
        assert stray_addresses(f"a=candidate:1 1 udp 1 {elsewhere} 9 typ host", here) == [elsewhere]
    for local in ("127.0.0.1", "127.0.0.2", "::1", "0.0.0.0", *here.hosts):
        assert not stray_addresses(f"c=IN IP4 {local}/127", here)


# --- hypothesis: any body on any POST route, shrunk to the smallest that fails -----------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    settings_ = SURFACE_CONFIG | {"pool_size": 2, "call_timeout_s": 1.0}
    process = ServerProcess(settings_, tmp_path_factory.mktemp("surface-server"))
    try:
        process.wait_listening()
        yield process
    finally:
        process.finish()


def _faults_since(server: ServerProcess, mark: int) -> list[str]:
    time.sleep(0.05)  # the log line of a failure is written as its answer goes
    return [f for line in server.lines[mark:] if (f := line.fault()) is not None]


def _post(server: ServerProcess, path: str, content_type: str, body: bytes) -> None:
    mark = len(server.lines)
    raw = http_request("POST", path, server.port, [("Content-Type", content_type)], body)
    answer = exchange_blocking(server.port, raw)
    assert not is_fault(answer), f"{answer.status}: {answer.body[:300]!r}"
    assert answer.status, f"no answer: {answer.error}"
    faults = _faults_since(server, mark)
    assert not faults, faults


JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False)
    | st.text(st.characters(codec=None, exclude_categories=()), max_size=8)
    | st.sampled_from(["\ud800", "\udfff", "a\udc00b"])  # lone surrogates, which st.text draws rarely
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["session", "type", "x"]) | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


def _nested(value: object, depth: int, *, raw: bool = False) -> bytes:
    """``value`` in ``depth`` arrays, as JSON; ``raw``: its text as UTF-8 (a lone surrogate's bytes are invalid)."""
    text = "[" * depth + json.dumps(value, ensure_ascii=not raw) + "]" * depth
    return text.encode("utf-8", "surrogatepass")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    value=JSON_VALUES,
    depth=st.sampled_from([0, 0, 0, 1, 1000, 50_000]),
    as_session=st.booleans(),
    raw=st.booleans(),
)
def test_any_json_body_is_answered_without_a_fault(
    server: ServerProcess, value: object, depth: int, as_session: bool, raw: bool
) -> None:
    """Any JSON (lone surrogates escaped or as raw bytes, any nesting, any types), as a body or a session."""
    body = _nested({"session": value} if as_session else value, depth, raw=raw)
    _post(server, "/v1/realtime/client_secrets", "application/json", body)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    steps=st.lists(st.tuples(st.sampled_from(sorted(SDP_MUTATIONS)), st.integers(0, 2**16)), min_size=1, max_size=3),
    ending=st.integers(0, 2**16),
)
def test_any_mutated_offer_is_answered_without_a_fault(
    server: ServerProcess, here: Here, offer: str, steps: list[tuple[str, int]], ending: int
) -> None:
    """An offer changed by any mutations, in any order (shrunk to the fewest that fail)."""
    body, _ = mutate_offer(random.Random(ending), offer, here, steps)
    _post(server, "/v1/realtime/calls", "application/sdp", body)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    session=JSON_VALUES,
    depth=st.sampled_from([0, 0, 1000, 50_000]),
    raw=st.booleans(),
    parts=st.sampled_from([0, 1, 9, 3000]),
)
def test_any_multipart_offer_is_answered_without_a_fault(
    server: ServerProcess, offer: str, session: object, depth: int, raw: bool, parts: int
) -> None:
    """A form with the offer, any session field, and any number of parts more."""
    b = b"--fuzzbound\r\n"
    field = _nested(session, depth, raw=raw)
    body = (
        b
        + b'Content-Disposition: form-data; name="sdp"\r\n\r\n'
        + offer.encode()
        + b"\r\n"
        + b
        + b'Content-Disposition: form-data; name="session"\r\n\r\n'
        + field
        + b"\r\n"
        + (b + b'Content-Disposition: form-data; name="x"\r\n\r\nx\r\n') * parts
        + b"--fuzzbound--\r\n"
    )
    _post(server, "/v1/realtime/calls", "multipart/form-data; boundary=fuzzbound", body)


def test_the_replay_helper_sends_a_saved_request_again(server: ServerProcess, tmp_path: Path) -> None:
    saved = tmp_path / "request.http"
    saved.write_bytes(http_request("GET", "/healthz", server.port))
    answer = exchange_blocking(server.port, saved.read_bytes())
    assert answer.status == 200

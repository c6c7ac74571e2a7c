"""SIPp (Debian's ``sip-tester``) as the caller in SIP tests: scenarios written per test, run as a process.

A scenario here is one call: an INVITE with a G.711 offer, then either the
call answered (200, ACK, the caller's audio streamed from ``in.ulaw`` for a
while, the caller's BYE) or refused with an expected status (and its ACK).
SIPp exits 0 when the call went as its scenario says, 1 when it did not.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import socket
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np
from conftest import missing

#: Where Debian's sip-tester keeps its recorded RTP (keypad presses among them).
PCAPS = Path("/usr/share/sip-tester")

INVITE = """
  <send retrans="500">
    <![CDATA[
      INVITE sip:agent@[remote_ip]:[remote_port] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:agent@[remote_ip]:[remote_port]>
      Call-ID: [call_id]
      CSeq: 1 INVITE
      Contact: sip:sipp@[local_ip]:[local_port];transport=[transport]
      X-Caller-Account: 4711
      Max-Forwards: 70
      Content-Type: application/sdp
      Content-Length: [len]

      v=0
      o=user1 53655765 2353687637 IN IP[local_ip_type] [local_ip]
      s=-
      c=IN IP4 127.0.0.1
      t=0 0
      m=audio {hears_on} RTP/AVP 0 8 101
      a=rtpmap:0 PCMU/8000
      a=rtpmap:8 PCMA/8000
      a=rtpmap:101 telephone-event/8000
      a=fmtp:101 0-15
    ]]>
  </send>
  <recv response="100" optional="true"/>
"""

ACK_2XX = """
  <send>
    <![CDATA[
      ACK sip:agent@[remote_ip]:[remote_port] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:agent@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 1 ACK
      Contact: sip:sipp@[local_ip]:[local_port];transport=[transport]
      Max-Forwards: 70
      Content-Length: 0
    ]]>
  </send>
"""

BYE = """
  <send retrans="500">
    <![CDATA[
      BYE sip:agent@[remote_ip]:[remote_port] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:agent@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 2 BYE
      Contact: sip:sipp@[local_ip]:[local_port];transport=[transport]
      Max-Forwards: 70
      Content-Length: 0
    ]]>
  </send>
  <recv response="200" timeout="5000"/>
"""

#: The caller's answer to the server's request just received (a REFER, a BYE): ``{code}`` is its status.
REPLY = """
  <send>
    <![CDATA[
      SIP/2.0 {code}
      [last_Via:]
      [last_From:]
      [last_To:]
      [last_Call-ID:]
      [last_CSeq:]
      Content-Length: 0
    ]]>
  </send>
"""


def answered(
    talk_ms: int, hears_on: int, *, ring: bool = True, keys_after_ms: int | None = None, answer_has: str = ""
) -> str:
    """A call answered, the caller's audio streamed for ``talk_ms``, then the caller's BYE.

    ``answer_has``: a regular expression (POSIX, SIPp's) the 200 must match, or the call fails.

    The offer asks for the answers' audio on ``hears_on`` (a UDP port the test reads), not SIPp's own.
    ``keys_after_ms``: the caller presses 1 (RFC 4733, Debian's ``dtmf_2833_1.pcap``; SIPp sends it
    from a raw socket, which needs root) that long after the call was answered.
    """
    keys = ""
    if keys_after_ms is not None:
        keys = (
            f'<pause milliseconds="{keys_after_ms}"/><nop><action><exec play_pcap_audio="dtmf_1.pcap"/></action></nop>'
        )
        talk_ms = max(0, talk_ms - keys_after_ms)
    return _scenario(
        hears_on,
        ('<recv response="180"/>' if ring else '<recv response="180" optional="true"/>')
        + (
            f'<recv response="200" rtd="true"><action><ereg regexp="{escape(answer_has, {chr(34): "&quot;"})}"'
            ' search_in="msg" check_it="true"'
            ' assign_to="has"/></action></recv>'
            if answer_has
            else '<recv response="200" rtd="true"/>'
        )
        + ACK_2XX
        + '<nop><action><exec rtp_stream="in.ulaw,1,0"/></action></nop>'
        + keys
        + f'<pause milliseconds="{talk_ms}"/>'
        + BYE
        + ('<Reference variables="has"/>' if answer_has else ""),
    )


def moved(talk_ms: int, hears_on: int, then_on: int) -> str:
    """A call answered with its answers' audio asked on ``hears_on``, moved by a re-INVITE (answered 200 with
    SDP, ACKed) to ``then_on``; then the caller's audio streams for ``talk_ms`` and it hangs up (BYE)."""
    # The first INVITE again, in the dialog (its To tag, CSeq 2), offering a new port and a new SDP version.
    reinvite = (
        INVITE.format(hears_on=then_on)
        .replace("CSeq: 1 INVITE", "CSeq: 2 INVITE")
        .replace(
            "To: <sip:agent@[remote_ip]:[remote_port]>", "To: <sip:agent@[remote_ip]:[remote_port]>[peer_tag_param]"
        )
        .replace("X-Caller-Account: 4711\n", "")
        .replace("2353687637", "2353687638")
        + '<recv response="200"><action><ereg regexp="m=audio [0-9]+ RTP/AVP 0" search_in="body"'
        ' check_it="true" assign_to="sdp"/></action></recv>'
    )
    ack = ACK_2XX.replace("CSeq: 1 ACK", "CSeq: 2 ACK")
    bye = BYE.replace("CSeq: 2 BYE", "CSeq: 3 BYE")
    return _scenario(
        hears_on,
        '<recv response="180" optional="true"/><recv response="200" rtd="true"/>'
        + ACK_2XX
        + reinvite
        + ack
        + '<nop><action><exec rtp_stream="in.ulaw,1,0"/></action></nop>'
        + f'<pause milliseconds="{talk_ms}"/>'
        + bye
        + '<Reference variables="sdp"/>',
    )


def transferred(target: str) -> str:
    """A call answered, then transferred by the server to ``target`` (a REFER naming it, answered 202), then
    hung up by it (BYE)."""
    return _scenario(
        9,
        '<recv response="180" optional="true"/><recv response="200" rtd="true"/>'
        + ACK_2XX
        + '<recv request="REFER" timeout="15000"><action>'
        + f'<ereg regexp="Refer-To:.*{re.escape(target)}[>;[:space:]]" search_in="msg" check_it="true" assign_to="to"/>'
        + "</action></recv>"
        + REPLY.format(code="202 Accepted")
        + '<recv request="BYE" timeout="15000"/>'
        + REPLY.format(code="200 OK")
        + '<Reference variables="to"/>',
    )


def silent(hears_on: int, *, bye_within_ms: int, talks_first: bool = False) -> str:
    """A call answered whose caller sends no media (or, ``talks_first``, stops after its ``in.ulaw`` once);
    the server must hang up (BYE, answered 200) in time."""
    return _scenario(
        hears_on,
        '<recv response="180" optional="true"/><recv response="200" rtd="true"/>'
        + ACK_2XX
        + ('<nop><action><exec rtp_stream="in.ulaw,1,0"/></action></nop>' if talks_first else "")
        + f'<recv request="BYE" timeout="{bye_within_ms}"/>'
        + REPLY.format(code="200 OK"),
    )


def cancelled(after_ms: int) -> str:
    """A call the caller gives up on while it rings (CANCEL, answered 200, the INVITE then 487, ACKed)."""
    line = """
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch-{back}]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:agent@[remote_ip]:[remote_port]>{tag}
      Call-ID: [call_id]
      CSeq: 1 {method}
      Max-Forwards: 70
      Content-Length: 0
"""
    cancel = line.format(back=4, tag="", method="CANCEL")
    ack = line.format(back=7, tag="[peer_tag_param]", method="ACK")
    return _scenario(
        9,
        f'<recv response="180"/><pause milliseconds="{after_ms}"/>'
        f"<send><![CDATA[\n      CANCEL sip:agent@[remote_ip]:[remote_port] SIP/2.0{cancel}    ]]></send>"
        '<recv response="200"/><recv response="487"/>'
        f"<send><![CDATA[\n      ACK sip:agent@[remote_ip]:[remote_port] SIP/2.0{ack}    ]]></send>",
    )


def refused(status: int) -> str:
    """A call refused with ``status`` (perhaps after ringing); the caller ACKs the refusal."""
    ack = """
  <send>
    <![CDATA[
      ACK sip:agent@[remote_ip]:[remote_port] SIP/2.0
      [last_Via:]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:agent@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 1 ACK
      Max-Forwards: 70
      Content-Length: 0
    ]]>
  </send>
"""
    return _scenario(9, f'<recv response="180" optional="true"/><recv response="{status}"/>' + ack)


def _scenario(hears_on: int, body: str) -> str:
    return (
        '<?xml version="1.0" encoding="ISO-8859-1" ?>\n<!DOCTYPE scenario SYSTEM "sipp.dtd">\n'
        f'<scenario name="s2s-rt test">{INVITE.format(hears_on=hears_on)}{body}</scenario>\n'
    )


def ulaw(pcm16: np.ndarray) -> bytes:
    """PCM16 samples as G.711 μ-law bytes."""
    x = np.clip(pcm16.astype(np.int32), -32635, 32635)
    sign = np.where(x < 0, 0x80, 0)
    x = np.abs(x) + 0x84
    exponent = np.floor(np.log2(x)).astype(np.int32) - 7
    mantissa = (x >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8).tobytes()


def from_ulaw(data: bytes) -> bytes:
    """G.711 μ-law bytes as PCM16 samples (little-endian bytes)."""
    u = ~np.frombuffer(data, dtype=np.uint8).astype(np.int32) & 0xFF
    magnitude = (((u & 0x0F) << 3) + 0x84) << ((u >> 4) & 0x07)
    return np.where(u & 0x80, 0x84 - magnitude, magnitude - 0x84).astype("<i2").tobytes()


async def sipp(
    folder: Path, scenario: str, port: int, *, transport: str = "u1", timeout: float = 30.0, audio: bytes = b""
) -> tuple[int, str]:
    """Run one call of ``scenario`` against ``127.0.0.1:port``; SIPp's exit status and output.

    ``audio`` (μ-law at 8 kHz) is what the caller streams when the scenario talks.
    """
    exe = shutil.which("sipp")
    if exe is None:
        missing("sipp (Debian sip-tester) is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "call.xml").write_text(scenario)
    (folder / "in.ulaw").write_bytes(audio or bytes([0xFF]) * 8000)
    if "dtmf_1.pcap" in scenario:
        if os.geteuid() != 0:
            missing("SIPp sends RFC 4733 keypad packets from a raw socket: run as root (CI does)")
        shutil.copy(PCAPS / "dtmf_2833_1.pcap", folder / "dtmf_1.pcap")
    process = await asyncio.create_subprocess_exec(
        exe, "-sf", "call.xml", f"127.0.0.1:{port}", "-i", "127.0.0.1",
        "-p", str(_free_port()), "-mp", str(_media_port()),
        "-t", transport, "-m", "1", "-nostdin", "-timeout", f"{int(timeout)}s",
        cwd=folder, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout + 10)
    except BaseException:  # timed out, or the test ended first (cancelled): SIPp never outlives it
        if process.returncode is None:
            process.kill()
            await asyncio.shield(process.wait())
        raise
    return int(process.returncode or 0), out.decode(errors="replace")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _media_port() -> int:
    """An even port with the next five free, for SIPp's media (its audio and RTP-stream sockets take several)."""
    for _ in range(200):
        base = random.randrange(21000, 29000, 2)
        socks = []
        try:
            for offset in range(6):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return base
    raise OSError("no free media ports for SIPp")

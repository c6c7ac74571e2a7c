"""A call's audio both ways, as its peer has it: what the server's track sends (and, while silent, does not),
and how the caller's packets are decoded and heard (:mod:`s2s_rt.server.webrtc_audio`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from aiortc import RTCRtpCodecParameters
from aiortc.jitterbuffer import JitterFrame
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RtpPacket
from av import CodecContext, Packet
from conftest import eventually, live_server, run, silence, tone

from s2s_rt.audio import AudioFormat, Resampler, float_to_pcm16, resample
from s2s_rt.bench.call import CallClient
from s2s_rt.server.playout import HANGOVER_FRAMES, LEAD_FRAMES
from s2s_rt.server.webrtc_audio import HEARD_FORMAT, OPUS_FRAME, OPUS_TIME_BASE, Hearing, InOrder, Playback, ToHeard

OPUS = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2, payloadType=111)
PCMU = RTCRtpCodecParameters(mimeType="audio/PCMU", clockRate=8000, channels=1, payloadType=0)
SAY = AudioFormat("audio/pcm", 24_000)
#: Samples a millisecond of what a caller is heard as (16 kHz).
KHZ = HEARD_FORMAT.rate // 1000


def decoded(packet: Packet) -> np.ndarray:
    """What a receiver's Opus decoder makes of one of the track's packets (48 kHz, as aiortc decodes)."""
    context = CodecContext.create("libopus", "r")
    context.format, context.layout, context.sample_rate = "s16", "mono", 48_000
    return np.concatenate([f.to_ndarray().reshape(-1) for f in context.decode(packet)])


async def timed_recv(track: Playback, timeout: float) -> tuple[Packet | None, float]:
    start = time.monotonic()
    try:
        packet = await asyncio.wait_for(track.recv(), timeout)
    except TimeoutError:
        return None, time.monotonic() - start
    return packet, time.monotonic() - start


def test_the_servers_track_sends_nothing_while_silent_and_its_rtp_time_runs_on() -> None:
    async def scenario() -> None:
        track = Playback()
        first, _ = await timed_recv(track, 1.0)
        assert first is not None and first.pts == 0 and first.time_base == OPUS_TIME_BASE
        # Nothing to play: no packet comes.
        nothing, _ = await timed_recv(track, 0.4)
        assert nothing is None
        # Audio is queued: its first packets go at once, stamped with the time that has passed.
        t0 = time.monotonic()
        track.play("resp_1", "item_1", tone(440, 0.2), SAY)  # 10 frames
        track.finish("resp_1")
        talk, at = [], []
        for _ in range(10 + HANGOVER_FRAMES):
            talk.append(await track.recv())
            at.append(time.monotonic() - t0)
        assert talk[0].pts % OPUS_FRAME == 0 and talk[0].pts >= OPUS_FRAME * 20  # 0.4 s and more had passed
        assert [p.pts - talk[0].pts for p in talk] == [OPUS_FRAME * i for i in range(len(talk))]
        # The first LEAD_FRAMES + 1 at once, for a receiver that holds that many before it plays; then one
        # every 20 ms, that many ahead of real time.
        assert at[LEAD_FRAMES] < 0.015, at
        for i in range(LEAD_FRAMES + 1, len(at)):
            assert at[i] >= (i - LEAD_FRAMES) * 0.02 - 0.002, (i, at)
        assert at[-1] < (len(at) - LEAD_FRAMES) * 0.02 + 0.2, at
        assert np.abs(decoded(talk[5])).max() > 1000  # the tone, not silence
        # The talkspurt ends with frames of silence, which push the tone's last frames out of such a buffer.
        assert all(np.abs(decoded(p)).max() < 50 for p in talk[-3:])
        # Once it has all played, the track falls silent again; stopped, its waiting sender ends.
        waiting = asyncio.ensure_future(track.recv())
        await asyncio.sleep(0.3)
        assert not waiting.done()
        track.stop()
        with pytest.raises(MediaStreamError):
            await asyncio.wait_for(waiting, 1.0)

    run(scenario())


def test_a_microphone_sends_silence_every_20_ms() -> None:
    async def scenario() -> None:
        mic = Playback(send_silence=True)
        packets = [await mic.recv() for _ in range(15)]
        assert [p.pts for p in packets] == [OPUS_FRAME * i for i in range(15)]
        assert np.abs(decoded(packets[-1])).max() < 50
        mic.stop()

    run(scenario())


def test_a_microphone_whose_loop_stalls_stamps_its_next_frame_with_the_time_that_passed() -> None:
    """RTP time is the sampling clock's: a sender whose loop stalled past the pacer's bound goes on from now,
    and its frames' RTP time with it (a gap, as after lost packets), never behind the time that passed."""

    async def scenario() -> None:
        mic = Playback(send_silence=True)
        start = time.monotonic()
        for _ in range(5):
            await mic.recv()
        time.sleep(0.5)  # the loop stalls
        after = await mic.recv()
        elapsed = time.monotonic() - start
        assert after.pts // OPUS_FRAME >= int(elapsed / 0.02) - 2, (after.pts // OPUS_FRAME, elapsed)
        mic.stop()

    run(scenario())


def _opus_packets(samples: np.ndarray) -> list[bytes]:
    from s2s_rt.server.webrtc_audio import opus_encoder

    encoder = opus_encoder()
    out = []
    for i in range(len(samples) // 480):
        from av import AudioFrame

        frame = AudioFrame.from_ndarray(samples[i * 480 : (i + 1) * 480].reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = 24_000, i * 480
        out += [bytes(p) for p in encoder.encode(frame)]
    return out


def test_a_microphone_with_dtx_sends_one_frame_in_20_once_silent() -> None:
    async def scenario() -> None:
        mic = Playback(send_silence=True, dtx=True)
        packets = [await asyncio.wait_for(mic.recv(), 1.0) for _ in range(13)]
        frames = [p.pts // OPUS_FRAME for p in packets]
        # The first frames, then one in 20 (as libopus with DTX on sends while silent).
        assert frames == [*range(10), 29, 49, 69], frames
        mic.stop()

    run(scenario(), timeout=10)


def test_the_callers_packets_are_heard_as_mono_16k_and_one_that_does_not_decode_is_skipped() -> None:
    async def scenario() -> None:
        heard: list[bytes] = []
        ended: list[str] = []
        hearing = Hearing(heard.append, ended.append, "rtc_test")
        speech = np.frombuffer(tone(300, 0.2), dtype="<i2")
        packets = _opus_packets(speech)
        hearing.put((OPUS, JitterFrame(packets[0], 0)))
        hearing.put((OPUS, JitterFrame(b"\xff\xff\xff\xff" * 40, OPUS_FRAME)))  # not Opus: skipped
        for i, packet in enumerate(packets[1:], start=2):
            hearing.put((OPUS, JitterFrame(packet, i * OPUS_FRAME)))
        assert ended == [] and len(heard) >= len(packets) - 1
        # 20 ms of mono PCM16 at 16 kHz each: the skipped packet's time is heard as silence.
        assert HEARD_FORMAT.rate == 16_000
        assert [len(pcm) for pcm in heard] == [640] * (len(packets) + 1)
        assert not any(heard[1])
        assert np.abs(np.frombuffer(heard[-1], dtype="<i2")).max() > 1000
        # G.711, should a peer choose it: heard at 16 kHz as well.
        hearing.put((PCMU, JitterFrame(b"\x00" * 160, 0)))
        assert len(heard[-1]) == 640 and ended == []
        hearing.put(None)

    run(scenario())


def test_a_callers_dtx_gaps_are_heard_as_silence_in_real_time() -> None:
    """A caller using Opus DTX sends one packet in 400 ms while silent: the session hears the time between as
    silence as it passes (not only when the next packet comes), each moment once."""

    async def scenario() -> None:
        heard: list[tuple[float, int, bool]] = []  # (when, samples, all zero)

        def hear(pcm: bytes) -> None:
            heard.append((time.monotonic(), len(pcm) // 2, not any(pcm)))

        hearing = Hearing(hear, lambda why: None, "rtc_dtx")
        stream = _opus_packets(np.frombuffer(tone(300, 0.1) + silence(0.5), dtype="<i2"))
        packets = stream[:5]
        start = time.monotonic()
        for i, packet in enumerate(packets):  # 100 ms of speech, packet by packet
            hearing.put((OPUS, JitterFrame(packet, i * OPUS_FRAME)))
            await asyncio.sleep(0.02)
        spoken_until = time.monotonic()
        # Then nothing for 400 ms but the DTX packet at its RTP time, as a browser sends it.
        await asyncio.sleep(0.4 - 0.02)
        hearing.put((OPUS, JitterFrame(stream[25], 25 * OPUS_FRAME)))
        await asyncio.sleep(0.3)
        hearing.put(None)
        ended = time.monotonic()
        # The gap was heard while it passed: by 150 ms into it, most of it up to then.
        by = sum(n for t, n, _ in heard if t <= spoken_until + 0.15) - KHZ * 100
        assert by >= KHZ * 60, by
        # All in all, about as much as the time that passed (each moment once); the gaps' pieces are silence.
        total_ms = sum(n for _, n, _ in heard) / KHZ
        assert (ended - start) * 1000 - 140 <= total_ms <= (ended - start) * 1000 + 40, (total_ms, ended - start)
        frame = 20 * KHZ
        assert all(silent for t, n, silent in heard if t > spoken_until + 0.01 and n != frame)
        assert len([n for t, n, _ in heard if t > spoken_until + 0.01 and n == frame]) == 1
        # Stopped, it hears nothing more.
        count = len(heard)
        await asyncio.sleep(0.2)
        assert len(heard) == count

    run(scenario())


def test_a_packet_waiting_to_be_read_when_a_gap_is_checked_is_heard_as_itself_not_as_silence() -> None:
    """The calls' sockets are read on a clock: when a caller's packets seem to have stopped, what waits on its
    socket is read before the gap is heard as silence, so a packet that came in time is heard as it is."""

    async def scenario() -> None:
        heard: list[bytes] = []
        waiting: list[int] = []
        speech = _opus_packets(np.frombuffer(tone(300, 0.4), dtype="<i2"))

        def read_waiting() -> None:  # what the call's sockets hold, handed over at once
            while waiting:
                i = waiting.pop(0)
                hearing.put((OPUS, JitterFrame(speech[i], i * OPUS_FRAME)))

        hearing = Hearing(heard.append, lambda why: None, "rtc_waiting", read_waiting)
        for i in range(5):
            hearing.put((OPUS, JitterFrame(speech[i], i * OPUS_FRAME)))
            await asyncio.sleep(0.02)
        waiting.append(5)  # came, but not read yet when the gap is checked (60 ms on)
        await asyncio.sleep(0.09)
        hearing.put(None)
        voiced = [np.abs(np.frombuffer(pcm, dtype="<i2")).max() > 1000 for pcm in heard]
        assert not waiting and len(voiced) >= 6 and all(voiced[:6]), voiced  # the sixth heard, as speech
        assert len(heard[5]) == 20 * KHZ * 2

    run(scenario())


def test_a_jump_in_a_callers_rtp_time_is_heard_as_silence_only_within_a_bound() -> None:
    async def scenario() -> None:
        heard: list[bytes] = []
        hearing = Hearing(heard.append, lambda why: None, "rtc_jump")
        packet = _opus_packets(np.zeros(480, dtype="<i2"))[0]

        def ms(pieces: list[bytes]) -> float:
            return sum(len(pcm) for pcm in pieces) / 2 / KHZ

        hearing.put((OPUS, JitterFrame(packet, 0)))
        await asyncio.sleep(0.2)  # 10 frames lost meanwhile: heard as silence, each moment once
        hearing.put((OPUS, JitterFrame(packet, 11 * OPUS_FRAME)))
        assert 220 <= ms(heard) <= 245, ms(heard)
        count = len(heard)
        hearing.put((OPUS, JitterFrame(packet, 5 * OPUS_FRAME)))  # late, and within what was heard: not again
        assert len(heard) == count
        # Timestamps 0.9 s apart, sent at once: never heard faster than real time (20 ms each, and the packets).
        for i in range(20):
            hearing.put((OPUS, JitterFrame(packet, (12 + 45 * (i + 1)) * OPUS_FRAME)))
        assert ms(heard[count:]) <= 20 * 40 + 20, ms(heard[count:])
        count = len(heard)
        hearing.put((OPUS, JitterFrame(packet, (2000 + 48_000 * 3600 // OPUS_FRAME) * OPUS_FRAME)))  # an hour on
        hearing.put((OPUS, JitterFrame(packet, (2**32 - OPUS_FRAME))))  # back (wrapping): neither is a gap
        assert [len(pcm) for pcm in heard[count:]] == [640, 640]
        hearing.put(None)

    run(scenario())


def test_a_caller_whose_rtp_time_falls_behind_after_a_pause_is_heard_again_after_that_shift() -> None:
    """A caller stops for half a second and goes on with the next RTP time (a sender whose loop stalled, a
    bridge that stamps what it forwards): the pause is heard as silence as it passes, the first packets after
    it fall within that silence and are not heard again, and once the caller's time passes what was heard,
    it is heard as it comes; the call does not go deaf."""

    async def scenario() -> None:
        heard: list[tuple[float, bytes]] = []
        hearing = Hearing(lambda pcm: heard.append((time.monotonic(), pcm)), lambda why: None, "rtc_behind")
        speech = _opus_packets(np.frombuffer(tone(300, 1.5), dtype="<i2"))
        start = time.monotonic()
        for i in range(5):
            hearing.put((OPUS, JitterFrame(speech[i], i * OPUS_FRAME)))
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
        resumed = time.monotonic()
        for i in range(5, 70):  # 1.3 s more, in real time, stamped on from where it stopped
            hearing.put((OPUS, JitterFrame(speech[i], i * OPUS_FRAME)))
            await asyncio.sleep(0.02)
        ended = time.monotonic()
        hearing.put(None)
        voiced = [t for t, pcm in heard if np.abs(np.frombuffer(pcm, dtype="<i2")).max() > 1000]
        late = [t - resumed for t in voiced if t > resumed]
        # Heard again once the caller's time passed the pause heard as silence (some 0.5 s), to the end.
        assert late and late[0] < 0.75, late[:3]
        assert ended - voiced[-1] < 0.1, ended - voiced[-1]
        # Each moment once: never more than the time that passed.
        total_ms = sum(len(pcm) for _, pcm in heard) / 2 / KHZ
        assert total_ms <= (ended - start) * 1000 + 40, (total_ms, ended - start)

    run(scenario(), timeout=10)


def test_the_callers_packets_are_released_as_they_come_and_a_lost_one_holds_nothing_back() -> None:
    """The receiver's jitter buffer releases each packet as it comes, in order: a lost packet holds none of
    those after it back (aiortc's own, as the server had it, then ran 14 packets, 280 ms, behind for the
    rest of the call), a late one or a copy is dropped, and a stream begun again is followed."""
    buffer = InOrder()

    def add(seq: int) -> int | None:
        packet = RtpPacket(payload_type=111, sequence_number=seq & 0xFFFF, timestamp=(seq * OPUS_FRAME) & 0xFFFFFFFF)
        packet._data = b"opus"  # type: ignore[attr-defined]  # as aiortc's depayloading sets it
        _, frame = buffer.add(packet)
        return None if frame is None else frame.timestamp // OPUS_FRAME

    assert [add(seq) for seq in range(65530, 65540)] == list(range(65530, 65540))  # through the wrap, at once
    assert [add(seq) for seq in (65541, 65542, 65543)] == [65541, 65542, 65543]  # 65540 lost: nothing held
    assert add(65540) is None and add(65543) is None  # late, and a copy
    assert [add(seq) for seq in range(65544, 65600)] == list(range(65544, 65600))
    assert add(65600 - 5000) == 65600 - 5000  # far back: the stream began again


def test_a_failure_while_decoding_ends_the_call_alone_and_never_reaches_aiortc(monkeypatch: Any) -> None:
    from s2s_rt.server import webrtc_audio

    def broken(codec: Any) -> Any:
        raise RuntimeError("a decoder that cannot be made")

    monkeypatch.setattr(webrtc_audio, "decoder", broken)
    ended: list[str] = []

    async def scenario() -> None:
        hearing = Hearing(lambda pcm: None, ended.append, "rtc_test")
        hearing.put((OPUS, JitterFrame(b"\x00", 0)))  # does not raise

    run(scenario())
    assert ended == ["internal error while decoding its audio"]


def test_a_silent_call_sends_no_media_and_its_answer_is_heard_after_the_gap() -> None:
    async def scenario() -> None:
        async with live_server() as server:
            call = await CallClient.open(f"http://127.0.0.1:{server.port}/v1", "unused")
            try:
                await call.next_event("session.created", 10)
                await asyncio.sleep(0.5)
                quiet_from = time.perf_counter()
                await asyncio.sleep(1.5)
                sent_while_silent = [t for t, _ in call.heard if t >= quiet_from]
                assert len(sent_while_silent) <= 1  # a packet already on its way at most, not 75
                asked = time.perf_counter()
                call.speak(tone(300, 0.8) + silence(1.0))
                await call.next_event("output_audio_buffer.stopped", 15)
                first = call.first_sound_after(asked)
                assert first is not None
                # Its answer is heard in full, as a stream of packets again.
                assert len([t for t, _ in call.heard if t >= first]) >= 10
            finally:
                await call.close()

    run(scenario())


def test_a_caller_using_dtx_is_heard_to_stop_speaking_as_one_without_it() -> None:
    """The server's answer asks for Opus DTX; a caller that uses it falls silent on the wire a moment after its
    speech. Side by side with one that sends silence every 20 ms, the same speech: the server hears its end as
    soon, and places it at the same moment of the caller's audio."""

    async def one(port: int, dtx: bool) -> tuple[float, int]:
        # 700 ms of silence to hear: without the gaps heard on the server's clock, a DTX caller's would be heard
        # only with the DTX packet after it (1 s after its speech, the 200 ms before DTX and 400 ms at a time).
        turns = {"type": "server_vad", "silence_duration_ms": 700}
        session = {"type": "realtime", "audio": {"input": {"turn_detection": turns}}}
        call = await CallClient.open(f"http://127.0.0.1:{port}/v1", "unused", session=session, dtx=dtx)
        try:
            assert call.mic.dtx == dtx  # with dtx: the answer said usedtx=1
            await call.next_event("session.created", 10)
            await asyncio.sleep(0.5)
            spoken = call.speak(tone(300, 0.8))
            started = await call.next_event("input_audio_buffer.speech_started", 10)
            stopped = await call.next_event("input_audio_buffer.speech_stopped", 10)
            return stopped["_received"] - spoken, stopped["audio_end_ms"] - started["audio_start_ms"]
        finally:
            await call.close()

    async def scenario() -> None:
        async with live_server() as server:
            (late, heard), (late_dtx, heard_dtx) = await asyncio.gather(one(server.port, False), one(server.port, True))
            # About 80 ms later at most (the gap's check and its margin), never seconds (the next DTX packets).
            assert late_dtx - late < 0.15, (late, late_dtx)
            assert abs(heard_dtx - heard) <= 60, (heard, heard_dtx)

    run(scenario())


class Racer(MediaStreamTrack):
    """A microphone that sends a tone's Opus packets in RTP order but not in real time: ``burst`` packets at once
    every ``every_s`` seconds (in between, one every 20 ms), or ``per_s`` packets a second."""

    kind = "audio"

    def __init__(self, *, per_s: float = 50.0, burst: int = 1, every_s: float = 1.0) -> None:
        super().__init__()
        self.per_s, self.burst, self.every_s = per_s, burst, every_s
        self.payloads = _opus_packets(np.frombuffer(tone(300, 0.2), dtype="<i2"))
        self.sent = 0
        self._pts = 0
        self._burst_at = time.monotonic() + every_s
        self._owed = 0

    async def recv(self) -> Packet:
        if self._owed:
            self._owed -= 1
        elif self.burst > 1 and time.monotonic() >= self._burst_at:
            self._burst_at += self.every_s
            self._owed = self.burst - 1
        else:
            await asyncio.sleep(1 / self.per_s)
        packet = Packet(self.payloads[self.sent % len(self.payloads)])
        packet.pts, packet.time_base = self._pts, OPUS_TIME_BASE
        self._pts += OPUS_FRAME
        self.sent += 1
        return packet


class RacingCall(CallClient):
    """A call whose microphone is a :class:`Racer` (set before the offer: ``RacingCall.racer = Racer(...)``)."""

    racer: Racer

    def __init__(self) -> None:
        super().__init__()
        self.pc.getSenders()[0].replaceTrack(self.racer)


def test_a_caller_flooding_its_media_is_ended_alone_and_one_bursting_within_the_budget_is_not() -> None:
    """aiortc takes every packet it is sent (its ICE queue, SRTP, RTP, the jitter buffer): a caller past its media
    budget has the excess dropped before that, and one that keeps at it is ended. A caller whose packets come in
    bursts, as after a network's stall, loses none of them."""

    async def scenario() -> None:
        async with live_server() as server:
            url = f"http://127.0.0.1:{server.port}/v1"
            calm = await CallClient.open(url, "unused")
            RacingCall.racer = Racer(burst=100, every_s=1.5)  # 100 packets at once every 1.5 s, else real time
            bursty = await RacingCall.open(url, "unused")
            flood: RacingCall | None = None
            try:
                for call in (calm, bursty):
                    await call.next_event("session.created", 10)
                while bursty.racer.sent < 400:
                    await asyncio.sleep(0.1)
                assert _dropped(server) == 0  # three bursts, not one packet dropped
                RacingCall.racer = Racer(per_s=1000)
                flood = await RacingCall.open(url, "unused")
                await flood.next_event("session.created", 10)
                began = time.monotonic()
                while flood.channel.readyState == "open" and time.monotonic() - began < 10:
                    await asyncio.sleep(0.1)
                print(f"\nflooding call ended after {time.monotonic() - began:.1f} s: {flood.racer.sent} packets sent")
                assert flood.channel.readyState != "open"  # the server ended it
                assert _dropped(server) > flood.racer.sent / 2  # most of them dropped unread
                assert await eventually(lambda: _pool_has(server, free=len(server.pool.slots) - 2), 5)
                # The others go on: the bursting call was not ended, and the calm one still has a turn.
                assert bursty.channel.readyState == "open"
                calm.speak(tone(440, 0.8) + silence(1.2))
                done = await calm.next_event("response.done", 15)
                assert done["response"]["status"] == "completed"
            finally:
                for call in (calm, bursty, flood):
                    if call is not None:
                        await call.close()

    run(scenario())


def _dropped(server: Any) -> float:
    return float(server.metrics.media_dropped.get(transport="webrtc"))


async def _pool_has(server: Any, free: int) -> bool:
    return bool(server.pool.free == free)


def test_a_callers_silence_is_heard_without_decoding_and_as_decoding_every_packet_would() -> None:
    """A caller sending silence every 20 ms sends the same packet again and again: once it has settled, it is
    heard without being decoded or resampled, and what is heard, the silence and the speech after it, is what
    decoding every packet and resampling them as one stream make of them."""
    from s2s_rt.server.webrtc_audio import decoder

    stream = silence(1.0) + tone(300, 0.2) + silence(0.4) + tone(500, 0.1) + silence(0.2)
    packets = _opus_packets(np.frombuffer(stream, dtype="<i2"))
    # And one packet of speech four times over: the same packet, but not the same sound each time.
    packets[55:56] = [packets[55]] * 4
    reference = CodecContext.create("libopus", "r")
    reference.format, reference.layout, reference.sample_rate = "s16", "mono", 48_000
    to_16k = Resampler(48_000, 16_000)
    decoded_48k = [np.concatenate([f.to_ndarray().reshape(-1) for f in reference.decode(Packet(p))]) for p in packets]
    expected = [float_to_pcm16(to_16k.process(pcm / 32768)) for pcm in decoded_48k]
    heard = decoder(OPUS)
    got = [heard(JitterFrame(packet, i * OPUS_FRAME)) for i, packet in enumerate(packets)]
    assert got == expected
    # 80 frames of silence in three runs: the encoder's first (a hiss of 32-byte packets) settles after a few,
    # those after each talkspurt at once (3 bytes each); each run's packet is decoded once more before speech.
    assert heard.skipped >= 60 and heard.decoded + heard.skipped == len(packets) + 2, (heard.decoded, heard.skipped)
    assert len(set(got[55:59])) == 4 and np.abs(np.frombuffer(got[58], dtype="<i2")).max() > 1000


def test_a_microphone_sending_silence_encodes_it_only_until_it_has_settled() -> None:
    """The load script's and the tests' callers send silence every 20 ms: once the encoder makes the same
    packet twice, that packet is sent again without encoding, and sound after it is encoded as sound."""

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner, self.calls = inner, 0

        def encode(self, frame: Any) -> Any:
            self.calls += 1
            return self.inner.encode(frame)

    mic = Playback(send_silence=True)
    counting = Counting(mic._encoder)
    mic._encoder = counting
    samples = np.frombuffer(silence(1.0) + tone(300, 0.2) + silence(0.4), dtype="<i2")
    frames = samples.reshape(-1, 480)
    sent = [mic._encode(frame, i) for i, frame in enumerate(frames)]
    assert all(p is not None and p.pts == i * OPUS_FRAME for i, p in enumerate(sent))
    data = [bytes(p) for p in sent if p is not None]
    # Silent, it sends what encoding each frame would (the same packet), and encodes few of its 70 silent frames
    # (the 10 of sound and one silent frame before them are encoded).
    reference = _opus_packets(np.frombuffer(silence(1.0), dtype="<i2"))
    assert data[:50] == reference
    assert 11 <= counting.calls <= 25, counting.calls
    # The sound after the silence is heard as sound, and the silence after it as silence again.
    context = CodecContext.create("libopus", "r")
    context.format, context.layout, context.sample_rate = "s16", "mono", 48_000
    heard = [np.concatenate([f.to_ndarray().reshape(-1) for f in context.decode(Packet(d))]) for d in data]
    assert all(np.abs(pcm).max() > 1000 for pcm in heard[52:59])
    assert len(set(data[-10:])) == 1 and all(np.abs(pcm).max() <= 2 for pcm in heard[-10:])


def test_a_callers_frames_are_heard_at_16k_as_one_stream_whatever_their_rate_and_layout() -> None:
    """aiortc's own decoders give Opus as packed stereo at 48 kHz and G.711 as mono at 8 kHz: each is heard as
    mono 16 kHz, resampled as one stream (what resampling the whole at once gives), not frame by frame."""
    from av import AudioFrame

    t = np.arange(48_000 * 4 // 10) / 48_000
    wave = (8000 * np.sin(2 * np.pi * 300 * t)).astype(np.int16)
    heard = ToHeard()
    pieces = []
    for i in range(0, len(wave), 960):  # 20 ms frames, the same wave on both channels, interleaved
        stereo = np.repeat(wave[i : i + 960], 2).reshape(1, -1)
        frame = AudioFrame.from_ndarray(stereo, format="s16", layout="stereo")
        frame.sample_rate = 48_000
        pieces.append(heard(frame))
    assert [len(p) for p in pieces] == [640] * len(pieces)
    got = np.frombuffer(b"".join(pieces), dtype="<i2").astype(np.float32) / 32768
    whole = Resampler(48_000, 16_000).process(wave.astype(np.float32) / 32768)
    assert np.abs(got - whole).max() <= 2 / 32768
    # Frame by frame, each frame's edges would be heard as clicks.
    floats = wave.astype(np.float32) / 32768
    one_by_one = np.concatenate([resample(floats[i : i + 960], 48_000, 16_000) for i in range(0, len(wave), 960)])
    assert np.abs(one_by_one - whole).max() > 0.01
    # A 300 Hz tone is heard as one, at 16 kHz.
    spectrum = np.abs(np.fft.rfft(got[1600:]))
    assert abs(np.argmax(spectrum) * 16_000 / len(got[1600:]) - 300) < 5
    # G.711's rate, mono: 20 ms heard as 20 ms.
    mono = AudioFrame.from_ndarray(wave[:160].reshape(1, -1), format="s16", layout="mono")
    mono.sample_rate = 8_000
    assert len(heard(mono)) == 640

"""Minimal OpenAI-Realtime-SIP-like UAS on aiosipua + aiortp (asyncio, UDP+TCP)."""
import asyncio, logging, sys, wave, math, struct
from aiosipua import SipUAS, CallSession
from aiosipua.uac import SipUAC
from aiosipua.transport import UdpSipTransport, TcpSipTransport

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
log = logging.getLogger("uas")
PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 5080
HANGUP_AFTER = float(sys.argv[2]) if len(sys.argv) > 2 else 0  # 0: wait for caller BYE
REFER_TO = sys.argv[3] if len(sys.argv) > 3 else None
next_rtp = [40000]
stats = {}

def make_uas(transport):
    uas = SipUAS(transport, user_agent="sipres-uas", uac=SipUAC(transport))

    def on_invite(call):
        log.info("INVITE %s from %s offer=%s", call.call_id, call.caller, call.sdp_offer is not None)
        call.ringing()                      # 180 Ringing (the webhook would be posted here)
        asyncio.get_running_loop().create_task(accept_later(call))

    async def accept_later(call):
        await asyncio.sleep(0.5)            # stands in for POST /v1/realtime/calls/{id}/accept
        port = next_rtp[0]; next_rtp[0] += 2
        sess = CallSession("127.0.0.1", port, call.sdp_offer, supported_codecs=[0, 8])
        st = stats[call.call_id] = {"rx_bytes": 0, "dtmf": [], "sess": sess, "pt": sess.chosen_payload_type}
        sess.on_audio = lambda pcm, ts: st.__setitem__("rx_bytes", st["rx_bytes"] + len(pcm))
        sess.on_dtmf = lambda d, dur: (st["dtmf"].append(d), log.info("DTMF %s %sms", d, dur))
        await sess.start()
        call.accept(sess.sdp_answer)        # 200 OK + SDP (retransmitted until ACK on UDP)
        log.info("accepted %s pt=%s rtp=%d", call.call_id, sess.chosen_payload_type, port)
        # send 1 s of 440 Hz tone back as PCM16 (session encodes to the chosen G.711 law)
        ts = 0
        for i in range(50):
            pcm = b"".join(struct.pack("<h", int(8000*math.sin(2*math.pi*440*(ts+n)/8000))) for n in range(160))
            sess.send_audio_pcm(pcm, ts); ts += 160
            await asyncio.sleep(0.02)
        if REFER_TO:                        # blind transfer: REFER in the dialog
            uas.uac.send_refer(call.dialog, REFER_TO, call.source_addr)
            log.info("REFER sent -> %s", REFER_TO)
        if HANGUP_AFTER:
            await asyncio.sleep(HANGUP_AFTER)
            log.info("UAS sends BYE: %s", call.hangup() is not None)
            await finish(call.call_id)

    async def finish(cid):
        st = stats.get(cid)
        if st and st.get("sess"):
            s = st.pop("sess"); await s.close()
            log.info("call %s done: rx_pcm_bytes=%d dtmf=%s", cid, st["rx_bytes"], "".join(st["dtmf"]))

    def on_bye(call, req):
        log.info("BYE received for %s", call.call_id)
        asyncio.get_running_loop().create_task(finish(call.call_id))

    uas.on_transfer_progress = lambda cid, code, reason: log.info("transfer NOTIFY %s %s %s", cid, code, reason)
    uas.on_invite = on_invite
    uas.on_bye = on_bye
    uas.on_refer = lambda call, to: log.info("REFER %s -> %s", call.call_id, to)
    return uas

async def main():
    uases = [make_uas(UdpSipTransport(local_addr=("127.0.0.1", PORT))),
             make_uas(TcpSipTransport(local_addr=("127.0.0.1", PORT)))]
    for u in uases:
        await u.start()
    log.info("listening udp+tcp 127.0.0.1:%d", PORT)
    await asyncio.Event().wait()

asyncio.run(main())

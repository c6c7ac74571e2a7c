"""The server: one ``websockets`` asyncio server, the pool, and HTTP on the same port.

- :mod:`~s2s_rt.server.lifecycle`: :class:`Server`, which keeps only the lifecycle (start, serve, drain, stop).
- :mod:`~s2s_rt.server.teardown`: the end of a shutdown: sessions closed within a bound, the rest cut.
- :mod:`~s2s_rt.server.stack`: loading the engines the config names.
- :mod:`~s2s_rt.server.pool`: the slots, and :meth:`~s2s_rt.server.pool.Pool.claim`.
- :mod:`~s2s_rt.server.handshake`: session paths, API keys, subprotocols, client addresses.
- :mod:`~s2s_rt.server.http`: health, readiness, the pool, metrics, drain, the browser page, and the POST routes.
- :mod:`~s2s_rt.server.posts`: requests with bodies (POST, OPTIONS) on the session port, read by h11.
- :mod:`~s2s_rt.server.secrets`: client secrets (``ek_…``), minted and checked.
- :mod:`~s2s_rt.server.connection`: one connection's life, its rate limits and deadlines.
- :mod:`~s2s_rt.server.direct`: the socket's direct route for audio appends, and its paced parsing.
- :mod:`~s2s_rt.server.calls`: WebRTC calls, from the offer to the hangup, admitted as WebSockets are.
- :mod:`~s2s_rt.server.webrtc`: one call through aiortc: its events channel, its peer connection, its lifecycle.
- :mod:`~s2s_rt.server.webrtc_audio`: a call's audio both ways: the answers' Opus track, silent between them,
  and the caller's packets decoded on the loop.
- :mod:`~s2s_rt.server.webrtc_rtp`: a call's audio packets from the datagram to the hearing, without aiortc's
  path for each.
- :mod:`~s2s_rt.server.call_sockets`: the calls' UDP sockets: bound within ``media_ports``, read together on a
  clock once each call is set up.
- :mod:`~s2s_rt.server.playout`: what a call plays, frame by frame, and what of it was heard (WebRTC and SIP).
- :mod:`~s2s_rt.server.sip`: phone calls over SIP, from the INVITE to the BYE, admitted as WebSockets are.
- :mod:`~s2s_rt.server.phone`: one phone call: its SIP dialog, its G.711 RTP both ways.
- :mod:`~s2s_rt.server.internals`: what the server uses of websockets, aiortc, aioice and aiosipua past their APIs.
- :mod:`~s2s_rt.server.state`: what the connections and routes may ask of the server.
"""

from s2s_rt.server.lifecycle import Server

__all__ = ["Server"]

// s2s-rt talk page: microphone → OpenAI Realtime API (GA events) → speaker.
//
// Two transports carry the same JSON events (see the transports section):
//
// - WebRTC (the default), as OpenAI's Realtime API does it: the microphone
//   goes on a media track, with the browser's echo cancellation, and the
//   answer comes back on the remote track, played by an <audio> element. The
//   events travel on the "oai-events" data channel. The server plays the
//   answer itself, so it knows what was heard: on a barge-in it clears its
//   output buffer and truncates the item (output_audio_buffer.cleared,
//   conversation.item.truncated); the page sends no truncate.
// - WebSocket: the microphone runs through an AudioWorklet
//   (capture-worklet.js) that resamples it to 24 kHz PCM16; chunks go out as
//   input_audio_buffer.append. Answer audio arrives as
//   response.output_audio.delta and is queued in a second worklet
//   (player-worklet.js), which counts what it has really played: a barge-in
//   stops playback at once and truncates the assistant item to that count.
//
// Push to talk commits by hand (turn_detection null); hands-free lets the
// server's VAD cut turns. When the server gives the page a short-lived
// client secret (POST /page/client_secret) the page uses it; otherwise it
// uses what the user pasted in the client secret field. No long-lived key
// is kept by the page.
//
// For tests and curious people, window.s2s holds the page's state.

const RATE = 24000; // wire rate, both directions
const MIN_COMMIT_SAMPLES = Math.ceil(0.12 * RATE); // the server wants at least 100 ms
const SOUND_LEVEL = 0.005; // RMS above which the answer's track is not silent
const ICE_GATHERING_MS = 3000; // the offer waits this long at most for its candidates
const CALL_OPEN_MS = 15000; // a call whose data channel is not open by then has failed

const $ = (id) => document.getElementById(id);

const s2s = {
  state: "idle", // idle | connecting | ready | closed | full | refused | error
  mode: "talk", // talk | handsfree
  transport: "webrtc", // webrtc | websocket
  credential: null, // what opened the session: page-secret | pasted | none
  activity: "", // listening | recording | hearing | thinking | speaking
  sessionId: null,
  callId: null, // WebRTC: the call's id (rtc_…)
  playing: null, // WebRTC: the response whose audio the server is playing on the answer's track
  playedSamples: 0, // assistant audio played, in 24 kHz samples
  heardSamples: 0, // WebRTC: samples of the answer's track that were not silent
  sentSamples: 0, // microphone audio sent, in 24 kHz samples
  micLevel: 0, // RMS of the latest 20 ms of microphone audio
  answerLevel: 0, // WebRTC: RMS of the latest 20 ms of the answer's track
  turns: [], // [{userItemId, assistantItemId, latencyMs}]
  userTranscripts: [],
  assistantTranscripts: [],
  bargeIns: [], // [{itemId, audioEndMs}] truncations this page sent (WebSocket)
  cleared: [], // [{responseId, itemId}] answers the server cut off (WebRTC)
  truncated: [], // [{itemId, audioEndMs}] truncations the server confirmed
  gaps: 0, // playback ran dry while an answer was still streaming
  lastError: null, // {code, message}
  events: {}, // server event counts by type
};
window.s2s = s2s;

let conn = null; // the running connection: see start()
// --- page state -------------------------------------------------------------

function setState(state, text) {
  s2s.state = state;
  const el = $("status");
  el.dataset.state = state;
  if (text !== undefined) el.textContent = text;
  const running = state === "connecting" || state === "ready";
  $("start").textContent = running ? "Stop" : "Start";
  $("start").classList.toggle("stop", running);
  $("talk").hidden = s2s.mode === "handsfree";
  $("talk").disabled = state !== "ready";
  $("apiKey").disabled = running;
  for (const radio of document.querySelectorAll('input[name="transport"]')) {
    radio.disabled = running || (radio.value === "webrtc" && !window.RTCPeerConnection);
  }
  if (!running) setLevel(0);
  renderActivity();
}

function setActivity(activity) {
  s2s.activity = activity;
  renderActivity();
}

function renderActivity() {
  if (s2s.state !== "ready") return;
  const handsFree = s2s.mode === "handsfree";
  const text = {
    listening: handsFree ? "Listening — just talk" : "Ready — hold the button (or space) to talk",
    recording: "Recording… release to send",
    hearing: "Hearing you…",
    thinking: "Thinking…",
    speaking: handsFree ? "Speaking — talk to interrupt" : "Speaking — hold the button to interrupt",
  }[s2s.activity || "listening"];
  $("status").textContent = text;
  const talk = $("talk");
  talk.classList.toggle("active", s2s.activity === "recording");
  talk.textContent = s2s.activity === "recording" ? "Release to send" : "Hold to talk";
}

function showError(code, message) {
  s2s.lastError = { code, message };
  const el = $("error");
  el.textContent = message;
  el.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function setLevel(level) {
  $("level").style.width = `${Math.min(100, Math.round(level * 400))}%`;
}

// --- transcript ---------------------------------------------------------------

const bubbles = new Map(); // item id -> <li>

function bubble(itemId, role) {
  let li = bubbles.get(itemId);
  if (li) return li;
  li = document.createElement("li");
  li.className = `${role} pending`;
  li.dataset.item = itemId;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Assistant";
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = "…";
  const meta = document.createElement("span");
  meta.className = "meta";
  li.append(who, text, meta);
  $("transcript").append(li);
  bubbles.set(itemId, li);
  scrollTranscript();
  return li;
}

function scrollTranscript() {
  const list = $("transcript");
  list.scrollTop = list.scrollHeight;
}

function setText(itemId, role, text, { append = false, final = false } = {}) {
  const li = bubble(itemId, role);
  const el = li.querySelector(".text");
  el.textContent = append && !li.classList.contains("pending") ? el.textContent + text : text;
  li.classList.remove("pending");
  if (final) li.dataset.final = "1";
  scrollTranscript();
}

// After a barge-in: what the user heard of the answer, and the rest struck through.
function showHeard(itemId, heard) {
  const el = bubble(itemId, "assistant").querySelector(".text");
  const said = el.textContent;
  const rest = said.startsWith(heard) ? said.slice(heard.length) : "";
  const unheard = document.createElement("span");
  unheard.className = "unheard";
  unheard.textContent = rest;
  el.replaceChildren(heard, unheard);
}

function setMeta(itemId, role, text) {
  bubble(itemId, role).querySelector(".meta").textContent = text;
}

function renderLatency() {
  const ms = s2s.turns.map((t) => t.latencyMs).sort((a, b) => a - b);
  if (!ms.length) return;
  const last = s2s.turns[s2s.turns.length - 1].latencyMs;
  const median = ms[Math.floor((ms.length - 1) / 2)];
  $("latency").textContent =
    `latency: last ${last} ms · median ${median} ms · ${ms.length} turn${ms.length === 1 ? "" : "s"}`;
}

// --- audio helpers -------------------------------------------------------------

// PCM16 little-endian on the wire; every platform browsers run on is little-endian.
function int16ToBase64(pcm) {
  const bytes = new Uint8Array(pcm.buffer, pcm.byteOffset, pcm.byteLength);
  let bin = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(bin);
}

function base64ToInt16(b64) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length & ~1);
  for (let i = 0; i < bytes.length; i++) bytes[i] = bin.charCodeAt(i);
  return new Int16Array(bytes.buffer);
}

function realtimeUrl() {
  const override = new URLSearchParams(location.search).get("ws");
  if (override) return override;
  const url = new URL("v1/realtime", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  return url.href;
}

function callsUrl() {
  return new URL("v1/realtime/calls", location.href).href;
}

function parseEvent(data) {
  try {
    return JSON.parse(data);
  } catch {
    return null;
  }
}

// --- transports -------------------------------------------------------------------
//
// A transport carries a session's JSON events, both ways, and its audio in its own way:
//
//   connect()            resolves once events can flow; rejects with a Refusal
//   send(event)          one client event
//   close()              the user is done: nothing more is sent or received
//   onEvent(event)       each server event
//   onClose({code, reason})  the session ended on the server's side, or the network's
//   sendAudio(pcm)       the microphone's latest 24 kHz PCM16, when it is to be heard
//   setMicrophone(open)  whether the server hears the microphone now
//   serverPlays          the server plays the answer, and truncates it at what was heard, itself
//   audioLagMs           how much later than the events the microphone's audio reaches the server
//   clocksTrack          the server's input audio clock (audio_start_ms, audio_end_ms) counts every
//                        frame of the microphone's track from connect() on (a muted track sends
//                        silence), not only what sendAudio sent

// Why a session did not start: the page's state, an error code and the message shown.
class Refusal extends Error {
  constructor(state, code, message) {
    super(message);
    this.state = state;
    this.code = code;
  }
}

const serverFull = () =>
  new Refusal(
    "full",
    "session_limit_reached",
    "The server is full: all its sessions are in use. Try again in a moment.",
  );
const unreachable = () => new Refusal("refused", "unreachable", "Cannot reach the server. Is it running?");
const keyRefused = () => new Refusal("refused", "connection_refused", "Connection refused: check the API key.");
const unavailable = () =>
  new Refusal(
    "refused",
    "unavailable",
    "The server is not taking new sessions right now (full or draining). Try again later.",
  );

// The events as JSON text frames; the microphone as input_audio_buffer.append, the answer
// as response.output_audio.delta (played by the page's player worklet).
class WebSocketTransport {
  constructor(token) {
    this.token = token;
    this.ws = null;
    this.serverPlays = false;
    this.audioLagMs = 0; // the appends travel in order with the other events
    this.clocksTrack = false; // the server's clock counts the appends
    this.onEvent = () => {};
    this.onClose = () => {};
  }

  connect() {
    const protocols = ["realtime"];
    if (this.token) protocols.push(`openai-insecure-api-key.${this.token}`);
    try {
      this.ws = new WebSocket(realtimeUrl(), protocols);
    } catch (err) {
      return Promise.reject(
        new Refusal("error", "invalid_api_key", `This API key cannot be sent from a browser: ${err.message}`),
      );
    }
    const ws = this.ws;
    ws.onmessage = (e) => {
      const ev = parseEvent(e.data);
      if (ev) this.onEvent(ev);
    };
    return new Promise((resolve, reject) => {
      ws.onopen = () => {
        ws.onclose = (e) => this.onClose({ code: e.code, reason: e.reason });
        resolve();
      };
      ws.onclose = async (e) => {
        if (e.code === 1013) {
          reject(serverFull());
          return;
        }
        // A browser sees an HTTP 401 or 403 at the handshake only as a failed socket;
        // /readyz tells a full or draining server apart from a refused key.
        reject(await explainRefusal());
      };
    });
  }

  send(event) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(event));
  }

  sendAudio(pcm) {
    this.send({ type: "input_audio_buffer.append", audio: int16ToBase64(pcm) });
  }

  setMicrophone() {} // the page sends only what is to be heard

  close() {
    const ws = this.ws;
    if (!ws) return;
    ws.onopen = ws.onmessage = ws.onclose = null;
    if (ws.readyState <= WebSocket.OPEN) ws.close(1000, "bye");
  }
}

async function explainRefusal() {
  // /readyz of the page's own server; another server (?ws=) cannot be asked across origins.
  if (new URLSearchParams(location.search).get("ws")) return keyRefused();
  try {
    const r = await fetch("readyz", { cache: "no-store" });
    return r.status === 503 ? unavailable() : keyRefused();
  } catch {
    return unreachable();
  }
}

// A call, as OpenAI's Realtime API takes one: the microphone on a media track (with the
// browser's echo cancellation), the answer on the remote track (played by `audio`, an
// <audio> element), the events on the "oai-events" data channel. The offer goes to
// POST /v1/realtime/calls with its ICE candidates in it: the server takes no trickled ones.
class WebRtcTransport {
  constructor(token, microphone, audio) {
    this.token = token;
    // A track of its own, so that muting it (push to talk) leaves the page's level meter alone. It starts
    // muted: media may flow before the data channel opens, and only then does the page know the mode
    // (push to talk must send nothing before the button is held).
    this.track = microphone.clone();
    this.track.enabled = false;
    this.audio = audio;
    this.pc = null;
    this.channel = null;
    this.id = null; // the call's id (rtc_…), from the answer's Location
    this.serverPlays = true;
    // The server hears the track some 50-100 ms after it was captured (the codec's 20 ms frames,
    // the network, its jitter buffer), while an event arrives at once: a commit waits for the last
    // words to have arrived.
    this.audioLagMs = 150;
    // The server hears the track from the moment the data channel opens (connect() resolves) and counts
    // its frames; what it hears first was captured those 50-100 ms before.
    this.clocksTrack = true;
    this.onEvent = () => {};
    this.onClose = () => {};
    this.onTrack = () => {}; // the answer's stream, once it arrives
  }

  async connect() {
    const pc = new RTCPeerConnection();
    this.pc = pc;
    pc.addTrack(this.track, new MediaStream([this.track]));
    pc.ontrack = (e) => {
      const remote = e.streams[0] || new MediaStream([e.track]);
      this.audio.srcObject = remote;
      this.audio.play().catch(() => {}); // autoplay: the Start click allows it
      this.onTrack(remote);
    };
    const channel = pc.createDataChannel("oai-events");
    this.channel = channel;
    channel.onmessage = (e) => {
      const ev = parseEvent(e.data);
      if (ev) this.onEvent(ev);
    };
    await pc.setLocalDescription(await pc.createOffer());
    await iceGathered(pc, ICE_GATHERING_MS);
    let r;
    try {
      r = await fetch(callsUrl(), {
        method: "POST",
        body: pc.localDescription.sdp,
        headers: this.headers({ "Content-Type": "application/sdp" }),
        cache: "no-store",
      });
    } catch {
      throw unreachable();
    }
    if (r.status !== 201) throw await callRefusal(r);
    const where = r.headers.get("Location") || "";
    this.id = where.slice(where.lastIndexOf("/") + 1) || null;
    await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
    await channelOpen(pc, channel, CALL_OPEN_MS);
    channel.onclose = () => this.onClose({ code: 1000, reason: "the call ended" });
    pc.onconnectionstatechange = () => {
      if (pc.connectionState === "failed") this.onClose({ code: null, reason: "the call's connection failed" });
    };
  }

  headers(extra = {}) {
    return this.token ? { ...extra, Authorization: `Bearer ${this.token}` } : extra;
  }

  send(event) {
    if (this.channel && this.channel.readyState === "open") this.channel.send(JSON.stringify(event));
  }

  sendAudio() {} // the media track carries it

  setMicrophone(open) {
    this.track.enabled = open; // a muted track sends silence
  }

  // Closing the data channel and the peer connection ends the call on the server.
  close() {
    const { pc, channel } = this;
    this.onEvent = this.onClose = this.onTrack = () => {};
    if (channel) channel.onclose = channel.onmessage = null;
    if (pc) {
      pc.ontrack = pc.onconnectionstatechange = null;
      if (channel) channel.close();
      pc.close();
    }
    this.track.stop();
    this.audio.srcObject = null;
  }
}

// Until the offer holds its candidates (gathering complete), or `ms` at most.
function iceGathered(pc, ms) {
  return new Promise((resolve) => {
    if (pc.iceGatheringState === "complete") {
      resolve();
      return;
    }
    const done = () => {
      clearTimeout(timer);
      pc.removeEventListener("icegatheringstatechange", check);
      resolve();
    };
    const check = () => pc.iceGatheringState === "complete" && done();
    const timer = setTimeout(done, ms);
    pc.addEventListener("icegatheringstatechange", check);
  });
}

function channelOpen(pc, channel, ms) {
  return new Promise((resolve, reject) => {
    const fail = (why) => {
      clearTimeout(timer);
      reject(
        new Refusal(
          "error",
          "call_failed",
          `The WebRTC call did not connect (${why}): a firewall may block it. Try the WebSocket transport.`,
        ),
      );
    };
    const timer = setTimeout(() => fail(`not within ${ms / 1000} s`), ms);
    channel.onopen = () => {
      clearTimeout(timer);
      resolve();
    };
    channel.onclose = () => fail("the server closed it");
    pc.onconnectionstatechange = () => pc.connectionState === "failed" && fail("no network path to the server");
  });
}

// An answer other than 201 to the offer: {"error": {code, message}}, or plain text.
async function callRefusal(r) {
  const text = await r.text().catch(() => "");
  const err = (parseEvent(text) || {}).error || {};
  if (err.code === "session_limit_reached") return serverFull();
  if (r.status === 401) return keyRefused();
  if (r.status === 503) return unavailable();
  const message = err.message || text.trim() || r.statusText;
  return new Refusal("refused", err.code || `http_${r.status}`, `The server refused the call: ${message}`);
}

// --- credentials --------------------------------------------------------------------

// What opens the session: a short-lived client secret the page's server gives it (when its
// operator allows that: --page-secrets), else what the user pasted (a client secret ek_…,
// minted by their backend), else nothing (a server without keys). The page keeps none of them.
async function credential() {
  const pasted = $("apiKey").value.trim();
  // Another server (?ws=) has its own secrets.
  if (!new URLSearchParams(location.search).get("ws")) {
    let r;
    try {
      r = await fetch("page/client_secret", { method: "POST", cache: "no-store" });
    } catch {
      throw unreachable();
    }
    if (r.ok) {
      const secret = await r.json();
      s2s.credential = "page-secret";
      return secret.value;
    }
    if (r.status !== 404) {
      const err = (parseEvent(await r.text()) || {}).error || {};
      const message = `No client secret for this page: ${err.message || r.statusText}`;
      throw new Refusal("refused", err.code || `http_${r.status}`, message);
    }
  }
  s2s.credential = pasted ? "pasted" : "none";
  return pasted;
}

// --- connection ------------------------------------------------------------------

async function start() {
  clearError();
  s2s.lastError = null;
  if (!window.isSecureContext || !navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    setState("error", "No microphone");
    showError("microphone_unavailable", "The microphone needs a secure page: open it over https or on localhost.");
    return;
  }
  const c = {
    transport: null,
    ctx: null,
    stream: null,
    capture: null,
    player: null,
    answerTap: null, // WebRTC: measures the answer's track
    talking: false,
    talkSamples: 0,
    commitPending: false,
    commitTimer: null,
    response: null, // the response in progress: {id, itemId, firstAudio}
    items: new Map(), // response id -> its assistant item id
    playingSince: null, // WebRTC: since when (performance.now()) s2s.playing has played
    lastAssistantItem: null,
    lastUserItem: null,
    turnEndAt: null, // performance.now() at the end of the user's speech
    heard: new InputClock(), // the server's input audio clock, on the page's
    clockRunning: false, // whether the server's clock counts every microphone frame now (a call's track)
    silenceMs: 0, // server_vad: the silence that ends a turn (speech_stopped's audio_end_ms includes it)
    interrupted: new Set(), // assistant items whose late audio is dropped
    pendingClears: new Map(), // item id -> was its response still streaming
    cancelled: new Set(), // responses cancelled (by the page, or by the server on a barge-in)
  };
  conn = c;
  setState("connecting", "Starting the microphone…");
  try {
    c.ctx = new AudioContext({ latencyHint: "interactive" });
    await c.ctx.audioWorklet.addModule("static/capture-worklet.js");
    await c.ctx.audioWorklet.addModule("static/player-worklet.js");
    c.stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
  } catch (err) {
    if (conn !== c) return;
    conn = null; // Start tries again
    teardown(c);
    setState("error", "No microphone");
    showError("microphone_unavailable", `Microphone not available: ${err.message || err}`);
    return;
  }
  if (conn !== c) {
    teardown(c);
    return;
  }
  // The capture node's output is silence; connecting it keeps it pulled by the graph.
  c.capture = new AudioWorkletNode(c.ctx, "s2s-capture", { processorOptions: { chunkSamples: RATE / 50 } });
  c.capture.port.onmessage = (e) => onMicrophone(c, e.data);
  c.ctx.createMediaStreamSource(c.stream).connect(c.capture);
  c.capture.connect(c.ctx.destination);
  if (c.ctx.state !== "running") await c.ctx.resume();

  setState("connecting", "Connecting…");
  try {
    const token = await credential();
    if (conn !== c) return;
    c.transport =
      s2s.transport === "webrtc"
        ? new WebRtcTransport(token, c.stream.getAudioTracks()[0], $("answer"))
        : new WebSocketTransport(token);
    c.transport.onEvent = (ev) => {
      s2s.events[ev.type] = (s2s.events[ev.type] || 0) + 1;
      onEvent(c, ev);
    };
    c.transport.onClose = (why) => onClose(c, why);
    c.transport.onTrack = (stream) => tapAnswer(c, stream);
    if (!c.transport.serverPlays) {
      c.player = new AudioWorkletNode(c.ctx, "s2s-player", { numberOfInputs: 0, outputChannelCount: [2] });
      c.player.port.onmessage = (e) => onPlayer(c, e.data);
      c.player.connect(c.ctx.destination);
    }
    await c.transport.connect();
  } catch (err) {
    if (conn !== c) return; // stopped (or started again) meanwhile
    conn = null;
    teardown(c);
    const refusal =
      err instanceof Refusal ? err : new Refusal("error", "connection_failed", `Cannot connect: ${err.message || err}`);
    setState(refusal.state, refusal.state === "full" ? "Server full" : "Not connected");
    showError(refusal.code, refusal.message);
    return;
  }
  if (conn !== c) return;
  c.clockRunning = c.transport.clocksTrack;
  s2s.callId = c.transport.id || null;
  c.transport.setMicrophone(micOpen(c));
  send(c, { type: "session.update", session: sessionConfig() });
}

function stop() {
  const c = conn;
  if (!c) return;
  teardown(c);
  conn = null;
  setState("closed", "Not connected");
}

function teardown(c) {
  clearTimeout(c.commitTimer);
  if (!conn || conn === c) s2s.playing = null;
  if (c.transport) c.transport.close();
  if (c.stream) c.stream.getTracks().forEach((t) => t.stop());
  if (c.ctx && c.ctx.state !== "closed") c.ctx.close();
}

function onClose(c, why) {
  if (conn !== c) return;
  conn = null;
  teardown(c);
  if (s2s.state === "full") return; // already explained by the error event
  if (why.code === 1013) {
    const full = serverFull();
    setState("full", "Server full");
    showError(full.code, full.message);
    return;
  }
  setState("closed", "Disconnected");
  if (why.code !== 1000 && why.code !== 1005) {
    const what = why.code === null ? why.reason : `code ${why.code}${why.reason ? `: ${why.reason}` : ""}`;
    showError("disconnected", `The connection closed (${what}).`);
  }
}

function send(c, event) {
  if (c.transport) c.transport.send(event);
}

function sessionConfig() {
  const handsFree = s2s.mode === "handsfree";
  return {
    type: "realtime",
    output_modalities: ["audio"],
    audio: {
      input: {
        format: { type: "audio/pcm", rate: RATE },
        transcription: { model: "whisper-1" },
        turn_detection: handsFree
          ? { type: "server_vad", create_response: true, interrupt_response: true }
          : null,
      },
      output: { format: { type: "audio/pcm", rate: RATE } },
    },
  };
}

// --- microphone --------------------------------------------------------------------

// Whether the server is to hear the microphone: always hands-free, while the button is held otherwise.
function micOpen(c) {
  return s2s.mode === "handsfree" || c.talking;
}

function onMicrophone(c, { pcm, level }) {
  if (conn !== c) return;
  const at = performance.now();
  s2s.micLevel = level;
  setLevel(level);
  const samples = new Int16Array(pcm);
  const sent = s2s.state === "ready" && micOpen(c);
  if (sent || c.clockRunning) c.heard.add(samples.length, at);
  if (!sent) return;
  c.transport.sendAudio(samples);
  s2s.sentSamples += samples.length;
  if (c.talking) c.talkSamples += samples.length;
}

// The server's input audio clock (audio_start_ms, audio_end_ms: milliseconds of the session's input
// audio it has heard) on the page's own: for each chunk of microphone audio the server counts, where
// that clock stood after it and when the page captured it.
class InputClock {
  constructor() {
    this.samples = 0;
    this.marks = []; // [{end, at}]: the clock in samples after a chunk, and performance.now() then
  }

  add(samples, at) {
    this.samples += samples;
    this.marks.push({ end: this.samples, at });
    if (this.marks.length > 3000) this.marks.splice(0, 1500); // the last 30-60 s are enough
  }

  // When the page captured the audio at `ms` on the server's clock (null before any audio).
  at(ms) {
    const marks = this.marks;
    if (!marks.length) return null;
    const sample = (ms * RATE) / 1000;
    let i = marks.length - 1;
    while (i > 0 && marks[i - 1].end >= sample) i--;
    return marks[i].at - ((marks[i].end - sample) * 1000) / RATE;
  }
}

function talkPressed() {
  const c = conn;
  if (!c || s2s.state !== "ready" || s2s.mode !== "talk" || c.talking) return;
  interrupt(c);
  if (c.response) {
    c.cancelled.add(c.response.id);
    send(c, { type: "response.cancel" });
  }
  send(c, { type: "input_audio_buffer.clear" });
  clearTimeout(c.commitTimer); // a new turn replaces one still waiting for its answer
  c.commitPending = false;
  c.talking = true;
  c.talkSamples = 0;
  c.transport.setMicrophone(true);
  setActivity("recording");
}

function talkReleased() {
  const c = conn;
  if (!c || !c.talking) return;
  c.talking = false;
  c.transport.setMicrophone(micOpen(c));
  if (c.talkSamples < MIN_COMMIT_SAMPLES) {
    send(c, { type: "input_audio_buffer.clear" });
    setActivity("listening");
    showError("too_short", "Hold the button while you speak.");
    return;
  }
  clearError();
  c.turnEndAt = performance.now();
  setActivity("thinking");
  const commit = () => {
    c.commitTimer = null;
    if (conn !== c) return;
    send(c, { type: "input_audio_buffer.commit" });
    c.commitPending = true;
  };
  // The last words must have reached the server before the commit does.
  if (c.transport.audioLagMs > 0) c.commitTimer = setTimeout(commit, c.transport.audioLagMs);
  else commit();
}

function setMode(mode) {
  s2s.mode = mode;
  localStorage.setItem("s2s-rt.mode", mode);
  const c = conn;
  if (c) {
    c.talking = false;
    clearTimeout(c.commitTimer);
    if (c.transport) c.transport.setMicrophone(micOpen(c));
    if (s2s.state === "ready") {
      send(c, { type: "input_audio_buffer.clear" });
      send(c, { type: "session.update", session: sessionConfig() });
    }
  }
  setState(s2s.state);
}

function setTransport(transport) {
  s2s.transport = transport === "websocket" || !window.RTCPeerConnection ? "websocket" : "webrtc";
  $(s2s.transport === "webrtc" ? "transportWebRTC" : "transportWebSocket").checked = true;
  $("endpointKind").textContent = s2s.transport === "webrtc" ? "WebRTC" : "WebSocket";
  $("endpoint").textContent = s2s.transport === "webrtc" ? `POST ${callsUrl()}` : realtimeUrl();
}

// --- playback and barge-in ------------------------------------------------------------

// The first sound of an answer after the end of the user's speech: the turn's latency, as the user waits.
function firstAudio(c, itemId, at = performance.now()) {
  if (c.turnEndAt === null) return;
  const latencyMs = Math.round(at - c.turnEndAt);
  c.turnEndAt = null;
  s2s.turns.push({ userItemId: c.lastUserItem, assistantItemId: itemId, latencyMs });
  if (itemId) setMeta(itemId, "assistant", `first audio ${latencyMs} ms after your last word`);
  renderLatency();
}

// Hands-free: when the user stopped speaking, on the page's clock. The server says where the turn ended
// on its input audio clock (speech_stopped's audio_end_ms), which includes the silence it waited to know
// the turn was over; the speech ended that silence earlier, and the page knows when it captured that audio.
// Over WebRTC the server's clock starts with the call's data channel, so this is later than the words
// were said by the time the track's audio takes to reach the server (some 50-100 ms).
function speechEnded(c, audioEndMs) {
  const now = performance.now();
  const at = typeof audioEndMs === "number" ? c.heard.at(audioEndMs - c.silenceMs) : null;
  return at === null ? now : Math.min(at, now);
}

// The silence after the last word that ends a turn: server_vad's silence_duration_ms (OpenAI's 500 ms
// when not said). semantic_vad's depends on the words; the page never asks for it.
function turnSilenceMs(session) {
  const input = (session && session.audio && session.audio.input) || {};
  const td = input.turn_detection;
  if (!td || td.type !== "server_vad") return 0;
  return typeof td.silence_duration_ms === "number" ? td.silence_duration_ms : 500;
}

// WebSocket: the player worklet's reports.
function onPlayer(c, m) {
  if (conn !== c) return;
  if (m.type === "progress") {
    s2s.playedSamples = m.played;
  } else if (m.type === "started") {
    setActivity("speaking");
  } else if (m.type === "drained") {
    if (c.response && c.response.itemId === m.item && !c.interrupted.has(m.item)) {
      s2s.gaps++; // the answer is still streaming but playback caught up with it
    } else if (s2s.activity === "speaking") {
      setActivity("listening");
    }
  } else if (m.type === "cleared") {
    s2s.playedSamples = m.played;
    const wasStreaming = c.pendingClears.get(m.item);
    c.pendingClears.delete(m.item);
    // Truncate only an answer that was cut: audio still queued, or still coming.
    if (m.dropped > 0 || wasStreaming) {
      const audioEndMs = Math.floor((m.itemPlayed * 1000) / RATE);
      send(c, { type: "conversation.item.truncate", item_id: m.item, content_index: 0, audio_end_ms: audioEndMs });
      s2s.bargeIns.push({ itemId: m.item, audioEndMs });
      bubble(m.item, "assistant").classList.add("interrupted");
    }
  }
}

// WebRTC: the answer's track, measured as the <audio> element plays it: how much played while
// the server said it was playing an answer, and when it first sounded after the user's turn.
function tapAnswer(c, stream) {
  if (conn !== c || c.answerTap) return;
  c.answerTap = new AudioWorkletNode(c.ctx, "s2s-capture", { processorOptions: { chunkSamples: RATE / 50 } });
  c.answerTap.port.onmessage = (e) => onAnswerAudio(c, e.data);
  c.ctx.createMediaStreamSource(stream).connect(c.answerTap);
  c.answerTap.connect(c.ctx.destination); // silence; keeps it pulled
}

function onAnswerAudio(c, { pcm, level }) {
  if (conn !== c) return;
  s2s.answerLevel = level;
  if (!s2s.playing) return;
  const samples = pcm.byteLength / 2;
  s2s.playedSamples += samples;
  if (level < SOUND_LEVEL) return;
  s2s.heardSamples += samples;
  firstAudio(c, c.items.get(s2s.playing));
}

// WebRTC: the server's output buffer has played a response's audio to the end, or cut it off.
function audioEnded(c, responseId) {
  if (s2s.playing !== responseId) return;
  // No sound measured (no track, or a silent answer): its audio began when the server said so.
  if (c.turnEndAt !== null && c.playingSince >= c.turnEndAt) firstAudio(c, c.items.get(responseId), c.playingSince);
  s2s.playing = null;
  if (s2s.activity === "speaking") setActivity("listening");
}

// Stop the assistant's voice now, if it is speaking or about to.
function interrupt(c) {
  if (c.transport.serverPlays) {
    // The server cuts it off, and truncates the item at what was heard (output_audio_buffer.cleared).
    // Only while it plays: a clear with nothing playing would truncate the last answer, heard in full.
    if (s2s.playing) send(c, { type: "output_audio_buffer.clear" });
    return;
  }
  const item = c.lastAssistantItem;
  if (!item || c.interrupted.has(item)) return;
  c.interrupted.add(item);
  const streaming = Boolean(c.response && c.response.itemId === item);
  c.pendingClears.set(item, streaming);
  c.player.port.postMessage({ type: "clear", item });
}

// --- server events ------------------------------------------------------------------

function onEvent(c, ev) {
  if (conn !== c) return;
  switch (ev.type) {
    case "session.created":
      s2s.sessionId = ev.session && ev.session.id;
      c.silenceMs = turnSilenceMs(ev.session);
      break;
    case "session.updated":
      c.silenceMs = turnSilenceMs(ev.session);
      if (s2s.state === "connecting") {
        setState("ready");
        setActivity("listening");
      }
      break;
    case "input_audio_buffer.speech_started":
      c.lastUserItem = ev.item_id;
      bubble(ev.item_id, "user");
      setActivity("hearing");
      // Barge-in: the server cancels the response; over WebRTC it also stops the sound (it plays it).
      if (!c.transport.serverPlays) interrupt(c);
      break;
    case "input_audio_buffer.speech_stopped":
      c.turnEndAt = speechEnded(c, ev.audio_end_ms);
      setActivity("thinking");
      break;
    case "input_audio_buffer.committed":
      c.lastUserItem = ev.item_id;
      bubble(ev.item_id, "user");
      if (c.commitPending) {
        // Asked for only now, so the answer follows the user's item in the conversation.
        c.commitPending = false;
        send(c, { type: "response.create" });
      }
      break;
    case "conversation.item.input_audio_transcription.delta":
      setText(ev.item_id, "user", ev.delta, { append: true });
      break;
    case "conversation.item.input_audio_transcription.completed": {
      const text = (ev.transcript || "").trim();
      setText(ev.item_id, "user", text || "(nothing recognised)", { final: true });
      s2s.userTranscripts.push(text);
      break;
    }
    case "conversation.item.input_audio_transcription.failed":
      setText(ev.item_id, "user", "(transcription failed)", { final: true });
      break;
    case "response.created":
      c.response = { id: ev.response.id, itemId: null, firstAudio: false };
      setActivity("thinking");
      break;
    case "response.output_item.added":
      if (ev.item && ev.item.type === "message") {
        if (c.response && c.response.id === ev.response_id) c.response.itemId = ev.item.id;
        c.items.set(ev.response_id, ev.item.id);
        c.lastAssistantItem = ev.item.id;
        bubble(ev.item.id, "assistant");
      }
      break;
    case "response.output_audio.delta":
    case "response.audio.delta":
      onAudio(c, ev);
      break;
    case "response.output_audio_transcript.delta":
    case "response.audio_transcript.delta":
    case "response.output_text.delta":
    case "response.text.delta":
      setText(ev.item_id, "assistant", ev.delta, { append: true });
      break;
    case "response.output_audio_transcript.done":
    case "response.audio_transcript.done":
    case "response.output_text.done":
    case "response.text.done": {
      const text = ev.transcript !== undefined ? ev.transcript : ev.text;
      if (!c.interrupted.has(ev.item_id)) setText(ev.item_id, "assistant", text, { final: true });
      s2s.assistantTranscripts.push(text);
      break;
    }
    case "response.done":
      onResponseDone(c, ev.response);
      break;
    // WebRTC: what the server's output buffer (the answer's track) is doing.
    case "output_audio_buffer.started":
      s2s.playing = ev.response_id;
      c.playingSince = performance.now();
      setActivity("speaking");
      // A cancel does not stop audio the server had already queued: an answer cancelled as it began is cut off now.
      if (c.cancelled.has(ev.response_id)) interrupt(c);
      break;
    case "output_audio_buffer.stopped":
      audioEnded(c, ev.response_id);
      break;
    case "output_audio_buffer.cleared": {
      // A barge-in: the server cut the answer off (its conversation.item.truncated follows).
      const item = c.items.get(ev.response_id) || null;
      s2s.cleared.push({ responseId: ev.response_id, itemId: item });
      if (item) {
        c.interrupted.add(item);
        bubble(item, "assistant").classList.add("interrupted");
      }
      audioEnded(c, ev.response_id);
      break;
    }
    case "conversation.item.truncated":
      s2s.truncated.push({ itemId: ev.item_id, audioEndMs: ev.audio_end_ms });
      setMeta(ev.item_id, "assistant", `interrupted after ${(ev.audio_end_ms / 1000).toFixed(1)} s`);
      // The server trimmed the item's transcript to what was heard: fetch it to show it.
      send(c, { type: "conversation.item.retrieve", item_id: ev.item_id });
      break;
    case "conversation.item.retrieved": {
      const item = ev.item || {};
      const part = (item.content || [])[0] || {};
      if (item.role === "assistant" && c.interrupted.has(item.id) && typeof part.transcript === "string") {
        showHeard(item.id, part.transcript);
      }
      break;
    }
    case "error":
      onServerError(c, ev.error || {});
      break;
    default:
      break;
  }
}

// WebSocket: a chunk of the answer's audio, to the player worklet.
function onAudio(c, ev) {
  if (c.interrupted.has(ev.item_id)) return; // late audio of an answer we cut
  const pcm = base64ToInt16(ev.delta || "");
  if (pcm.length === 0) return;
  const r = c.response;
  if (r && !r.firstAudio) {
    r.firstAudio = true;
    firstAudio(c, ev.item_id);
  }
  c.lastAssistantItem = ev.item_id;
  c.player.port.postMessage({ type: "push", item: ev.item_id, pcm: pcm.buffer }, [pcm.buffer]);
}

function onResponseDone(c, r) {
  if (c.response && c.response.id === r.id) c.response = null;
  if (r.status === "cancelled") c.cancelled.add(r.id);
  const item = r.output && r.output[0] && r.output[0].id;
  if (r.status === "cancelled" && item) {
    bubble(item, "assistant").classList.add("interrupted");
    if (!bubble(item, "assistant").querySelector(".meta").textContent) setMeta(item, "assistant", "interrupted");
  } else if (r.status === "failed") {
    const err = (r.status_details && r.status_details.error) || {};
    showError(err.code || "response_failed", `The answer failed: ${err.message || "unknown error"}`);
  }
  if (s2s.activity === "thinking" && r.status !== "completed") setActivity("listening");
}

function onServerError(c, err) {
  if (err.code === "session_limit_reached") {
    const full = serverFull();
    setState("full", "Server full");
    showError(err.code, full.message);
    return;
  }
  // A cancel that crossed the answer's end on the wire is harmless.
  if (err.code === "response_cancel_not_active") return;
  if (err.code === "input_audio_buffer_commit_empty") c.commitPending = false;
  showError(err.code || "error", `Server error: ${err.message || "unknown"}${err.code ? ` (${err.code})` : ""}`);
}

// --- wiring -------------------------------------------------------------------------

function init() {
  const params = new URLSearchParams(location.search);
  const mode = params.get("mode") || localStorage.getItem("s2s-rt.mode") || "talk";
  s2s.mode = mode === "handsfree" ? "handsfree" : "talk";
  $(s2s.mode === "handsfree" ? "modeHandsFree" : "modeTalk").checked = true;
  setTransport(params.get("transport") || localStorage.getItem("s2s-rt.transport") || "webrtc");
  // Earlier versions of this page kept the key field in localStorage: a key must not be kept.
  localStorage.removeItem("s2s-rt.apiKey");
  for (const radio of document.querySelectorAll('input[name="mode"]')) {
    radio.addEventListener("change", () => radio.checked && setMode(radio.value));
  }
  for (const radio of document.querySelectorAll('input[name="transport"]')) {
    radio.addEventListener("change", () => {
      if (!radio.checked) return;
      setTransport(radio.value);
      localStorage.setItem("s2s-rt.transport", s2s.transport);
    });
  }
  $("start").addEventListener("click", () => {
    if (conn) stop();
    else start();
  });
  const talk = $("talk");
  talk.addEventListener("pointerdown", (e) => {
    talk.setPointerCapture(e.pointerId);
    talkPressed();
  });
  talk.addEventListener("pointerup", talkReleased);
  talk.addEventListener("pointercancel", talkReleased);
  talk.addEventListener("lostpointercapture", talkReleased);
  const typing = (e) => e.target instanceof HTMLInputElement && e.target.type !== "radio";
  window.addEventListener("keydown", (e) => {
    if (e.code === "Space" && !e.repeat && !typing(e) && conn) {
      e.preventDefault();
      talkPressed();
    }
  });
  window.addEventListener("keyup", (e) => {
    if (e.code === "Space" && !typing(e) && conn) {
      e.preventDefault(); // else a focused button would be clicked by the same key
      talkReleased();
    }
  });
  window.addEventListener("blur", talkReleased);
  s2s.start = start;
  s2s.stop = stop;
  setState("idle", "Not connected");
}

init();

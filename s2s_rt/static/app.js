// s2s-rt talk page: microphone → OpenAI Realtime API (GA events) → speaker.
//
// The microphone runs through an AudioWorklet (capture-worklet.js) that
// resamples it to 24 kHz PCM16; chunks go out as input_audio_buffer.append.
// Push to talk commits by hand (turn_detection null); hands-free lets the
// server's VAD cut turns. Answer audio is queued in a second worklet
// (player-worklet.js), which counts what it has really played: a barge-in
// stops playback at once and truncates the assistant item to that count.
//
// For tests and curious people, window.s2s holds the page's state.

const RATE = 24000; // wire rate, both directions
const MIN_COMMIT_SAMPLES = Math.ceil(0.12 * RATE); // the server wants at least 100 ms

const $ = (id) => document.getElementById(id);

const s2s = {
  state: "idle", // idle | connecting | ready | closed | full | refused | error
  mode: "talk", // talk | handsfree
  activity: "", // listening | recording | hearing | thinking | speaking
  sessionId: null,
  playedSamples: 0, // assistant audio played, in 24 kHz samples
  sentSamples: 0, // microphone audio sent, in 24 kHz samples
  micLevel: 0, // RMS of the latest 20 ms of microphone audio
  turns: [], // [{userItemId, assistantItemId, latencyMs}]
  userTranscripts: [],
  assistantTranscripts: [],
  bargeIns: [], // [{itemId, audioEndMs}] truncations this page sent
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
    ws: null,
    ctx: null,
    stream: null,
    capture: null,
    player: null,
    opened: false,
    talking: false,
    talkSamples: 0,
    commitPending: false,
    response: null, // the response in progress: {id, itemId, firstAudio}
    lastAssistantItem: null,
    lastUserItem: null,
    turnEndAt: null, // performance.now() at the end of the user's turn
    interrupted: new Set(), // assistant items whose late audio is dropped
    pendingClears: new Map(), // item id -> was its response still streaming
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
    teardown(c);
    setState("error", "No microphone");
    showError("microphone_unavailable", `Microphone not available: ${err.message || err}`);
    return;
  }
  if (conn !== c) {
    teardown(c);
    return;
  }
  c.player = new AudioWorkletNode(c.ctx, "s2s-player", { numberOfInputs: 0, outputChannelCount: [2] });
  c.player.port.onmessage = (e) => onPlayer(c, e.data);
  c.player.connect(c.ctx.destination);
  // The capture node's output is silence; connecting it keeps it pulled by the graph.
  c.capture = new AudioWorkletNode(c.ctx, "s2s-capture", { processorOptions: { chunkSamples: RATE / 50 } });
  c.capture.port.onmessage = (e) => onMicrophone(c, e.data);
  c.ctx.createMediaStreamSource(c.stream).connect(c.capture);
  c.capture.connect(c.ctx.destination);
  if (c.ctx.state !== "running") await c.ctx.resume();

  const key = $("apiKey").value.trim();
  const protocols = ["realtime"];
  if (key) protocols.push(`openai-insecure-api-key.${key}`);
  setState("connecting", "Connecting…");
  try {
    c.ws = new WebSocket(realtimeUrl(), protocols);
  } catch (err) {
    teardown(c);
    setState("error", "Not connected");
    showError("invalid_api_key", `This API key cannot be sent from a browser: ${err.message}`);
    return;
  }
  c.ws.onopen = () => {
    c.opened = true;
    send(c, { type: "session.update", session: sessionConfig() });
  };
  c.ws.onmessage = (e) => {
    let ev;
    try {
      ev = JSON.parse(e.data);
    } catch {
      return;
    }
    s2s.events[ev.type] = (s2s.events[ev.type] || 0) + 1;
    onEvent(c, ev);
  };
  c.ws.onclose = (e) => onClose(c, e);
}

function stop() {
  const c = conn;
  if (!c) return;
  teardown(c);
  conn = null;
  setState("closed", "Not connected");
}

function teardown(c) {
  if (c.ws && c.ws.readyState <= WebSocket.OPEN) c.ws.close(1000, "bye");
  if (c.stream) c.stream.getTracks().forEach((t) => t.stop());
  if (c.ctx && c.ctx.state !== "closed") c.ctx.close();
}

async function onClose(c, e) {
  if (conn !== c) return;
  conn = null;
  teardown(c);
  if (s2s.state === "full") return; // already explained by the error event
  if (e.code === 1013) {
    setState("full", "Server full");
    showError("session_limit_reached", "The server is full: all its sessions are in use. Try again in a moment.");
    return;
  }
  if (!c.opened) {
    // A browser sees an HTTP 401 or 403 at the handshake only as a failed socket;
    // /readyz tells a full or draining server apart from a refused key.
    const [code, message] = await explainRefusal();
    if (conn) return; // the user started again meanwhile
    setState("refused", "Not connected");
    showError(code, message);
    return;
  }
  setState("closed", "Disconnected");
  if (e.code !== 1000 && e.code !== 1005) {
    showError("disconnected", `The connection closed (code ${e.code}${e.reason ? `: ${e.reason}` : ""}).`);
  }
}

async function explainRefusal() {
  // /readyz of the page's own server; another server (?ws=) cannot be asked across origins.
  const refused = ["connection_refused", "Connection refused: check the API key."];
  if (new URLSearchParams(location.search).get("ws")) return refused;
  try {
    const r = await fetch("readyz", { cache: "no-store" });
    if (r.status === 503) {
      return ["unavailable", "The server is not taking new sessions right now (full or draining). Try again later."];
    }
    return refused;
  } catch {
    return ["unreachable", "Cannot reach the server. Is it running?"];
  }
}

function send(c, event) {
  if (c.ws && c.ws.readyState === WebSocket.OPEN) c.ws.send(JSON.stringify(event));
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

function onMicrophone(c, { pcm, level }) {
  if (conn !== c) return;
  s2s.micLevel = level;
  setLevel(level);
  if (s2s.state !== "ready") return;
  if (s2s.mode !== "handsfree" && !c.talking) return;
  const samples = new Int16Array(pcm);
  send(c, { type: "input_audio_buffer.append", audio: int16ToBase64(samples) });
  s2s.sentSamples += samples.length;
  if (c.talking) c.talkSamples += samples.length;
}

function talkPressed() {
  const c = conn;
  if (!c || s2s.state !== "ready" || s2s.mode !== "talk" || c.talking) return;
  interrupt(c);
  if (c.response) send(c, { type: "response.cancel" });
  send(c, { type: "input_audio_buffer.clear" });
  c.commitPending = false; // a new turn replaces one still waiting for its answer
  c.talking = true;
  c.talkSamples = 0;
  setActivity("recording");
}

function talkReleased() {
  const c = conn;
  if (!c || !c.talking) return;
  c.talking = false;
  if (c.talkSamples < MIN_COMMIT_SAMPLES) {
    send(c, { type: "input_audio_buffer.clear" });
    setActivity("listening");
    showError("too_short", "Hold the button while you speak.");
    return;
  }
  clearError();
  send(c, { type: "input_audio_buffer.commit" });
  c.commitPending = true;
  c.turnEndAt = performance.now();
  setActivity("thinking");
}

function setMode(mode) {
  s2s.mode = mode;
  localStorage.setItem("s2s-rt.mode", mode);
  const c = conn;
  if (c) {
    c.talking = false;
    if (s2s.state === "ready") {
      send(c, { type: "input_audio_buffer.clear" });
      send(c, { type: "session.update", session: sessionConfig() });
    }
  }
  setState(s2s.state);
}

// --- playback and barge-in ------------------------------------------------------------

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

// Stop the assistant's voice now, if it is speaking or about to.
function interrupt(c) {
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
      break;
    case "session.updated":
      if (s2s.state === "connecting") {
        setState("ready");
        setActivity("listening");
      }
      break;
    case "input_audio_buffer.speech_started":
      c.lastUserItem = ev.item_id;
      bubble(ev.item_id, "user");
      setActivity("hearing");
      interrupt(c); // barge-in: the server cancels the response, we stop the sound
      break;
    case "input_audio_buffer.speech_stopped":
      c.turnEndAt = performance.now();
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

function onAudio(c, ev) {
  if (c.interrupted.has(ev.item_id)) return; // late audio of an answer we cut
  const pcm = base64ToInt16(ev.delta || "");
  if (pcm.length === 0) return;
  const r = c.response;
  if (r && !r.firstAudio) {
    r.firstAudio = true;
    if (c.turnEndAt !== null) {
      const latencyMs = Math.round(performance.now() - c.turnEndAt);
      c.turnEndAt = null;
      s2s.turns.push({ userItemId: c.lastUserItem, assistantItemId: ev.item_id, latencyMs });
      setMeta(ev.item_id, "assistant", `first audio after ${latencyMs} ms`);
      renderLatency();
    }
  }
  c.lastAssistantItem = ev.item_id;
  c.player.port.postMessage({ type: "push", item: ev.item_id, pcm: pcm.buffer }, [pcm.buffer]);
}

function onResponseDone(c, r) {
  if (c.response && c.response.id === r.id) c.response = null;
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
    setState("full", "Server full");
    showError(err.code, "The server is full: all its sessions are in use. Try again in a moment.");
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
  $("apiKey").value = localStorage.getItem("s2s-rt.apiKey") || "";
  $("apiKey").addEventListener("change", () => localStorage.setItem("s2s-rt.apiKey", $("apiKey").value.trim()));
  $("endpoint").textContent = realtimeUrl();
  for (const radio of document.querySelectorAll('input[name="mode"]')) {
    radio.addEventListener("change", () => radio.checked && setMode(radio.value));
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

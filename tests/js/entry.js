// The page side of tests/test_agents_realtime_browser.py: @openai/agents-realtime as a browser app uses it.
//
// Bundled by `make agents-js` (esbuild) into build/agents-realtime.js, which index.html loads. The test sets
// window.agentsConfig, clicks #start (a user gesture, so the answer may play), and reads what happened from
// window.s2s over the DevTools protocol. The transport is the SDK's WebRTC one, its baseUrl our server's
// POST /v1/realtime/calls; the microphone is Chromium's fake one.
import { hostedMcpTool } from '@openai/agents-core'; // agents-realtime's own dependency (the lock file pins it)
import { OpenAIRealtimeWebRTC, RealtimeAgent, RealtimeSession, tool } from '@openai/agents-realtime';
import { z } from 'zod';

const s2s = {
  state: 'idle', // idle, connecting, connected, failed
  error: null, // why connect() failed
  errors: [], // the session's `error` events
  transportEvents: [], // every server event the transport parsed (its `*` event)
  sent: [], // every client event the SDK sent on the data channel, as it went on the wire
  toolStarts: [], // agent_tool_start: the tool names
  toolRuns: [], // the arguments the tool's execute got
  toolEnds: [], // agent_tool_end: [name, result]
  audioStopped: 0, // audio_stopped events (the SDK's response.output_audio.done)
  agentEnds: [], // agent_end: the text of each finished response
  history: [], // the session's history (history_updated)
  mcpTools: [], // mcp_tools_changed: the names of the hosted MCP tools the SDK knows
  mcpCalls: [], // mcp_tool_call_completed: the calls, with their output
  callId: null,
};
window.s2s = s2s; // also what test_browser's Page.goto waits for on an http:// page

// What the SDK writes on the `oai-events` data channel, read where it leaves the page.
const channelSend = RTCDataChannel.prototype.send;
RTCDataChannel.prototype.send = function send(data) {
  if (this.label === 'oai-events' && typeof data === 'string') s2s.sent.push(JSON.parse(data));
  return channelSend.call(this, data);
};

const plain = (value) => {
  try {
    return JSON.parse(JSON.stringify(value));
  } catch {
    return String(value);
  }
};

function describe(error) {
  if (error instanceof Error) return `${error.name}: ${error.message}`;
  if (error && typeof error === 'object') {
    const inner = error.error ?? error;
    if (inner instanceof Error) return `${inner.name}: ${inner.message}`;
    if (inner instanceof Event) return `${inner.type} event`;
    return JSON.stringify(plain(inner));
  }
  return String(error);
}

async function start() {
  const config = window.agentsConfig;
  s2s.state = 'connecting';
  const getWeather = tool({
    name: config.toolName ?? 'get_weather',
    description: 'The weather in a city.',
    parameters: z.object({ city: z.string() }),
    execute: async ({ city }) => {
      s2s.toolRuns.push({ city });
      return config.toolResult ?? `sunny in ${city}`;
    },
  });
  // instructions: null leaves them to the SDK (an agent without any, as its users may write it).
  const instructions = config.instructions === null ? {} : { instructions: config.instructions ?? 'Answer briefly.' };
  // config.mcp: a hosted MCP server ({serverLabel, serverUrl}), which the server lists and calls itself.
  const hosted = config.mcp ? [hostedMcpTool({ ...config.mcp, requireApproval: 'never' })] : [];
  const agent = new RealtimeAgent({ name: 'Assistant', ...instructions, tools: [getWeather, ...hosted] });
  const transport = new OpenAIRealtimeWebRTC({ baseUrl: config.callsUrl });
  const session = new RealtimeSession(agent, { transport });
  window.session = session;
  session.on('transport_event', (event) => s2s.transportEvents.push(plain(event)));
  session.on('error', (error) => s2s.errors.push(describe(error)));
  session.on('agent_tool_start', (_context, _agent, t) => s2s.toolStarts.push(t.name));
  session.on('agent_tool_end', (_context, _agent, t, result) => s2s.toolEnds.push([t.name, result]));
  session.on('audio_stopped', () => {
    s2s.audioStopped += 1;
  });
  session.on('mcp_tools_changed', (tools) => {
    s2s.mcpTools = tools.map((t) => t.name);
  });
  session.on('mcp_tool_call_completed', (_context, _agent, call) => s2s.mcpCalls.push(plain(call)));
  session.on('agent_end', (_context, _agent, text) => s2s.agentEnds.push(text));
  session.on('history_updated', (history) => {
    s2s.history = plain(history);
  });
  try {
    await session.connect({ apiKey: config.apiKey });
    s2s.callId = transport.callId ?? null;
    s2s.state = 'connected';
  } catch (error) {
    s2s.error = describe(error);
    s2s.state = 'failed';
  }
}

// What the remote track has delivered so far, from the peer connection's statistics.
window.audioStats = async () => {
  const pc = window.session?.transport?.connectionState?.peerConnection;
  if (!pc) return null;
  const out = { inbound: null, outbound: null };
  (await pc.getStats()).forEach((report) => {
    if (report.kind !== 'audio') return;
    if (report.type === 'inbound-rtp') {
      out.inbound = {
        packetsReceived: report.packetsReceived,
        bytesReceived: report.bytesReceived,
        totalAudioEnergy: report.totalAudioEnergy,
        totalSamplesReceived: report.totalSamplesReceived,
      };
    } else if (report.type === 'outbound-rtp') {
      out.outbound = { packetsSent: report.packetsSent, bytesSent: report.bytesSent };
    }
  });
  return out;
};

document.getElementById('start').addEventListener('click', () => void start());

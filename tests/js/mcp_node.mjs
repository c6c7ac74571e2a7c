// @openai/agents-realtime in Node (its WebSocket transport, the `ws` package) with a hosted MCP tool, against
// the server: tests/test_mcp_tools.py runs it. Usage: node mcp_node.mjs WS_URL MCP_URL
// Prints one JSON line: the MCP tools the SDK learnt, the MCP calls it saw complete, the answers, the errors.
import { hostedMcpTool } from '@openai/agents-core'; // agents-realtime's own dependency (the lock file pins it)
import { OpenAIRealtimeWebSocket, RealtimeAgent, RealtimeSession } from '@openai/agents-realtime';

const [url, mcpUrl] = process.argv.slice(2);
const out = { tools: [], calls: [], answers: [], errors: [], sent: [] };
const agent = new RealtimeAgent({
  name: 'Assistant',
  instructions: 'Answer briefly.',
  tools: [hostedMcpTool({ serverLabel: 'weather', serverUrl: mcpUrl, requireApproval: 'never' })],
});
const transport = new OpenAIRealtimeWebSocket({ url });
const session = new RealtimeSession(agent, { transport, model: 's2s-rt', config: { outputModalities: ['text'] } });
session.on('mcp_tools_changed', (tools) => {
  out.tools = tools.map((t) => t.name);
});
session.on('mcp_tool_call_completed', (_context, _agent, call) => out.calls.push({ name: call.name, output: call.output }));
session.on('agent_end', (_context, _agent, text) => out.answers.push(text));
session.on('error', (e) => out.errors.push(String(e?.error?.error?.message ?? e?.error?.message ?? e?.error ?? e)));
transport.on('*', (event) => {
  if (event.type === 'response.create' || event.type === 'conversation.item.retrieve') out.sent.push(event.type);
});

async function until(check, seconds) {
  const deadline = Date.now() + seconds * 1000;
  while (!check()) {
    if (Date.now() > deadline) return false;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
  return true;
}

try {
  await session.connect({ apiKey: 'sk-node', url });
  if (await until(() => out.tools.includes('get_weather'), 20)) {
    session.sendMessage('please get_weather Oslo');
    await until(() => out.answers.some((a) => a.includes('Sunny')), 20);
  }
} catch (error) {
  out.errors.push(String(error));
} finally {
  console.log(JSON.stringify(out));
  session.close();
  process.exit(0);
}

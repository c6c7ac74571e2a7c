"""The LLM in the process or behind an OpenAI-compatible endpoint: the figures of BENCHMARKS.md.

    make bench-llm        # or: .venv/bin/python tests/llm_endpoint_bench.py --out bench-results

The same model both ways: Qwen2.5-Coder-0.5B as the default preset's
CTranslate2 conversion in the process, and as its GGUF behind llama.cpp's
server (``llama-cpp-python[server]``, ``make llama-server``) on loopback.

1. First token and decoding rate of a short question (greedy, 2 threads),
   three ways: CTranslate2 in the process, llama.cpp in a process of its own
   without HTTP, and llama.cpp's server through s2s-rt's endpoint client;
   then the client's own cost against a server that answers at once.
2. End of speech → first audio: ``s2s-rt bench`` (one session, 20 fresh
   conversations of one spoken question) against a server with the
   in-process LLM, then against one with ``--llm-url``.

Not a test (pytest does not collect it); it lives here beside the llama.cpp
helpers it shares with the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llama_server import LLAMA_PYTHON, LlamaServer

from s2s_rt.engines.base import ChatMessage, LLMRequest, LLMUsage
from s2s_rt.engines.llm import CT2ChatLLM
from s2s_rt.engines.remote_llm import RemoteChatLLM
from s2s_rt.models import ensure_prepared
from s2s_rt.models.recipes import source_gguf

SYSTEM = "You are a helpful voice assistant. Answer in one short sentence."
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Who wrote Pride and Prejudice?",
    "What is seven times eight?",
    "What is the square root of 144?",
    "How far away is the Moon?",
    "What colour is the sky?",
    "Which planet is the largest?",
    "What is the boiling point of water?",
    "Who painted the Mona Lisa?",
    "What is the capital of Italy?",
    "How many days are in a week?",
]
ANSWER_TOKENS = 32

#: (first piece after s, whole answer after s, pieces) of one answer.
Run = tuple[float, float, int]


def _messages(question: str) -> list[ChatMessage]:
    return [ChatMessage("system", SYSTEM), ChatMessage("user", question)]


def in_process(runs: int) -> list[Run]:
    llm = CT2ChatLLM(ensure_prepared(progress=lambda _: None).llms["default"], intra_threads=2)
    try:
        out = []
        for i in range(runs + 2):
            usage, first, started = LLMUsage(), 0.0, time.perf_counter()
            for _ in llm.stream(
                LLMRequest.of(_messages(QUESTIONS[i % len(QUESTIONS)]), max_tokens=ANSWER_TOKENS, temperature=0.0),
                should_stop=lambda: False,
                usage=usage,
            ):
                first = first or time.perf_counter() - started
            if i >= 2:  # two to warm up
                out.append((first, time.perf_counter() - started, usage.output_tokens))
        return out
    finally:
        llm.close()


_LLAMA_IN_PROCESS = """
import json, sys, time
from llama_cpp import Llama
request = json.load(sys.stdin)
llm = Llama(model_path=request["gguf"], n_ctx=4096, n_threads=2, n_threads_batch=2, verbose=False)
out = []
for i in range(request["runs"] + 2):
    messages = [{"role": "system", "content": request["system"]},
                {"role": "user", "content": request["questions"][i % len(request["questions"])]}]
    first, pieces, started = 0.0, 0, time.perf_counter()
    for chunk in llm.create_chat_completion(messages, max_tokens=request["tokens"], temperature=0, stream=True):
        if chunk["choices"][0]["delta"].get("content"):
            first = first or time.perf_counter() - started
            pieces += 1
    if i >= 2:
        out.append((first, time.perf_counter() - started, pieces))
print(json.dumps(out))
"""


def llama_in_process(gguf: Path, runs: int) -> list[Run]:
    request = {"gguf": str(gguf), "system": SYSTEM, "questions": QUESTIONS, "runs": runs, "tokens": ANSWER_TOKENS}
    done = subprocess.run(
        [str(LLAMA_PYTHON), "-c", _LLAMA_IN_PROCESS],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        check=True,
        env=os.environ | {"OMP_WAIT_POLICY": "passive"},
    )
    return [tuple(run) for run in json.loads(done.stdout.splitlines()[-1])]  # type: ignore[misc]


async def endpoint(url: str, runs: int) -> list[Run]:
    llm = RemoteChatLLM(url, "bench")
    out = []
    for i in range(runs + 2):
        first, pieces, started = 0.0, 0, time.perf_counter()
        async for _ in llm.astream(
            LLMRequest.of(_messages(QUESTIONS[i % len(QUESTIONS)]), max_tokens=ANSWER_TOKENS, temperature=0.0),
            should_stop=lambda: False,
            usage=LLMUsage(),
        ):
            first = first or time.perf_counter() - started
            pieces += 1
        if i >= 2:
            out.append((first, time.perf_counter() - started, pieces))
    await llm.aclose()
    return out


async def client_only(runs: int) -> list[Run]:
    """The endpoint client against a loopback server that sends a canned 32-piece answer at once."""
    chunks = [
        "data: "
        + json.dumps(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}],
            }
        )
        + "\n\n"
        for i in range(ANSWER_TOKENS)
    ]
    body = ("".join(chunks) + "data: [DONE]\n\n").encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next(
                    int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        return await endpoint(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", runs)


def summary(name: str, runs: list[Run]) -> str:
    firsts = sorted(run[0] * 1000 for run in runs)
    rate = statistics.median((run[2] - 1) / (run[1] - run[0]) for run in runs if run[2] > 1)
    return (
        f"{name:<56} first token p50 {statistics.median(firsts):7.1f} ms "
        f"(min {firsts[0]:.1f}, max {firsts[-1]:.1f}); {rate:6.1f} pieces/s, "
        f"{1000 / rate:6.2f} ms each (n={len(runs)})"
    )


def talk(out: Path, name: str, *extra: str) -> str:
    """One ``s2s-rt bench`` run (single-fresh); returns its report."""
    command = [sys.executable, "-m", "s2s_rt", "bench", "--spawn", "--stack", "default", "--sessions", "1"]
    command += ["--turns", "20", "--turns-per-connection", "1", "--json", str(out / f"{name}.json"), "--quiet", *extra]
    report = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    (out / f"{name}.txt").write_text(report)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--runs", type=int, default=12, help="answers per first-token measurement")
    parser.add_argument("--skip-talk", action="store_true", help="only the first-token figures")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = source_gguf("default", args.out)
    lines = [
        f"machine load before: {os.getloadavg()[0]:.2f}",
        summary("CTranslate2 in the process (int8, 2 threads)", in_process(args.runs)),
        summary("llama.cpp in a process of its own, no HTTP (Q4_K_M)", llama_in_process(gguf, args.runs)),
    ]
    with LlamaServer(gguf, args.out / "llama-server.log") as llama:
        lines.append(
            summary("llama.cpp's server over loopback (s2s-rt's client)", asyncio.run(endpoint(llama.url, args.runs)))
        )
        lines.append(summary("s2s-rt's client against an instant server", asyncio.run(client_only(args.runs))))
        print("\n".join(lines), flush=True)
        if not args.skip_talk:
            for name, extra in (
                ("llm-in-process", ()),
                ("llm-endpoint", ("--server-arg=--llm-url", f"--server-arg={llama.url}")),
            ):
                report = talk(args.out, name, *extra)
                lines += [f"--- {name}", report]
                print(f"--- {name}\n{report}", flush=True)
    (args.out / "llm-endpoint.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

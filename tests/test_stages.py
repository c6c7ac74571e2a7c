"""A stage built alone: a stage context, its queues and callbacks, the fake engines, and no server or slot.

What the stage emits is read from its outbox's queue, decoded as a client
would read the frames.
"""

from __future__ import annotations

import asyncio
import json
import types
from typing import Any

import numpy as np

from s2s_rt.engines.base import PIPELINE_RATE
from s2s_rt.engines.fake import checksum_transcript, load_fake_stack
from s2s_rt.inference import StagePool
from s2s_rt.metrics import Metrics
from s2s_rt.pipeline.context import SessionContext
from s2s_rt.pipeline.outbox import Outbox
from s2s_rt.pipeline.stage import StageContext
from s2s_rt.pipeline.transcribing import Transcriber
from s2s_rt.pipeline.work import ResponseRequest, Transcribe
from s2s_rt.protocol.config import Transcription
from s2s_rt.protocol.server_events import GA
from s2s_rt.protocol.session import Session
from s2s_rt.scope import Scope
from s2s_rt.turn import SemanticTurnEnd


def _events(outbox: Outbox) -> list[dict[str, Any]]:
    out = []
    while not outbox.queue.empty():
        item = outbox.queue.get_nowait()
        out.append(json.loads(item.data))
    return out


def test_the_transcribing_stage_alone_transcribes_a_turn_and_starts_its_response() -> None:
    async def main() -> None:
        metrics = Metrics(dict, lambda: 0)
        stack = load_fake_stack()
        pools = {"stt": StagePool("stt", 1, metrics)}
        failures: list[tuple[BaseException, str, Scope | None]] = []
        outbox = Outbox(0, metrics, 64, 1.0)
        stage = StageContext(0, stack, pools, metrics, outbox, lambda e, w, s: failures.append((e, w, s)))
        session = Session(GA)
        session.config.transcription = Transcription()  # the client asked for transcription events
        session.commit_audio("item_1")  # as the listener does when the turn ends
        ctx = SessionContext(None, session, "test", stack.vad.new_state(), SemanticTurnEnd(), lambda c: None)  # type: ignore[arg-type]
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        to_llm: asyncio.Queue[Any] = asyncio.Queue()
        stage_task = asyncio.create_task(Transcriber(stage, lambda: ctx, inbox, to_llm).run())
        try:
            audio = (0.3 * np.sin(np.arange(PIPELINE_RATE) / 7)).astype(np.float32)
            # A job whose handling raises (it is not a job at all) ends its session's share, not the stage.
            await inbox.put(types.SimpleNamespace(scope=session.scope))
            await inbox.put(Transcribe(session.scope, "item_1", audio, True, 0.0))
            request = await asyncio.wait_for(to_llm.get(), 10)
        finally:
            stage_task.cancel()
            pools["stt"].executor.shutdown(wait=False)
        assert len(failures) == 1 and failures[0][1] == "the STT stage" and failures[0][2] is session.scope
        assert isinstance(request, ResponseRequest) and request.response is session.response
        events = _events(outbox)
        done = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
        assert [(e["item_id"], e["transcript"]) for e in done] == [("item_1", checksum_transcript(audio))]
        assert events[-1]["type"] == "response.created"

    asyncio.run(main())

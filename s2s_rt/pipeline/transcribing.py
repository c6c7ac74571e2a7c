"""Transcribing: the STT stage turns committed user audio into words, and starts the turn's response."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from s2s_rt.engines.base import PIPELINE_RATE, Transcript
from s2s_rt.pipeline.context import SessionContext
from s2s_rt.pipeline.stage import Stage, StageContext
from s2s_rt.pipeline.work import ResponseRequest, SessionEnd, Transcribe
from s2s_rt.turn import shorten_pauses

log = logging.getLogger(__name__)


class Transcriber(Stage[SessionContext, Transcribe | ResponseRequest]):
    """The STT stage: transcribes each committed user turn, sends its transcript, and starts the turn's response.

    A ``response.create`` (a :class:`ResponseRequest`) passes through it to
    the responding stage, behind the turns committed before it.

    Args:
        stage: the slot's stage context.
        serving: the session the slot serves now.
        inbox: its queue (turns to transcribe, response requests, session ends).
        to_llm: the responding stage's queue.
    """

    name = "stt"

    def __init__(
        self,
        stage: StageContext,
        serving: Callable[[], SessionContext | None],
        inbox: asyncio.Queue[Any],
        to_llm: asyncio.Queue[Any],
    ) -> None:
        super().__init__(stage, serving, inbox)
        self.to_llm = to_llm

    async def forward(self, end: SessionEnd) -> None:
        await self.to_llm.put(end)

    def scoped(self, item: Transcribe | ResponseRequest) -> bool:
        return not isinstance(item, ResponseRequest)  # passed on whole, not cancelled halfway

    async def work(self, ctx: SessionContext, job: Transcribe | ResponseRequest) -> None:
        if isinstance(job, ResponseRequest):
            await self.to_llm.put(job)
            return
        stage = self.stage
        session = ctx.session
        tr = session.config.transcription
        ahead, job.anticipation = job.anticipation, None
        try:
            result: Transcript | BaseException
            if job.speculation is not None:
                result = await job.speculation
            else:
                result = await stage.pools["stt"].call(
                    stage.stack.stt.transcribe,
                    shorten_pauses(job.audio, job.start, job.pauses),
                    language=tr.language if tr else None,
                    prompt=tr.prompt if tr else None,
                )
            if isinstance(result, BaseException):
                raise result
        except Exception as exc:
            log.warning("slot %d: transcription failed: %r", stage.index, exc)
            if ahead is not None:
                ahead.drop("transcription failed")
            stage.metrics.errors.inc(code="transcription_failed")
            await stage.outbox.emit(
                session.transcription_failed(job.item_id, f"Transcription failed: {exc}"), session.scope
            )
            return
        text = result.text.strip()
        if text and result.language != ctx.language:
            how = "given" if tr is not None and tr.language else "detected"
            log.info("slot %d: the user speaks %s (%s)", stage.index, result.language, how)
            ctx.language = result.language
        await stage.outbox.emit(session.transcribed(job.item_id, text, len(job.audio) / PIPELINE_RATE), session.scope)
        # A session that became a transcription session meanwhile answers nothing (its settings win).
        if job.respond and session.response is None and not session.transcription_only:
            events = session.start_response(None)
            r = session.response
            assert r is not None
            timing = ctx.timings.begin(r.id, job.timing)
            if job.speculation is None or timing.transcribed is None:
                timing.transcribed = time.perf_counter()
            timing.user_text = text
            await stage.outbox.emit(events, session.scope)
            await self.to_llm.put(ResponseRequest(r.scope, r, ahead))
        elif ahead is not None:
            ahead.drop("no response")
            stage.metrics.speculative_responses.inc(outcome="unused")

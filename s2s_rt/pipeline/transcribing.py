"""Transcribing: the STT stage turns committed user audio into words, and starts the turn's response."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from s2s_rt.engines.base import PIPELINE_RATE, Transcript
from s2s_rt.pipeline.context import SessionContext
from s2s_rt.pipeline.stage import StageContext, serve
from s2s_rt.pipeline.work import ResponseRequest, SessionEnd, Transcribe, TurnTiming, run_scoped
from s2s_rt.turn import shorten_pauses

log = logging.getLogger(__name__)


class Transcriber:
    """The STT stage of one stage.

    Args:
        stage: the slot's stage context.
        serving: the session the slot serves now.
        inbox: its queue (turns to transcribe, response requests, session ends).
        to_llm: the responding stage's queue.
    """

    def __init__(
        self,
        stage: StageContext,
        serving: Callable[[], SessionContext | None],
        inbox: asyncio.Queue[Any],
        to_llm: asyncio.Queue[Any],
    ) -> None:
        self.stage = stage
        self.serving = serving
        self.inbox = inbox
        self.to_llm = to_llm

    async def run(self) -> None:
        await serve(self.stage, self.inbox, self._handle, "STT")

    async def _handle(self, item: Any) -> None:
        stage = self.stage
        if isinstance(item, SessionEnd):
            await self.to_llm.put(item)
            return
        if item.scope.stale:
            stage.metrics.dropped_stale.inc(stage="stt")
            return
        if isinstance(item, ResponseRequest):
            await self.to_llm.put(item)
            return
        ctx = self.serving()
        assert ctx is not None
        await run_scoped(item.scope, self._transcribe(ctx, item))

    async def _transcribe(self, ctx: SessionContext, job: Transcribe) -> None:
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
            timing = job.timing or TurnTiming()
            if job.speculation is None or timing.transcribed is None:
                timing.transcribed = time.perf_counter()
            timing.user_text = text
            stage.outbox.timings[r.id] = timing
            await stage.outbox.emit(events, session.scope)
            await self.to_llm.put(ResponseRequest(r.scope, r, ahead))
        elif ahead is not None:
            ahead.drop("no response")
            stage.metrics.speculative_responses.inc(outcome="unused")

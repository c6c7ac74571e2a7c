"""Transcribing: the STT stage turns committed user audio into words, and starts the turn's response."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from s2s_rt.engines.base import PIPELINE_RATE, Transcript
from s2s_rt.pipeline.work import ResponseRequest, SessionEnd, Transcribe, TurnTiming, run_scoped

if TYPE_CHECKING:
    from s2s_rt.pipeline.context import SessionContext
    from s2s_rt.slot import Slot

log = logging.getLogger("s2s_rt.slot")


class Transcriber:
    """The STT stage of one slot."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot

    async def run(self) -> None:
        await self.slot.serve(self.slot.stt_q, self._handle, "STT")

    async def _handle(self, item: Any) -> None:
        slot = self.slot
        if isinstance(item, SessionEnd):
            await slot.llm_q.put(item)
            return
        if item.scope.stale:
            slot.metrics.dropped_stale.inc(stage="stt")
            return
        if isinstance(item, ResponseRequest):
            await slot.llm_q.put(item)
            return
        ctx = slot.ctx
        assert ctx is not None
        await run_scoped(item.scope, self._transcribe(ctx, item))

    async def _transcribe(self, ctx: SessionContext, job: Transcribe) -> None:
        slot = self.slot
        session = ctx.session
        tr = session.config.transcription
        ahead, job.anticipation = job.anticipation, None
        try:
            result: Transcript | BaseException
            if job.speculation is not None:
                result = await job.speculation
            else:
                result = await slot.pools["stt"].call(
                    slot.stack.stt.transcribe,
                    job.audio,
                    language=tr.language if tr else None,
                    prompt=tr.prompt if tr else None,
                )
            if isinstance(result, BaseException):
                raise result
        except Exception as exc:
            log.warning("slot %d: transcription failed: %r", slot.index, exc)
            if ahead is not None:
                ahead.drop("transcription failed")
            slot.metrics.errors.inc(code="transcription_failed")
            await slot.outbox.emit(
                session.transcription_failed(job.item_id, f"Transcription failed: {exc}"), session.scope
            )
            return
        text = result.text.strip()
        if text and result.language != ctx.language:
            how = "given" if tr is not None and tr.language else "detected"
            log.info("slot %d: the user speaks %s (%s)", slot.index, result.language, how)
            ctx.language = result.language
        await slot.outbox.emit(session.transcribed(job.item_id, text, len(job.audio) / PIPELINE_RATE), session.scope)
        # A session that became a transcription session meanwhile answers nothing (its settings win).
        if job.respond and session.response is None and not session.transcription_only:
            events = session.start_response(None)
            r = session.response
            assert r is not None
            slot.outbox.timings[r.id] = TurnTiming(
                speech_end=job.speech_end, transcribed=time.perf_counter(), user_text=text
            )
            await slot.outbox.emit(events, session.scope)
            await slot.llm_q.put(ResponseRequest(r.scope, r, ahead))
        elif ahead is not None:
            ahead.drop("no response")
            slot.metrics.speculative_responses.inc(outcome="unused")

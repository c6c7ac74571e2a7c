"""A slot's pipeline, one module per part; each stage sees a :class:`~s2s_rt.pipeline.stage.StageContext`.

``stage`` (the narrow context and the stage loop), ``work`` (what travels
between stages), ``context`` (what a slot keeps about the session it serves),
``listener`` (turns from heard audio), ``turns`` (its state),
``speculation`` (transcribing and answering in a turn's closing silence),
``anticipation`` (the answer begun ahead), ``transcribing`` (STT),
``responding`` (LLM, tool-call retry), ``clauses`` (cutting answers for
speech), ``speaking`` (TTS, resampling), ``outbox`` (emit, send loop, close)
and ``dispatch`` (client frames in). :mod:`s2s_rt.slot` wires them with
queues and callbacks and supervises them; nothing here imports it. The
process-wide hearing is :mod:`s2s_rt.listening`.
"""

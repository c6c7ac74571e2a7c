"""A slot's pipeline, one module per part.

``work`` (what travels between stages), ``listening`` (VAD, turns,
speculation policy), ``transcribing`` (STT), ``responding`` (LLM, clauses,
tool-call retry), ``speaking`` (TTS, resampling), ``outbox`` (emit, send
loop, close) and ``dispatch`` (client frames in). :mod:`s2s_rt.slot` wires
them with queues and supervises them.
"""

"""Listening for the whole process: every session's audio heard in one batch per tick.

- :mod:`~s2s_rt.listening.buffer`: a session's uncommitted input audio.
- :mod:`~s2s_rt.listening.hearing`: decoding, resampling and VAD scoring of a batch.
- :mod:`~s2s_rt.listening.admission`: what hearing costs, measured, and how many sessions fit.
- :mod:`~s2s_rt.listening.clock`: the clock that runs the batches and drives each slot's listener.

What a session's audio means (turns, speculation) is the pipeline's
(:mod:`s2s_rt.pipeline.listener`); this package knows no session, slot or response.
"""

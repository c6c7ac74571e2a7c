"""A setting's default and a package's list of modules are each said in one place, and say what is true.

The listening clock once defaulted to 20 ms ticks while ``s2s-rt serve``
ran 10 ms ones (``config.py``): a test or an embedder building the clock
without arguments measured a server nobody runs.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

import s2s_rt.server
from s2s_rt.config import DEFAULTS, Config, mib
from s2s_rt.listening.clock import ListeningClock
from s2s_rt.slot import Slot
from s2s_rt.turn import SemanticTurnEnd

#: Each of the clock's parameters, and the default ``s2s-rt serve`` gives it (config.py, in the clock's unit).
CLOCK_SETTINGS = {
    "tick_s": DEFAULTS.listen_tick_ms / 1000,
    "listen_s_per_tick": DEFAULTS.listen_s_per_tick,
    "max_backlog_s": DEFAULTS.max_audio_backlog_s,
    "shed_after_s": DEFAULTS.shed_after_ms / 1000,
    "max_load": DEFAULTS.max_listening_load,
}


def test_defaults_are_the_configs_defaults() -> None:
    assert Config() == DEFAULTS
    assert DEFAULTS.listen_tick_ms == 10.0  # what the README says the clock ticks at


@pytest.mark.parametrize("name", sorted(CLOCK_SETTINGS))
def test_the_listening_clock_defaults_to_what_the_server_runs_with(name: str) -> None:
    parameter = inspect.signature(ListeningClock).parameters[name]
    assert parameter.default == CLOCK_SETTINGS[name]


def test_the_clock_takes_its_defaults_from_the_config_not_a_copy() -> None:
    [init] = ast.parse(textwrap.dedent(inspect.getsource(ListeningClock.__init__))).body
    assert isinstance(init, ast.FunctionDef)
    defaults = zip(init.args.kwonlyargs, init.args.kw_defaults, strict=True)
    restated = [arg.arg for arg, default in defaults if isinstance(default, ast.Constant)]
    assert restated == [], f"ListeningClock restates these defaults instead of reading s2s_rt.config: {restated}"


def test_the_server_package_lists_each_of_its_modules() -> None:
    package = Path(s2s_rt.server.__file__).parent
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    doc = s2s_rt.server.__doc__ or ""
    listed = sorted(line.split("`")[1].rpartition(".")[2] for line in doc.splitlines() if line.startswith("- :mod:"))
    assert listed == modules


#: Each of the slot's settings, and the default ``s2s-rt serve`` gives it (config.py, in the slot's unit). Not here:
#: ``speculate_after_ms`` (the server's default depends on the stack; a bare slot never works ahead) and
#: ``semantic`` (``SemanticTurnEnd()``, whose waits are compared below).
SLOT_SETTINGS = {
    "queue_size": DEFAULTS.queue_size,
    "drain_timeout_s": DEFAULTS.drain_deadline_s,
    "max_input_buffer_s": DEFAULTS.max_input_buffer_s,
    "send_timeout_s": DEFAULTS.send_timeout_s,
    "first_clause_words": DEFAULTS.first_clause_words,
    "max_output_bytes": mib(DEFAULTS.max_output_mib),
    "max_input_queue_bytes": mib(DEFAULTS.max_input_queue_mib),
}


@pytest.mark.parametrize("name", sorted(SLOT_SETTINGS))
def test_a_slot_defaults_to_what_the_server_runs_with(name: str) -> None:
    assert inspect.signature(Slot).parameters[name].default == SLOT_SETTINGS[name]


def test_the_slot_takes_its_defaults_from_the_config_not_a_copy() -> None:
    init = next(
        node
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(Slot))))
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    )
    defaults = zip(init.args.kwonlyargs, init.args.kw_defaults, strict=True)
    restated = [arg.arg for arg, default in defaults if isinstance(default, ast.Constant) and default.value is not None]
    assert restated == [], f"Slot restates these defaults instead of reading s2s_rt.config: {restated}"


def test_semantic_vads_waits_default_to_the_configs() -> None:
    waits = SemanticTurnEnd()
    assert (waits.min_silence_ms, waits.unknown_ms) == (DEFAULTS.semantic_min_silence_ms, DEFAULTS.semantic_unknown_ms)

"""The package's shape, read from its source: who imports whom, and how big each module is.

Every import counts, those under ``if TYPE_CHECKING:`` and inside functions
too: a circle that only the type checker sees is still a circle a reader
has to hold in their head.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "s2s_rt"

#: Modules allowed past :data:`MAX_LINES`, each with why.
LONG_MODULES: dict[str, str] = {}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The ``s2s_rt`` modules ``name`` imports (resolved to modules, not the names in them)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` imports the module; ``from module import name`` the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_graph_was_read() -> None:
    # A reader that found nothing would pass every test below.
    assert "s2s_rt.slot" in GRAPH["s2s_rt.server"] or any("s2s_rt.slot" in deps for deps in GRAPH.values())
    assert sum(len(deps) for deps in GRAPH.values()) > 100


def test_nothing_in_the_pipeline_imports_the_slot() -> None:
    offenders = sorted(
        name for name, deps in GRAPH.items() if name.startswith("s2s_rt.pipeline") and "s2s_rt.slot" in deps
    )
    assert offenders == [], f"these pipeline modules import s2s_rt.slot: {offenders}"


#: The core: what the pipeline and the server are built on. Layers import downward only, so none of these
#: imports a module of the layers above (process-wide listening, for one, knows no session or slot).
CORE = ("s2s_rt.turn", "s2s_rt.scope", "s2s_rt.lifecycle", "s2s_rt.engines", "s2s_rt.protocol", "s2s_rt.listening")
ABOVE_THE_CORE = ("s2s_rt.pipeline", "s2s_rt.slot", "s2s_rt.server")


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_core_imports_nothing_from_the_pipeline_the_slot_or_the_server() -> None:
    core = [name for name in GRAPH if _in(name, CORE)]
    assert {"s2s_rt.turn", "s2s_rt.scope", "s2s_rt.engines.base", "s2s_rt.protocol.session"} <= set(core)
    offenders = {name: sorted(d for d in GRAPH[name] if _in(d, ABOVE_THE_CORE)) for name in core}
    assert {k: v for k, v in offenders.items() if v} == {}, "core modules import the layers above them"


def test_the_pipeline_imports_nothing_from_the_server() -> None:
    """The pipeline defines the ports its transports implement (the channel, the playback); it never imports one."""
    pipeline = [name for name in GRAPH if _in(name, ("s2s_rt.pipeline",))]
    assert "s2s_rt.pipeline.outbox" in pipeline
    offenders = {name: sorted(d for d in GRAPH[name] if _in(d, ("s2s_rt.server",))) for name in pipeline}
    assert {k: v for k, v in offenders.items() if v} == {}, "pipeline modules import the server"


#: What of the pipeline the server may import: the ports the transports implement. The rest it reaches through
#: the slot (:class:`~s2s_rt.slot.SessionPort`).
PIPELINE_PORTS = ("s2s_rt.pipeline.ports",)


def test_the_server_reaches_the_pipeline_only_through_the_slot_and_the_ports() -> None:
    server = [name for name in GRAPH if _in(name, ("s2s_rt.server",))]
    assert "s2s_rt.server.connection" in server and "s2s_rt.slot" in GRAPH["s2s_rt.server.connection"]
    offenders = {
        name: sorted(d for d in GRAPH[name] if _in(d, ("s2s_rt.pipeline",)) and d not in PIPELINE_PORTS)
        for name in server
    }
    assert {k: v for k, v in offenders.items() if v} == {}, (
        "server modules import pipeline modules other than its ports"
    )


def test_nothing_below_the_server_imports_it() -> None:
    below = [
        name
        for name in GRAPH
        if _in(name, ("s2s_rt.pipeline", "s2s_rt.listening", "s2s_rt.protocol", "s2s_rt.engines"))
    ]
    assert "s2s_rt.listening.clock" in below and "s2s_rt.engines.llm" in below
    offenders = {name: sorted(d for d in GRAPH[name] if _in(d, ("s2s_rt.server",))) for name in below}
    assert {k: v for k, v in offenders.items() if v} == {}, "modules below the server import it"


def _private_reads(path: Path) -> list[str]:
    """Where a module reads a private attribute (``x._name``) of anything but itself (``self``, ``cls``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os")):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_server_reads_no_private_field_of_another_object() -> None:
    server = [path for name, path in MODULES.items() if _in(name, ("s2s_rt.server",))]
    assert len(server) > 5
    assert _private_reads(ROOT / "slot.py"), "the reader finds the slot's port reading its own slot's fields"
    assert [found for path in server for found in _private_reads(path)] == []


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_the_package() -> None:
    # A package's __init__ that only documents its modules imports none of them.
    assert _circles(GRAPH) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_500_lines(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    if name in LONG_MODULES:
        return
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concept (or name it in LONG_MODULES, with why)"

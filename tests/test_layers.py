"""The package layers of docs/architecture.md, enforced: importing any module loads no
module of a higher layer (nor of the other middle package), and the pure packages load
no I/O library, checked through `sys.modules` in a fresh interpreter.

    costmodel  <  broker_config  <  dispatcher | workers  <  producers
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Package -> its layer; a module may load packages of lower layers only (and its own).
LAYERS = {"costmodel": 0, "broker_config": 1, "dispatcher": 2, "workers": 2, "producers": 3}
# Pure code: no I/O library is loaded by importing it.
PURE = ("costmodel", "dispatcher.core")
IO_LIBRARIES = {"asyncio", "nats", "redis", "vllm"}

# Imports each module with every fairq module unloaded before it (what a fresh
# interpreter would do, without starting ~70 of them), and reports what it loaded. The
# pure modules come first, before anything has loaded an I/O library, so an I/O library
# in `sys.modules` after one of them was loaded by it.
_PROBE = """
import importlib, json, sys
packages, io_libraries, names = (set(json.loads(arg)) if i < 2 else json.loads(arg)
                                 for i, arg in enumerate(sys.argv[1:]))
report = {}
for name in names:
    for loaded in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[loaded]
    importlib.import_module(name)
    report[name] = sorted(m for m in sys.modules
                          if m.split(".")[0] in packages | io_libraries)
print(json.dumps(report))
"""


def modules() -> list[str]:
    """Every module of the layered packages, the pure ones first."""
    names = []
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names, key=lambda name: not name.startswith(PURE))


@functools.cache
def loaded_by_module() -> dict[str, list[str]]:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _PROBE,
            json.dumps(list(LAYERS)),
            json.dumps(sorted(IO_LIBRARIES)),
            json.dumps(modules()),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_no_module_loads_a_higher_layer_or_its_sibling() -> None:
    loaded = loaded_by_module()
    assert len(loaded) > 40  # every package was walked
    breaches = []
    for name, modules_loaded in loaded.items():
        own = name.split(".")[0]
        for other in {m.split(".")[0] for m in modules_loaded} & LAYERS.keys():
            if other != own and LAYERS[other] >= LAYERS[own]:
                breaches.append(f"{name} loads {other}")
    assert not breaches, "\n".join(sorted(breaches))


def test_pure_packages_load_no_io_library() -> None:
    loaded = loaded_by_module()
    breaches = [
        f"{name} loads {m}"
        for name, modules_loaded in loaded.items()
        if name.startswith(PURE)
        for m in modules_loaded
        if m.split(".")[0] in IO_LIBRARIES
    ]
    assert not breaches, "\n".join(sorted(breaches))


def test_the_probe_sees_a_breach() -> None:
    """The check above can fail: a module that loads a higher layer is reported."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _PROBE,
            json.dumps(list(LAYERS)),
            json.dumps(sorted(IO_LIBRARIES)),
            json.dumps(["dispatcher.service"]),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded = json.loads(result.stdout)["dispatcher.service"]
    assert "nats" in {m.split(".")[0] for m in loaded}
    assert "broker_config.config" in loaded


# The dispatcher's rooms (docs/architecture.md, "Map"), checked on each module's own
# import statements: a room's rule is about what it uses itself, not what it reaches
# through another room.
SIM = "dispatcher.sim"
CORE = "dispatcher.core"
# Modules that serve HTTP (a socket server or an HTTP framework); only dispatcher.api
# may use them inside the dispatcher.
HTTP_SERVING = ("broker_config.health", "wsgiref", "http.server", "hypercorn", "starlette")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path, *, top_level_only: bool = False) -> set[str]:
    """The modules `path` imports (absolute names; `from a import b` counts as `a.b`
    when a.b is a module, else as `a`), outside `if TYPE_CHECKING:` blocks. With
    `top_level_only`, imports inside functions are left out (they cannot form a cycle
    at import time)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    if (ROOT / candidate.replace(".", "/")).with_suffix(".py").exists():
                        found.add(candidate)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and top_level_only:
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list) and children and isinstance(children[0], ast.AST):
                    visit([c for c in children if isinstance(c, ast.stmt | ast.ExceptHandler)])

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return found


@functools.cache
def project_imports(top_level_only: bool = False) -> dict[str, set[str]]:
    return {
        _module_name(path): imports_of(path, top_level_only=top_level_only)
        for package in LAYERS
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def _within(name: str, room: str) -> bool:
    return name == room or name.startswith(room + ".")


# Room -> the other dispatcher rooms it may import (the map in docs/architecture.md).
D = "dispatcher."
ROOMS: dict[str, set[str]] = {
    D + "core": {D + "core.policies"},
    D + "core.policies": {D + "core"},
    D + "sim": {D + "core", D + "core.policies"},
    D + "intake": set(),
    D + "admission": {D + "core", D + "dispatch", D + "intake", D + "parts"},
    D + "dispatch": {D + "core", D + "admission", D + "fleet", D + "parts"},
    D + "fleet": {D + "core", D + "parts"},
    D + "observe": {D + "core"},
    D + "parts": {D + "core", D + "admission", D + "dispatch", D + "observe"},
    D + "api": {D + r for r in ("core", "admission", "dispatch", "intake", "observe", "parts")},
    D + "ha": {D + "service"},
    D + "service": {
        D + r
        for r in ("core", "admission", "dispatch", "intake", "fleet", "observe", "parts")
        + ("api", "ha")
    },
    D + "__main__": {D + r for r in ("admission", "api", "ha", "observe", "service")},
}


def room_of(name: str) -> str:
    parts = name.split(".")
    if parts[1:3] == ["core", "policies"]:
        return D + "core.policies"
    return ".".join(parts[:2])


def test_each_room_imports_only_the_rooms_the_map_allows() -> None:
    breaches = []
    for name, imported_set in project_imports().items():
        if not _within(name, "dispatcher") or name == "dispatcher":
            continue
        room = room_of(name)
        assert room in ROOMS, f"{name}: a room the map does not list"
        breaches += [
            f"{name} imports {imported}"
            for imported in imported_set
            if _within(imported, "dispatcher")
            and imported != "dispatcher"
            and room_of(imported) not in ROOMS[room] | {room}
        ]
    assert not breaches, "\n".join(sorted(breaches))


def test_the_core_imports_nothing_of_the_edge() -> None:
    breaches = [
        f"{name} imports {imported}"
        for name, imported_set in project_imports().items()
        if _within(name, CORE)
        for imported in imported_set
        if _within(imported, "dispatcher") and not _within(imported, CORE)
    ]
    assert not breaches, "\n".join(sorted(breaches))


def test_nothing_the_service_runs_imports_the_simulator() -> None:
    """The simulator and its fairness metrics drive the core; the dispatcher and the
    workers never load them (the CLI's `fairq simulate` and the benchmarks do)."""
    breaches = [
        f"{name} imports {imported}"
        for name, imported_set in project_imports().items()
        if name.split(".")[0] in ("dispatcher", "workers") and not _within(name, SIM)
        for imported in imported_set
        if _within(imported, SIM)
    ]
    assert not breaches, "\n".join(sorted(breaches))
    service = loaded_by_module()
    for runs in ("dispatcher.service", "dispatcher.__main__", "workers.__main__"):
        assert not [m for m in service[runs] if _within(m, SIM)], runs


def test_only_the_api_room_serves_http() -> None:
    breaches = [
        f"{name} imports {imported}"
        for name, imported_set in project_imports().items()
        if _within(name, "dispatcher") and not _within(name, "dispatcher.api")
        for imported in imported_set
        if any(_within(imported, http) for http in HTTP_SERVING)
    ]
    assert not breaches, "\n".join(sorted(breaches))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return cycles


def test_no_import_cycles() -> None:
    assert import_cycles(project_imports(top_level_only=True)) == []


def test_the_cycle_check_sees_a_cycle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

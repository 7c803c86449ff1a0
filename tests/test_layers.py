"""The package layers of docs/architecture.md, enforced: importing any module loads no
module of a higher layer (nor of the other middle package), and the pure packages load
no I/O library, checked through `sys.modules` in a fresh interpreter.

    costmodel  <  broker_config  <  dispatcher | workers  <  producers
"""

from __future__ import annotations

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

"""What a benchmark ran on, recorded beside its figures."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec
import nats

from broker_config.server import find_nats_server

S = TypeVar("S")


def command_line(module: str, argv: list[str] | None = None) -> str:
    """How a benchmark was started, recorded with its results."""
    return " ".join([f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])


def with_overrides(settings: S, overrides: Mapping[str, object]) -> S:
    """`settings` (a dataclass) with the options given on the command line; None means
    not given."""
    return dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})


def machine_facts(command: str) -> dict[str, Any]:
    server_version = subprocess.run(
        [str(find_nats_server()), "--version"],
        check=False,
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.strip()
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "nproc": len(os.sched_getaffinity(0)),
        "loadavg_at_start": os.getloadavg(),
        "nats_server": server_version,
        "nats_py": nats.aio.client.__version__,
        "msgspec": msgspec.__version__,
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def ran_on(command: str) -> str:
    """The line above a benchmark's table: the command, this host and today's date."""
    return (
        f"`{command}`, {platform.node()} ({platform.machine()}), "
        f"{datetime.date.today().isoformat()}"
    )


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table, one line per row."""
    lines = [header, ["---"] * len(header), *rows]
    return ["| " + " | ".join(cells) + " |" for cells in lines]

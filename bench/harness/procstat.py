"""What a process of a benchmark used, read from Linux's /proc: CPU seconds and memory.

On 2 shared cores every process of a run (load generator, nats-server, dispatcher,
workers) competes for the same CPU, so a rate is explained by who used the CPU; these
readings go into the result files beside the figures.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


class ProcError(RuntimeError):
    """/proc has no such process or field (not Linux, or the process is gone)."""


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds the process has used so far (its threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # The command name (field 2) may hold spaces: count the fields after its ')'.
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError as exc:
        raise ProcError(f"cannot read /proc/{pid}/stat: {exc}") from exc
    # utime and stime are fields 14 and 15 of stat(5); fields[0] here is field 3.
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def memory_kb(pid: int | str = "self") -> dict[str, int]:
    """`rss_kb` (resident now) and `peak_rss_kb` (the high-water mark, VmHWM)."""
    wanted = {"VmRSS:": "rss_kb", "VmHWM:": "peak_rss_kb"}
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key = wanted.get(line.split(maxsplit=1)[0]) if line.strip() else None
                if key is not None:
                    found[key] = int(line.split()[1])
    except OSError as exc:
        raise ProcError(f"cannot read /proc/{pid}/status: {exc}") from exc
    if len(found) != len(wanted):
        raise ProcError(
            f"/proc/{pid}/status lacks VmRSS or VmHWM: memory is measured on Linux only"
        )
    return found


def processes() -> dict[int, tuple[int, list[str]]]:
    """pid -> (parent pid, argv) of every live process (zombies have no argv)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:  # exited meanwhile
            continue
        if argv:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            found[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), argv)
    return found


def worker_pid(parent: int, worker_id: str) -> int | None:
    """The pid of the worker process `worker_id` that `parent` (`fairq up`) runs."""
    for pid, (ppid, argv) in processes().items():
        if ppid == parent and "workers" in argv and worker_id in argv:
            return pid
    return None


def children_of(parent: int) -> dict[int, list[str]]:
    """pid -> argv of the live children of `parent`."""
    return {pid: argv for pid, (ppid, argv) in processes().items() if ppid == parent}


class CpuMeter:
    """CPU seconds each named process used between `start()` and `stop()`."""

    def __init__(self, pids: Mapping[str, int | str]) -> None:
        self.pids = dict(pids)
        self._started: dict[str, float] = {}

    def start(self) -> None:
        self._started = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) - self._started[name] for name, pid in self.pids.items()}


def run_timed(main: Callable[..., Awaitable[T]], *args: Any) -> tuple[T, float]:
    """`asyncio.run(main(*args))` in this process, and the CPU seconds it took (for the
    consumers that benchmarks run in a process of their own)."""
    started = time.process_time()
    result = asyncio.run(main(*args))
    return result, time.process_time() - started

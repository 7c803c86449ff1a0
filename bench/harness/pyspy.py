"""py-spy sampling of a stack's processes while a benchmark runs, and what it found.

    async with recording({"dispatcher": pid}, log_dir) as profile:
        ...  # the measured work
    profile["processes"]["dispatcher"]["top_own"]  # filled in at the exit

Each target gets `py-spy record -f raw` at `PROFILE_RATE` samples per second into
`<log_dir>/profile-<name>.txt`; at the exit py-spy is stopped (it writes its file on
Ctrl-C) and the file summarised: the share of samples in the event loop's epoll call,
and the top functions by own samples and, for the project's code, by inclusive samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from bench.harness.machine import table
from bench.harness.procstat import cpu_seconds

# py-spy samples per second.
PROFILE_RATE = 200
TOP_FUNCTIONS = 8
# Inclusive shares are listed for these (the entry points, always 100%, apart).
PROJECT_DIRS = ("dispatcher/", "workers/", "broker_config/", "producers/", "costmodel/")


@contextlib.asynccontextmanager
async def recording(targets: Mapping[str, int], log_dir: Path) -> AsyncIterator[dict[str, Any]]:
    """py-spy on each of `targets` (name -> pid) while the block runs; the dict yielded
    gets `cpu_s` (each target's CPU seconds during the block) and `processes` (each
    one's `summarise_profile`) at the exit."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile needs py-spy on PATH (pip install py-spy)")
    paths = {name: log_dir / f"profile-{name}.txt" for name in targets}
    spies = {
        name: await asyncio.create_subprocess_exec(
            *(spy, "record", "-p", str(pid), "-r", str(PROFILE_RATE)),
            *("-f", "raw", "-o", str(paths[name])),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for name, pid in targets.items()
    }
    await asyncio.sleep(1.0)  # py-spy attaches
    cpu_before = {name: cpu_seconds(pid) for name, pid in targets.items()}
    profile: dict[str, Any] = {}
    try:
        yield profile
        profile["cpu_s"] = {
            name: cpu_seconds(pid) - cpu_before[name] for name, pid in targets.items()
        }
    finally:
        for process in spies.values():
            process.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
            await process.wait()
    profile["processes"] = {name: summarise_profile(path) for name, path in paths.items()}


def summarise_profile(path: Path) -> dict[str, Any]:
    """py-spy raw output (`frame;frame;... count` per stack; without `--idle` py-spy
    skips a thread asleep in a system call, though not always one in epoll): the share
    of samples in the event loop's epoll call, and the top functions by own samples and,
    for the project's code, by inclusive samples, as shares of all samples."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = epoll = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        frames = [_function(frame) for frame in stack.split(";")]
        total += samples
        if frames[-1].startswith("selectors.py:"):
            epoll += samples
            continue
        own[frames[-1]] += samples
        for function in set(frames):
            if function.startswith(PROJECT_DIRS) and "__main__.py" not in function:
                inclusive[function] += samples
    total = max(total, 1)
    return {
        "samples": total,
        "epoll_share": epoll / total,
        "top_own": [[f, n / total] for f, n in own.most_common(TOP_FUNCTIONS)],
        "top_inclusive": [[f, n / total] for f, n in inclusive.most_common(TOP_FUNCTIONS)],
    }


def _function(frame: str) -> str:
    """`name (path/file.py:line)` -> `path/file.py:name` (lines of a function merged)."""
    name, _, where = frame.partition(" (")
    return f"{where.rsplit(':', 1)[0]}:{name}" if where else name


def render_processes(processes: Mapping[str, dict[str, Any]]) -> list[str]:
    """Markdown: per process its samples, its epoll share and its top functions."""
    lines: list[str] = []
    for name, prof in processes.items():
        lines += [
            "",
            (
                f"{name}: {prof['samples']} samples, {prof['epoll_share']:.0%} in "
                "epoll (the event loop waiting or polling sockets)."
            ),
        ]
        for kind, label in (("top_own", "own time"), ("top_inclusive", "inclusive, project code")):
            lines += [""] + table(
                [f"{name}: {label}", "share"], [[f"`{f}`", f"{s:.1%}"] for f, s in prof[kind]]
            )
    return lines

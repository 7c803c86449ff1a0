"""`fairq up` as a user starts it, for the scenarios and tests that drive it from outside:

with fairq_up(log_dir, "--workers", "chat=1") as up:
    up.values["NATS_URL"]   # every NAME=value line it printed
# left: Ctrl-C (SIGINT), as a user stops it
"""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.harness.paths import REPO

START_S = 60.0
STOP_S = 30.0


@dataclass(frozen=True, slots=True)
class Running:
    process: subprocess.Popen[str]
    values: dict[str, str]  # every NAME=value line it printed before "fairq is up"


@contextlib.contextmanager
def fairq_up(log_dir: Path, *flags: str) -> Iterator[Running]:
    """`fairq up` on free ports with `flags` (default: the example config), its output
    read on a thread to the end so that it never blocks on a full pipe."""
    process = subprocess.Popen(
        [sys.executable, "-m", "producers.cli", "up", "--port", "0", "--metrics-port", "0"]
        + ["--front-port", "0", "--log-dir", str(log_dir), *flags],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in process.stdout or ()], daemon=True
    ).start()
    try:
        yield Running(process, _values_until_up(lines))
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _values_until_up(lines: queue.Queue[str]) -> dict[str, str]:
    values: dict[str, str] = {}
    deadline, seen = time.monotonic() + START_S, []
    while not (seen and seen[-1].startswith("fairq is up")):
        try:
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())).strip())
        except queue.Empty:
            raise RuntimeError(f"fairq up was not up within {START_S:g}s: {seen}") from None
        name, sep, value = seen[-1].partition("=")
        if sep and name.isupper():
            values[name] = value
    return values

"""`fairq up` as a user starts it, for the scenarios and tests that drive it from outside:

with fairq_up(log_dir) as nats_url:
    ...  # its NATS_URL; Ctrl-C (SIGINT) on leaving, as a user stops it
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
from pathlib import Path

from bench.harness.paths import REPO

START_S = 60.0
STOP_S = 60.0


@contextlib.contextmanager
def fairq_up(log_dir: Path) -> Iterator[str]:
    """`fairq up` on the example config, its output in `log_dir`; its NATS_URL."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producers.cli",
            "up",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--front-port",
            "0",
            "--log-dir",
            str(log_dir),
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # Read on a thread to the end, so that a quiet or chatty `fairq up` never blocks.
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in process.stdout or ()], daemon=True
    ).start()
    try:
        url, deadline, seen = None, time.monotonic() + START_S, []
        while not (seen and seen[-1].startswith("fairq is up")):
            try:
                seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise RuntimeError(
                    f"fairq up was not up within {START_S:g}s: {''.join(seen)[-2000:]}"
                ) from None
            if seen[-1].startswith("NATS_URL="):
                url = seen[-1].strip().split("=", 1)[1]
        assert url is not None, "fairq up said it was up without a NATS_URL"
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=STOP_S)

"""Child processes, started, watched, restarted and stopped from asyncio.

A `Child` is one process: a name, its argv and a log file that takes its stdout and
stderr. It runs in its own session, so a Ctrl-C in the terminal reaches only the parent,
which then stops its children in the order it chooses. `stop()` sends SIGTERM (the
fairq services drain on it), waits up to `stop_timeout_s`, then sends SIGKILL. A
`Child` on its own is what a caller that checks on its processes itself needs (start,
`check_alive`, stop, `log_tail`).

A `Supervisor` watches the children added to it, one task each. A child that exits
without having been asked to is restarted if it has a `restart` policy (`Backoff`):
after 0.5 s, then twice as long after each further crash up to 30 s, back to 0.5 s once
a run lasted `stable_s`; so a child that crashes at once, every time, is started at most
once per 30 s, never in a busy loop. Without a policy the exit is reported and the child
stays down (`check_alive` raises). Every exit and restart is reported through
`on_event`.

Stopping through the supervisor (`stop`, `replace`, leaving its context) first cancels
the child's watch task, so the exit asked for is never taken for a crash, then stops the
process. Leaving the context stops all children at once, each within its own stop
timeout; the caller decides what stops before and after them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

log = logging.getLogger("fairq.supervisor")

# After SIGKILL, or after cancelling a watch task, the wait is short: neither can be
# refused. Exceeding it means the kernel or the event loop is stuck; it is reported.
KILL_WAIT_S = 5.0


class SupervisorError(RuntimeError):
    """A child that cannot be started, stopped or found."""


class ChildExited(SupervisorError):
    """A child that is down although nobody stopped it."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays between restarts: `first_s`, times `factor` after every further crash, at
    most `max_s`; a run of at least `stable_s` counts as healthy and starts over."""

    first_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0
    stable_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {self.first_s!r}, {self.max_s!r}")
        if not self.factor >= 1:
            raise ValueError(f"factor must be >= 1, got {self.factor!r}")
        if not self.stable_s >= 0:
            raise ValueError(f"stable_s must be >= 0, got {self.stable_s!r}")

    def next_delay(self, previous_s: float | None, ran_s: float) -> float:
        """The wait before restarting a child that ran `ran_s` seconds, when the wait
        before that run was `previous_s` (None: it was the first start)."""
        if previous_s is None or ran_s >= self.stable_s:
            return self.first_s
        return min(previous_s * self.factor, self.max_s)


def describe_exit(code: int) -> str:
    """`exited with code 1` or `was killed by SIGKILL` (asyncio's negative codes)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class Child:
    """One child process: `argv` run in `cwd`, in its own session, output to `log_path`.

    `restart` is the supervisor's restart policy for it (None: stays down if it exits).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        cwd: Path | None = None,
        stop_timeout_s: float = 30.0,
        restart: Backoff | None = None,
    ) -> None:
        if not argv:
            raise ValueError(f"{name}: empty argv")
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.cwd = cwd
        self.stop_timeout_s = stop_timeout_s
        self.restart = restart
        self.process: asyncio.subprocess.Process | None = None
        self.starts = 0
        self.started_at = 0.0  # time.monotonic() of the last start
        # Exits nobody asked for (counted by the supervisor), and the last one's code.
        self.crashes = 0
        self.last_crash: int | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.running else None

    async def start(self) -> None:
        if self.running:
            raise SupervisorError(f"{self.name} is already running (pid {self.pid})")
        # The first start replaces a log an earlier run left; a restart appends to it, so
        # the output of the run that crashed stays readable.
        try:
            with self.log_path.open("ab" if self.starts else "wb") as log_file:
                self.process = await asyncio.create_subprocess_exec(
                    *self.argv,
                    cwd=self.cwd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            raise SupervisorError(f"cannot start {self.name} ({self.argv[0]}): {exc}") from exc
        self.starts += 1
        self.started_at = time.monotonic()

    async def wait(self) -> int:
        """Until the process exits (no bound: the supervisor cancels it); its exit code."""
        if self.process is None:
            raise SupervisorError(f"{self.name} was never started")
        return await self.process.wait()

    def check_alive(self) -> None:
        """Raise ChildExited, with the end of its log, if the process has exited."""
        if self.process is not None and self.process.returncode is not None:
            raise ChildExited(
                f"{self.name} {describe_exit(self.process.returncode)}:\n{self.log_tail()}"
            )

    def kill(self) -> None:
        """SIGKILL at once (a stopped or wedged process that SIGTERM would not move)."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                self.process.kill()

    async def stop(self) -> int | None:
        """SIGTERM, SIGKILL after `stop_timeout_s`; the exit code (None if not running)."""
        process = self.process
        if process is None or process.returncode is not None:
            return None
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self.stop_timeout_s):
                return await process.wait()
        except TimeoutError:
            pass  # it did not finish in time: killed below
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        try:
            async with asyncio.timeout(KILL_WAIT_S):
                return await process.wait()
        except TimeoutError:
            raise SupervisorError(
                f"{self.name} (pid {process.pid}) did not exit {KILL_WAIT_S:g}s after SIGKILL"
            ) from None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class Supervisor:
    """Runs children, restarts those with a restart policy, stops them on exit.

    `add`, `stop` and `replace` are the whole API for changing the set at run time (what
    scaling and health checks build on); `children` is the current set by name.
    """

    def __init__(self, *, on_event: Callable[[str], None] = log.warning) -> None:
        self.children: dict[str, Child] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._report = on_event

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop_all()

    async def add(self, child: Child) -> Child:
        """Start `child` and watch it. Raises SupervisorError if the name is taken or the
        process cannot be started."""
        if child.name in self.children:
            raise SupervisorError(f"a child named {child.name} is already supervised")
        await child.start()
        self.children[child.name] = child
        self._watchers[child.name] = asyncio.create_task(
            self._watch(child), name=f"watch {child.name}"
        )
        return child

    async def stop(self, name: str) -> int | None:
        """Stop one child (SIGTERM: a worker drains) and forget it; its exit code."""
        child = self._child(name)
        del self.children[name]
        try:
            await self._unwatch(name)
        finally:
            # Even if its watch task failed: no process is left behind.
            code = await child.stop()
        if code == -signal.SIGKILL:
            self._report(f"{name} did not stop within {child.stop_timeout_s:g}s of SIGTERM: killed")
        return code

    def kill(self, name: str, why: str) -> None:
        """SIGKILL a running child that is wedged; its watch restarts it under its policy."""
        child = self._child(name)
        if child.running:
            self._report(f"{name} (pid {child.pid}) killed: {why}")
            child.kill()

    async def replace(self, name: str, new: Child | None = None) -> Child:
        """Put `new` in place of child `name`; without `new`, a fresh run of the same one.

        A new child with the same name (a worker id must be unique) starts only once the
        old one has stopped; one with another name starts first, so capacity never dips.
        """
        old = self._child(name)
        new = new or old
        if new.name == name:
            await self.stop(name)
            return await self.add(new)
        await self.add(new)
        await self.stop(name)
        return new

    async def stop_all(self) -> None:
        """Stop every child at once, each within its own timeout."""
        names = list(self.children)
        results = await asyncio.gather(*(self.stop(name) for name in names), return_exceptions=True)
        failures = [
            f"{name}: {result}"
            for name, result in zip(names, results, strict=True)
            if isinstance(result, BaseException)
        ]
        if failures:
            raise SupervisorError("children not stopped cleanly:\n" + "\n".join(failures))

    def _child(self, name: str) -> Child:
        try:
            return self.children[name]
        except KeyError:
            known = ", ".join(sorted(self.children)) or "none"
            raise SupervisorError(f"no child named {name} (supervised: {known})") from None

    async def _unwatch(self, name: str) -> None:
        watcher = self._watchers.pop(name)
        watcher.cancel()
        done, _ = await asyncio.wait({watcher}, timeout=KILL_WAIT_S)
        if not done:
            raise SupervisorError(f"the watch task of {name} did not end when cancelled")
        if not watcher.cancelled() and watcher.exception() is not None:
            raise SupervisorError(f"watching {name} failed") from watcher.exception()

    async def _watch(self, child: Child) -> None:
        """Wait for the child to exit; restart it after a backoff if its policy allows.
        Runs until cancelled by `_unwatch`, or until a child without a policy exits."""
        delay: float | None = None
        while True:
            code = await child.wait()
            ran_s = time.monotonic() - child.started_at
            child.crashes += 1
            child.last_crash = code
            what = (
                f"{child.name} (pid {child.process.pid}) {describe_exit(code)} after {ran_s:.1f}s"
            )
            if child.restart is None:
                self._report(f"{what}; not restarted (log: {child.log_path})")
                return
            delay = child.restart.next_delay(delay, ran_s)
            self._report(f"{what}; restarting in {delay:g}s (log: {child.log_path})")
            await asyncio.sleep(delay)
            while True:
                try:
                    await child.start()
                    break
                except SupervisorError as exc:  # e.g. no processes left: try again later
                    delay = child.restart.next_delay(delay, 0.0)
                    self._report(f"{exc}; next try in {delay:g}s")
                    await asyncio.sleep(delay)
            self._report(f"{child.name} restarted (pid {child.process.pid})")

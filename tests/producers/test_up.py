"""`fairq up` as a user runs it: a real subprocess serving requests, a worker process
killed with SIGKILL and restarted by the supervisor, Ctrl-C stopping everything. Also the
supervisor on its own: its backoff (pure), and add, stop, replace and restart on small
processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import nats
import pytest
from nats.aio.subscription import Subscription

from bench.harness.procstat import children_of, processes, worker_pid
from broker_config.config import load_config
from broker_config.connection import server_urls
from broker_config.subjects import Subjects
from broker_config.wire import DoneEvent
from producers.client import Client
from producers.errors import ConnectionFailed
from producers.scaling import ScaleFollower
from producers.supervisor import Backoff, Child, Supervisor, SupervisorError
from tests.wire_support import until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SUBJECTS = Subjects()

START_S = 30.0  # fairq up: nats-server, dispatcher, worker interpreters, first heartbeats
REQUEST_S = 10.0
RESTART_S = 10.0  # 0.5 s backoff, a new interpreter, its first heartbeat (1 s interval)
# A stopped worker: 15 s of grace after its start, 5 s of silence, a 1 s check.
REPLACE_S = 40.0
STOP_S = 20.0


# -- the backoff, without processes ------------------------------------------------------


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_stable_run() -> None:
    backoff = Backoff(first_s=0.5, max_s=30.0, stable_s=10.0)
    delays, delay = [], None
    for _ in range(9):  # crashing at once, every time
        delay = backoff.next_delay(delay, ran_s=0.1)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff.next_delay(30.0, ran_s=9.9) == 30.0
    assert backoff.next_delay(30.0, ran_s=10.0) == 0.5  # ran stably: a fresh crash


@pytest.mark.parametrize(
    "fields", [{"first_s": 0}, {"first_s": 2, "max_s": 1}, {"factor": 0.5}, {"stable_s": -1}]
)
def test_backoff_refuses_settings_that_could_busy_loop(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**fields)


# -- the supervisor on small processes ---------------------------------------------------


def python_child(name: str, code: str, log_dir: Path, **options: object) -> Child:
    return Child(name, [sys.executable, "-c", code], log_dir / f"{name}.log", **options)


# Says "ready" once its SIGTERM handler is in place; exits 0 on SIGTERM, as a service
# that drains does.
SERVE = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: (print('drained', flush=True), sys.exit(0)))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)"
)
# Says "ready", then ignores SIGTERM.
STUBBORN = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)"
)


async def until_ready(child: Child) -> None:
    """Until the child's current run has said "ready" (one line per start)."""
    await until(lambda: child.log_tail().count("ready") == child.starts, f"{child.name} ready")


async def test_supervisor_restarts_with_backoff_and_stops_adds_and_replaces(tmp_path: Path) -> None:
    events: list[str] = []
    async with Supervisor(on_event=events.append) as supervisor:
        began = time.monotonic()
        crasher = await supervisor.add(
            python_child(
                "crasher",
                "raise SystemExit(3)",
                tmp_path,
                restart=Backoff(first_s=0.05, max_s=0.2, stable_s=10.0),
            )
        )
        once = await supervisor.add(python_child("once", "pass", tmp_path))
        server = await supervisor.add(python_child("server", SERVE, tmp_path, restart=Backoff()))
        await until(lambda: crasher.crashes >= 4, "four crashes")
        # Never a busy loop: the first three restarts waited 0.05, 0.1 and 0.2 s.
        assert time.monotonic() - began >= 0.35
        exits = [e for e in events if e.startswith("crasher (pid ") and "restarting" in e]
        delays = [e.rsplit("restarting in ", 1)[1].split(" ")[0] for e in exits]
        assert delays[:4] == ["0.05s", "0.1s", "0.2s", "0.2s"], events
        assert crasher.last_crash == 3 and all("exited with code 3" in e for e in exits)
        # No restart policy: it stays down and says so.
        await until(lambda: once.crashes == 1, "once exited")
        assert once.starts == 1 and not once.running
        assert any(e.startswith("once (pid ") and e.count("not restarted") for e in events)

        # Replace under the same name: the old process drains before the new one starts.
        await until_ready(server)
        old_pid = server.pid
        assert await supervisor.replace("server") is server
        assert server.starts == 2 and server.running and server.pid != old_pid
        assert server.crashes == 0  # the stop was asked for, not a crash
        # Another name starts first; the old one is drained and forgotten.
        await until_ready(server)
        other = await supervisor.replace("server", python_child("server-2", SERVE, tmp_path))
        assert other.running and not server.running
        assert set(supervisor.children) == {"crasher", "once", "server-2"}
        assert await supervisor.stop("crasher") in (None, 3, -signal.SIGTERM)
        with pytest.raises(SupervisorError, match="no child named crasher"):
            await supervisor.stop("crasher")
        with pytest.raises(SupervisorError, match="already supervised"):
            await supervisor.add(python_child("server-2", SERVE, tmp_path))
        await until_ready(other)
    assert not other.running and not supervisor.children
    # Each run drained on SIGTERM; the restart appended to the log of the first run.
    assert (tmp_path / "server.log").read_text().split() == ["ready", "drained"] * 2
    assert (tmp_path / "server-2.log").read_text().split() == ["ready", "drained"]


async def test_a_child_that_ignores_sigterm_is_killed_after_its_timeout(tmp_path: Path) -> None:
    events: list[str] = []
    async with Supervisor(on_event=events.append) as supervisor:
        child = await supervisor.add(
            python_child("stubborn", STUBBORN, tmp_path, stop_timeout_s=0.5)
        )
        await until_ready(child)
        assert await supervisor.stop("stubborn") == -signal.SIGKILL
    assert events == ["stubborn did not stop within 0.5s of SIGTERM: killed"]


# -- fairq up, end to end ------------------------------------------------------------------


class Output:
    """The lines a process prints, read as they come; every wait bounded."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.lines: list[str] = []
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._stream = stream

    async def pump(self) -> None:
        async for raw in self._stream:
            await self._queue.put(raw.decode(errors="replace").rstrip("\n"))
        await self._queue.put(None)  # end of output: the process exited

    async def expect(self, prefix: str, timeout_s: float) -> str:
        """The next line starting with `prefix`; fails with the output so far."""
        return await self._expect(lambda line: line.startswith(prefix), repr(prefix), timeout_s)

    async def expect_containing(self, text: str, timeout_s: float) -> str:
        """The next line with `text` in it (a log line); fails with the output so far."""
        return await self._expect(lambda line: text in line, f"with {text!r}", timeout_s)

    async def _expect(self, wanted: Callable[[str], bool], what: str, timeout_s: float) -> str:
        try:
            async with asyncio.timeout(timeout_s):
                while (line := await self._queue.get()) is not None:
                    self.lines.append(line)
                    if wanted(line):
                        return line
            reason = "the process exited"
        except TimeoutError:
            reason = f"nothing within {timeout_s}s"
        pytest.fail(f"no line {what}: {reason}; output:\n" + "\n".join(self.lines))


async def start_up(*flags: str) -> tuple[asyncio.subprocess.Process, Output, asyncio.Task]:
    """`fairq up` on free ports with `flags`; its output read as it comes."""
    up = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "producers.cli",
        "up",
        "--port",
        "0",
        "--metrics-port",
        "0",
        *flags,
        cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output = Output(up.stdout)
    return up, output, asyncio.create_task(output.pump())


async def stop_cleanly(
    up: asyncio.subprocess.Process, output: Output, *, draining: bool = False
) -> None:
    """Ctrl-C: `fairq up` says it stopped (after draining, if asked) and exits 0."""
    up.send_signal(signal.SIGINT)
    if draining:
        await output.expect("fairq: draining...", STOP_S)
    await output.expect("fairq: stopped", STOP_S)
    async with asyncio.timeout(STOP_S):
        assert await up.wait() == 0


async def submit(nc: nats.NATS, request_id: str, publish_tries: int = 1) -> list[dict]:
    """One chat request for tenant acme over plain NATS; its events up to the final one.
    The publish is tried again (same message id) while a cluster elects a leader."""
    reply = nc.new_inbox()
    events = await nc.subscribe(reply)
    try:
        for tries_left in range(publish_tries - 1, -1, -1):
            try:
                await nc.jetstream().publish(
                    "fq.req.chat.acme",
                    json.dumps({"prompt": "hi", "max_tokens": 4}).encode(),
                    headers={"Nats-Msg-Id": request_id, "Fq-Reply": reply},
                    timeout=2,
                )
                break
            except (nats.errors.Error, TimeoutError):
                if not tries_left:
                    raise
                await asyncio.sleep(0.5)
        received = []
        async with asyncio.timeout(REQUEST_S):
            while not received or received[-1]["type"] not in ("done", "error"):
                received.append(json.loads((await events.next_msg(timeout=REQUEST_S)).data))
        return received
    finally:
        await events.unsubscribe()


def assert_completed(events: list[dict], request_id: str) -> None:
    assert [e["type"] for e in events][-1] == "done", events
    assert {e["type"] for e in events[:-1]} <= {"token"} and events[:-1], events
    assert all(e["id"] == request_id for e in events)


async def heartbeat_after(subscription: Subscription, started_at: float) -> dict:
    """The next heartbeat from a worker process started after `started_at`."""
    async with asyncio.timeout(RESTART_S):
        while True:
            beat = json.loads((await subscription.next_msg(timeout=RESTART_S)).data)
            if beat["started_at"] > started_at:
                return beat


def still_running(started: dict[int, list[str]]) -> list[int]:
    """Those of `started` still alive (same pid and argv: not a reused pid)."""
    return [pid for pid, (_, argv) in processes().items() if started.get(pid) == argv]


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def leave_nothing_running(
    up: asyncio.subprocess.Process, started: dict[int, list[str]], reader: asyncio.Task
) -> None:
    """After a `fairq up` test: a run that failed midway is stopped as Ctrl-C would, then
    harder; no process it started is left behind."""
    if up.returncode is None:
        started |= children_of(up.pid)
        up.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(up.wait(), STOP_S)
        except TimeoutError:
            up.kill()
            await asyncio.wait_for(up.wait(), STOP_S)
    for pid in still_running(started):
        os.kill(pid, signal.SIGKILL)
    await asyncio.wait_for(reader, STOP_S)


async def test_fairq_up_serves_restarts_a_killed_worker_and_stops_on_ctrl_c(
    nats_binary: Path, tmp_path: Path
) -> None:
    up, output, reader = await start_up(
        "--workers", "1", "--time-scale", "0.05", "--log-dir", str(tmp_path)
    )
    started: dict[int, list[str]] = {}  # what it ran, to check (or clean) after it exits
    try:
        url = (await output.expect("NATS_URL=", START_S)).removeprefix("NATS_URL=")
        assert url.startswith("nats://127.0.0.1:")
        up_line = await output.expect("fairq is up:", START_S)
        assert up_line == "fairq is up: 2 simulated workers on chat, embed; Ctrl-C stops"
        # The start's last line: the front had served (hypercorn says so) before it.
        assert any("Running on http://" in line for line in output.lines), output.lines
        # The dispatcher's log beside the workers'.
        assert "took the lease" in (tmp_path / "dispatcher.log").read_text()
        assert (tmp_path / "chat-w1.log").exists()
        started = children_of(up.pid)
        assert len(started) == 3  # nats-server and one worker per endpoint
        metrics_url = next(line for line in output.lines if line.startswith("METRICS_URL="))
        base = metrics_url.removeprefix("METRICS_URL=").removesuffix("/metrics")
        # The dispatcher's, beside its metrics; ready once it has settled.
        assert http_status(base + "/healthz") == 200
        deadline = time.monotonic() + START_S
        while http_status(base + "/readyz") != 200:
            assert time.monotonic() < deadline, "the dispatcher never became ready"
            await asyncio.sleep(0.2)

        nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
        try:
            assert_completed(await submit(nc, "up-1"), "up-1")

            heartbeats = await nc.subscribe("fq.int.hb.chat.chat-w1")
            before = await heartbeat_after(heartbeats, 0.0)
            old_pid = worker_pid(up.pid, "chat-w1")
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)
            line = await output.expect("fairq: chat-w1 restarted (pid ", RESTART_S)
            new_pid = int(line.rsplit(" ", 1)[1].rstrip(")"))
            assert new_pid != old_pid and worker_pid(up.pid, "chat-w1") == new_pid
            assert any(
                f"chat-w1 (pid {old_pid}) was killed by SIGKILL" in seen for seen in output.lines
            ), output.lines
            started |= children_of(up.pid)
            # The new process serves the same worker id.
            beat = await heartbeat_after(heartbeats, before["started_at"])
            assert beat["healthy"]
            await heartbeats.unsubscribe()

            assert_completed(await submit(nc, "up-2"), "up-2")

            # A stopped process never exits: silent, it is held unhealthy, killed and
            # restarted (its first REPLACE_GRACE_S of life spared).
            os.kill(new_pid, signal.SIGSTOP)
            await output.expect(
                f"fairq: chat-w1 (pid {new_pid}) killed: the dispatcher holds it silent", REPLACE_S
            )
            line = await output.expect("fairq: chat-w1 restarted (pid ", RESTART_S)
            third_pid = int(line.rsplit(" ", 1)[1].rstrip(")"))
            assert third_pid not in (old_pid, new_pid)
            started |= children_of(up.pid)
            assert_completed(await submit(nc, "up-3"), "up-3")
        finally:
            await nc.close()
        with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
            exported = response.read().decode()
        # Both new processes of chat-w1 (after SIGKILL, after SIGSTOP) are counted.
        assert 'fairq_worker_replacements_total{endpoint="chat"} 2.0' in exported

        await stop_cleanly(up, output, draining=True)
        left = still_running(started)
        assert not left, {pid: started[pid] for pid in left}
    finally:
        await leave_nothing_running(up, started, reader)


AUTOSCALED = """
[endpoints.chat.autoscale]
min_replicas = 1
max_replicas = 3
cold_start_s = 1.0
scale_down_after_s = 6.0
rate_window_s = 3.0
drain_s = 2.0
"""
SCALE_S = 30.0  # a decision within a tick, a worker interpreter, its first heartbeat


async def test_fairq_up_autoscale_adds_workers_for_a_burst_and_drains_them_after(
    nats_binary: Path, tmp_path: Path
) -> None:
    """A burst on chat: workers go up, then, after the quiet window, back down to one;
    every request of the burst ends with exactly one final event, `done`."""
    config = tmp_path / "autoscaled.toml"
    config.write_text((ROOT / "configs" / "example.toml").read_text() + AUTOSCALED)
    up, output, reader = await start_up(
        "--autoscale",
        "--config",
        str(config),
        "--time-scale",
        "0.2",
        "--log-dir",
        str(tmp_path / "logs"),
    )
    started: dict[int, list[str]] = {}
    try:
        url = (await output.expect("NATS_URL=", START_S)).removeprefix("NATS_URL=")
        assert (await output.expect("fairq is up:", START_S)) == (
            "fairq is up: 2 simulated workers on chat, embed; Ctrl-C stops"
        )
        nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
        try:
            finals: dict[str, list[dict]] = {}
            inbox = nc.new_inbox()

            async def on_event(msg) -> None:
                event = json.loads(msg.data)
                if event["type"] in ("done", "error"):
                    finals.setdefault(event["id"], []).append(event)

            await nc.subscribe(inbox + ".*", cb=on_event)
            js = nc.jetstream()
            ids = [f"burst-{i}" for i in range(300)]
            for rid in ids:
                await js.publish(
                    "fq.req.chat.acme",
                    json.dumps({"prompt": "hi", "max_tokens": 200}).encode(),
                    headers={"Nats-Msg-Id": rid, "Fq-Reply": f"{inbox}.{rid}"},
                )
            await output.expect("fairq: scaled chat up: started chat-w2", SCALE_S)
            started |= children_of(up.pid)
            deadline = time.monotonic() + 120
            while len(finals) < len(ids):
                assert time.monotonic() < deadline, f"{len(finals)} of {len(ids)} finished"
                await asyncio.sleep(0.2)
            await output.expect("fairq: scaled chat down: draining chat-w", SCALE_S)
            await asyncio.sleep(1.0)  # a repeated final event would have come by now
            assert sorted(finals) == sorted(ids)
            assert all(
                len(events) == 1 and events[0]["type"] == "done" for events in finals.values()
            ), finals
        finally:
            await nc.close()
        await stop_cleanly(up, output)
        ups = [line for line in output.lines if "scaled chat up" in line]
        downs = [line for line in output.lines if "scaled chat down" in line]
        assert len(downs) == len(ups) >= 1, output.lines  # back to the one it started with
    finally:
        await leave_nothing_running(up, started, reader)


# Says "ready"; on SIGTERM takes a second to drain, then exits 0.
SLOW_DRAIN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), sys.exit(0)))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)"
)


async def test_scaling_never_reuses_the_id_of_a_worker_still_draining(tmp_path: Path) -> None:
    said: list[str] = []
    async with Supervisor(on_event=said.append) as supervisor:
        follower = ScaleFollower(
            None,
            load_config(),
            supervisor,  # type: ignore[arg-type]
            lambda ep, n: python_child(f"{ep}-w{n}", SLOW_DRAIN, tmp_path),
            said.append,
        )
        await follower.apply("chat", 2)
        assert sorted(supervisor.children) == ["chat-w1", "chat-w2"]
        await follower.apply("chat", 1)  # chat-w2 drains, for about a second
        await follower.apply("chat", 2)  # demand is back before it has exited
        assert sorted(supervisor.children) == ["chat-w1", "chat-w3"]
        await follower.__aexit__(None, None, None)  # waits for the drain to end
        await follower.apply("chat", 3)  # chat-w2 has exited: its id is free again
        assert sorted(supervisor.children) == ["chat-w1", "chat-w2", "chat-w3"]
    assert any("scaled chat down: draining chat-w2" in line for line in said), said


async def test_fairq_up_auth_runs_every_part_as_its_own_broker_user(
    nats_binary: Path, tmp_path: Path
) -> None:
    """`--auth`: nats-server refuses anonymous clients, the workers and the front serve
    with their own users, and a tenant connects with the seed file under AUTH_DIR."""
    up, output, reader = await start_up(
        "--auth",
        "--workers",
        "chat=1,embed=0",
        "--time-scale",
        "0.05",
        "--front-port",
        "0",
        "--log-dir",
        str(tmp_path),
    )
    started: dict[int, list[str]] = {}
    try:
        url = (await output.expect("NATS_URL=", START_S)).removeprefix("NATS_URL=")
        base_url = (await output.expect("OPENAI_BASE_URL=", START_S)).split("=", 1)[1]
        key = (await output.expect("OPENAI_API_KEY=", START_S)).split("=", 1)[1]
        auth_dir = Path((await output.expect("AUTH_DIR=", START_S)).split("=", 1)[1])
        assert auth_dir == tmp_path / "auth"
        await output.expect("fairq is up: 1 simulated workers on chat, embed", START_S)
        started = children_of(up.pid)
        with pytest.raises(ConnectionFailed, match="(?i)authorization violation"):
            await Client.connect(url, allow_reconnect=False)
        async with Client.connect(url, nkey=auth_dir / "acme.nk", tenant_inboxes="acme") as acme:
            done = await acme.run("chat", "acme", prompt="hi", max_tokens=4, timeout_s=REQUEST_S)
            assert isinstance(done, DoneEvent)
            with pytest.raises(nats.errors.TimeoutError):
                await acme.connection.jetstream(timeout=1).publish("fq.req.chat.globex", b"{}")
        # The front, as fq-front, submits for acme into acme's inbox.
        body = json.dumps(
            {"model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        request = urllib.request.Request(
            f"{base_url}/chat/completions",
            data=body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        answer = await asyncio.to_thread(urllib.request.urlopen, request, timeout=REQUEST_S)
        assert json.loads(answer.read())["choices"][0]["message"]["content"]
        await stop_cleanly(up, output)
    finally:
        await leave_nothing_running(up, started, reader)


async def test_fairq_up_auth_takes_a_tenant_added_to_the_file_on_sighup(
    nats_binary: Path, tmp_path: Path
) -> None:
    """A tenant added to the config file of a running `fairq up --auth`: SIGHUP renders
    its broker user, reloads nats-server and the dispatcher, and it is served without a
    restart; `fairq reload`, as the operator user, then applies a change of its tier."""
    config = tmp_path / "fairq.toml"
    config.write_text((ROOT / "configs" / "example.toml").read_text())
    up, output, reader = await start_up(
        "--auth",
        "--config",
        str(config),
        "--workers",
        "chat=1,embed=0",
        "--time-scale",
        "0.05",
        "--front-port",
        "0",
        "--log-dir",
        str(tmp_path / "run"),
    )
    started: dict[int, list[str]] = {}
    try:
        url = (await output.expect("NATS_URL=", START_S)).removeprefix("NATS_URL=")
        auth_dir = Path((await output.expect("AUTH_DIR=", START_S)).split("=", 1)[1])
        await output.expect("fairq is up", START_S)
        started = children_of(up.pid)
        assert not (auth_dir / "newco.nk").exists()

        with config.open("a") as file:
            file.write('\n[tenants.newco]\ntier = "free"\n')
        up.send_signal(signal.SIGHUP)
        await output.expect("fairq: new broker user newco", REQUEST_S)
        assert "tenants added newco," in await output.expect("fairq: reloaded", REQUEST_S)
        async with Client.connect(url, nkey=auth_dir / "newco.nk", tenant_inboxes="newco") as newco:
            done = await newco.run("chat", "newco", prompt="hi", max_tokens=4, timeout_s=REQUEST_S)
            assert isinstance(done, DoneEvent)

        config.write_text(
            config.read_text().replace(
                '[tenants.newco]\ntier = "free"', '[tenants.newco]\ntier = "enterprise"'
            )
        )
        reload = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "producers.cli",
            "reload",
            "--nats",
            url,
            "--nkey",
            str(auth_dir / "fq-operator.nk"),
            "--expect",
            "1",
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(reload.communicate(), REQUEST_S)
        assert reload.returncode == 0, err.decode()
        assert "changed newco" in out.decode(), out.decode()

        # Removing newco together with a change a reload cannot make: refused whole, and
        # newco keeps its broker user and its service.
        config.write_text(
            config.read_text()
            .replace('[tenants.newco]\ntier = "enterprise"', "")
            .replace("max_tokens_cap = ", "max_tokens_cap = 1", 1)
        )
        up.send_signal(signal.SIGHUP)
        assert "endpoints" in await output.expect("fairq: reload refused", REQUEST_S)
        assert (auth_dir / "newco.nk").exists()
        async with Client.connect(url, nkey=auth_dir / "newco.nk", tenant_inboxes="newco") as newco:
            assert isinstance(
                await newco.run("chat", "newco", prompt="hi", max_tokens=4, timeout_s=REQUEST_S),
                DoneEvent,
            )
        await stop_cleanly(up, output)
    finally:
        await leave_nothing_running(up, started, reader)


async def test_fairq_up_cluster_serves_through_the_kill_of_the_stream_leaders_node(
    nats_binary: Path, tmp_path: Path
) -> None:
    """`--cluster`: three nodes, NATS_URL lists them; kill -9 of the node that leads the
    requests stream (perhaps the one fairq up's own connection uses): requests published
    after it are served, and fairq up keeps running and stops cleanly."""
    up, output, reader = await start_up(
        "--cluster",
        "--workers",
        "chat=1,embed=0",
        "--time-scale",
        "0.05",
        "--log-dir",
        str(tmp_path),
    )
    started: dict[int, list[str]] = {}
    try:
        url = (await output.expect("NATS_URL=", START_S * 2)).removeprefix("NATS_URL=")
        assert len(server_urls(url)) == 3, url
        await output.expect("fairq is up", START_S)
        started = children_of(up.pid)
        nc = await nats.connect(
            server_urls(url), max_reconnect_attempts=-1, reconnect_time_wait=0.2
        )
        try:
            assert_completed(await submit(nc, "before"), "before")
            info = await nc.jetstream().stream_info(SUBJECTS.requests_stream)
            assert info.config.num_replicas == 3
            store = str(tmp_path / "nats" / info.cluster.leader)
            [node] = [pid for pid, argv in started.items() if store in argv]
            os.kill(node, signal.SIGKILL)
            for n in range(3):
                request_id = f"after{n}"
                assert_completed(await submit(nc, request_id, publish_tries=30), request_id)
            assert up.returncode is None, "\n".join(output.lines)
        finally:
            await nc.close()
        await stop_cleanly(up, output)
    finally:
        await leave_nothing_running(up, started, reader)


async def test_fairq_up_paused_past_its_lease_stands_by_and_serves_again(
    nats_binary: Path, tmp_path: Path
) -> None:
    """docs/operations.md's local takeover: `fairq up` paused (SIGSTOP) past its lease, a
    standby `python -m dispatcher` serves; woken, fairq up's dispatcher stands by rather
    than stopping fairq up, takes the lease back when the standby stops, serves, and
    fairq up still stops cleanly."""
    up, output, reader = await start_up(
        "--workers", "chat=1,embed=0", "--time-scale", "0.05", "--log-dir", str(tmp_path)
    )
    started: dict[int, list[str]] = {}
    standby = None
    try:
        url = (await output.expect("NATS_URL=", START_S)).removeprefix("NATS_URL=")
        await output.expect("fairq is up", START_S)
        started = children_of(up.pid)
        standby = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dispatcher",
            "--nats",
            url,
            cwd=ROOT,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        said = Output(standby.stdout)
        standby_reader = asyncio.create_task(said.pump())
        await said.expect_containing("standing by", START_S)
        nc = await nats.connect(url)
        try:
            up.send_signal(signal.SIGSTOP)
            try:
                await said.expect_containing("took the lease", START_S)
                assert_completed(await submit(nc, "paused"), "paused")
            finally:
                up.send_signal(signal.SIGCONT)
            await output.expect_containing("lost the lease", START_S)
            standby.send_signal(signal.SIGTERM)  # hands the lease over
            async with asyncio.timeout(STOP_S):
                assert await standby.wait() == 0
            await standby_reader
            assert_completed(await submit(nc, "back"), "back")  # fairq up's again
            assert up.returncode is None
        finally:
            await nc.close()
        await stop_cleanly(up, output, draining=True)
    finally:
        if standby is not None and standby.returncode is None:
            standby.kill()
            await standby.wait()
        await leave_nothing_running(up, started, reader)


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--cluster", "--auth"], "--cluster and --auth cannot be combined"),
        (["--cluster", "--port", "4222"], "leave out --port"),
    ],
)
def test_fairq_up_cluster_refuses_what_it_cannot_do_and_says_why(
    flags: list[str], reason: str, tmp_path: Path
) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "producers.cli", "up", *flags, "--log-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    assert reason in refused.stderr
    assert not (tmp_path / "nats").exists()  # nothing started

"""Intake layouts compared on one machine in one run: how the requests stream could be
read at 10, 100 and 1,000 tenants (issue 10, "The wall: active tenants").

    python -m bench.intake_layouts [--quick] [--tenants 10,100,1000] [--layouts a,b]

Raw nats-py against a fresh nats-server process (free loopback port, its own store dir)
for every row, the requests stream exactly as fairq provisions it (work-queue retention:
an acked or deleted message is gone). Layouts (`LAYOUTS`):

- pull-per-tenant: one durable pull consumer per tenant, standing pulls into one inbox,
  `tenant_window` credits topped up at half (the intake before issue 10);
- push-per-tenant: one durable push consumer per tenant with flow control, idle
  heartbeats and `max_ack_pending` = `tenant_window` as the per-tenant window, each
  delivering to its own inbox subject;
- pull-shards-S: S pull consumers, each with the filters of the tenants hashed to it
  (FilterSubjects, nats-server >= 2.10); a pull asks for the window of all its tenants,
  at most `max_ack_pending`;
- pull-partitioned-16: 16 pull consumers over the shards the stream's subject transform
  stores tenants in (`<prefix>.q.<shard>.*.*`, one filter each: today's intake,
  dispatcher.intake.shards, without the moves that keep a shard's tenants apart);
- pull-shared: one pull consumer over every stored request subject;
- pull-mix: a dedicated consumer for each backlogged tenant (every tenth tenant in the
  rate run; the backlogged tenant in the head-of-line run, already moved out) and one
  shared consumer listing the others' filters (a subject filter cannot say "all but").
- direct-get-delete / direct-get-keep: no consumer. Every tenant's subject is read with
  batch direct gets (`next_by_subj`, broker_config.direct_get) from a read position the
  intake keeps itself, all tenants each round, a pause when a round found nothing (there
  is no long poll). Nothing is removed by reading: on the work-queue stream the intake
  must delete each message itself (`$JS.API.STREAM.MSG.DELETE`, one request each, as
  the dispatcher would on finishing a request); the keep variant leaves them, so the
  difference is the cost of deleting.

Every consumed message is acked (or deleted) at once; the consumer does nothing else.
Two measurements per layout and tenant count, each on a fresh server, the consumer in a
fresh process that makes its consumers before the clock starts:

- rate: `messages` messages of about 200 bytes (with Nats-Msg-Id, as producers send
  them) published round-robin over the tenants' subjects while being consumed: messages
  per second from the first publish to the last ack; CPU microseconds per message of
  nats-server (publishing included, the same for every layout) and of the consumer
  process (bench.procstat); the server's RSS at the end;
- head of line: tenant A's `backlog` messages, then one of newcomer B, stored before
  the consumer starts: seconds from its start until B's message is delivered, and how
  many messages came before it. B is a tenant that shares A's consumer wherever the
  layout has one. A dispatcher holds what it took until the request finishes, so a
  shared consumer that must deliver more of A than its `max_ack_pending` before B would
  block B until A's requests finish; here everything is acked at once, the best case.

Writes bench/results/intake_layouts/summary.json (`--quick`: quick.json) and prints a
markdown table with the machine's load before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import multiprocessing
import os
import sys
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig

from bench.bench_intake import connected
from bench.machine import command_line, machine_facts, table, with_overrides
from bench.procstat import CpuMeter, memory_kb
from bench.scenario_rate import tenant_names
from broker_config import jetstream
from broker_config.config import BrokerSettings, DispatcherOptions
from broker_config.direct_get import DirectBatchGet, DirectGetError, StoredMessage
from broker_config.server import EmbeddedNatsServer
from broker_config.streams import (
    ConsumerLimits,
    ConsumerSpec,
    apply_stream,
    requests_stream_config,
)
from broker_config.subjects import HDR_MSG_ID
from broker_config.subjects import shard_of as broker_shard_of

RESULTS = Path(__file__).resolve().parent / "results" / "intake_layouts"
BROKER = BrokerSettings()
SUBJECTS = BROKER.subjects
STREAM = SUBJECTS.requests_stream
ENDPOINT = "chat"
# About 200 bytes, the size of a short chat request.
BODY = b'{"prompt":"' + b"x" * 170 + b'","max_tokens":16}'
WINDOW = DispatcherOptions().tenant_window
MAX_ACK_PENDING = DispatcherOptions().max_ack_pending
ACK_WAIT_S = DispatcherOptions().ack_wait_s
# The dispatcher's consumer limits (dispatcher.service).
LIMITS = ConsumerLimits(ACK_WAIT_S, MAX_ACK_PENDING)
PUBLISH_IN_FLIGHT = 512
# Consumers made concurrently, as the dispatcher's intake makes them.
CREATE_IN_FLIGHT = 64
PUSH_HEARTBEAT_S = 5.0
DIRECT_IN_FLIGHT = 128
# A direct-get round that found nothing waits this long before the next (no long poll).
DIRECT_IDLE_S = 0.005
DELETE_TIMEOUT_S = 5.0
# In the mix, every DEDICATED_EVERY-th tenant counts as backlogged in the rate run.
DEDICATED_EVERY = 10
# The consumer process and this one meet on core subjects: made its consumers, go.
READY_SUBJECT = "bench.intake_layouts.ready"
GO_SUBJECT = "bench.intake_layouts.go"
STREAM_EMPTY_WITHIN_S = 5.0
# The consumer process ends within its own bound; this covers its start and exit.
JOB_MARGIN_S = 30.0
POLL_S = 0.02
BACKLOGGED, NEWCOMER = "A", "B"

Kind = Literal["pull", "push", "direct"]


class BenchError(RuntimeError):
    """A measurement that did not complete in time, or whose counts do not add up."""


# -- layouts -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Group:
    """One pull consumer: its filter subjects and the tenants they cover."""

    filters: list[str]
    tenants: list[str]

    @property
    def window(self) -> int:
        return min(WINDOW * len(self.tenants), MAX_ACK_PENDING)


@dataclass(frozen=True, slots=True)
class Layout:
    name: str
    kind: Kind
    shards: int = 0  # pull: 0 is one consumer per tenant
    partitioned: bool = False  # pull: the stream's shards, one filter each
    shared: bool = False  # pull: one consumer over all subjects
    mix: bool = False  # pull: dedicated consumers for `backlogged`, one shared for the rest
    delete: bool = True  # direct: delete each message read

    def groups(self, tenants: list[str], backlogged: list[str]) -> list[Group]:
        """The pull consumers for `tenants`."""
        if self.shared:
            return [Group([SUBJECTS.all_stored], tenants)]
        if self.partitioned:
            shards = BROKER.intake_shards
            members = {
                shard: [t for t in tenants if broker_shard_of(t, shards) == shard]
                for shard in range(shards)
            }
            return [
                Group([SUBJECTS.shard_filter(shard)], names)
                for shard, names in members.items()
                if names
            ]
        if self.mix:
            rest = [t for t in tenants if t not in backlogged]
            return [*map(own_group, backlogged), *([tenant_group(rest)] if rest else [])]
        if not self.shards:
            return [own_group(t) for t in tenants]
        shards: dict[int, list[str]] = {}
        for tenant in tenants:
            shards.setdefault(shard_of(tenant, self.shards), []).append(tenant)
        return [tenant_group(members) for _, members in sorted(shards.items())]


def own_group(tenant: str) -> Group:
    return tenant_group([tenant])


def tenant_group(tenants: list[str]) -> Group:
    return Group([SUBJECTS.stored_tenant_filter(t) for t in tenants], tenants)


def shard_of(tenant: str, shards: int) -> int:
    # crc32: stable across processes and runs (Python's str hash is salted).
    return zlib.crc32(tenant.encode()) % shards


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("pull-per-tenant", "pull"),
        Layout("push-per-tenant", "push"),
        Layout("pull-shards-16", "pull", shards=16),
        Layout("pull-shards-64", "pull", shards=64),
        Layout("pull-partitioned-16", "pull", partitioned=True),
        Layout("pull-shared", "pull", shared=True),
        Layout("pull-mix", "pull", mix=True),
        Layout("direct-get-delete", "direct"),
        Layout("direct-get-keep", "direct", delete=False),
    )
}


def head_of_line_tenants(layout: Layout, tenants: int) -> tuple[list[str], bool]:
    """Tenant names with A first and newcomer B second, and whether B shares A's consumer
    (B is chosen to share it where the layout makes that possible)."""
    others = tenant_names(tenants - 1)
    if layout.shards or layout.partitioned:
        # The first tenant name that hashes to A's shard stands in for B.
        shard = (
            functools.partial(broker_shard_of, shards=BROKER.intake_shards)
            if layout.partitioned
            else functools.partial(shard_of, shards=layout.shards)
        )
        mates = [t for t in others if shard(t) == shard(BACKLOGGED)]
        if mates:
            others.remove(mates[0])
            return [BACKLOGGED, mates[0], *others], True
        return [BACKLOGGED, *others], False
    names = [BACKLOGGED, NEWCOMER, *others[1:]]
    return names, layout.shared


# -- the consumer side (a fresh process per measurement) -----------------------------------


@dataclass(slots=True)
class Tally:
    """What the consumer has taken: done once `want` distinct messages, or `watch`, came."""

    want: int | None
    watch: str | None
    seen: set[str] = field(default_factory=set)
    deliveries: int = 0
    before_watch: int | None = None
    statuses: Counter[str] = field(default_factory=Counter)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None

    def count(self, msg_id: str) -> None:
        self.deliveries += 1
        self.seen.add(msg_id)
        if msg_id == self.watch and self.before_watch is None:
            self.before_watch = self.deliveries - 1
            self.done.set()
        elif self.want is not None and len(self.seen) >= self.want:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        """End the measurement at once with `error` (raised by the consumer process)."""
        self.error = error
        self.done.set()


class LayoutIntake:
    """What `consume` does with a layout's intake: setup (before go), start, stop; the
    JetStream API requests it made per kind (direct gets and deletes)."""

    consumers = 0

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.requests = Counter[str]()

    async def setup(self) -> None:
        """Nothing to make before go."""

    async def start(self, tally: Tally) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        """Nothing of its own runs."""


class PullIntake(LayoutIntake):
    """Durable pull consumers with standing pulls into one wildcard inbox, each consumer
    holding `Group.window` credits, topped up once they fell to half."""

    def __init__(self, nc: NATS, groups: list[Group], expires_s: float) -> None:
        super().__init__(nc)
        self.groups = groups
        self.expires_s = expires_s
        self.credits = [0] * len(groups)
        self.consumers = len(groups)
        # A delivered message keeps its stream subject: its tenant tells its consumer.
        self.group_of = {tenant: n for n, group in enumerate(groups) for tenant in group.tenants}
        self.inbox = nc.new_inbox()
        self.tally: Tally | None = None

    async def setup(self) -> None:
        configs = []
        for n, group in enumerate(self.groups):
            # As the dispatcher makes its consumers; several filters as FilterSubjects.
            config = ConsumerSpec(f"il~{n}", group.filters[0], LIMITS).config()
            if len(group.filters) > 1:
                config = dataclasses.replace(
                    config, filter_subject=None, filter_subjects=group.filters
                )
            configs.append(config)
        await create_consumers(self.nc, configs)

    async def start(self, tally: Tally) -> None:
        self.tally = tally
        await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_message)
        for n, group in enumerate(self.groups):
            await self._pull(n, group.window)

    async def _pull(self, n: int, credits: int) -> None:
        self.credits[n] += credits
        await self.nc.publish(
            jetstream.pull_subject(STREAM, f"il~{n}"),
            jetstream.pull_request(credits, self.expires_s),
            reply=f"{self.inbox}.{n}",
        )

    async def _on_message(self, msg: Msg) -> None:
        assert self.tally is not None
        status, _ = jetstream.status_of(msg)
        if status is not None:  # a pull that ended (expired): the run is over by then
            self.tally.statuses[status] += 1
            return
        n = self.group_of[msg.subject.rsplit(".", 1)[1]]
        await msg.ack()
        self.tally.count(msg.headers[HDR_MSG_ID])
        self.credits[n] -= 1
        window = self.groups[n].window
        if self.credits[n] <= window // 2:
            await self._pull(n, window - self.credits[n])


class PushIntake(LayoutIntake):
    """A durable push consumer per tenant with flow control, each delivering to its own
    subject under one inbox; `max_ack_pending` is the tenant's window."""

    def __init__(self, nc: NATS, tenants: list[str]) -> None:
        super().__init__(nc)
        self.tenants = tenants
        self.consumers = len(tenants)
        self.inbox = nc.new_inbox()
        self.tally: Tally | None = None

    async def setup(self) -> None:
        # Nothing is delivered until start subscribes to the deliver subjects.
        await create_consumers(
            self.nc,
            [
                dataclasses.replace(
                    ConsumerSpec(
                        f"il~{n}",
                        SUBJECTS.stored_tenant_filter(tenant),
                        ConsumerLimits(ACK_WAIT_S, WINDOW),
                    ).config(),
                    deliver_subject=f"{self.inbox}.{n}",
                    flow_control=True,
                    idle_heartbeat=PUSH_HEARTBEAT_S,
                )
                for n, tenant in enumerate(self.tenants)
            ],
        )

    async def start(self, tally: Tally) -> None:
        self.tally = tally
        # One subscription each: the server notices a deliver subject's interest that
        # comes after the consumer for a literal subscription, not for a wildcard one.
        for n in range(len(self.tenants)):
            await self.nc.subscribe(f"{self.inbox}.{n}", cb=self._on_message)

    async def _on_message(self, msg: Msg) -> None:
        assert self.tally is not None
        status, _ = jetstream.status_of(msg)
        if status is None:
            await msg.ack()
            self.tally.count(msg.headers[HDR_MSG_ID])
            return
        self.tally.statuses[status] += 1
        # A flow-control request carries a reply; a heartbeat of a stalled consumer names
        # where to answer. Unanswered, the server stops delivering.
        stalled = (msg.headers or {}).get("Nats-Consumer-Stalled")
        for reply in (msg.reply, stalled):
            if reply:
                await self.nc.publish(reply, b"")


class DirectIntake(LayoutIntake):
    """Batch direct gets by subject, every tenant each round, from read positions kept
    here; each message read is deleted (or, `keep`, left in the stream)."""

    def __init__(self, nc: NATS, tenants: list[str], delete: bool) -> None:
        super().__init__(nc)
        self.tenants = tenants
        self.delete = delete
        self.next_seq = dict.fromkeys(tenants, 1)
        self._slots = asyncio.Semaphore(DIRECT_IN_FLIGHT)
        self._task: asyncio.Task[None] | None = None

    async def start(self, tally: Tally) -> None:
        self._task = asyncio.create_task(self._rounds(tally))

    async def _rounds(self, tally: Tally) -> None:
        try:
            async with DirectBatchGet(self.nc, STREAM) as reader:
                while not tally.done.is_set():
                    found = await asyncio.gather(
                        *(self._read(reader, t, tally) for t in self.tenants)
                    )
                    if not any(found):
                        await asyncio.sleep(DIRECT_IDLE_S)
        except (DirectGetError, BenchError, nats.errors.Error) as exc:
            tally.fail(exc)  # not lost in a task nobody awaits: the run fails with it

    async def _read(self, reader: DirectBatchGet, tenant: str, tally: Tally) -> int:
        async with self._slots:
            self.requests["direct get"] += 1
            page = await reader.scan(
                SUBJECTS.stored_tenant_filter(tenant), self.next_seq[tenant], WINDOW
            )
            if not page:
                return 0
            self.next_seq[tenant] = page[-1].seq + 1
            if self.delete:
                await asyncio.gather(*(self._delete(m) for m in page))
        for message in page:
            tally.count(message.headers[HDR_MSG_ID])
        return len(page)

    async def _delete(self, message: StoredMessage) -> None:
        # nats-py's delete_msg erases (overwrites) the message; an ack does not, so neither
        # does this.
        self.requests["delete"] += 1
        reply = await self.nc.request(
            jetstream.msg_delete_subject(STREAM),
            jetstream.msg_delete_request(message.seq),
            timeout=DELETE_TIMEOUT_S,
        )
        error = jetstream.api_error(reply.data)
        if error is not None:
            raise BenchError(f"deleting message {message.seq}: {error}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def create_consumers(nc: NATS, configs: list[ConsumerConfig]) -> None:
    js = nc.jetstream()
    for first in range(0, len(configs), CREATE_IN_FLIGHT):
        await asyncio.gather(
            *(
                js.add_consumer(STREAM, config)
                for config in configs[first : first + CREATE_IN_FLIGHT]
            )
        )


def consume_job(
    url: str,
    layout_name: str,
    tenants: list[str],
    backlogged: list[str],
    want: int | None,
    watch: str | None,
    timeout_s: float,
) -> dict[str, Any]:
    """Spawned-process entry point: plain arguments, plain data back."""
    return asyncio.run(
        consume(url, LAYOUTS[layout_name], tenants, backlogged, want, watch, timeout_s)
    )


async def consume(
    url: str,
    layout: Layout,
    tenants: list[str],
    backlogged: list[str],
    want: int | None,
    watch: str | None,
    timeout_s: float,
) -> dict[str, Any]:
    """Make the layout's consumers, say ready, wait for go; then consume until `want`
    distinct messages (or the message `watch`) came, every one acked or deleted.

    Times from go: `elapsed_s`; `finished_at` is the unix time once the last ack was
    flushed to the server."""
    # Drained on exit: a head-of-line run stops while deliveries are still on their way.
    async with connected(url) as nc:
        go = await nc.subscribe(GO_SUBJECT, max_msgs=1)
        intake: LayoutIntake
        if layout.kind == "pull":
            intake = PullIntake(nc, layout.groups(tenants, backlogged), timeout_s)
        elif layout.kind == "push":
            intake = PushIntake(nc, tenants)
        else:
            intake = DirectIntake(nc, tenants, layout.delete)
        started = time.perf_counter()
        await intake.setup()
        setup_s = time.perf_counter() - started
        await nc.publish(READY_SUBJECT, b"")
        await go.next_msg(timeout=timeout_s)
        meter = CpuMeter({"consumer": "self"})
        meter.start()
        tally = Tally(want, watch)
        started = time.perf_counter()
        await intake.start(tally)
        try:
            async with asyncio.timeout(timeout_s):
                await tally.done.wait()
        except TimeoutError:
            raise BenchError(
                f"{layout.name}: {len(tally.seen)} messages after {timeout_s}s "
                f"(wanted {want or watch})"
            ) from None
        if tally.error is not None:
            raise tally.error
        await nc.flush()
        elapsed_s, finished_at = time.perf_counter() - started, time.time()
        cpu_s = meter.stop()["consumer"]
        await intake.stop()
        return {
            "consumers": intake.consumers,
            "consumed": len(tally.seen),
            "deliveries": tally.deliveries,
            "elapsed_s": elapsed_s,
            "finished_at": finished_at,
            "cpu_s": cpu_s,
            "setup_s": setup_s,
            "before_watch": tally.before_watch,
            "statuses": dict(tally.statuses),
            "requests": dict(intake.requests),
        }


# -- the publisher side (this process) -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    tenant_counts: tuple[int, ...] = (10, 100, 1000)
    layouts: tuple[str, ...] = tuple(LAYOUTS)
    messages: int = 10_000
    backlog: int = 5_000
    # Bound on each measurement's consuming, and on each consumer process.
    timeout_s: float = 120.0


FULL = Settings()
QUICK = Settings(tenant_counts=(10,), messages=1_000, backlog=1_000, timeout_s=30.0)


async def publish(nc: NATS, subjects: list[str]) -> None:
    """One message on each subject, in order, `PUBLISH_IN_FLIGHT` unacked at most."""
    js = nc.jetstream()
    slots = asyncio.Semaphore(PUBLISH_IN_FLIGHT)

    async def one(subject: str, msg_id: str) -> None:
        try:
            await js.publish(subject, BODY, headers={HDR_MSG_ID: msg_id})
        finally:
            slots.release()

    async with asyncio.TaskGroup() as group:
        for n, subject in enumerate(subjects):
            await slots.acquire()
            group.create_task(one(subject, f"m{n}"))


async def until_ready(ready: Any, job: asyncio.Future[Any], timeout_s: float) -> None:
    """Wait for the consumer process's ready, failing early with its error if it died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if job.done():
            job.result()  # raises what the consumer process raised
            raise BenchError("the consumer process ended before it was ready")
        try:
            await ready.next_msg(timeout=POLL_S)
            return
        except nats.errors.TimeoutError:
            continue
    raise BenchError(f"the consumer process was not ready after {timeout_s}s")


async def stream_messages(nc: NATS, expect: int) -> int:
    """Messages left in the stream, once the acks have been applied (or after a bound)."""
    js = nc.jetstream()
    deadline = time.monotonic() + STREAM_EMPTY_WITHIN_S
    while True:
        left = (await js.stream_info(STREAM)).state.messages
        if left == expect or time.monotonic() > deadline:
            return left
        await asyncio.sleep(POLL_S)


async def measure(
    pool: ProcessPoolExecutor, layout: Layout, tenants: int, settings: Settings
) -> dict[str, Any]:
    """The rate run on a fresh server."""
    names = tenant_names(tenants)
    subjects = [SUBJECTS.request(ENDPOINT, names[n % tenants]) for n in range(settings.messages)]
    async with started_consumer(
        pool, layout, names, names[::DEDICATED_EVERY], settings.messages, None, settings.timeout_s
    ) as (server, nc, job):
        assert server.pid is not None
        meter = CpuMeter({"nats-server": server.pid, "publisher": "self"})
        meter.start()
        await nc.publish(GO_SUBJECT, b"")
        first_publish = time.time()
        await publish(nc, subjects)
        publish_s = time.time() - first_publish
        result = await asyncio.wait_for(job, settings.timeout_s + JOB_MARGIN_S)
        cpu = meter.stop()
        server_rss_kb = memory_kb(server.pid)["rss_kb"]
        kept = layout.kind == "direct" and not layout.delete
        left = await stream_messages(nc, settings.messages if kept else 0)
    messages = settings.messages
    return {
        "tenants": tenants,
        "consumers": result["consumers"],
        "published": messages,
        "consumed": result["consumed"],
        "deliveries": result["deliveries"],
        "left_in_stream": left,
        "statuses": result["statuses"],
        "publish_msgs_per_s": messages / publish_s,
        "msgs_per_s": messages / (result["finished_at"] - first_publish),
        "server_cpu_us_per_msg": 1e6 * cpu["nats-server"] / messages,
        "consumer_cpu_us_per_msg": 1e6 * result["cpu_s"] / messages,
        "publisher_cpu_us_per_msg": 1e6 * cpu["publisher"] / messages,
        "server_rss_kb": server_rss_kb,
        "setup_s": result["setup_s"],
        "requests_per_msg": {k: v / messages for k, v in result["requests"].items()},
    }


async def measure_head_of_line(
    pool: ProcessPoolExecutor, layout: Layout, tenants: int, settings: Settings
) -> dict[str, Any]:
    """The head-of-line run on a fresh server: A's backlog and B's one message are stored
    before the consumer starts."""
    names, shares = head_of_line_tenants(layout, tenants)
    subjects = [SUBJECTS.request(ENDPOINT, names[0])] * settings.backlog
    subjects.append(SUBJECTS.request(ENDPOINT, names[1]))
    async with started_consumer(
        pool, layout, names, names[:1], None, f"m{settings.backlog}", settings.timeout_s
    ) as (_, nc, job):
        await publish(nc, subjects)
        await nc.publish(GO_SUBJECT, b"")
        result = await asyncio.wait_for(job, settings.timeout_s + JOB_MARGIN_S)
    return {
        "backlog": settings.backlog,
        "newcomer": names[1],
        "newcomer_shares_consumer": shares,
        "newcomer_after_s": result["elapsed_s"],
        "delivered_before_newcomer": result["before_watch"],
    }


@contextlib.asynccontextmanager
async def started_consumer(
    pool: ProcessPoolExecutor,
    layout: Layout,
    tenants: list[str],
    backlogged: list[str],
    want: int | None,
    watch: str | None,
    timeout_s: float,
) -> AsyncIterator[tuple[EmbeddedNatsServer, NATS, Any]]:
    """A fresh nats-server with the requests stream, a connection to it, and the consumer
    process (`consume`, as a future) once it has made its consumers and waits for go."""
    async with EmbeddedNatsServer() as server:
        nc = await nats.connect(server.url, connect_timeout=5)
        try:
            await apply_stream(nc.jetstream(), requests_stream_config(BROKER))
            ready = await nc.subscribe(READY_SUBJECT, max_msgs=1)
            job = asyncio.get_running_loop().run_in_executor(
                pool,
                consume_job,
                server.url,
                layout.name,
                tenants,
                backlogged,
                want,
                watch,
                timeout_s,
            )
            # Should this run fail, the consumer process ends within its own bounds.
            await until_ready(ready, job, timeout_s)
            yield server, nc, job
        finally:
            await nc.close()


async def run_all(settings: Settings, command: str) -> dict[str, Any]:
    facts = machine_facts(command)
    rows = []
    # A fresh interpreter per consumer (spawn, one task per child): no heap carried over.
    pool = ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1
    )
    with pool:
        for tenants in settings.tenant_counts:
            for name in settings.layouts:
                started = time.monotonic()
                layout = LAYOUTS[name]
                row = {"layout": name, **await measure(pool, layout, tenants, settings)}
                row["head_of_line"] = await measure_head_of_line(pool, layout, tenants, settings)
                rows.append(row)
                print(
                    f"{name} at {tenants} tenants: {row['msgs_per_s']:,.0f} msg/s, newcomer "
                    f"after {1e3 * row['head_of_line']['newcomer_after_s']:.0f} ms "
                    f"({time.monotonic() - started:.1f} s)",
                    file=sys.stderr,
                )
    facts["loadavg_at_end"] = os.getloadavg()
    return {"machine": facts, "settings": asdict(settings), "rows": rows}


def render(summary: dict[str, Any]) -> str:
    facts, settings = summary["machine"], summary["settings"]
    load = " / ".join(f"{a:.2f}" for a in facts["loadavg_at_start"])
    load_end = " / ".join(f"{a:.2f}" for a in facts["loadavg_at_end"])
    machine = (
        f"{facts['date']}, {facts['nproc']} cores ({facts['cpu']}), "
        f"{facts['nats_server']}, nats-py {facts['nats_py']}; load average (1/5/15 min) "
        f"{load} at the start, {load_end} at the end."
    )
    setup = (
        f"Rate: {settings['messages']:,} messages of {len(BODY)} bytes published "
        "round-robin while being consumed. Newcomer: its first message is delivered this "
        f"long after the consumer starts on {settings['backlog']:,} of A's stored before "
        'it ("A before": how many came first; * = B shares A\'s consumer).'
    )
    out = ["# Intake layouts", "", f"`{facts['command']}`", "", machine, "", setup, ""]
    cells = []
    for r in summary["rows"]:
        hol = r["head_of_line"]
        requests = ", ".join(f"{k} {v:.2f}" for k, v in r["requests_per_msg"].items())
        cells.append(
            [
                r["layout"],
                str(r["tenants"]),
                str(r["consumers"]),
                f"{r['msgs_per_s']:,.0f}",
                f"{r['server_cpu_us_per_msg']:.0f}",
                f"{r['consumer_cpu_us_per_msg']:.0f}",
                f"{r['server_rss_kb'] / 1024:.0f}",
                f"{1e3 * hol['newcomer_after_s']:.1f}",
                f"{hol['delivered_before_newcomer']:,}"
                + ("*" if hol["newcomer_shares_consumer"] else ""),
                requests,
            ]
        )
    out += table(
        [
            "layout",
            "tenants",
            "consumers",
            "msg/s",
            "server us/msg",
            "consumer us/msg",
            "server RSS MiB",
            "newcomer ms",
            "A before",
            "API requests per msg",
        ],
        cells,
    )
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.intake_layouts", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="the few-second variant: 10 tenants, 1,000 messages"
    )
    parser.add_argument("--tenants", type=_counts, help="tenant counts, e.g. 10,100,1000")
    parser.add_argument(
        "--layouts", type=_layouts, help=f"comma-separated, of {', '.join(LAYOUTS)} (default: all)"
    )
    parser.add_argument("--messages", type=int, help="messages per rate run (default 10000)")
    parser.add_argument("--backlog", type=int, help="A's backlog (default 5000)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    return parser


def _counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(part) for part in text.split(","))
    if any(count < 2 for count in counts):
        raise argparse.ArgumentTypeError("each tenant count must be at least 2 (A and B)")
    return counts


def _layouts(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    unknown = [name for name in names if name not in LAYOUTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown layouts {unknown}; known: {list(LAYOUTS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = with_overrides(
        QUICK if args.quick else FULL,
        {
            "tenant_counts": args.tenants,
            "layouts": args.layouts,
            "messages": args.messages,
            "backlog": args.backlog,
        },
    )
    if not 1 <= settings.backlog < BROKER.max_queued_per_subject:
        parser.error(
            f"--backlog must be 1..{BROKER.max_queued_per_subject - 1} (A's backlog is one subject)"
        )
    if settings.messages < 1:
        parser.error("--messages must be at least 1")
    summary = asyncio.run(run_all(settings, command_line("bench.intake_layouts", argv)))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / ("quick.json" if args.quick else "summary.json")
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

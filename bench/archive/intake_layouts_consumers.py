"""The layouts of `bench.archive.intake_layouts` and the consumer process that reads the
requests stream in each: pull consumers per tenant, per hashed shard, per stored shard,
shared or mixed; push consumers per tenant; or no consumer, batch direct gets. The
process makes its consumers, says ready, waits for go, then acks (or deletes) every
message it takes until it has what it wants (`consume`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig

from bench.harness.procstat import CpuMeter
from bench.harness.stack import connected
from broker_config import jetstream
from broker_config.config import BrokerSettings, DispatcherOptions
from broker_config.direct_get import DirectBatchGet, DirectGetError, StoredMessage
from broker_config.streams import (
    ConsumerLimits,
    ConsumerSpec,
)
from broker_config.subjects import HDR_MSG_ID
from broker_config.subjects import shard_of as broker_shard_of

BROKER = BrokerSettings()
SUBJECTS = BROKER.subjects
STREAM = SUBJECTS.requests_stream
WINDOW = DispatcherOptions().tenant_window
MAX_ACK_PENDING = DispatcherOptions().max_ack_pending
ACK_WAIT_S = DispatcherOptions().ack_wait_s
# The dispatcher's consumer limits (dispatcher.service).
LIMITS = ConsumerLimits(ACK_WAIT_S, MAX_ACK_PENDING)
# Consumers made concurrently, as the dispatcher's intake makes them.
CREATE_IN_FLIGHT = 64
PUSH_HEARTBEAT_S = 5.0
DIRECT_IN_FLIGHT = 128
# A direct-get round that found nothing waits this long before the next (no long poll).
DIRECT_IDLE_S = 0.005
DELETE_TIMEOUT_S = 5.0
# The consumer process and this one meet on core subjects: made its consumers, go.
READY_SUBJECT = "bench.archive.intake_layouts.ready"
GO_SUBJECT = "bench.archive.intake_layouts.go"
Kind = Literal["pull", "push", "direct"]


class BenchError(RuntimeError):
    """A measurement that did not complete in time, or whose counts do not add up."""


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


@dataclass(frozen=True, slots=True)
class Job:
    """What the consumer process does (plain data: it crosses into a spawned process):
    read `tenants` in `layout` (`backlogged` ones get their own consumer in the mix)
    until `want` distinct messages, or the message `watch`, came, within `timeout_s`."""

    layout: str
    tenants: list[str]
    backlogged: list[str]
    want: int | None
    watch: str | None
    timeout_s: float


def consume_job(url: str, job: Job) -> dict[str, Any]:
    """Spawned-process entry point: plain arguments, plain data back."""
    return asyncio.run(consume(url, job))


async def consume(url: str, job: Job) -> dict[str, Any]:
    """Make the layout's consumers, say ready, wait for go; then consume until `want`
    distinct messages (or the message `watch`) came, every one acked or deleted.

    Times from go: `elapsed_s`; `finished_at` is the unix time once the last ack was
    flushed to the server."""
    # Drained on exit: a head-of-line run stops while deliveries are still on their way.
    async with connected(url) as nc:
        go = await nc.subscribe(GO_SUBJECT, max_msgs=1)
        intake: LayoutIntake
        layout, timeout_s = LAYOUTS[job.layout], job.timeout_s
        if layout.kind == "pull":
            intake = PullIntake(nc, layout.groups(job.tenants, job.backlogged), timeout_s)
        elif layout.kind == "push":
            intake = PushIntake(nc, job.tenants)
        else:
            intake = DirectIntake(nc, job.tenants, layout.delete)
        started = time.perf_counter()
        await intake.setup()
        setup_s = time.perf_counter() - started
        await nc.publish(READY_SUBJECT, b"")
        await go.next_msg(timeout=timeout_s)
        meter = CpuMeter({"consumer": "self"})
        meter.start()
        tally = Tally(job.want, job.watch)
        started = time.perf_counter()
        await intake.start(tally)
        try:
            async with asyncio.timeout(timeout_s):
                await tally.done.wait()
        except TimeoutError:
            raise BenchError(
                f"{layout.name}: {len(tally.seen)} messages after {timeout_s}s "
                f"(wanted {job.want or job.watch})"
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

"""Intake: the requests stream read through a few shard consumers, each tenant's waiting
requests bounded by a window, a flooding tenant's excess moved aside.

    async with Intake(nc, subjects, handler=..., queued=..., in_hand=...) as intake:
        ...                           # handler(batch) is called with arrived messages
        await intake.top_up(tenant)   # after the dispatcher took some of its queue

Why shards: nats-server's cost per delivered message grows with the number of consumers
that have a pull waiting (docs/benchmarks.md, "Intake layouts": about 600 us per message
with 1,000 pull consumers against 30 with 10). The requests stream stores a tenant's
requests as `<prefix>.q.<shard>.<endpoint>.<tenant>`, the shard a hash of the tenant
(the stream's subject transform), and each shard is read by one durable pull consumer.

Head of line: a shard consumer delivers in stream order, so a request behind another
tenant's deep backlog in the same shard is reached only by reading through that backlog.
Each tenant has a window of waiting requests here (arrived, being admitted, or queued in
the scheduler). What arrives for a tenant holding twice its window, or with requests
already parked, is moved to the parked stream (dispatcher/park.py), from which a
consumer of its own (one per parked tenant, only while it has parked requests) brings
them back, in order, as its window drains. Memory per tenant is thus bounded by twice
the window plus what it runs.

Lazy reading: a shard is read only as far as one of its tenants needs. A pull asks for
the room (window minus waiting, once at most half the window waits) of the shard's
tenants known to have requests in the stream: from the subject listing, and from
deliveries (a pull used up by a tenant's messages means it has more). A shard whose
waiting tenants are all full is not read: a lone flood stays in the stream, and nothing
is moved unless another tenant waits behind it. A shard with nothing known to wait keeps
a standing pull of one window, so a new tenant's first request arrives the moment it is
stored; one that starts sending behind a full tenant in a shard not being read is found
by the next listing, within `list_s`. A pull that expires unused says the shard has
nothing more, which corrects the estimates.

Listing: every `list_s` both streams' subjects are listed with counts: the backlog per
(endpoint, tenant) for admission and the depth API, the tenants waiting in each shard
(their stored requests minus what the dispatcher holds of them), tenants with parked
requests (after a restart), and shards that hold requests but are not configured (the
shard count was changed, or requests stored before shards existed).

Pulls: every consumer gets a standing pull request (`$JS.API.CONSUMER.MSG.NEXT`) whose
replies go to `<inbox>.<consumer>` under one wildcard subscription; the server pushes a
message the moment it is stored.

Drain order on exit: stop listing, let the hand-over task finish its batch and the move
task its moves; drain the inbox subscription (what is on its way is still queued here;
the server drops the outstanding pulls with their interest); nak what arrived but was
not handed over or moved, so another dispatcher gets it at once; close the mover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import APIError

from broker_config import jetstream
from broker_config.streams import ConsumerLimits, ConsumerSpec, ensure_consumer
from broker_config.subjects import Subjects
from dispatcher.park import Park, restore

log = logging.getLogger("fairq.intake")

# A pull whose expiry status is this much overdue was lost (a reconnect, a server restart).
PULL_LOST_MARGIN_S = 2.0
# After a 409 (consumer deleted, leadership change...), wait this long before pulling again.
PULL_RETRY_S = 1.0
# A pull to a consumer that does not exist (any more): no responders, not found.
CONSUMER_GONE = (jetstream.NO_RESPONDERS, jetstream.NOT_FOUND)
# The shard of requests stored before the requests stream had shards (`<prefix>.req.*.*`).
UNSHARDED = "unsharded"
# The server removes a parked tenant's consumer after this long without pulls.
PARKED_CONSUMER_IDLE_S = 60.0

Handler = Callable[[list[Msg]], Awaitable[None]]


@dataclass(slots=True)
class Pull:
    """A durable consumer and its outstanding pull request: a shard's, or (`tenant`) one
    tenant's parked requests."""

    consumer: str
    stream: str
    tenant: str = ""
    requested: int = 0  # credits left on the outstanding pull
    pull_deadline: float = 0.0
    retry_at: float = 0.0
    gone: bool = False  # the consumer must be made again
    last_tenant: str = ""  # shard: whose message came last
    tenants: set[str] = field(default_factory=set)  # shard: tenants with stored requests


@dataclass(slots=True)
class Tenant:
    name: str  # the subject token: a valid tenant name or not (admission answers those)
    shard: str = ""
    arrived: deque[Msg] = field(default_factory=deque)
    handing_over: int = 0  # arrived messages the handler is working on
    ready: bool = False  # in the hand-over ring
    waiting: int = 0  # its requests in its shard not delivered yet, as far as known
    parked: int = 0  # its requests in the parked stream not delivered back yet
    moving: int = 0  # its requests being moved to the parked stream
    parked_pull: Pull | None = None


class Intake:
    def __init__(self, nc: NATS, subjects: Subjects, *,
                 handler: Handler,
                 queued: Callable[[str], int],
                 in_hand: Callable[[], Counter[tuple[bool, str]]],
                 shards: int = 16,
                 limits: ConsumerLimits = ConsumerLimits(max_ack_pending=10_000),
                 parked_limits: ConsumerLimits = ConsumerLimits(),
                 window: int = 64,
                 batch: int = 256,
                 expires_s: float = 10.0,
                 list_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.handler = handler
        self.queued = queued
        self.in_hand = in_hand  # (parked?, tenant) -> messages the dispatcher holds
        self.shard_count = shards
        self.limits = limits
        self.parked_limits = ConsumerLimits(
            parked_limits.ack_wait_s, parked_limits.max_ack_pending, parked_limits.max_deliver,
            inactive_threshold_s=PARKED_CONSUMER_IDLE_S)
        self.window = window
        self.batch = batch
        self.expires_s = expires_s
        self.list_s = list_s
        self.clock = clock
        self.tenants: dict[str, Tenant] = {}
        self.shards: dict[str, Pull] = {}
        # (endpoint, tenant) -> unfinished requests in both streams, as of the last listing.
        self.backlog: dict[tuple[str, str], int] = {}
        self._pulls: dict[str, Pull] = {}  # by consumer name
        self._ready: deque[Tenant] = deque()
        self._arrivals = asyncio.Event()
        self._to_move: list[tuple[Tenant, Msg]] = []
        self._moves = asyncio.Event()
        self._park = Park(nc, subjects)
        self._open = False
        self._inbox = ""
        self._reconnects = 0
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Intake:
        self._inbox = self.nc.new_inbox()
        await self._stack.enter_async_context(self._park)
        # Unbounded pending queue: the server bounds it (shards x max_ack_pending).
        subscription = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_message,
                                               pending_msgs_limit=0, pending_bytes_limit=0)
        self._stack.push_async_callback(self._nak_arrived)
        # Drain, not unsubscribe: what is already on its way is queued here, then nak'd.
        self._stack.push_async_callback(subscription.drain)
        self._stack.push_async_callback(self._stop_tasks)
        self._open = True
        self._reconnects = self.nc.stats["reconnects"]
        try:
            for shard in range(self.shard_count):
                await self._add_shard(str(shard))
            await self._list()
        except BaseException:
            await self._stack.aclose()
            raise
        self._tasks = [asyncio.create_task(self._hand_over_loop(), name="intake-hand-over"),
                       asyncio.create_task(self._move_loop(), name="intake-move"),
                       asyncio.create_task(self._care_loop(), name="intake-care")]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop intake (idempotent): the drain of the module docstring."""
        await self._stack.aclose()

    async def _stop_tasks(self) -> None:
        # The hand-over and move tasks are not cancelled: they finish what they hold (a
        # batch cut off halfway would wait for its ack wait to be redelivered).
        self._open = False
        self._arrivals.set()
        self._moves.set()
        if not self._tasks:
            return  # the start failed before they were made
        *finishing, care = self._tasks
        care.cancel()
        await asyncio.gather(*finishing, care, return_exceptions=True)

    async def _nak_arrived(self) -> None:
        tenants = {id(t): t for t in [*self.tenants.values(), *self._ready]}.values()
        msgs = [msg for tenant in tenants for msg in tenant.arrived]
        msgs += [msg for _, msg in self._to_move]
        for msg in msgs:
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()

    # -- consumers -----------------------------------------------------------------------

    async def _add_shard(self, key: str) -> None:
        spec = (ConsumerSpec(f"{self.subjects.prefix}~shard~{UNSHARDED}",
                             self.subjects.all_requests, self.limits)
                if key == UNSHARDED else ConsumerSpec.for_shard(self.subjects, int(key),
                                                                self.limits))
        await ensure_consumer(self.js, self.subjects.requests_stream, spec)
        pull = self.shards.get(key) or Pull(spec.durable, self.subjects.requests_stream)
        pull.gone = False
        self.shards[key] = self._pulls[spec.durable] = pull
        await self._pull(pull)

    async def _add_parked(self, tenant: Tenant) -> bool:
        spec = ConsumerSpec.for_parked(self.subjects, tenant.name, self.parked_limits)
        try:
            await ensure_consumer(self.js, self.subjects.parked_stream, spec)
        except Exception as exc:
            log.error("cannot make the parked consumer of tenant %r: %s", tenant.name, exc)
            return False
        tenant.parked_pull = self._pulls[spec.durable] = Pull(
            spec.durable, self.subjects.parked_stream, tenant=tenant.name)
        return True

    def _tenant(self, name: str, shard: str = "") -> Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(name)
        if shard and tenant.shard != shard:
            if tenant.shard in self.shards:
                self.shards[tenant.shard].tenants.discard(name)
            tenant.shard = shard
            self.shards[shard].tenants.add(name)
        return tenant

    # -- listing -------------------------------------------------------------------------

    async def _list(self) -> None:
        before = self.in_hand()
        stored = await self._subjects(self.subjects.requests_stream, f"{self.subjects.prefix}.>")
        parked = await self._subjects(self.subjects.parked_stream, self.subjects.all_parked)
        held = before | self.in_hand()  # max of both: messages acked or delivered meanwhile
        backlog: Counter[tuple[str, str]] = Counter()
        waiting: dict[str, dict[str, int]] = {key: {} for key in self.shards}
        for subject, count in stored.items():
            parts = subject.split(".")
            key, endpoint, name = ((UNSHARDED, *parts[2:]) if len(parts) == 4
                                   else (parts[2], *parts[3:]))
            backlog[(endpoint, name)] += count
            waiting.setdefault(key, {}).setdefault(name, 0)
            waiting[key][name] += count
        for key, counts in waiting.items():
            if key not in self.shards:
                await self._add_shard(key)
            shard = self.shards[key]
            for name in shard.tenants - counts.keys():
                self.tenants[name].waiting = 0
            for name, count in counts.items():
                tenant = self._tenant(name, key)
                tenant.waiting = max(0, count - held[(False, name)] - self._holding(tenant)
                                     - tenant.moving)
        parked_by: Counter[str] = Counter()
        for subject, count in parked.items():
            _, _, endpoint, name = subject.split(".")
            backlog[(endpoint, name)] += count
            parked_by[name] += count
        for name, count in parked_by.items():
            tenant = self._tenant(name)
            unseen = count - held[(True, name)] - self._holding(tenant)
            if tenant.parked < unseen:  # after a restart: they were parked before it
                tenant.parked = unseen
        self.backlog = dict(backlog)
        for pull in [*self._pulls.values()]:
            await self._pull(pull)

    async def _subjects(self, stream: str, subjects_filter: str) -> dict[str, int]:
        info = await self.js.stream_info(stream, subjects_filter=subjects_filter)
        return info.state.subjects or {}

    async def _care_loop(self) -> None:
        while self._open:
            await asyncio.sleep(self.list_s)
            try:
                await self._list()
            except (nats.errors.Error, APIError, asyncio.TimeoutError) as exc:
                log.warning("listing the request subjects failed: %s", exc)
            await self._tick()

    async def _tick(self) -> None:
        """Find lost pulls, make gone shard consumers again, forget idle tenants."""
        now = self.clock()
        reconnects = self.nc.stats["reconnects"]
        reconnected, self._reconnects = reconnects != self._reconnects, reconnects
        for pull in list(self._pulls.values()):
            if pull.requested and (reconnected or now > pull.pull_deadline):
                pull.requested = 0  # the server forgot it: ask again
            if pull.gone and not pull.tenant and now >= pull.retry_at:
                key = next(k for k, shard in self.shards.items() if shard is pull)
                try:
                    await self._add_shard(key)
                except Exception as exc:
                    pull.retry_at = now + PULL_RETRY_S
                    log.error("cannot make the consumer of shard %s again: %s", key, exc)
            await self._pull(pull)
        for tenant in list(self.tenants.values()):
            if tenant.parked and tenant.parked_pull is None:
                await self._add_parked(tenant)
            if not (tenant.ready or tenant.handing_over or tenant.waiting or tenant.parked
                    or tenant.moving or self.queued(tenant.name)):
                self._forget(tenant)

    def _forget(self, tenant: Tenant) -> None:
        del self.tenants[tenant.name]
        if tenant.shard in self.shards:
            self.shards[tenant.shard].tenants.discard(tenant.name)
        if tenant.parked_pull is not None:
            self._pulls.pop(tenant.parked_pull.consumer, None)

    # -- pulls ---------------------------------------------------------------------------

    def _holding(self, tenant: Tenant) -> int:
        return len(tenant.arrived) + tenant.handing_over

    def _room(self, tenant: Tenant) -> int:
        """What `tenant` may still take in, once at most half its window waits."""
        waiting = self._holding(tenant) + self.queued(tenant.name)
        return self.window - waiting if waiting <= self.window // 2 else 0

    def _credits(self, pull: Pull) -> int:
        if pull.tenant:  # parked: its room, while it has parked requests
            tenant = self.tenants.get(pull.tenant)
            if tenant is None or not (tenant.parked or tenant.moving):
                return 0
            return self._room(tenant)
        waiting = [self.tenants[name] for name in pull.tenants if self.tenants[name].waiting]
        if not waiting:
            return self.window  # a standing pull: a new tenant's request arrives at once
        # A parked tenant's requests in the shard would only be moved: no room for them.
        credits = sum(self._room(t) for t in waiting if not (t.parked or t.moving))
        return min(credits, self.limits.max_ack_pending)

    async def top_up(self, tenant: str) -> None:
        """Pull more for `tenant` (its shard, its parked requests) if its window has room."""
        found = self.tenants.get(tenant)
        if found is not None:
            if found.parked_pull is not None:
                await self._pull(found.parked_pull)
            if found.shard in self.shards:
                await self._pull(self.shards[found.shard])

    async def _pull(self, pull: Pull) -> None:
        if not self._open or pull.requested or pull.gone or self.clock() < pull.retry_at:
            return
        credits = self._credits(pull)
        if credits <= 0:
            return
        pull.requested = credits
        pull.pull_deadline = self.clock() + self.expires_s + PULL_LOST_MARGIN_S
        try:
            await self.nc.publish(jetstream.pull_subject(pull.stream, pull.consumer),
                                  jetstream.pull_request(credits, self.expires_s),
                                  reply=f"{self._inbox}.{pull.consumer}")
        except nats.errors.Error as exc:
            pull.requested = 0
            pull.retry_at = self.clock() + PULL_RETRY_S
            log.warning("pull on %s not sent: %s", pull.consumer, exc)

    # -- arrivals ------------------------------------------------------------------------

    async def _on_message(self, msg: Msg) -> None:
        if not msg.reply:  # a status for one of our pull requests, on `<inbox>.<consumer>`
            pull = self._pulls.get(msg.subject.rsplit(".", 1)[1])
            if pull is not None:
                await self._on_status(pull, msg)
            return
        pull = self._pulls.get(jetstream.consumer_of(msg.reply))
        if pull is not None:
            pull.requested = max(0, pull.requested - 1)
        # (A parked tenant forgotten meanwhile has no pull any more; its message goes on.)
        if self.subjects.is_parked(msg.subject):
            tenant = self._tenant(msg.subject.rsplit(".", 1)[1])
            tenant.parked = max(0, tenant.parked - 1)
            self._arrive(tenant, restore(msg))
        else:
            key = self._shard_of(msg.subject)
            tenant = self._tenant(msg.subject.rsplit(".", 1)[1], key)
            tenant.waiting = max(0, tenant.waiting - 1)
            full = self._holding(tenant) + self.queued(tenant.name) >= 2 * self.window
            # A redelivery (handed back by a dispatcher that stopped) is older than what
            # was moved after it: it is not moved behind that unless the tenant is full.
            redelivered = jetstream.delivery_of(msg.reply)[1] > 1
            if full or ((tenant.parked or tenant.moving) and not redelivered):
                tenant.moving += 1
                self._to_move.append((tenant, msg))
                self._moves.set()
            else:
                self._arrive(tenant, msg)
            if pull is not None:
                pull.last_tenant = tenant.name
                if not pull.requested:  # used up: whoever came last has more, likely
                    tenant.waiting = max(1, tenant.waiting)
                    await self._pull(pull)

    def _shard_of(self, subject: str) -> str:
        parts = subject.split(".")
        return parts[2] if len(parts) == 5 else UNSHARDED

    def _arrive(self, tenant: Tenant, msg: Msg) -> None:
        tenant.arrived.append(msg)
        if not tenant.ready:
            tenant.ready = True
            self._ready.append(tenant)
        self._arrivals.set()

    async def _on_status(self, pull: Pull, msg: Msg) -> None:
        status, description = jetstream.status_of(msg)
        unused, pull.requested = pull.requested, 0
        if status == jetstream.REQUEST_TIMEOUT:
            if unused:  # the consumer had nothing more to deliver
                if not pull.tenant:
                    for name in pull.tenants:
                        self.tenants[name].waiting = 0
                elif pull.tenant in self.tenants and not self.tenants[pull.tenant].moving:
                    self.tenants[pull.tenant].parked = 0
            await self._pull(pull)  # keep one standing
            return
        log.warning("pull on %s ended: %s %s", pull.consumer, status, description)
        if status in CONSUMER_GONE or "deleted" in description.lower():
            # What was delivered through the old consumer is redelivered through the new.
            pull.gone = True
            if pull.tenant:
                tenant = self.tenants.get(pull.tenant)
                if tenant is not None and tenant.parked_pull is pull:
                    tenant.parked_pull = None
                self._pulls.pop(pull.consumer, None)
        pull.retry_at = self.clock() + PULL_RETRY_S

    # -- moving to the parked stream -----------------------------------------------------

    async def _move_loop(self) -> None:
        while self._open or self._to_move:
            await self._moves.wait()
            self._moves.clear()
            if not self._open:
                return  # what waits is nak'd on exit
            while self._to_move:
                moving, self._to_move = self._to_move, []
                for tenant in {tenant.name: tenant for tenant, _ in moving}.values():
                    if tenant.parked_pull is None:
                        await self._add_parked(tenant)  # else made again by the next tick
                moved = await self._park.move([msg for _, msg in moving])
                for (tenant, _), ok in zip(moving, moved):
                    tenant.moving -= 1
                    tenant.parked += ok
                for tenant in {tenant.name: tenant for tenant, _ in moving}.values():
                    if tenant.parked_pull is not None:
                        await self._pull(tenant.parked_pull)

    # -- hand-over -----------------------------------------------------------------------

    def _take(self) -> list[Msg]:
        """Up to `batch` arrived messages, one tenant at a time round-robin."""
        taken: list[Msg] = []
        while self._ready and len(taken) < self.batch:
            tenant = self._ready.popleft()
            taken.append(tenant.arrived.popleft())
            tenant.handing_over += 1
            if tenant.arrived:
                self._ready.append(tenant)
            else:
                tenant.ready = False
        return taken

    async def _hand_over_loop(self) -> None:
        while self._open:
            await self._arrivals.wait()
            self._arrivals.clear()
            while self._ready and self._open:
                batch = self._take()
                try:
                    await self.handler(batch)
                except Exception:
                    log.exception("intake handler failed; its messages will be redelivered")
                for name in {msg.subject.rsplit(".", 1)[1] for msg in batch}:
                    tenant = self.tenants.get(name)
                    if tenant is not None:
                        tenant.handing_over = 0
                        await self.top_up(name)

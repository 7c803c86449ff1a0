"""Intake: the requests stream read through a few shard consumers, each tenant's waiting
requests bounded by a window, a flooding tenant's excess moved aside.

    async with Intake(nc, subjects, handler=..., queued=..., in_hand=...) as intake:
        ...                           # handler(batch) is called with arrived messages
        await intake.top_up(tenant)   # after the dispatcher took some of its queue

docs/architecture.md ("Intake") explains the design and the measurements behind it:

- Shards: nats-server's cost per message grows with the number of consumers, so the
  requests stream stores a tenant's requests as `<prefix>.q.<shard>.<endpoint>.<tenant>`
  (subject transform) and each shard has one durable pull consumer.
- Windows: a tenant's waiting requests here (arrived, being admitted, queued in the
  scheduler) are bounded; what arrives for a tenant holding twice its window, or with
  requests parked, is moved to the parked stream (dispatcher/intake/park.py), from which a
  consumer of its own brings them back in order as its window drains.
- Lazy reading: a shard pull asks for the room of the shard's tenants known to have
  requests not yet delivered (listing, deliveries); a shard whose waiting tenants are
  all full is not read (a lone flood stays in the stream) and is listed every
  STALLED_POLL_S for new tenants; one with nothing known to wait keeps a standing pull.
  Both streams are listed every `list_s` (estimates, backlogs).
- Pulls: one standing pull per consumer, replies through one inbox (dispatcher/intake/pulls.py).

Drain order on exit: stop listing; the hand-over and move tasks finish what they hold;
drain the pulls' subscription; nak what arrived but was not handed over or moved (another
dispatcher gets it at once); close the mover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import APIError

from broker_config import jetstream
from broker_config.streams import ConsumerLimits, ConsumerSpec, ensure_consumer
from broker_config.subjects import Subjects
from dispatcher.intake.arrivals import Arrivals, HandOver
from dispatcher.intake.park import Moved, Park, restore
from dispatcher.intake.pulls import Pull, StandingPulls

log = logging.getLogger("fairq.intake")

# A shard whose consumer could not be made is tried again (sooner if the broker was mute).
CONSUMER_RETRY_S, BROKER_RETRY_S = 30.0, 2.0
# How often the shards that are not being read are listed for new tenants.
STALLED_POLL_S = 0.1
# The server removes a parked tenant's consumer after this long without pulls.
PARKED_CONSUMER_IDLE_S = 60.0


@dataclass(slots=True)
class Tenant(Arrivals):
    # `name` is the subject token: a valid tenant name or not (admission answers those).
    shard: str = ""
    waiting: int = 0  # its requests in its shard not delivered yet, as far as known
    parked: int = 0  # its requests in the parked stream not delivered back yet
    moving: int = 0  # its requests being moved to the parked stream
    parked_pull: Pull | None = None


class Intake:
    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        *,
        handler: Callable[[list[Msg]], Awaitable[None]],
        queued: Callable[[str], int],
        in_hand: Callable[[], Counter[tuple[bool, str]]],
        shards: int = 16,
        limits: ConsumerLimits = ConsumerLimits(max_ack_pending=10_000),
        parked_limits: ConsumerLimits = ConsumerLimits(),
        window: int = 64,
        batch: int = 256,
        expires_s: float = 10.0,
        list_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.queued = queued
        self.in_hand = in_hand  # (parked?, tenant) -> messages the dispatcher holds
        self.shard_count = shards
        self.limits = limits
        self.parked_limits = replace(parked_limits, inactive_threshold_s=PARKED_CONSUMER_IDLE_S)
        self.window = window
        self.list_s = list_s
        self.clock = clock
        self._pulls = StandingPulls(
            nc,
            on_message=self._on_message,
            on_expired=self._on_expired,
            expires_s=expires_s,
            clock=clock,
        )
        self.tenants: dict[str, Tenant] = {}
        self.shards: dict[str, Pull] = {}
        # (endpoint, tenant) -> unfinished requests in both streams, as of the last listing.
        self.backlog: dict[tuple[str, str], int] = {}
        self._hand_over = HandOver(handler, batch=batch, after=self.top_up)
        self._to_move: list[tuple[Tenant, Msg]] = []
        self._moves = asyncio.Event()
        self._park = Park(nc, subjects)
        self._open = False
        self._held: Counter[tuple[bool, str]] = Counter()  # as of the last listing
        self._stack = contextlib.AsyncExitStack()
        self._finishing: list[asyncio.Task] = []
        self._cancelled: list[asyncio.Task] = []

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Intake:
        await self._stack.enter_async_context(self._park)
        self._stack.push_async_callback(self._nak_arrived)
        await self._stack.enter_async_context(self._pulls)
        self._stack.push_async_callback(self._stop_tasks)
        try:
            # Every consumer first, the listing's too, then the pulls: what a consumer of
            # the last release held is redelivered before anything is read.
            for shard in range(self.shard_count):
                await self._add_shard(str(shard), strict=True)
            await self._list()
            self._open = True
            for pull in [*self._pulls.by_consumer.values()]:
                await self._pull(pull)
        except BaseException:
            await self._stack.aclose()
            raise
        self._finishing = [
            asyncio.create_task(self._hand_over.run(), name="intake-hand-over"),
            asyncio.create_task(self._move_loop(), name="intake-move"),
        ]
        self._cancelled = [
            asyncio.create_task(self._care_loop(), name="intake-care"),
            asyncio.create_task(self._watch_stalled(), name="intake-stalled"),
        ]
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
        self._hand_over.stop()
        self._moves.set()
        for task in self._cancelled:
            task.cancel()
        await asyncio.gather(*self._finishing, *self._cancelled, return_exceptions=True)

    async def _nak_arrived(self) -> None:
        # The hand-over ring holds known tenants only: a ready tenant is never forgotten.
        msgs = [msg for tenant in self.tenants.values() for msg in tenant.arrived]
        for msg in msgs + [msg for _, msg in self._to_move]:
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()

    # -- consumers -----------------------------------------------------------------------

    async def _add_shard(self, key: str, *, strict: bool = False) -> None:
        """Make the shard's consumer and pull; on a failure it is tried again later by the
        tick, or, `strict` (at start), a refused setting raises."""
        spec = ConsumerSpec.for_shard(self.subjects, key, self.limits)
        pull = self.shards.setdefault(
            key, Pull(spec.durable, self.subjects.requests_stream, spec.filter_subject, gone=True)
        )
        try:
            await ensure_consumer(self.js, self.subjects.requests_stream, spec)
        except Exception as exc:
            if strict and not jetstream.unanswered(exc):
                raise
            retry_s = BROKER_RETRY_S if jetstream.unanswered(exc) else CONSUMER_RETRY_S
            pull.retry_at = self.clock() + retry_s
            log.error(
                "cannot make the consumer of shard %s (trying again in %gs): %r", key, retry_s, exc
            )
            return
        self._pulls.add(pull)
        await self._pull(pull)

    async def _add_parked(self, tenant: Tenant) -> None:
        spec = ConsumerSpec.for_parked(self.subjects, tenant.name, self.parked_limits)
        try:
            await ensure_consumer(self.js, self.subjects.parked_stream, spec)
        except Exception as exc:  # tried again by the next tick
            log.error("cannot make the parked consumer of tenant %r: %s", tenant.name, exc)
            return
        tenant.parked_pull = self._pulls.add(
            Pull(spec.durable, self.subjects.parked_stream, tenant=tenant.name)
        )

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
        settled = {t.name for t in self.tenants.values() if t.parked and not t.moving}
        stored = (
            await self.js.stream_info(self.subjects.requests_stream, subjects_filter=">")
        ).state.subjects or {}
        parked = (
            await self.js.stream_info(self.subjects.parked_stream, subjects_filter=">")
        ).state.subjects or {}
        # The max of both: messages acked or delivered meanwhile.
        self._held = held = before | self.in_hand()
        backlog: Counter[tuple[str, str]] = Counter()
        waiting: defaultdict[str, Counter[str]] = defaultdict(Counter)
        waiting.update((key, Counter()) for key in self.shards)
        for subject, count in stored.items():
            endpoint, name = subject.split(".")[-2:]
            backlog[(endpoint, name)] += count
            waiting[self.subjects.shard_key(subject)][name] += count
        for key, counts in waiting.items():
            if key not in self.shards:
                await self._add_shard(key)
            shard = self.shards[key]
            for name in shard.tenants - counts.keys():
                self.tenants[name].waiting = 0
            for name, count in counts.items():
                tenant = self._tenant(name, key)
                tenant.waiting = max(
                    0, count - held[(False, name)] - self._holding(tenant) - tenant.moving
                )
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
        # Every move of these was stored before the listing, which shows none left: they
        # were taken back, or cancelled in the parked stream.
        for name in settled - parked_by.keys():
            if name in self.tenants and not self.tenants[name].moving:
                self.tenants[name].parked = 0
        self.backlog = dict(backlog)
        for pull in [*self._pulls.by_consumer.values()]:
            await self._pull(pull)

    async def _care_loop(self) -> None:
        while self._open:
            await asyncio.sleep(self.list_s)
            try:
                await self._list()
            except (TimeoutError, nats.errors.Error, APIError) as exc:
                log.warning("listing the request subjects failed: %s", exc)
            except Exception:  # the loop must go on: it also finds lost pulls
                log.exception("listing the request subjects failed")
            await self._tick()

    async def _watch_stalled(self) -> None:
        """List the subjects of each shard that is not being read (its waiting tenants
        are full) every STALLED_POLL_S: a tenant unknown here that starts sending behind
        them is read within that, not the next full listing."""
        while self._open:
            await asyncio.sleep(STALLED_POLL_S)
            for key, shard in list(self.shards.items()):
                if shard.requested or not any(self.tenants[name].waiting for name in shard.tenants):
                    continue
                try:
                    info = await self.js.stream_info(
                        self.subjects.requests_stream, subjects_filter=shard.filter_subject
                    )
                except (TimeoutError, nats.errors.Error, APIError) as exc:
                    log.warning("listing the subjects of shard %s failed: %s", key, exc)
                    continue
                for subject in info.state.subjects or {}:
                    name = subject.rsplit(".", 1)[1]
                    if name not in self.tenants:  # else the full listing knows better
                        self._tenant(name, key).waiting = 1
                await self._pull(shard)

    async def _tick(self) -> None:
        """Find lost pulls, make gone consumers again, forget idle tenants."""
        now = self.clock()
        self._pulls.forget_lost()
        for key, shard in self.shards.items():
            if shard.gone and now >= shard.retry_at:
                await self._add_shard(key)
        for pull in [*self._pulls.by_consumer.values()]:
            await self._pull(pull)
        for tenant in list(self.tenants.values()):
            if tenant.parked_pull is not None and tenant.parked_pull.gone:
                tenant.parked_pull = None
            if tenant.parked and tenant.parked_pull is None:
                await self._add_parked(tenant)
            if not (
                tenant.ready
                or tenant.handing_over
                or tenant.waiting
                or tenant.parked
                or tenant.moving
                or self.queued(tenant.name)
                or self._held[(False, tenant.name)]
                or self._held[(True, tenant.name)]
            ):
                self._forget(tenant)

    def _forget(self, tenant: Tenant) -> None:
        del self.tenants[tenant.name]
        if tenant.shard in self.shards:
            self.shards[tenant.shard].tenants.discard(tenant.name)
        if tenant.parked_pull is not None:
            self._pulls.remove(tenant.parked_pull)

    # -- pulls ---------------------------------------------------------------------------

    def arriving(self) -> list[str]:
        """Tenants with requests not handed to the dispatcher yet, as far as known: in
        their shard, parked, being moved, arrived or being handed over."""
        return [
            tenant.name
            for tenant in self.tenants.values()
            if tenant.waiting or tenant.parked or tenant.moving or self._holding(tenant)
        ]

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
        if self._open and self._pulls.can_send(pull):
            await self._pulls.send(pull, self._credits(pull))

    # -- arrivals ------------------------------------------------------------------------

    async def _on_message(self, pull: Pull | None, msg: Msg) -> None:
        # (A parked tenant forgotten meanwhile has no pull any more; its message goes on.)
        if self.subjects.is_parked(msg.subject):
            tenant = self._tenant(msg.subject.rsplit(".", 1)[1])
            tenant.parked = max(0, tenant.parked - 1)
            self._hand_over.arrive(tenant, restore(msg))
            return
        tenant = self._tenant(msg.subject.rsplit(".", 1)[1], self.subjects.shard_key(msg.subject))
        tenant.waiting = max(0, tenant.waiting - 1)
        full = self._holding(tenant) + self.queued(tenant.name) >= 2 * self.window
        # A redelivery (handed back by a dispatcher that stopped) is older than what was
        # moved after it: it is not moved behind that unless the tenant is full.
        redelivered = jetstream.delivery_of(msg.reply)[1] > 1
        if full or ((tenant.parked or tenant.moving) and not redelivered):
            tenant.moving += 1
            self._to_move.append((tenant, msg))
            self._moves.set()
        else:
            self._hand_over.arrive(tenant, msg)
        if pull is not None and not pull.requested:  # used up: the last tenant has more, likely
            tenant.waiting = max(1, tenant.waiting)
            await self._pull(pull)

    async def _on_expired(self, pull: Pull, unused: int) -> None:
        if unused:  # the consumer had nothing more to deliver
            if not pull.tenant:
                for name in pull.tenants:
                    self.tenants[name].waiting = 0
            elif pull.tenant in self.tenants and not self.tenants[pull.tenant].moving:
                self.tenants[pull.tenant].parked = 0
        await self._pull(pull)  # keep one standing

    # -- moving to the parked stream -----------------------------------------------------

    async def _move_loop(self) -> None:
        while self._open:  # what waits when it stops is nak'd on exit
            await self._moves.wait()
            self._moves.clear()
            while self._to_move and self._open:
                moving, self._to_move = self._to_move, []
                tenants = {tenant.name: tenant for tenant, _ in moving}.values()
                for tenant in tenants:
                    if tenant.parked_pull is None:
                        await self._add_parked(tenant)
                moved = await self._park.move([msg for _, msg in moving])
                for (tenant, msg), outcome in zip(moving, moved):
                    tenant.moving -= 1
                    tenant.parked += outcome is Moved.MOVED
                    if outcome is Moved.REFUSED:
                        self._hand_over.arrive(tenant, msg)
                for tenant in tenants:
                    if tenant.parked_pull is not None:
                        await self._pull(tenant.parked_pull)

"""Intake: one durable pull consumer per tenant, all long-polled at once through one inbox.

    async with TenantIntake(nc, subjects, handler=..., queued=..., listed=...) as intake:
        ...                     # handler(batch) is called with arrived messages
        await intake.top_up(tenant)   # after the dispatcher took some of its queue

Why per tenant: the requests stream keeps one subject per (endpoint, tenant), in publish
order. A single consumer over all of them reads in stream order, so a newcomer published
behind another tenant's deep backlog waits until intake has read that backlog. With one
consumer per tenant (filter `<prefix>.req.*.<tenant>`), each tenant's next requests are
always within reach, however much another tenant has published.

Why one inbox and raw pull requests: a pull subscription per tenant with `fetch` needs a
task per tenant, and `fetch` round-robin blocks on empty consumers. Instead every consumer
gets a standing pull request (`$JS.API.CONSUMER.MSG.NEXT`) whose replies go to
`<inbox>.<consumer>` under one wildcard subscription; the server pushes a message the
moment it is stored, and an idle tenant costs one small pull request per `expires_s`.

Flow control, per tenant: the dispatcher buffers at most `window` of its requests that
are waiting (arrived here, being admitted, or queued in the scheduler) plus the credits
of its outstanding pull. A new pull asks for `window - buffered` once `buffered` fell to
half the window. Running requests do not count against the window (they are bounded by
the consumer's `max_ack_pending`, which the server enforces), so a lone tenant can still
fill every worker. Memory per tenant is thus bounded by `max_ack_pending` messages
whatever it publishes; everything beyond stays in the stream.

Tenants: consumers for the tenants the config lists are made at start. Other tenants (who
may be admitted into a default tier, or must get `unknown_tenant`) are found by listing
the stream's subjects every `discover_s`; their consumers are removed by the server
(`inactive_threshold`) once the dispatcher stopped pulling them after `idle_s` without
a request.

Drain order on exit: stop discovery and let the hand-over task finish its batch; drain
the inbox subscription (what is on its way is still queued here; the server drops the
outstanding pulls with their interest); nak what arrived but was not handed over, so
another dispatcher gets it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import APIError

from broker_config import jetstream
from broker_config.streams import ConsumerLimits, ConsumerSpec, ensure_consumer
from broker_config.subjects import Subjects

log = logging.getLogger("fairq.intake")

# A pull whose expiry status is this much overdue was lost (a reconnect, a server restart).
PULL_LOST_MARGIN_S = 2.0
# After a 409 (consumer deleted, leadership change...), wait this long before pulling again.
PULL_RETRY_S = 1.0
# A tenant whose consumer could not be made is tried again after this long.
CONSUMER_RETRY_S = 30.0
# A pull to a consumer that does not exist (any more): no responders, not found.
CONSUMER_GONE = (jetstream.NO_RESPONDERS, jetstream.NOT_FOUND)


@dataclass(slots=True)
class TenantPull:
    """One tenant's consumer and the state of its pull requests."""

    tenant: str
    consumer: str
    listed: bool
    arrived: deque[Msg] = field(default_factory=deque)
    handing_over: int = 0  # arrived messages the handler is working on
    requested: int = 0  # credits left on the outstanding pull
    pull_deadline: float = 0.0
    retry_at: float = 0.0
    last_arrival: float = 0.0
    retiring: bool = False  # idle: do not pull again after the outstanding pull ends
    ready: bool = False  # in the hand-over ring


class TenantIntake:
    def __init__(self, nc: NATS, subjects: Subjects, *,
                 handler: Callable[[list[Msg]], Awaitable[None]],
                 queued: Callable[[str], int],
                 listed: Iterable[str],
                 limits: ConsumerLimits = ConsumerLimits(),
                 window: int = 64,
                 batch: int = 256,
                 expires_s: float = 10.0,
                 discover_s: float = 0.25,
                 idle_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.stream = subjects.requests_stream
        self.handler = handler
        self.queued = queued
        self.listed = frozenset(listed)
        self.limits = limits
        self.window = window
        self.batch = batch
        self.expires_s = expires_s
        self.discover_s = discover_s
        self.idle_s = idle_s
        self.clock = clock
        self.pulls: dict[str, TenantPull] = {}
        # (endpoint, tenant) -> unfinished requests in the stream, as of the last listing.
        self.backlog: dict[tuple[str, str], int] = {}
        self._by_consumer: dict[str, TenantPull] = {}
        # Tenants whose consumer could not be made -> when to try again.
        self._refused: dict[str, float] = {}
        self._ready: deque[TenantPull] = deque()
        self._arrivals = asyncio.Event()
        self._open = False
        self._inbox = ""
        self._reconnects = 0
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> TenantIntake:
        self._inbox = self.nc.new_inbox()
        # Unbounded pending queue: the server bounds it (tenants x max_ack_pending).
        subscription = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_message,
                                               pending_msgs_limit=0, pending_bytes_limit=0)
        self._stack.push_async_callback(self._nak_arrived)
        # Drain, not unsubscribe: what is already on its way is queued here, then nak'd.
        self._stack.push_async_callback(subscription.drain)
        self._stack.push_async_callback(self._stop_tasks)
        self._open = True
        self._reconnects = self.nc.stats["reconnects"]
        try:
            await self._add_tenants(sorted(self.listed), listed=True, strict=True)
            await self._discover()
        except BaseException:
            await self._stack.aclose()
            raise
        self._tasks = [asyncio.create_task(self._hand_over_loop(), name="intake-hand-over"),
                       asyncio.create_task(self._care_loop(), name="intake-care")]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop intake (idempotent): the drain of the module docstring."""
        await self._stack.aclose()

    async def _stop_tasks(self) -> None:
        # The hand-over task is not cancelled: it finishes the batch it is handing over
        # (a batch cut off halfway would wait for its ack wait to be redelivered).
        self._open = False
        self._arrivals.set()
        if not self._tasks:
            return  # the start failed before they were made
        hand_over, care = self._tasks
        care.cancel()
        await asyncio.gather(hand_over, care, return_exceptions=True)

    async def _nak_arrived(self) -> None:
        for pull in [*self.pulls.values(), *self._ready]:  # the ring: forgotten ones too
            while pull.arrived:
                with contextlib.suppress(nats.errors.Error):
                    await pull.arrived.popleft().nak()

    # -- tenants and their consumers ------------------------------------------------------

    async def _add_tenants(self, tenants: list[str], *, listed: bool,
                           strict: bool = False) -> None:
        """Make the tenants' consumers and start pulling. `strict` (at start): a failure
        raises; otherwise the tenant is tried again after CONSUMER_RETRY_S (for instance
        once the stream's `max_consumers` has room again), so the log stays readable."""
        # Concurrent, but bounded: each is one JetStream API request.
        for start in range(0, len(tenants), 64):
            chunk = tenants[start:start + 64]
            results = await asyncio.gather(*(self._add_tenant(t, listed) for t in chunk),
                                           return_exceptions=True)
            for tenant, result in zip(chunk, results):
                if not isinstance(result, BaseException):
                    self._refused.pop(tenant, None)
                elif strict:
                    raise result
                else:
                    self._refused[tenant] = self.clock() + CONSUMER_RETRY_S
                    log.error("cannot make a consumer for tenant %r (trying again in %gs): %s",
                              tenant, CONSUMER_RETRY_S, result)

    async def _add_tenant(self, tenant: str, listed: bool) -> None:
        limits = self.limits if listed else ConsumerLimits(
            self.limits.ack_wait_s, self.limits.max_ack_pending, self.limits.max_deliver,
            inactive_threshold_s=self.idle_s)
        spec = ConsumerSpec.for_tenant(self.subjects, tenant, limits)
        name = spec.durable
        await ensure_consumer(self.js, self.stream, spec)
        pull = TenantPull(tenant, name, listed, last_arrival=self.clock())
        self.pulls[tenant] = pull
        self._by_consumer[name] = pull
        await self._pull(pull)

    async def _discover(self) -> None:
        """Start pulling for tenants with requests in the stream and no consumer yet."""
        info = await self.js.stream_info(self.stream, subjects_filter=self.subjects.all_requests)
        backlog = {}
        for subject, count in (info.state.subjects or {}).items():
            _, _, endpoint, tenant = subject.split(".")
            backlog[(endpoint, tenant)] = count
        self.backlog = backlog
        found = {tenant for _, tenant in backlog}
        now = self.clock()
        self._refused = {t: at for t, at in self._refused.items() if t in found and at > now}
        # A retiring tenant's consumer may be gone already (the server removes it once
        # nobody pulls): it is made again like a new one's.
        new = sorted(t for t in found if (t not in self.pulls or self.pulls[t].retiring)
                     and t not in self._refused)
        for listed in (True, False):
            chosen = [t for t in new if (t in self.listed) is listed]
            if chosen:
                await self._add_tenants(chosen, listed=listed)

    async def _care_loop(self) -> None:
        while self._open:
            await asyncio.sleep(self.discover_s)
            try:
                await self._discover()
            except (nats.errors.Error, APIError, asyncio.TimeoutError) as exc:
                log.warning("listing the request subjects failed: %s", exc)
            await self._tick()

    # -- pulls ---------------------------------------------------------------------------

    def _buffered(self, pull: TenantPull) -> int:
        return (pull.requested + len(pull.arrived) + pull.handing_over
                + self.queued(pull.tenant))

    async def top_up(self, tenant: str) -> None:
        """Pull more for `tenant` if its buffer fell to half the window."""
        pull = self.pulls.get(tenant)
        if pull is not None:
            await self._pull(pull)

    async def _pull(self, pull: TenantPull) -> None:
        if not self._open or pull.requested or pull.retiring or self.clock() < pull.retry_at:
            return
        buffered = self._buffered(pull)
        if buffered > self.window // 2:
            return
        credits = self.window - buffered
        pull.requested = credits
        pull.pull_deadline = self.clock() + self.expires_s + PULL_LOST_MARGIN_S
        try:
            await self.nc.publish(jetstream.pull_subject(self.stream, pull.consumer),
                                  jetstream.pull_request(credits, self.expires_s),
                                  reply=f"{self._inbox}.{pull.consumer}")
        except nats.errors.Error as exc:
            pull.requested = 0
            pull.retry_at = self.clock() + PULL_RETRY_S
            log.warning("pull for tenant %r not sent: %s", pull.tenant, exc)

    async def _tick(self) -> None:
        """Find lost pulls, retire idle tenants, top everyone up."""
        now = self.clock()
        reconnects = self.nc.stats["reconnects"]
        reconnected, self._reconnects = reconnects != self._reconnects, reconnects
        for pull in list(self.pulls.values()):
            if pull.requested and (reconnected or now > pull.pull_deadline):
                pull.requested = 0  # the server forgot it: ask again
                if pull.retiring:  # no expiry status will come to end its retirement
                    self._forget(pull)
                    continue
            if (not pull.listed and not pull.retiring and now - pull.last_arrival > self.idle_s
                    and not pull.arrived and not pull.handing_over
                    and not self.queued(pull.tenant)):
                pull.retiring = True
            await self._pull(pull)

    # -- arrivals ------------------------------------------------------------------------

    async def _on_message(self, msg: Msg) -> None:
        if not msg.reply:  # a status for one of our pull requests
            await self._on_status(msg)
            return
        pull = self.pulls.get(msg.subject.rsplit(".", 1)[1])
        if pull is None:  # cannot happen for a filtered consumer; never strand a message
            log.error("a request on %s arrived for no known tenant; nak", msg.subject)
            await msg.nak()
            return
        pull.requested = max(0, pull.requested - 1)
        pull.last_arrival = self.clock()
        pull.retiring = False
        pull.arrived.append(msg)
        if not pull.ready:
            pull.ready = True
            self._ready.append(pull)
        self._arrivals.set()

    async def _on_status(self, msg: Msg) -> None:
        pull = self._by_consumer.get(msg.subject.rsplit(".", 1)[1])
        if pull is None:
            return
        status, description = jetstream.status_of(msg)
        pull.requested = 0
        if pull.retiring and status == jetstream.REQUEST_TIMEOUT:
            self._forget(pull)
            return
        if status != jetstream.REQUEST_TIMEOUT:
            log.warning("pull for tenant %r ended: %s %s", pull.tenant, status, description)
            if status in CONSUMER_GONE or "deleted" in description.lower():
                # Discovery makes the consumer again while its tenant has requests; what
                # was delivered through the old one is redelivered through the new.
                self._forget(pull)
            else:  # 409 leadership change, server shutdown...: pause, then pull again
                pull.retry_at = self.clock() + PULL_RETRY_S
            return
        await self._pull(pull)  # the pull expired: keep one standing

    def _forget(self, pull: TenantPull) -> None:
        # What it has arrived stays in the hand-over ring, which holds the pull itself.
        if self.pulls.get(pull.tenant) is pull:  # not a newer pull for the same tenant
            del self.pulls[pull.tenant]
            del self._by_consumer[pull.consumer]

    def _take(self) -> list[Msg]:
        """Up to `batch` arrived messages, one tenant at a time round-robin."""
        taken: list[Msg] = []
        while self._ready and len(taken) < self.batch:
            pull = self._ready.popleft()
            taken.append(pull.arrived.popleft())
            pull.handing_over += 1
            if pull.arrived:
                self._ready.append(pull)
            else:
                pull.ready = False
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
                tenants = {msg.subject.rsplit(".", 1)[1] for msg in batch}
                for tenant in tenants:
                    pull = self.pulls.get(tenant)
                    if pull is not None:
                        pull.handing_over = 0
                        await self._pull(pull)

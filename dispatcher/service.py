"""The dispatcher: the scheduling core on the wire, wired from rooms with one job each.

    async with Dispatcher(nc, config, limiter=..., metrics=..., http=...):
        await until_sigterm()               # leaving the block drains (see below)

What the rooms' components share is one frozen `Parts` (dispatcher/parts.py), built here
once; each takes it plus only what is its own. One request's path through them:

    intake.shards.Intake         shard consumers, per-tenant windows -> batches of messages
    admission.admit.Admission    parse, de-duplicate, stored results, adoption, admission
    core.Scheduler               queues; tier -> DRR -> priority per batch
    dispatch.batches.Dispatch    fill each worker's free capacity (core.WorkerPool), send
    dispatch.reports.WorkerReports  heartbeats (liveness, lost work), completions (ack)
    dispatch.endings.Endings     a held request ended (a final event) or handed back
    dispatch.stored_results.Results  final events: stored, published
    fleet.probes.Probes          black-box health probes, evictions
    fleet.autoscale.Autoscaling  desired workers per autoscaled endpoint: gauges, events
    fleet.drift.DriftWatch       is each endpoint's profile still right: a gauge, a warning
    api.request_reply.Api        status, cancel, depth
    api.calls.ApiCalls           status and cancel calls side by side, a cap per tenant
    api.reload.Reloader          the config file re-read at run time (SIGHUP, admin request)
    api.http.HttpApi             /metrics, /healthz, /readyz, the dashboard (the caller's)

The maintenance tick is a table of (period, job) (`_maintenance`), run in order by one
loop: drop queued requests past their deadline, end those of removed tenants, probe
workers, forget old cancels, feed autoscaling and the drift watch; extend the ack wait of
held messages, export the queue-depth gauges and forget idle tenants, each at its own
period; wake the dispatch loop.

States: STARTING (subscribing) -> STANDBY (with a lease, dispatcher/ha/lease.py: until
this process holds it, listening to heartbeats only) -> SETTLING (until `settle_s` after
heartbeats were first heard, and until every worker heard lately has been heard again
since the lease was taken, so requests still running on workers are adopted, not run
twice) -> RUNNING -> DRAINING -> STOPPED. A dispatcher that takes the lease from one
that did not release it first has JetStream deliver at once what that one held
(`streams.reset_consumers`). Drain order on exit (SIGTERM):

1. stop intake: stop listing the stream, finish the batch being admitted, nak what
   arrived but was not admitted;
2. stop dispatching (DRAINING);
3. give back the token limits the queued requests were charged (the next dispatcher
   charges them again) and nak them, so another dispatcher gets them at once
   (`Endings.hand_back_queued`);
4. release the lease: a standby takes over now (a dispatcher that lost its lease skips
   this and step 5: the new holder adopts what runs);
5. wait up to `grace_s` for running requests to complete (completions are still
   processed and acked);
6. stop the dispatch and maintenance tasks; nak everything still held;
7. unsubscribe; end the status and cancel calls still waiting on a lookup in the streams
   (unanswered: their callers ask again); close the results reader and writer, flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from broker_config.config import Config, DispatcherOptions
from broker_config.direct_get import DirectBatchGet
from broker_config.lease_key import ensure_leases_bucket
from broker_config.streams import ConsumerLimits, provision, reset_consumers
from broker_config.subjects import ApiKind
from dispatcher.admission.admit import Admission
from dispatcher.admission.redis_store import AsyncLimiterStore, MemoryLimiterAsync
from dispatcher.api.calls import ApiCalls
from dispatcher.api.http import HttpApi
from dispatcher.api.reload import Reloader, ReloadReply
from dispatcher.api.request_reply import Api
from dispatcher.core.pool import WorkerPool
from dispatcher.core.scheduler import Scheduler
from dispatcher.dispatch.batches import Dispatch
from dispatcher.dispatch.endings import Endings
from dispatcher.dispatch.held import HeldRequests
from dispatcher.dispatch.reports import WorkerReports
from dispatcher.dispatch.stored_results import Results
from dispatcher.fleet.autoscale import Autoscaling
from dispatcher.fleet.drift import DriftWatch
from dispatcher.fleet.probes import Probes
from dispatcher.ha.lease import Lease
from dispatcher.intake.shards import Intake
from dispatcher.observe.dashboard import Watched
from dispatcher.observe.metrics import DispatcherMetrics
from dispatcher.parts import Parts

log = logging.getLogger("fairq.dispatcher")

# How often the queue-depth gauges are refreshed (a scan of every queue).
DEPTH_EXPORT_S = 1.0
# How often the state of tenants with nothing queued or running is swept.
FORGET_IDLE_S = 10.0
# /healthz fails once the maintenance loop missed this many ticks (plus 5 s).
LIVE_TICKS = 20
EVERY_TICK = 0.0


@dataclass(frozen=True, slots=True)
class Job:
    """A maintenance job: `run(now)` at the first tick `period_s` after its last run
    (EVERY_TICK: at each tick); it returns what to await, if anything."""

    period_s: float
    run: Callable[[float], Awaitable[object] | None]


class State(enum.Enum):
    STARTING = "starting"
    STANDBY = "standby"
    SETTLING = "settling"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class Dispatcher:
    def __init__(
        self,
        nc: NATS,
        config: Config,
        *,
        limiter: AsyncLimiterStore | None = None,
        metrics: DispatcherMetrics | None = None,
        http: HttpApi | None = None,
        config_path: str | Path | None = None,
        lease: Lease | None = None,
        heard: dict[str, float] | None = None,
    ) -> None:
        """`http`: the server whose /healthz and /readyz this dispatcher's checks answer.
        `config_path`: the file `config` was read from, re-read by `reload`. `lease`:
        it dispatches only while holding it (None: no lease, unfenced); one process's
        dispatchers share one. `heard`: when each worker was last heard, kept by the
        process across its dispatchers (updated here)."""
        options = config.dispatcher
        self.parts = Parts(
            nc=nc,
            subjects=config.subjects,
            scheduler=Scheduler(config),
            pool=WorkerPool(timeout_s=options.worker_timeout_s, evict_after=options.probe_failures),
            held=HeldRequests(),
            results=Results(nc, config.subjects),
            metrics=metrics or DispatcherMetrics(list(config.endpoints)),
            limiter=limiter or MemoryLimiterAsync(),
            wake=asyncio.Event(),
            backlog=self._backlog,
        )
        # What callers look at (the entry points, tests): the parts'.
        parts = self.parts
        self.nc, self.subjects, self.scheduler = parts.nc, parts.subjects, parts.scheduler
        self.pool, self.held = parts.pool, parts.held
        self.limiter, self.metrics = parts.limiter, parts.metrics
        self.endings = Endings(self.parts)
        if http is not None:
            http.check_with(self.live, self.ready)
        self.state = State.STARTING
        self._settled_at = 0.0
        self._ticked_at = time.time()
        self._stack = contextlib.AsyncExitStack()
        self.intake: Intake | None = None
        self.reloader = Reloader(self.parts, self.endings, config_path)
        self.lease = lease
        self._heard = heard if heard is not None else {}
        self._tenure_at = 0.0  # when it took the lease (or started, without one)
        self._reconnects = nc.stats["reconnects"]

    @property
    def config(self) -> Config:
        """The running configuration (a reload swaps it, dispatcher/api/reload.py)."""
        return self.parts.config

    @property
    def options(self) -> DispatcherOptions:
        return self.parts.options

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Dispatcher:
        stack = self._stack
        try:
            await self._start(stack)
        except BaseException:
            await stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        parts = self.parts
        js = self.nc.jetstream()
        await provision(js, self.config.broker)
        await stack.enter_async_context(parts.results)
        stored = await stack.enter_async_context(
            DirectBatchGet(self.nc, self.subjects.requests_stream)
        )
        parked = await stack.enter_async_context(
            DirectBatchGet(self.nc, self.subjects.parked_stream)
        )
        self.admission = Admission(parts, self.endings)
        self.dispatch = Dispatch(parts, self.endings, self._top_up, self._on_the_way)
        self.probes = Probes(parts)
        self.autoscaling = Autoscaling(parts)
        self.drift = DriftWatch(parts)
        self.reports = WorkerReports(
            parts, self.admission, self.endings, self.probes, self._answers_for_work
        )
        self.reports.heard = self._heard
        self.api = Api(parts, self.admission, self.endings, parked, stored)
        stack.push_async_callback(self.api.close)  # before the readers close
        self.calls = ApiCalls(self.api)
        stack.push_async_callback(self.calls.close)  # before the API closes
        for endpoint in self.config.endpoints:
            await self._subscribe(self.subjects.heartbeats(endpoint), self._on_heartbeat)
        self.reloader.start()  # once what a reload changes exists
        await self._subscribe(self.subjects.admin_reload, self.reloader.on_request)
        stack.push_async_callback(self.reloader.close)
        self._settled_at = time.time() + self.options.settle_s
        if self.lease is not None:
            await self._take_lease(self.lease, js, stack)
        self._tenure_at = time.time()
        for endpoint in self.config.endpoints:
            await self._subscribe(self.subjects.completions(endpoint), self.reports.on_completions)
        await self._subscribe(
            self.subjects.api_filter(ApiKind.STATUS), self.api.on_status, side_by_side=True
        )
        await self._subscribe(
            self.subjects.api_filter(ApiKind.CANCEL), self.api.on_cancel, side_by_side=True
        )
        await self._subscribe(self.subjects.depth, self.api.on_depth)
        self.state = State.SETTLING
        self._ticked_at = time.time()  # the maintenance loop starts now
        stack.callback(self.metrics.watch.follow(asyncio.get_running_loop(), self._watched))
        self.intake = self._intake()  # before it starts: its handler reads its backlog
        await stack.enter_async_context(self.intake)
        # Unwound before the intake and the subscriptions above: the drain still uses them.
        group = await stack.enter_async_context(asyncio.TaskGroup())
        tasks = [
            group.create_task(self.dispatch.run(self._may_dispatch), name="dispatch"),
            group.create_task(self._maintenance_loop(), name="maintenance"),
        ]
        taking_back = group.create_task(
            self.reports.take_back_loop(self.options.tick_s), name="take back"
        )
        stack.push_async_callback(self._drain, tasks, taking_back)

    def _intake(self) -> Intake:
        """The shard consumers cover all endpoints: requests for an endpoint this config
        does not know are still answered (unknown_endpoint), not stranded."""
        options = self.options
        return Intake(
            self.nc,
            self.subjects,
            handler=self._admit_batch,
            queued=self.scheduler.tenant_queued,
            in_hand=self._in_hand,
            shards=self.config.broker.intake_shards,
            limits=ConsumerLimits(
                ack_wait_s=options.ack_wait_s, max_ack_pending=options.max_held_per_shard
            ),
            parked_limits=ConsumerLimits(
                ack_wait_s=options.ack_wait_s, max_ack_pending=options.max_ack_pending
            ),
            window=options.tenant_window,
            batch=options.intake_batch,
            list_s=options.discover_s,
        )

    async def _take_lease(
        self, lease: Lease, js: JetStreamContext, stack: contextlib.AsyncExitStack
    ) -> None:
        """Stand by until this process holds the lease; then fence what it sends with the
        lease's epoch and take back at once what another holder left unacked."""
        kv, ttl_s = await ensure_leases_bucket(js, self.config.broker, self.options.lease_ttl_s)
        stack.push_async_callback(lease.release)  # if the drain did not
        self.state = State.STANDBY
        take_back = await lease.acquire(kv, ttl_s)
        self.parts.results.epoch = self.dispatch.epoch = self.probes.epoch = lease.epoch
        if take_back:
            await reset_consumers(js, self.config.broker)

    async def _subscribe(
        self, subject: str, handler: Callable[[Msg], Awaitable[None]], *, side_by_side: bool = False
    ) -> None:
        """`side_by_side`: each message in a task of its own (dispatcher/api/calls.py)."""

        async def guarded(msg: Msg) -> None:
            # Every loop that reads from the network survives a malformed message.
            try:
                await handler(msg)
            except Exception:
                log.exception("handling a message on %s failed", msg.subject)

        callback = self.calls.side_by_side(guarded) if side_by_side else guarded
        subscription = await self.nc.subscribe(subject, cb=callback)
        self._stack.push_async_callback(subscription.unsubscribe)

    async def _drain(
        self, tasks: list[asyncio.Task[None]], taking_back: asyncio.Task[None]
    ) -> None:
        """Steps 1-6 of the drain order (step 7 is the exit stack unwinding further)."""
        await self.intake.close()
        self.state = State.DRAINING
        async with self.dispatch.passing:  # a pass under way places requests: let it end
            await self.endings.hand_back_queued(time.time())
        lost = self.lease is not None and self.lease.lost.is_set()
        if self.lease is not None and not lost:
            await self.lease.release()
        deadline = time.monotonic() + (0.0 if lost else self.options.grace_s)
        while self.held.running() and time.monotonic() < deadline:
            await asyncio.sleep(self.options.tick_s)
        self.reports.stop_taking_back()
        await asyncio.wait([taking_back])  # not cut halfway: what it took out of `held`
        for task in tasks:
            task.cancel()
        self.state = State.STOPPED
        # Requests taken back from lost workers during the wait went back to the queue.
        await self.endings.hand_back_queued(time.time())
        await self.held.hand_back()
        await self.nc.flush()

    # -- reload ----------------------------------------------------------------------------

    async def reload(self) -> ReloadReply:
        """Re-read the config file and apply its tenants, tiers and unlisted policy
        (dispatcher/api/reload.py); the reply says what changed, or why nothing did."""
        return await self.reloader.reload()

    # -- glue ------------------------------------------------------------------------------

    async def _on_heartbeat(self, msg: Msg) -> None:
        reconnects = self.nc.stats["reconnects"]
        if reconnects != self._reconnects:
            self._reconnects = reconnects
            self.pool.sent_again(time.time())
        await self.reports.on_heartbeat(msg)

    def _answers_for_work(self) -> bool:
        """Whether what it holds is still its own to end or run again: with a valid lease,
        or one it released (a planned stop: no other holder took over what it holds, a
        standby adopts only what its messages bring). One whose lease lapsed (a pause)
        must not: the next holder runs those requests now (dispatcher/dispatch/reports.py)."""
        return self.lease is None or self.lease.valid() or self.lease.released

    def _may_dispatch(self) -> bool:
        if self.state is State.SETTLING and self._settled(time.time()):
            self.admission.adopt_running()
            self.state = State.RUNNING
        return self.state is State.RUNNING and (self.lease is None or self.lease.valid())

    def _settled(self, now: float) -> bool:
        """Heartbeats show what runs: `settle_s` passed, and each worker heard within the
        worker timeout before this tenure began was heard since (what the last holder
        sent it is in that heartbeat), or the timeout passed (it is gone)."""
        if now < self._settled_at:
            return False
        timeout = self.options.worker_timeout_s
        if now >= self._tenure_at + timeout:
            return True
        return all(
            at >= self._tenure_at for at in self._heard.values() if at >= self._tenure_at - timeout
        )

    def _backlog(self) -> dict[tuple[str, str], int]:
        return self.intake.backlog if self.intake is not None else {}

    def _on_the_way(self, endpoint: str) -> list[str]:
        """Tenants with requests to `endpoint` that the intake has not queued yet: the
        intake still has some of theirs to read or admit, and the streams held more of
        them for `endpoint`, at the last listing, than are queued or running here."""
        if self.intake is None:
            return []
        backlog = self.intake.backlog
        tenants = []
        for tenant in self.intake.arriving():
            flow = self.scheduler.flow(endpoint, tenant)
            here = len(flow.queue) + flow.running if flow is not None else 0
            if backlog.get((endpoint, tenant), 0) > here:
                tenants.append(tenant)
        return tenants

    def _in_hand(self) -> Counter[tuple[bool, str]]:
        """(parked?, tenant) -> the messages held, for the intake's estimates."""
        return Counter(
            (self.subjects.is_parked(held.msg.subject), held.submission.tenant)
            for held in self.held
        )

    async def _top_up(self, tenant: str) -> None:
        await self.intake.top_up(tenant)

    async def _admit_batch(self, messages: list[Msg]) -> None:
        await self.admission.batch(messages)
        self.parts.wake.set()

    # -- maintenance -------------------------------------------------------------------------

    async def lease_lost(self) -> None:
        """Returns once this dispatcher's lease is lost (never, without a lease)."""
        await (self.lease.lost.wait() if self.lease is not None else asyncio.Event().wait())

    def live(self) -> bool:
        """Standing by, or its maintenance loop ran lately (for /healthz: a wedged loop
        fails it)."""
        if self.state in (State.STARTING, State.STANDBY):
            return True
        return (
            self.state is not State.STOPPED
            and time.time() - self._ticked_at < LIVE_TICKS * self.options.tick_s + 5.0
        )

    def ready(self) -> bool:
        """Settled and not draining (for /readyz)."""
        return self.state is State.RUNNING

    def _maintenance(self) -> tuple[Job, ...]:
        """The maintenance tick's jobs, in the order they run."""
        return (
            Job(EVERY_TICK, lambda now: self.endings.drop_expired(self.scheduler.expire(now), now)),
            Job(EVERY_TICK, lambda now: self.reloader.end_set_aside()),
            Job(EVERY_TICK, self._probe),
            Job(EVERY_TICK, self.admission.forget_old_cancels),
            Job(EVERY_TICK, self.autoscaling.tick),
            Job(EVERY_TICK, self.drift.tick),
            # Held messages' ack wait, extended well before it runs out.
            Job(self.options.ack_wait_s / 3, lambda now: self.held.in_progress()),
            Job(DEPTH_EXPORT_S, self._export_depth),
            Job(FORGET_IDLE_S, self._forget_idle),
            Job(EVERY_TICK, lambda now: self.parts.wake.set()),
        )

    async def _maintenance_loop(self) -> None:
        jobs = self._maintenance()
        last = [time.time()] * len(jobs)
        while True:
            await asyncio.sleep(self.options.tick_s)
            now = self._ticked_at = time.time()
            for n, job in enumerate(jobs):
                if job.period_s and now - last[n] < job.period_s:
                    continue
                last[n] = now
                if (pending := job.run(now)) is not None:
                    await pending

    async def _probe(self, now: float) -> None:
        if self._may_dispatch():  # probes and evictions are the lease holder's
            for worker, lost in await self.probes.tick(now):
                self.reports.evicted(worker, lost)

    def _forget_idle(self, now: float) -> None:
        """What is kept per tenant goes once it matters no more (tenants that come once,
        unlisted ones named per end user, must leave nothing behind)."""
        for queues in self.scheduler.endpoints.values():
            queues.forget_idle(now)
        self.admission.forget_counts(now)

    def _export_depth(self, now: float) -> None:
        watched = self._watched(now)
        self.metrics.export_depth(watched.rows)
        self.metrics.watch.refresh(watched, now)

    def _watched(self, now: float) -> Watched:
        """What the dashboard shows (dispatcher/observe/dashboard.py), at `now`."""
        return Watched(self.api.depth_rows(now), self.admission.counts, self.scheduler)

"""The load generator and recorder: replays arrivals on schedule over the wire contract and
records what happened to every request (the records are `bench.harness.measured`'s).

Each arrival is one JetStream publish to `fq.req.<endpoint>.<tenant>` through the SDK
(`producers.client.Client`: `Nats-Msg-Id` = the request id `<tenant>-<index of the
arrival>`, body with `prompt`, `max_tokens` and `input_tokens`), at `offset_s` after the
start, by one connection for the streamed tenants and another for the collected ones.
Every tenant publishes independently, at most `PUBLISH_IN_FLIGHT` unacknowledged at a
time (the well-behaved one below: at most its slots), so one tenant's burst never delays
another's submits in the recorder. Two ways to observe a request, chosen per tenant:

- streamed: with an `Fq-Reply` inbox; the first event and the final event are timed
  when they arrive here (the client's view);
- collected: without `Fq-Reply`, as a batch job would submit (nothing is streamed
  back); the final event is read from the results bucket once everything has finished
  (not through the status API: the naive queue has no dispatcher to answer it), and
  its times are placed from the worker's clock: finished = the time the result was
  stored, first token = finished - (total_s - ttft_s). Every process runs on one
  machine, so the clocks agree. This keeps a 10,000-request flood from sending
  hundreds of thousands of token events to this process, which would make the
  measurement one of the recorder's CPU rather than of the scheduling.

For both, the dispatch time comes from the done event's timings (seconds since the
request was queued): dispatched = first token - (ttft_s - queued_s), so queue wait =
dispatched - submitted and TTFT = first token - submitted, both from the client's submit.
A third kind of tenant, `WellBehaved`, runs closed loop: it sends its next request
whenever this replay's requests in flight (its own and every streamed one) leave one of
its `slots` free, so it keeps the engine as busy as it may without ever building a
backlog. Free slots are filled at once (the publishes in flight together), as the
simulator's `ClosedLoop` fills them. It submits without `Fq-Reply` and learns that a
request ended by watching the results bucket (one message per request, not its token
stream).

The replay ends when every streamed request has its final event and the requests stream
is empty (every message acked: every request finished), bounded by `timeout_s`; requests
without a final event by then are recorded as `lost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import nats
import nats.errors
from nats.js.errors import KeyNotFoundError

from bench.harness.measured import (
    DONE,
    LOST,
    REFUSED,
    Arrival,
    Measured,
    Replay,
    arrivals_from_trace,
    describe_outcomes,
    to_measure,
)
from broker_config.config import BrokerSettings
from broker_config.wire import DoneEvent, TokenEvent
from broker_config.wire_internal import STORED_RESULT, StoredResult
from producers.client import Client
from producers.errors import FairqError
from producers.submission import Submitted

# The engine is told the input length; the prompt itself is only a placeholder.
PROMPT = "benchmark request"
PUBLISH_IN_FLIGHT = 256
# Results-bucket reads in flight while collecting.
COLLECT_IN_FLIGHT = 512
_POLL_S = 0.2
WATCH_S = 0.5

# What this module's users import from it: the records are `bench.harness.measured`'s.
__all__ = [
    "DONE",
    "LOST",
    "REFUSED",
    "Arrival",
    "Measured",
    "Replay",
    "WellBehaved",
    "arrivals_from_trace",
    "bounded",
    "describe_outcomes",
    "read_stored",
    "replay",
    "to_measure",
]


@dataclass(frozen=True, slots=True)
class WellBehaved:
    """A closed-loop tenant (see the module doc): `requests` are sent in order, their
    offsets ignored, while fewer than `slots` requests of the replay are in flight."""

    requests: Sequence[Arrival]
    slots: int

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots!r}")
        if len({a.tenant for a in self.requests}) > 1:
            raise ValueError("a well-behaved client is one tenant")


class _InFlight:
    """Requests of the replay submitted and not yet ended, for the well-behaved tenant."""

    def __init__(self) -> None:
        self.count = 0
        self._ended = asyncio.Event()

    def start(self) -> None:
        self.count += 1

    def end(self) -> None:
        self.count -= 1
        self._ended.set()

    async def below(self, slots: int) -> None:
        while self.count >= slots:
            self._ended.clear()
            await self._ended.wait()


async def replay(
    url: str,
    arrivals: Sequence[Arrival],
    *,
    endpoint: str,
    settings: BrokerSettings,
    timeout_s: float,
    alive: Callable[[], None] | None = None,
    well_behaved: WellBehaved | None = None,
) -> Replay:
    """Send `arrivals` on schedule to the stack at `url`, and run `well_behaved`'s
    closed loop beside them; see the module doc.

    `alive` is called every `WATCH_S` while requests are outstanding and should raise if
    the stack has died (`Stack.check_alive`), so a crash ends the replay at once instead
    of at `timeout_s`.
    """
    closed = (
        [replace(a, streamed=False) for a in well_behaved.requests]
        if well_behaved is not None
        else []
    )
    measured = to_measure([*arrivals, *closed])
    open_loop, closed_loop = measured[: len(arrivals)], measured[len(arrivals) :]
    by_tenant = _by_tenant(open_loop)
    in_flight = _InFlight()
    # Collected tenants (a flood, a batch job) publish on a connection of their own, as
    # separate clients would: a burst of theirs must not queue the streamed tenants'
    # submits behind it in this process.
    async with (
        Client.connect(url, prefix=settings.prefix) as client,
        Client.connect(url, prefix=settings.prefix) as batch_client,
    ):
        loop = asyncio.get_running_loop()
        start_wall, start_loop = time.time(), loop.time()

        async def replay_all() -> None:
            parts = [
                _tenant(
                    client if mine[0].streamed else batch_client,
                    endpoint,
                    mine,
                    start_wall,
                    start_loop,
                    in_flight,
                )
                for mine in by_tenant.values()
            ]
            if well_behaved is not None:
                parts.append(
                    _closed_loop(
                        batch_client,
                        endpoint,
                        settings,
                        closed_loop,
                        well_behaved.slots,
                        in_flight,
                        start_wall,
                    )
                )
            await asyncio.gather(*parts)
            await _until_stream_empty(client.connection, settings)

        await bounded(replay_all(), timeout_s, alive)
        await _collect(
            client.connection,
            settings,
            [m for m in open_loop if not m.streamed and m.submitted is not None],
            start_wall,
        )
        ends = [m.finished for m in measured if m.finished is not None]
    # The closed loop has no schedule to be late against.
    return Replay(measured, max(ends, default=0.0), _lateness(by_tenant), start_wall)


def _by_tenant(measured: Sequence[Measured]) -> dict[str, list[Measured]]:
    """Each tenant's requests in the order they are due."""
    by_tenant: dict[str, list[Measured]] = defaultdict(list)
    for m in sorted(measured, key=lambda m: m.offset_s):
        by_tenant[m.tenant].append(m)
    return by_tenant


def _lateness(by_tenant: dict[str, list[Measured]]) -> dict[str, float]:
    """How late each tenant's worst submit was against its schedule."""
    return {
        tenant: max(
            (m.submitted - m.offset_s for m in mine if m.submitted is not None), default=0.0
        )
        for tenant, mine in by_tenant.items()
    }


async def bounded(
    work: Awaitable[None], timeout_s: float, alive: Callable[[], None] | None
) -> None:
    """Await `work` for at most `timeout_s` (what has no final event by then stays
    `lost`), calling `alive` every `WATCH_S` meanwhile: it raises, and so ends the run at
    once, when the stack has died."""

    async def watch() -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            alive()

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s), asyncio.TaskGroup() as group:
            watchdog = group.create_task(watch()) if alive is not None else None
            await work
            if watchdog is not None:
                watchdog.cancel()


async def _tenant(
    client: Client,
    endpoint: str,
    mine: list[Measured],
    start_wall: float,
    start_loop: float,
    in_flight: _InFlight,
) -> None:
    """One tenant's requests, each at its offset; returns when its streamed ones ended."""
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(PUBLISH_IN_FLIGHT)
    async with asyncio.TaskGroup() as group:
        for m in mine:
            delay = start_loop + m.offset_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            group.create_task(_request(client, endpoint, m, start_wall, slots, in_flight))


async def _request(
    client: Client,
    endpoint: str,
    m: Measured,
    start_wall: float,
    slots: asyncio.Semaphore,
    in_flight: _InFlight,
) -> None:
    if m.streamed:  # from before its submit, as the well-behaved client counts its own
        in_flight.start()
    try:
        try:
            submitted = await _submit(client, endpoint, m, start_wall)
        finally:
            slots.release()
        if submitted is not None and m.streamed:
            await _stream(client, submitted, m, start_wall)
    finally:
        if m.streamed:
            in_flight.end()


async def _submit(
    client: Client, endpoint: str, m: Measured, start_wall: float
) -> Submitted | None:
    """Publish one request; None (and outcome `refused`) if the broker did not store it."""
    try:
        m.submitted = time.time() - start_wall
        submitted = await client.submit(
            endpoint,
            m.tenant,
            prompt=PROMPT,
            max_tokens=m.max_tokens,
            input_tokens=m.input_tokens,
            id=m.id,
            reply=m.streamed,
        )
    except FairqError:
        m.outcome = REFUSED
        return None
    m.acked = time.time() - start_wall
    return submitted


async def _closed_loop(
    client: Client,
    endpoint: str,
    settings: BrokerSettings,
    mine: list[Measured],
    slots: int,
    in_flight: _InFlight,
    start_wall: float,
) -> None:
    """The well-behaved tenant: send while a slot is free; a request ends when its final
    event is stored in the results bucket."""
    if not mine:
        return
    results = await client.connection.jetstream().key_value(settings.subjects.results_bucket)
    tenant = mine[0].tenant
    watcher = await results.watch(settings.subjects.tenant_results(tenant))
    running: dict[str, Measured] = {}
    sent = asyncio.Event()

    async def submit(m: Measured, key: str) -> None:
        # A refused publish may still have been stored (a timeout): if its result came
        # first, it has ended already.
        if await _submit(client, endpoint, m, start_wall) is None and running.pop(key, None):
            in_flight.end()

    async def send() -> None:
        # Every free slot is filled at once, each publish awaiting its own ack: one at a
        # time, the first fill would take about 60 ms here and leave slots free that the
        # definition (and the simulator's ClosedLoop) keeps busy.
        async with asyncio.TaskGroup() as publishes:
            for m in mine:
                await in_flight.below(slots)
                in_flight.start()
                key = settings.subjects.result_key(tenant, m.id)
                running[key] = m
                publishes.create_task(submit(m, key))
        sent.set()

    async def receive() -> None:
        while not (sent.is_set() and not running):
            try:
                entry = await watcher.updates(timeout=WATCH_S)
            except nats.errors.TimeoutError:
                continue
            # None ends the initial values; a delete or purge carries no result.
            ours = entry is not None and entry.operation is None
            m = running.pop(entry.key, None) if ours else None
            if m is None:
                continue
            result = STORED_RESULT.decode(entry.value)
            m.settle(result.event, result.stored_at - start_wall, None)
            in_flight.end()

    try:
        async with asyncio.TaskGroup() as group:  # one failing stops the other
            group.create_task(send())
            group.create_task(receive())
    finally:
        await watcher.stop()


async def _stream(client: Client, submitted: Submitted, m: Measured, start_wall: float) -> None:
    first_token = None
    async with contextlib.aclosing(client.stream(submitted)) as events:
        async for event in events:
            now = time.time() - start_wall
            if isinstance(event, TokenEvent):
                if first_token is None:
                    first_token = now
                continue
            if isinstance(event, DoneEvent) and first_token is None:
                first_token = now  # a done event without tokens before it: output at once
            m.settle(event, now, first_token)


async def _until_stream_empty(nc: nats.NATS, settings: BrokerSettings) -> None:
    """Requests leave the work-queue stream when acked, that is once finished."""
    js = nc.jetstream()
    while (await js.stream_info(settings.subjects.requests_stream)).state.messages:
        await asyncio.sleep(_POLL_S)


async def _collect(
    nc: nats.NATS, settings: BrokerSettings, collected: list[Measured], start_wall: float
) -> None:
    """Final events of the requests submitted without Fq-Reply, from the results bucket."""
    stored = await read_stored(nc, settings, collected)
    for m in collected:
        result = stored.get(m.id)
        if result is not None:  # else not finished: stays `lost`
            m.settle(result.event, result.stored_at - start_wall, None)


async def read_stored(
    nc: nats.NATS, settings: BrokerSettings, measured: Sequence[Measured]
) -> dict[str, StoredResult]:
    """The stored result of each request of `measured` that has one, by request id."""
    if not measured:
        return {}
    results = await nc.jetstream().key_value(settings.subjects.results_bucket)
    slots = asyncio.Semaphore(COLLECT_IN_FLIGHT)
    found: dict[str, StoredResult] = {}

    async def one(m: Measured) -> None:
        async with slots:
            with contextlib.suppress(KeyNotFoundError):
                entry = await results.get(settings.subjects.result_key(m.tenant, m.id))
                found[m.id] = STORED_RESULT.decode(entry.value)

    await asyncio.gather(*(one(m) for m in measured))
    return found

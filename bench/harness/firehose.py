"""The load generator of the rate, latency and tenant-scale scenarios: thousands of
requests per second on the wire contract, from one process.

`bench.harness.recorder.replay` submits through the SDK, which subscribes to a fresh inbox per
request (a SUB and an UNSUB on the server, a task and a queue here, for each one); at
these rates that would make the load generator a large share of the machine's CPU. Here
one connection publishes every request with JetStream (`Nats-Msg-Id` = the request id,
`Fq-Reply` = `<inbox>.<n>`, a JSON body as the SDK would send) and one wildcard
subscription on `<inbox>.*` receives the events of all of them, as a high-volume client
of the contract would.

Arrivals (`bench.harness.measured.Arrival`) are published at their offsets (a late one at once),
at most `in_flight` unacknowledged at a time. Each request is recorded as the recorder
records it (`bench.harness.measured.Measured`, wall seconds since the start): submitted just
before its publish, acked when its PubAck arrived, first token when its first event
arrived, finished at its final event, and the done event's timings. Requests without
`streamed` get no `Fq-Reply` and are only published (a backlog): their outcome is
`published` once the broker stored them. `fire_measured` can send given bodies in place
of some requests' (garbage, for the soak) and lets the caller watch the records live.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import msgspec
import nats
import nats.errors
from nats.aio.msg import Msg

from bench.harness.measured import REFUSED, Arrival, Measured, Replay, to_measure
from bench.harness.recorder import bounded
from broker_config.config import BrokerSettings
from broker_config.subjects import HDR_MSG_ID, HDR_REPLY
from broker_config.wire import EVENT, DoneEvent, SubmitRequest, TokenEvent, encode

PROMPT = "benchmark request"
# The outcome of a request sent without Fq-Reply: stored, and nobody waits for its answer.
PUBLISHED = "published"
PUBACK_TIMEOUT_S = 10.0


async def fire(
    url: str,
    arrivals: Sequence[Arrival],
    *,
    endpoint: str,
    settings: BrokerSettings,
    in_flight: int,
    timeout_s: float,
    alive: Callable[[], None] | None = None,
) -> Replay:
    """Send `arrivals` (ids `<tenant>-<index>`); return once every one is published and
    every streamed one has its final event, or after `timeout_s` (the rest stay `lost`).

    `alive` is called every `WATCH_S` and should raise if the stack has died.
    """
    return await fire_measured(
        url,
        to_measure(arrivals),
        endpoint=endpoint,
        settings=settings,
        in_flight=in_flight,
        timeout_s=timeout_s,
        alive=alive,
    )


async def fire_measured(
    url: str,
    measured: list[Measured],
    *,
    endpoint: str,
    settings: BrokerSettings,
    in_flight: int,
    timeout_s: float,
    alive: Callable[[], None] | None = None,
    bodies: Mapping[str, bytes] | None = None,
) -> Replay:
    """`fire` on records made by `bench.harness.measured.to_measure`, which are updated as the
    run goes (a caller may read them meanwhile). `bodies`: request id -> the body sent
    instead of the well-formed one (a request that breaks the contract)."""
    nc = await nats.connect(url, connect_timeout=5)
    try:
        run = _Run(nc, measured, endpoint, settings, in_flight, bodies or {})
        await run.subscribe()

        async def fire_all() -> None:
            await run.publish_all()
            await run.answered.wait()

        await bounded(fire_all(), timeout_s, alive)
    finally:
        await nc.drain()
    ends = [m.finished if m.finished is not None else m.acked for m in measured]
    return Replay(
        measured,
        max((e for e in ends if e is not None), default=0.0),
        dict(run.max_lateness_s),
        run.start_wall,
    )


class _Run:
    def __init__(
        self,
        nc: nats.NATS,
        measured: list[Measured],
        endpoint: str,
        settings: BrokerSettings,
        in_flight: int,
        bodies: Mapping[str, bytes],
    ) -> None:
        self.nc = nc
        self.bodies = bodies
        self.js = nc.jetstream(timeout=PUBACK_TIMEOUT_S)
        self.measured = measured
        self.endpoint = endpoint
        self.subjects = settings.subjects
        self.slots = asyncio.Semaphore(in_flight)
        self.inbox = nc.new_inbox()
        self.unanswered = sum(m.streamed for m in measured)
        self.answered = asyncio.Event()
        # How late the worst submit was against its schedule, per tenant.
        self.max_lateness_s: dict[str, float] = defaultdict(float)
        self.start_wall = 0.0
        if not self.unanswered:
            self.answered.set()

    async def subscribe(self) -> None:
        await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_event)
        await self.nc.flush()  # the subscription is on the server before any publish

    async def publish_all(self) -> None:
        loop = asyncio.get_running_loop()
        self.start_wall, start_loop = time.time(), loop.time()
        order = sorted(range(len(self.measured)), key=lambda n: self.measured[n].offset_s)
        async with asyncio.TaskGroup() as group:
            for n in order:
                m = self.measured[n]
                delay = start_loop + m.offset_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self.slots.acquire()
                group.create_task(self._publish(n, m))

    async def _publish(self, n: int, m: Measured) -> None:
        body = self.bodies.get(m.id)
        if body is None:
            body = encode(
                SubmitRequest(
                    id=m.id, prompt=PROMPT, max_tokens=m.max_tokens, input_tokens=m.input_tokens
                )
            )
        headers = {HDR_MSG_ID: m.id}
        if m.streamed:
            headers[HDR_REPLY] = f"{self.inbox}.{n}"
        try:
            m.submitted = time.time() - self.start_wall
            self.max_lateness_s[m.tenant] = max(
                self.max_lateness_s[m.tenant], m.submitted - m.offset_s
            )
            await self.js.publish(
                self.subjects.request(self.endpoint, m.tenant), body, headers=headers
            )
            m.acked = time.time() - self.start_wall
            if not m.streamed:
                m.outcome = PUBLISHED
        except nats.errors.Error:
            m.outcome = REFUSED  # not stored: no event will come
            if m.streamed:
                self._answered()
        finally:
            self.slots.release()

    async def _on_event(self, msg: Msg) -> None:
        now = time.time() - self.start_wall
        try:
            event = EVENT.decode(msg.data)
            m = self.measured[int(msg.subject.rsplit(".", 1)[1])]
        except (msgspec.DecodeError, ValueError, IndexError):
            return  # not an event of this run
        if m.finished is not None or m.outcome == REFUSED:
            # A redelivered request's second run, or one whose PubAck timed out but that
            # was stored anyway: it was counted answered already.
            return
        if isinstance(event, TokenEvent):
            if m.first_token is None:
                m.first_token = now
            return
        if isinstance(event, DoneEvent) and m.first_token is None:
            m.first_token = now  # a done event without tokens before it: output at once
        m.settle(event, now, m.first_token)
        self._answered()

    def _answered(self) -> None:
        self.unanswered -= 1
        if not self.unanswered:
            self.answered.set()

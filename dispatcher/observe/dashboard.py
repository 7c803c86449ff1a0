"""The live queue dashboard: per endpoint, tier and tenant, what is queued and running, the
oldest wait of what is queued, admissions and rejections per second, the 95th percentile
of queue wait (of dispatched requests) and of time to first token, the cost served and
how fairly (dispatcher/observe/fairness.py), from the dispatcher's own state rather than
per-tenant Prometheus series (a thousand tenants would be a thousand series per metric).

The maintenance loop calls `QueueWatch.refresh` once a second: it samples the admission
counts and the cost served (dispatcher/observe/window.py), steps the history
(dispatcher/observe/history.py), and builds the snapshot while someone reads it (the
last `WATCHED_S`). The HTTP server's threads (dispatcher/api/http.py) serve the latest
snapshot as JSON (`/dashboard.json`) beside a page that polls it (`/dashboard`); a read
that finds it older than `FRESH_S` (nobody watched for a while) asks the event loop for a
new one and waits up to `BUILD_WAIT_S` for it, so every read shows figures at most
`FRESH_S` old while nobody watching costs only the samples. Rates and fairness are over
the last `RATE_WINDOW_S`, percentiles over the requests of the last `LATENCY_WINDOW_S`
(the newest `latency.MAX_SAMPLES` per endpoint and tenant).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

import msgspec
import numpy as np

from dispatcher.core.scheduler import DepthRow
from dispatcher.core.view import FlowRow
from dispatcher.observe.fairness import Service, jain, ratios, shares
from dispatcher.observe.history import History
from dispatcher.observe.latency import Samples, p95
from dispatcher.observe.window import ZERO, Key, Totals, Window

RATE_WINDOW_S = 10.0
WATCHED_S = 10.0
LATENCY_WINDOW_S = 60.0
FRESH_S = 2.0
BUILD_WAIT_S = 1.0


class Counts(Protocol):
    """A tenant's admission decisions on one endpoint so far (dispatcher.admission.admit)."""

    admitted: int
    rejected: int


class Queues(Protocol):
    """The scheduler's read-only queries the dashboard uses (dispatcher/core/view.py)."""

    def flow_rows(self) -> list[FlowRow]: ...
    def cost_units(self) -> dict[str, str]: ...
    def tier_of(self, tenant: str) -> str | None: ...
    def tier_names(self) -> list[str]: ...


class Watched(NamedTuple):
    """What the dispatcher shows the dashboard at one moment."""

    rows: list[DepthRow]  # the queues, the requests still in the stream counted
    counts: Mapping[Key, Counts]
    queues: Queues


class Figures(msgspec.Struct):
    """One row of the dashboard: a tenant, a tier or an endpoint."""

    name: str
    queued: int = 0
    running: int = 0
    # The longest a request still queued has waited since its publish; None: none queued.
    oldest_wait_s: float | None = None
    admitted_per_s: float = 0.0
    rejected_per_s: float = 0.0
    # Of the requests dispatched (or first tokens streamed) in the latency window; None:
    # none in the window.
    p95_queue_wait_s: float | None = None
    p95_ttft_s: float | None = None
    served_per_s: float = 0.0  # in the endpoint's cost unit
    # A tenant's: shares of its tier's service in the window and of its active weight.
    service_share: float | None = None
    weight_share: float | None = None
    # A tier's or endpoint's: Jain's index (dispatcher/observe/fairness.py).
    fairness: float | None = None


class TierView(msgspec.Struct):
    figures: Figures
    tenants: list[Figures]


class EndpointView(msgspec.Struct):
    figures: Figures
    tiers: list[TierView]
    cost_unit: str = ""  # of `served_per_s`: "request", "token" or "model_units"


class Snapshot(msgspec.Struct):
    at: float
    rate_window_s: float
    latency_window_s: float
    endpoints: list[EndpointView]


# A tenant as it is built: its key, its row, and its part in the fairness figures
# (None: it has no flow, so no weight).
Member = tuple[Key, Figures, Service | None]
Source = Callable[[float], Watched]


class QueueWatch:
    """What the dashboard shows, kept up to date by the dispatcher (see the module)."""

    def __init__(self, endpoints: Iterable[str]) -> None:
        self._endpoints = list(endpoints)
        self._waits, self._ttfts = Samples(), Samples()
        self._window = Window(RATE_WINDOW_S)
        self._history = History(self._endpoints)
        self._snapshot = msgspec.json.encode(
            Snapshot(
                0.0,
                RATE_WINDOW_S,
                LATENCY_WINDOW_S,
                [EndpointView(Figures(name), []) for name in self._endpoints],
            )
        )
        self._read_at = -math.inf  # time.monotonic() of the last read
        self._built_at = -math.inf  # and of the last snapshot built
        self._follower: tuple[asyncio.AbstractEventLoop, Source] | None = None
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[None] | None = None

    def read(self) -> bytes:
        """A snapshot (JSON) at most `FRESH_S` old (unless the event loop is stuck for
        `BUILD_WAIT_S`, or no dispatcher is followed), from any thread but the loop's;
        keeps the snapshots coming."""
        self._read_at = time.monotonic()
        if self._read_at - self._built_at > FRESH_S:
            self._build_from_loop()
        return self._snapshot

    def history(self) -> bytes:
        """The history (JSON, dispatcher/observe/history.py), from any thread."""
        return self._history.read()

    def waited(self, endpoint: str, tenant: str, seconds: float, now: float) -> None:
        """A request of `tenant` was dispatched after `seconds` in the queue."""
        self._waits.add((endpoint, tenant), seconds, now)
        self._history.waited((endpoint, tenant), seconds)

    def first_token(self, endpoint: str, tenant: str, seconds: float, now: float) -> None:
        """A request of `tenant` streamed its first token `seconds` after intake."""
        self._ttfts.add((endpoint, tenant), seconds, now)

    def follow(self, loop: asyncio.AbstractEventLoop, source: Source) -> Callable[[], None]:
        """Show the dispatcher whose event loop is `loop`: reads that find the snapshot
        stale have `source(now)` built on it. Its counts start at zero now. Returns the
        call that stops following it (a later `follow` replaces it anyway)."""
        follower = (loop, source)
        self._follower = follower
        self._window.restart(time.time())

        def stop() -> None:
            if self._follower is follower:
                self._follower = None

        return stop

    def refresh(self, watched: Watched, now: float) -> None:
        """Sample the counts and the cost served, step the history, forget what fell out
        of every window, and build the snapshot if someone reads it."""
        backlogged = [(row.endpoint, row.tenant) for row in watched.rows if row.queued]
        self._window.sample(_totals(watched.counts, watched.queues.flow_rows()), backlogged, now)
        for samples in (self._waits, self._ttfts):
            samples.trim(now - LATENCY_WINDOW_S)
        queues = watched.queues
        self._history.step(watched.rows, queues.tier_of, queues.tier_names(), now)
        if time.monotonic() - self._read_at <= WATCHED_S:
            self._build(watched, now)

    def _build_from_loop(self) -> None:
        """Have the followed dispatcher's loop build a snapshot; wait a little for it."""
        follower = self._follower
        if follower is None:
            return
        loop, source = follower
        with self._lock:  # one build for the readers that come meanwhile
            pending = self._pending
            if pending is None or pending.done():
                pending = self._pending = concurrent.futures.Future()
                try:
                    loop.call_soon_threadsafe(self._build_pending, source, pending)
                except RuntimeError:  # the loop is closed: the last snapshot stays
                    self._pending = None
                    return
        concurrent.futures.wait([pending], timeout=BUILD_WAIT_S)

    def _build_pending(self, source: Source, pending: concurrent.futures.Future[None]) -> None:
        try:
            now = time.time()
            self._build(source(now), now)
        finally:
            pending.set_result(None)

    def _build(self, watched: Watched, now: float) -> None:
        waits, ttfts = self._waits.arrays(), self._ttfts.arrays()
        rank = {name: n for n, name in enumerate(watched.queues.tier_names())}
        units = watched.queues.cost_units()
        self._snapshot = msgspec.json.encode(
            Snapshot(
                now,
                RATE_WINDOW_S,
                LATENCY_WINDOW_S,
                [
                    _endpoint_view(name, units.get(name, ""), tiers, rank, waits, ttfts)
                    for name, tiers in self._members(watched, waits, ttfts, now).items()
                ],
            )
        )
        self._built_at = time.monotonic()

    def _members(
        self, watched: Watched, waits: Arrays, ttfts: Arrays, now: float
    ) -> dict[str, dict[str, list[Member]]]:
        """Every tenant's figures, by endpoint and tier: those with work here, admission
        decisions or latency samples (and a tier: still in the registry)."""
        flows = watched.queues.flow_rows()
        span, added = self._window.added(_totals(watched.counts, flows), now)
        rows = {(row.endpoint, row.tenant): row for row in watched.rows}
        weights = {(flow.endpoint, flow.tenant): flow.weight for flow in flows}
        members: dict[str, dict[str, list[Member]]] = {name: {} for name in self._endpoints}
        for key in rows.keys() | watched.counts.keys() | waits.keys() | ttfts.keys():
            row = rows.get(key)
            tier = row.tier if row is not None else watched.queues.tier_of(key[1])
            if tier is None:
                continue
            admitted, rejected, served = added.get(key, ZERO)
            figures = Figures(
                key[1],
                queued=row.queued if row else 0,
                running=row.running if row else 0,
                oldest_wait_s=row.oldest_wait_s if row and row.queued else None,
                admitted_per_s=admitted / span if span > 0 else 0.0,
                rejected_per_s=rejected / span if span > 0 else 0.0,
                p95_queue_wait_s=p95([waits[key]] if key in waits else []),
                p95_ttft_s=p95([ttfts[key]] if key in ttfts else []),
                served_per_s=served / span if span > 0 else 0.0,
            )
            service = (
                Service(
                    weights[key],
                    served,
                    present=row is not None,
                    backlogged=bool(row and row.queued) and self._window.backlogged_throughout(key),
                )
                if key in weights
                else None
            )
            members.setdefault(key[0], {}).setdefault(tier, []).append((key, figures, service))
        return members


Arrays = dict[Key, np.ndarray]


def _totals(counts: Mapping[Key, Counts], flows: list[FlowRow]) -> dict[Key, Totals]:
    """Admission decisions and cost served so far, per endpoint and tenant."""
    totals: dict[Key, Totals] = {
        key: (count.admitted, count.rejected, 0.0) for key, count in counts.items()
    }
    for flow in flows:
        key = (flow.endpoint, flow.tenant)
        admitted, rejected, _ = totals.get(key, ZERO)
        totals[key] = (admitted, rejected, flow.served_cost)
    return totals


def _endpoint_view(
    name: str,
    unit: str,
    tiers: dict[str, list[Member]],
    rank: Mapping[str, int],
    waits: Arrays,
    ttfts: Arrays,
) -> EndpointView:
    views, pooled = [], []
    for tier, members in tiers.items():
        view, tier_ratios = _tier_view(tier, members, waits, ttfts)
        views.append(view)
        pooled += tier_ratios
    views.sort(key=lambda view: (rank.get(view.figures.name, len(rank)), view.figures.name))
    keys = [key for members in tiers.values() for key, _, _ in members]
    total = _total(name, keys, [view.figures for view in views], waits, ttfts)
    # Each tier's ratios are among its own tenants: pooled, they say how far each
    # backlogged tenant is from its share in its tier.
    total.fairness = jain(pooled)
    return EndpointView(total, views, unit)


def _tier_view(
    tier: str, members: list[Member], waits: Arrays, ttfts: Arrays
) -> tuple[TierView, list[float]]:
    """The tier's row and tenants, and the ratios its fairness figure is made of."""
    services = {figures.name: service for _, figures, service in members if service}
    tier_shares = shares(services)
    tenants = []
    for _, figures, _ in members:
        figures.service_share, figures.weight_share = tier_shares.get(figures.name, (None, None))
        tenants.append(figures)
    # Busiest first: a page with a thousand tenants shows those that matter on top.
    tenants.sort(key=lambda f: (-(f.queued + f.running), -f.admitted_per_s, f.name))
    tier_ratios = ratios(services.values())
    total = _total(tier, [key for key, _, _ in members], tenants, waits, ttfts)
    total.fairness = jain(tier_ratios)
    return TierView(total, tenants), tier_ratios


def _total(
    name: str, keys: list[Key], parts: Sequence[Figures], waits: Arrays, ttfts: Arrays
) -> Figures:
    """Sums of `parts`, the oldest of their waits, and percentiles over the samples of
    every key together."""
    return Figures(
        name,
        queued=sum(f.queued for f in parts),
        running=sum(f.running for f in parts),
        oldest_wait_s=max(
            (f.oldest_wait_s for f in parts if f.oldest_wait_s is not None), default=None
        ),
        admitted_per_s=sum(f.admitted_per_s for f in parts),
        rejected_per_s=sum(f.rejected_per_s for f in parts),
        p95_queue_wait_s=p95([waits[key] for key in keys if key in waits]),
        p95_ttft_s=p95([ttfts[key] for key in keys if key in ttfts]),
        served_per_s=sum(f.served_per_s for f in parts),
    )

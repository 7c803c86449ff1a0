"""The live queue dashboard: per endpoint, tier and tenant, what is queued and running,
admissions and rejections per second, and the 95th percentile of queue wait and of time
to first token, from the dispatcher's own state rather than per-tenant Prometheus
series (a thousand tenants would be a thousand series per metric).

The maintenance loop builds a snapshot once a second (`QueueWatch.refresh`) while
someone reads it (the last `WATCHED_S`; nobody watching costs only the samples' upkeep);
the HTTP server's threads (dispatcher/api/http.py) serve the latest one as JSON
(`/dashboard.json`) beside a page that polls it (`/dashboard`), so a page load never
touches the event loop. Rates are over the last `RATE_WINDOW_S`, percentiles over the
requests of the last `LATENCY_WINDOW_S` (the newest `MAX_SAMPLES` per endpoint and tenant).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import msgspec
import numpy as np

from dispatcher.core.scheduler import DepthRow

RATE_WINDOW_S = 10.0
WATCHED_S = 10.0
LATENCY_WINDOW_S = 60.0
MAX_SAMPLES = 2048

Key = tuple[str, str]  # (endpoint, tenant)


class Counts(Protocol):
    """A tenant's admission decisions on one endpoint so far (dispatcher.admission.admit)."""

    admitted: int
    rejected: int


class Figures(msgspec.Struct):
    """One row of the dashboard: a tenant, a tier or an endpoint."""

    name: str
    queued: int = 0
    running: int = 0
    admitted_per_s: float = 0.0
    rejected_per_s: float = 0.0
    # None: no request in the window.
    p95_queue_wait_s: float | None = None
    p95_ttft_s: float | None = None


class TierView(msgspec.Struct):
    figures: Figures
    tenants: list[Figures]


class EndpointView(msgspec.Struct):
    figures: Figures
    tiers: list[TierView]


class Snapshot(msgspec.Struct):
    at: float
    rate_window_s: float
    latency_window_s: float
    endpoints: list[EndpointView]


class QueueWatch:
    """What the dashboard shows, kept up to date by the dispatcher (see the module)."""

    def __init__(self, endpoints: Iterable[str]) -> None:
        self._endpoints = list(endpoints)
        self._waits: dict[Key, deque[tuple[float, float]]] = {}
        self._ttfts: dict[Key, deque[tuple[float, float]]] = {}
        # (when, admitted, rejected) at each refresh of the rate window.
        self._counted: dict[Key, deque[tuple[float, int, int]]] = {}
        self._snapshot = msgspec.json.encode(
            Snapshot(
                0.0,
                RATE_WINDOW_S,
                LATENCY_WINDOW_S,
                [EndpointView(Figures(name), []) for name in self._endpoints],
            )
        )
        self._read_at = -math.inf  # time.monotonic() of the last read

    def read(self) -> bytes:
        """The latest snapshot (JSON), from any thread; keeps the snapshots coming."""
        self._read_at = time.monotonic()
        return self._snapshot

    def waited(self, endpoint: str, tenant: str, seconds: float, now: float) -> None:
        """A request of `tenant` was dispatched after `seconds` in the queue."""
        _sample(self._waits, (endpoint, tenant), now, seconds)

    def first_token(self, endpoint: str, tenant: str, seconds: float, now: float) -> None:
        """A request of `tenant` streamed its first token `seconds` after intake."""
        _sample(self._ttfts, (endpoint, tenant), now, seconds)

    def refresh(
        self,
        rows: list[DepthRow],
        counts: Mapping[Key, Counts],
        tier_of: Callable[[str], str | None],
        tiers: Sequence[str],
        now: float,
    ) -> None:
        """Build the snapshot the HTTP server serves next, from the queues (`rows`), the
        admission counts and the samples; forget what fell out of every window. Tiers
        are shown in the order of `tiers` (the config's, highest first)."""
        rates = self._rates(counts, now)
        for samples in (self._waits, self._ttfts):
            _trim(samples, now - LATENCY_WINDOW_S)
        if time.monotonic() - self._read_at > WATCHED_S:
            return
        waits, ttfts = _values(self._waits), _values(self._ttfts)
        tenants: dict[Key, tuple[str, Figures]] = {}
        for row in rows:
            tenants[(row.endpoint, row.tenant)] = (
                row.tier,
                Figures(row.tenant, queued=row.queued, running=row.running),
            )
        for key in {*rates, *self._waits, *self._ttfts} - tenants.keys():
            tier = tier_of(key[1])
            if tier is not None:
                tenants[key] = (tier, Figures(key[1]))
        by_endpoint: dict[str, dict[str, list[tuple[Key, Figures]]]] = {
            name: {} for name in self._endpoints
        }
        for key, (tier, figures) in tenants.items():
            figures.admitted_per_s, figures.rejected_per_s = rates.get(key, (0.0, 0.0))
            figures.p95_queue_wait_s = _p95([waits[key]] if key in waits else [])
            figures.p95_ttft_s = _p95([ttfts[key]] if key in ttfts else [])
            by_endpoint.setdefault(key[0], {}).setdefault(tier, []).append((key, figures))
        rank = {name: n for n, name in enumerate(tiers)}
        self._snapshot = msgspec.json.encode(
            Snapshot(
                now,
                RATE_WINDOW_S,
                LATENCY_WINDOW_S,
                [
                    _endpoint_view(name, members, rank, waits, ttfts)
                    for name, members in by_endpoint.items()
                ],
            )
        )

    def _rates(self, counts: Mapping[Key, Counts], now: float) -> dict[Key, tuple[float, float]]:
        """(admitted, rejected) per second over the rate window, per endpoint and tenant."""
        rates = {}
        for key in self._counted.keys() - counts.keys():  # forgotten by admission
            del self._counted[key]
        for key, count in counts.items():
            history = self._counted.setdefault(key, deque())
            if history and (count.admitted < history[-1][1] or count.rejected < history[-1][2]):
                history.clear()  # counted afresh since (forgotten, then back)
            history.append((now, count.admitted, count.rejected))
            while now - history[0][0] > RATE_WINDOW_S:
                history.popleft()
            then, admitted, rejected = history[0]
            span = now - then
            rates[key] = (
                ((count.admitted - admitted) / span, (count.rejected - rejected) / span)
                if span > 0
                else (0.0, 0.0)
            )
        return rates


Arrays = dict[Key, np.ndarray]


def _endpoint_view(
    name: str,
    tiers: dict[str, list[tuple[Key, Figures]]],
    rank: Mapping[str, int],
    waits: Arrays,
    ttfts: Arrays,
) -> EndpointView:
    views = [_tier_view(tier, members, waits, ttfts) for tier, members in tiers.items()]
    views.sort(key=lambda view: (rank.get(view.figures.name, len(rank)), view.figures.name))
    keys = [key for members in tiers.values() for key, _ in members]
    return EndpointView(_total(name, keys, [view.figures for view in views], waits, ttfts), views)


def _tier_view(
    tier: str, members: list[tuple[Key, Figures]], waits: Arrays, ttfts: Arrays
) -> TierView:
    tenants = [figures for _, figures in members]
    # Busiest first: a page with a thousand tenants shows those that matter on top.
    tenants.sort(key=lambda f: (-(f.queued + f.running), -f.admitted_per_s, f.name))
    return TierView(_total(tier, [key for key, _ in members], tenants, waits, ttfts), tenants)


def _total(
    name: str, keys: list[Key], parts: list[Figures], waits: Arrays, ttfts: Arrays
) -> Figures:
    """Sums of `parts`, and percentiles over the samples of every key together."""
    return Figures(
        name,
        queued=sum(f.queued for f in parts),
        running=sum(f.running for f in parts),
        admitted_per_s=sum(f.admitted_per_s for f in parts),
        rejected_per_s=sum(f.rejected_per_s for f in parts),
        p95_queue_wait_s=_p95([waits[key] for key in keys if key in waits]),
        p95_ttft_s=_p95([ttfts[key] for key in keys if key in ttfts]),
    )


def _sample(
    samples: dict[Key, deque[tuple[float, float]]], key: Key, now: float, value: float
) -> None:
    window = samples.get(key)
    if window is None:
        window = samples[key] = deque(maxlen=MAX_SAMPLES)
    window.append((now, value))


def _trim(samples: dict[Key, deque[tuple[float, float]]], since: float) -> None:
    for key in list(samples):
        window = samples[key]
        while window and window[0][0] < since:
            window.popleft()
        if not window:
            del samples[key]


def _values(samples: dict[Key, deque[tuple[float, float]]]) -> Arrays:
    return {
        key: np.fromiter((value for _, value in window), float, len(window))
        for key, window in samples.items()
    }


def _p95(arrays: list[np.ndarray]) -> float | None:
    """The nearest-rank 95th percentile of the values together; None without any."""
    values = np.concatenate(arrays) if len(arrays) > 1 else (arrays[0] if arrays else None)
    if values is None or not len(values):
        return None
    rank = math.ceil(0.95 * len(values)) - 1
    return float(np.partition(values, rank)[rank])  # linear, not a sort

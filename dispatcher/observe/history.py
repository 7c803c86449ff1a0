"""The dashboard's history, kept by the dispatcher so that a page opened or reloaded
shows the last `HISTORY_S` at once: every `STEP_S`, per endpoint, the requests queued
and running, and per tier the oldest wait of a request still queued (0 with none) and the
95th percentile of the queue waits of the requests dispatched during the step (None with
none). At most `HISTORY_S / STEP_S` points; served as JSON (`/dashboard/history.json`),
in columns, encoded at each step so that a read never touches the event loop.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

import msgspec

from dispatcher.core.scheduler import DepthRow
from dispatcher.observe.latency import p95
from dispatcher.observe.window import Key

STEP_S = 2.0
HISTORY_S = 600.0
# Queue waits kept for one step's percentile: the newest, should dispatch outrun it.
MAX_STEP_WAITS = 16384


class TierSeries(msgspec.Struct):
    name: str
    oldest_wait_s: list[float | None]  # None: the tier was not configured then
    p95_queue_wait_s: list[float | None]


class EndpointSeries(msgspec.Struct):
    name: str
    queued: list[int]
    running: list[int]
    tiers: list[TierSeries]


class HistoryView(msgspec.Struct):
    step_s: float
    span_s: float
    at: list[float]  # the points' times, oldest first (Unix seconds)
    endpoints: list[EndpointSeries]


# One endpoint at one step: queued, running, tier -> (oldest wait, p95 queue wait).
Point = tuple[int, int, dict[str, tuple[float, float | None]]]


class History:
    def __init__(self, endpoints: Sequence[str]) -> None:
        self._endpoints = list(endpoints)
        self._points: deque[tuple[float, dict[str, Point]]] = deque(
            maxlen=round(HISTORY_S / STEP_S)
        )
        self._waits: deque[tuple[Key, float]] = deque(maxlen=MAX_STEP_WAITS)
        self._stepped_at = -math.inf
        self._encoded = b""
        self._encode()

    def read(self) -> bytes:
        """The history as JSON, from any thread."""
        return self._encoded

    def waited(self, key: Key, seconds: float) -> None:
        self._waits.append((key, seconds))

    def step(
        self,
        rows: list[DepthRow],
        tier_of: Callable[[str], str | None],
        tiers: Sequence[str],
        now: float,
    ) -> None:
        """Add a point if a step has passed since the last one."""
        if now - self._stepped_at < STEP_S:
            return
        self._stepped_at = now
        waits: dict[tuple[str, str | None], list[float]] = {}
        for (endpoint, tenant), seconds in self._waits:
            waits.setdefault((endpoint, tier_of(tenant)), []).append(seconds)
        self._waits.clear()
        points: dict[str, Point] = {
            name: (0, 0, {tier: (0.0, p95([waits.get((name, tier), [])])) for tier in tiers})
            for name in self._endpoints
        }
        for row in rows:
            point = points.get(row.endpoint)
            if point is None:
                continue
            queued, running, by_tier = point
            oldest, wait = by_tier.get(row.tier, (0.0, None))
            if row.queued:
                oldest = max(oldest, row.oldest_wait_s)
            by_tier[row.tier] = (oldest, wait)
            points[row.endpoint] = (queued + row.queued, running + row.running, by_tier)
        self._points.append((now, points))
        self._encode()

    def _encode(self) -> None:
        self._encoded = msgspec.json.encode(
            HistoryView(
                STEP_S,
                HISTORY_S,
                [at for at, _ in self._points],
                [self._series(name) for name in self._endpoints],
            )
        )

    def _series(self, endpoint: str) -> EndpointSeries:
        points = [points[endpoint] for _, points in self._points]
        tiers: dict[str, TierSeries] = {}
        for n, (_, _, by_tier) in enumerate(points):
            for tier, (oldest, wait) in by_tier.items():
                series = tiers.get(tier)
                if series is None:
                    series = tiers[tier] = TierSeries(
                        tier, [None] * len(points), [None] * len(points)
                    )
                series.oldest_wait_s[n] = oldest
                series.p95_queue_wait_s[n] = wait
        return EndpointSeries(
            endpoint,
            [queued for queued, _, _ in points],
            [running for _, running, _ in points],
            list(tiers.values()),
        )

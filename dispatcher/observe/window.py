"""The dashboard's sliding window of running totals per endpoint and tenant: admission
decisions (admitted, rejected) and cost served, sampled once a second.

Each sample keeps what every key added since the one before, so a key's first sample
counts from zero: a tenant whose burst began between two samples shows its rate from
the first second, not from its second sample on. `backlogged_throughout` says which
tenants had work queued at every sample of the window (the fairness figures' subjects).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

Key = tuple[str, str]  # (endpoint, tenant)
Totals = tuple[int, int, float]  # admitted, rejected, cost served: so far
ZERO: Totals = (0, 0, 0.0)


class Window:
    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        # (when, what each key added since the sample before); the first one is the
        # window's start, and what it added is before the window.
        self._samples: deque[tuple[float, dict[Key, Totals]]] = deque()
        self._last: dict[Key, Totals] = {}
        self._backlogged_since: dict[Key, float] = {}

    def restart(self, now: float) -> None:
        """Start over from zero totals at `now` (a new dispatcher's counts start at 0)."""
        self._samples.clear()
        self._samples.append((now, {}))
        self._last = {}
        self._backlogged_since = {}

    def sample(self, totals: dict[Key, Totals], backlogged: Iterable[Key], now: float) -> None:
        """The totals at `now` (keys missing: forgotten), and who has work queued."""
        self._samples.append((now, _added(totals, self._last)))
        self._last = totals
        # The start is the newest sample at least the span old: rates over a span a
        # little longer than `span_s` rather than a shorter one.
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.span_s:
            self._samples.popleft()
        since = self._backlogged_since
        self._backlogged_since = {key: since.get(key, now) for key in backlogged}

    def added(self, totals: dict[Key, Totals], now: float) -> tuple[float, dict[Key, Totals]]:
        """(span, what each key added over it), from the window's start to `now`, when
        the totals are `totals`."""
        if not self._samples:
            return 0.0, {}
        sums: dict[Key, Totals] = {}
        steps = itertools.islice(self._samples, 1, None)
        for added in itertools.chain((step for _, step in steps), [_added(totals, self._last)]):
            for key, (admitted, rejected, served) in added.items():
                a, r, s = sums.get(key, ZERO)
                sums[key] = (a + admitted, r + rejected, s + served)
        return now - self._samples[0][0], sums

    def backlogged_throughout(self, key: Key) -> bool:
        """Queued at every sample since the window's start."""
        since = self._backlogged_since.get(key)
        return since is not None and bool(self._samples) and since <= self._samples[0][0]


def _added(totals: dict[Key, Totals], last: dict[Key, Totals]) -> dict[Key, Totals]:
    """What each key added from `last` to `totals`; a key new to `totals` from zero."""
    added = {}
    for key, (admitted, rejected, served) in totals.items():
        admitted_before, rejected_before, served_before = last.get(key, ZERO)
        if admitted < admitted_before or rejected < rejected_before:
            admitted_before = rejected_before = 0  # counted afresh since (forgotten, back)
        step = (
            admitted - admitted_before,
            rejected - rejected_before,
            # Less than before: a refund (a requeue) or a flow forgotten and made again.
            max(0.0, served - served_before),
        )
        if step != ZERO:
            added[key] = step
    return added

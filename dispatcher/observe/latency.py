"""The dashboard's latency samples (queue wait, time to first token): the newest
`MAX_SAMPLES` per endpoint and tenant, with when each was taken, and their percentile."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from dispatcher.observe.window import Key

MAX_SAMPLES = 2048


class Samples:
    def __init__(self) -> None:
        self._windows: dict[Key, deque[tuple[float, float]]] = {}

    def add(self, key: Key, value: float, now: float) -> None:
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = deque(maxlen=MAX_SAMPLES)
        window.append((now, value))

    def trim(self, since: float) -> None:
        """Forget the samples taken before `since`, and the keys left without any."""
        for key in list(self._windows):
            window = self._windows[key]
            while window and window[0][0] < since:
                window.popleft()
            if not window:
                del self._windows[key]

    def keys(self) -> set[Key]:
        return set(self._windows)

    def arrays(self) -> dict[Key, np.ndarray]:
        return {
            key: np.fromiter((value for _, value in window), float, len(window))
            for key, window in self._windows.items()
        }


def p95(parts: Sequence[Sequence[float]]) -> float | None:
    """The nearest-rank 95th percentile of the values of `parts` together; None without
    any."""
    if not parts:
        return None
    values = np.asarray(parts[0], float) if len(parts) == 1 else np.concatenate(parts)
    if not len(values):
        return None
    rank = math.ceil(0.95 * len(values)) - 1
    return float(np.partition(values, rank)[rank])  # linear, not a sort

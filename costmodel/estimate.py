"""Output-length estimates before dispatch.

The scheduler must charge a request before its output length is known. It charges an
estimate, `ratio * max_tokens`, where `ratio` is an exponential moving average of
output_tokens / max_tokens observed for the same key (the scheduler uses
(tenant, endpoint)); the charge is corrected with the real usage on completion.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable


def _check_smoothing(smoothing: float) -> None:
    if not 0 < smoothing <= 1:
        raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")


class Ema:
    """Exponential moving average: value += smoothing * (x - value).

    Without an initial value the first update sets the value outright.
    """

    __slots__ = ("smoothing", "value")

    def __init__(self, smoothing: float = 0.2, initial: float | None = None) -> None:
        _check_smoothing(smoothing)
        self.smoothing = smoothing
        self.value = initial

    def update(self, x: float) -> float:
        """Fold in one observation and return the new value."""
        if not math.isfinite(x):
            raise ValueError(f"EMA observation must be finite, got {x!r}")
        self.value = x if self.value is None else self.value + self.smoothing * (x - self.value)
        return self.value


class OutputEstimator:
    """Per-key EMA of the output/max_tokens ratio, with a prior for unseen keys.

    Memory is bounded: at most `max_keys` keys are kept, the least recently used
    (estimated or observed) is forgotten first and falls back to the prior.
    """

    def __init__(self, smoothing: float = 0.2, prior: float = 0.5, max_keys: int = 100_000) -> None:
        _check_smoothing(smoothing)
        if not 0 <= prior <= 1:
            raise ValueError(f"prior ratio must be in [0, 1], got {prior!r}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys!r}")
        self.smoothing = smoothing
        self.prior = prior
        self.max_keys = max_keys
        self._ratios: OrderedDict[Hashable, Ema] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ratios)

    def ratio(self, key: Hashable, fallback: Hashable | None = None) -> float:
        """The current output/max_tokens ratio for `key`. An unseen key gets that of
        `fallback` (a pool the key belongs to, such as every tenant of its endpoint) if
        that was seen, else the prior."""
        ema = self._ratios.get(key)
        if ema is None:
            return self.prior if fallback is None else self.ratio(fallback)
        self._ratios.move_to_end(key)
        assert ema.value is not None  # every stored Ema starts from a value
        return ema.value

    def estimate(self, key: Hashable, max_tokens: int, fallback: Hashable | None = None) -> int:
        """Expected output tokens of a request capped at `max_tokens`, in [1, max_tokens]."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        return min(max(round(self.ratio(key, fallback) * max_tokens), 1), max_tokens)

    def observe(
        self, key: Hashable, output_tokens: int, max_tokens: int, fallback: Hashable | None = None
    ) -> None:
        """Fold in a completed request, into `fallback`'s average too; ignored when
        `max_tokens` <= 0. A key seen for the first time starts from the ratio it was
        estimated with (the fallback's, else the prior), so one odd request does not
        swing its estimate."""
        if max_tokens <= 0:
            return
        ratio = min(max(output_tokens / max_tokens, 0.0), 1.0)
        start = self.ratio(key, fallback)
        if fallback is not None:
            self._update(fallback, ratio, self.prior)
        self._update(key, ratio, start)

    def _update(self, key: Hashable, ratio: float, start: float) -> None:
        ema = self._ratios.get(key)
        if ema is None:
            ema = self._ratios[key] = Ema(self.smoothing, initial=start)
            if len(self._ratios) > self.max_keys:
                self._ratios.popitem(last=False)
        else:
            self._ratios.move_to_end(key)
        ema.update(ratio)

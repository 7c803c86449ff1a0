"""Autoscaling on model-unit utilisation: how many replicas an endpoint should run.

Pure and clock-free (every call takes `now`); the dispatcher and the simulator feed the
same `Autoscaler` and act on its decisions in their own way.

- **Demand** (model units per second): the arrival rate of model units over the last
  `rate_window_s` (every valid request, admitted or not: offered load), plus the queued
  backlog worked off within `drain_s`.
- **Capacity**: replicas x the profile's `capacity_mu_per_s`; **utilisation** = demand
  over the capacity of the replicas serving now (infinite with none and demand waiting).
- **Desired replicas**: enough that demand runs at `target_utilisation`. Scaling up
  takes the cold start into account: for `cold_start_s` the new replicas do not serve,
  so the backlog grows by the demand the serving ones cannot take, and that backlog
  must drain too. Clamped to [min_replicas, max_replicas].
- **Stabilisation**: up at once (the next decision), down only to the highest
  recommendation of the last `scale_down_after_s`, so a lull shorter than that quiet
  window never gives replicas back (Kubernetes' HPA stabilisation window, one-sided).
- **Scale to zero** (min_replicas = 0): an endpoint without demand for the quiet window
  goes to zero; the first request after that is backlog, so the next decision asks for
  a replica.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import msgspec

# Guards ceil() against float noise: 2.0000000000000004 replicas means 2.
_CEIL_SLACK = 1e-9


class ScalingPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One endpoint's autoscaling settings (`[endpoints.<name>.autoscale]`)."""

    min_replicas: int = 1
    max_replicas: int = 16
    target_utilisation: float = 0.8
    # Replicas are given back only after demand stayed lower this long.
    scale_down_after_s: float = 300.0
    # From the decision to start a replica to it serving.
    cold_start_s: float = 60.0
    # Demand: the arrival rate over this window, plus the backlog drained within drain_s.
    rate_window_s: float = 60.0
    drain_s: float = 60.0

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas!r}")
        if self.max_replicas < max(self.min_replicas, 1):
            raise ValueError(
                f"max_replicas must be >= max(min_replicas, 1), got "
                f"{self.max_replicas!r} with min_replicas {self.min_replicas!r}"
            )
        if not 0 < self.target_utilisation <= 1:
            raise ValueError(
                f"target_utilisation must be in (0, 1], got {self.target_utilisation!r}"
            )
        for name in ("scale_down_after_s", "cold_start_s"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)!r}")
        for name in ("rate_window_s", "drain_s"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    desired: int
    demand_mu_per_s: float
    utilisation: float


def utilisation(replicas: int, demand_mu_per_s: float, mu_per_s_per_replica: float) -> float:
    """Demand over fleet capacity; infinite when demand meets a fleet of zero replicas."""
    if replicas == 0:
        return math.inf if demand_mu_per_s > 0 else 0.0
    return demand_mu_per_s / (replicas * mu_per_s_per_replica)


class Autoscaler:
    """One endpoint's autoscaler: `arrived` for every request, `decide` periodically."""

    def __init__(self, policy: ScalingPolicy, mu_per_s_per_replica: float) -> None:
        if not (mu_per_s_per_replica > 0 and math.isfinite(mu_per_s_per_replica)):
            raise ValueError(
                f"mu_per_s_per_replica must be finite and > 0, got {mu_per_s_per_replica!r}"
            )
        self.policy = policy
        self.mu_per_s_per_replica = mu_per_s_per_replica
        self._arrivals: deque[tuple[float, float]] = deque()
        self._arrived_mu = 0.0  # the sum over `_arrivals`
        self._first: tuple[float, float] | None = None  # the first arrival: time, units
        # (time, recommendation), recommendations never rising toward the right: the
        # window's highest is always first.
        self._recommended: deque[tuple[float, int]] = deque()

    def arrived(self, model_units: float, now: float) -> None:
        if self._first is None:
            self._first = (now, model_units)
        self._arrivals.append((now, model_units))
        self._arrived_mu += model_units

    def arrival_rate(self, now: float) -> float:
        """Model units per second arrived over the last `rate_window_s`. Until a whole
        window has passed since the first arrival, what arrived after it over the time
        since: a fleet that starts under load sees the load at once, without the
        overshoot of counting the first arrival over almost no time."""
        horizon = now - self.policy.rate_window_s
        while self._arrivals and self._arrivals[0][0] <= horizon:
            self._arrived_mu -= self._arrivals.popleft()[1]
        if not self._arrivals:
            self._arrived_mu = 0.0  # no float residue once the window is empty
        if self._first is not None and self._first[0] > horizon:
            elapsed = now - self._first[0]
            return (self._arrived_mu - self._first[1]) / elapsed if elapsed > 0 else 0.0
        return max(self._arrived_mu, 0.0) / self.policy.rate_window_s

    def decide(self, now: float, serving: int, backlog_mu: float) -> ScaleDecision:
        """The replica count to run: `serving` replicas serve now, `backlog_mu` model
        units wait for one."""
        policy = self.policy
        rate = self.arrival_rate(now)
        demand = rate + max(backlog_mu, 0.0) / policy.drain_s
        serving_mu = serving * self.mu_per_s_per_replica
        # What piles up while new replicas start, beyond what the serving ones take.
        backlog_at_start = (
            max(backlog_mu, 0.0)
            + max(0.0, rate - serving_mu * policy.target_utilisation) * policy.cold_start_s
        )
        needed = (
            rate + backlog_at_start / policy.drain_s
            if demand > serving_mu * policy.target_utilisation
            else demand
        )
        raw = math.ceil(
            needed / (self.mu_per_s_per_replica * policy.target_utilisation) - _CEIL_SLACK
        )
        raw = min(max(raw, policy.min_replicas), policy.max_replicas)
        recommended = self._recommended
        while recommended and recommended[0][0] <= now - policy.scale_down_after_s:
            recommended.popleft()
        while recommended and recommended[-1][1] <= raw:
            recommended.pop()
        recommended.append((now, raw))
        return ScaleDecision(
            recommended[0][1], demand, utilisation(serving, demand, self.mu_per_s_per_replica)
        )


class DriftPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """When a profile's capacity counts as off (`[dispatcher.drift]`)."""

    # Observed over predicted outside [low, high] ...
    low: float = 0.8
    high: float = 1.25
    # ... for this long, counted from the first reading out of the band, gives a warning.
    warn_after_s: float = 60.0
    # A reading covers the last window_s, and needs min_full_s of it with work queued.
    window_s: float = 60.0
    min_full_s: float = 20.0

    def __post_init__(self) -> None:
        if not 0 < self.low <= 1 <= self.high < math.inf:
            raise ValueError(
                f"drift band must satisfy 0 < low <= 1 <= high, got [{self.low!r}, {self.high!r}]"
            )
        if not (self.warn_after_s >= 0 and math.isfinite(self.warn_after_s)):
            raise ValueError(f"warn_after_s must be finite and >= 0, got {self.warn_after_s!r}")
        if not 0 < self.min_full_s <= self.window_s < math.inf:
            raise ValueError(
                f"need 0 < min_full_s <= window_s, got {self.min_full_s!r} and {self.window_s!r}"
            )


class DriftMeter:
    """How far an endpoint's profile is from what its replicas really do: observed over
    predicted model-unit throughput.

    Predicted: the serving replicas' advertised `capacity_mu_per_s`. Observed: model
    units of the requests that completed, priced from their real usage. Only intervals
    in which the endpoint had work waiting that no replica had room for, at both ends,
    count: then its replicas run at their limits, the condition under which `fairq
    calibrate` measures capacity, so the reading does not fall with the load. A lighter
    load says nothing about capacity and gives no reading (None), and no warning until
    readings say the profile is still off.

    Because a profile's coefficients price the model units, a wrong alpha or beta moves
    the reading as much as a wrong capacity does; so does a traffic mix unlike the one
    the profile was measured on.
    """

    def __init__(self, policy: DriftPolicy) -> None:
        self.policy = policy
        # (end, seconds, completed model units, predicted model units) per full interval,
        # and their sums over the window.
        self._intervals: deque[tuple[float, float, float, float]] = deque()
        self._full_s = self._completed = self._predicted = 0.0
        self._last: tuple[float, float, bool] | None = None  # time, completed total, full
        # Since when every reading has been out of the band (None: the last one was in
        # it, or there is no reading).
        self.out_since: float | None = None
        self._warned = False
        self.ratio: float | None = None

    def observe(self, now: float, completed_mu: float, serving_mu_per_s: float, full: bool) -> None:
        """One look at the endpoint: `completed_mu` is the running total of completed
        model units, `serving_mu_per_s` the healthy replicas' capacity, `full` whether
        work waits that none of them has room for. A look with a non-finite figure is
        skipped."""
        if not all(map(math.isfinite, (now, completed_mu, serving_mu_per_s))):
            return
        last, self._last = self._last, (now, completed_mu, full)
        if last is not None and last[2] and full and serving_mu_per_s > 0 and now > last[0]:
            seconds = now - last[0]
            interval = (now, seconds, completed_mu - last[1], seconds * serving_mu_per_s)
            self._intervals.append(interval)
            self._add(interval, 1)
        while self._intervals and self._intervals[0][0] <= now - self.policy.window_s:
            self._add(self._intervals.popleft(), -1)
        if not self._intervals:
            self._full_s = self._completed = self._predicted = 0.0  # no float residue
        if self._full_s < self.policy.min_full_s or self._predicted <= 0:
            # No reading: an excursion is counted again from the next one out of band.
            self.ratio = self.out_since = None
            return
        self.ratio = self._completed / self._predicted
        if self.policy.low <= self.ratio <= self.policy.high:
            self.out_since, self._warned = None, False
        elif self.out_since is None:
            self.out_since = now

    def _add(self, interval: tuple[float, float, float, float], sign: int) -> None:
        self._full_s += sign * interval[1]
        self._completed += sign * interval[2]
        self._predicted += sign * interval[3]

    def warning_due(self, now: float) -> bool:
        """True once per excursion: every reading has been out of the band for
        `warn_after_s`. It is due again only after a reading back inside."""
        if self._warned or self.out_since is None:
            return False
        if now - self.out_since < self.policy.warn_after_s:
            return False
        self._warned = True
        return True

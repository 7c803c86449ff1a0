"""Fairness and latency metrics from per-request records.

Pure functions over `RequestRecord`s, so the simulator and the end-to-end benchmarks
(records measured through the real stack) report the same figures the same way.

Service. A served request delivers its cost, spread evenly from its first token to its
finish (a request whose first token is also its last delivers it all at that instant).
Service in a window is the part of that spread inside the window. The cost is in one of
three units (`SERVICE_UNITS`, `service_unit`):
- `vtc`: `input_weight * input_tokens + output_weight * output_tokens` with weights 1
  and 2, as in the VTC paper;
- `model_units`: the same with the profile's prices at its operating batch;
- `engine`: the engine time the replica attributed to the request (its prefill, images
  and share of every decode step: costmodel/engine_model.py), the judge of fairness in
  engine time. A request that was not served has no attribution; its demand is priced
  as in `model_units`.

Windows. Fixed windows of `window_s` (default 60 s) start after `warmup_s` (default
30 s) and cover the arrival period (up to the last arrival), so the drain of a backlog
after the trace has ended does not dilute the averages. When not even one whole window
fits, the single window from 0 to the last arrival (or, if every request arrived at
once, to the last finish) is used, so short traces still get a figure.

Service difference (VTC paper, "Fairness in Serving Large Language Models", OSDI
2024, section 6, computed as in its artifact's `get_service_diff_over_time`): per
window, with s_i the service tenant i received and d_i its demand, both as rates over
the window (service units per second),

    diff = sum_i min(max_j s_j - s_i, |d_i - s_i|)

where the demand d_i is the cost of tenant i's requests that *arrived* in the window,
whatever became of them (the artifact's "request rate"). A tenant that received as
much as the best-served tenant, or as much as it asked for, adds nothing; a tenant
starved while it asks adds what it is short of. With tenant weights, s_i and d_i are
divided by tenant i's weight, so tenants served in proportion to their weights add
nothing (the paper's tenants all have weight 1). Reported: the max and the mean over
windows.

Jain's index per window is computed on normalised service x_i = s_i / f_i, as in
Jain, Chiu and Hawe (1984), where f_i is tenant i's weighted max-min fair share of the
service delivered in the window (water-filling over the tenants' available work with
their weights). A tenant's available work in a window is what it could have been
served there: the unserved remainder, at the window's start, of its requests that
arrived before the window's end. Tenants with no available work are not counted, so
a small tenant that asked for little and got it is perfectly fair (x_i = 1), and a
flooding tenant is only owed its fair share. Windows in which nothing was served have
no index.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from costmodel.units import ModelProfile

PERCENTILES = (50, 95, 99)


@dataclass(slots=True, frozen=True)
class RequestRecord:
    """What happened to one request. Times are on one clock, in seconds.

    `outcome` is an `Outcome` value ("admitted" for a request that entered the queue);
    `output_tokens` is the request's real output length (what the engine produced,
    or would have produced for a request that never ran).
    """

    id: str
    tenant: str
    arrival: float
    dispatched: float | None
    first_token: float | None
    finished: float | None
    input_tokens: int
    output_tokens: int
    outcome: str
    endpoint: str = ""
    cached_tokens: int = 0  # input tokens found in the replica's prefix cache
    worker: str = ""  # the replica that ran it
    engine_s: float = 0.0  # the engine time its replica attributed to it

    @property
    def served(self) -> bool:
        return self.first_token is not None and self.finished is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True, frozen=True)
class MetricOptions:
    """How service is costed and windowed."""

    input_weight: float = 1.0
    output_weight: float = 2.0
    window_s: float = 60.0
    warmup_s: float = 30.0
    # A served request's cost is its attributed engine time (the weights price the rest).
    engine_time: bool = False
    unit: str = "vtc"  # the name reports give the unit

    def __post_init__(self) -> None:
        for name in ("input_weight", "output_weight", "warmup_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise ValueError(f"window_s must be finite and > 0, got {self.window_s!r}")

    def cost(self, record: RequestRecord) -> float:
        if self.engine_time and record.served:
            return record.engine_s
        return self.input_weight * record.input_tokens + self.output_weight * record.output_tokens


DEFAULT_METRICS = MetricOptions()
SERVICE_UNITS = ("vtc", "engine", "model_units")


def service_unit(unit: str, profile: ModelProfile, **options: float) -> MetricOptions:
    """Metric options that cost service in `unit` (one of `SERVICE_UNITS`), with the
    prices of `profile` at its operating batch where the unit needs them."""
    if unit == "vtc":
        return MetricOptions(**options)
    if unit not in SERVICE_UNITS:
        raise ValueError(f"service unit must be one of {', '.join(SERVICE_UNITS)}, got {unit!r}")
    return MetricOptions(
        input_weight=profile.alpha,
        output_weight=profile.decode_token_s(),
        engine_time=unit == "engine",
        unit=unit,
        **options,
    )


Window = tuple[float, float]


# -- latency ----------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q!r}")
    rank = (len(sorted_values) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def latency_summary(values: Iterable[float]) -> dict[str, float | None]:
    """{"p50", "p95", "p99"}; None for each when there are no values."""
    ordered = sorted(values)
    return {f"p{q}": (percentile(ordered, q) if ordered else None) for q in PERCENTILES}


# -- Jain's index -------------------------------------------------------------------------


def jain_index(values: Sequence[float]) -> float:
    """(sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one has everything."""
    if not values:
        raise ValueError("Jain's index of no values")
    if any(v < 0 for v in values):
        raise ValueError("Jain's index needs non-negative values")
    square_sum = sum(v * v for v in values)
    if square_sum == 0:
        return 1.0  # everyone got nothing: equal
    return sum(values) ** 2 / (len(values) * square_sum)


def max_min_shares(
    available: Mapping[str, float], capacity: float, weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Weighted max-min fair split of `capacity` among demands capped at `available`."""
    weights = weights or {}
    order = sorted(available, key=lambda t: (available[t] / weights.get(t, 1.0), t))
    remaining = capacity
    weight_left = sum(weights.get(t, 1.0) for t in order)
    shares: dict[str, float] = {}
    for tenant in order:
        weight = weights.get(tenant, 1.0)
        share = min(available[tenant], remaining * weight / weight_left)
        shares[tenant] = share
        remaining -= share
        weight_left -= weight
    return shares


# -- windows ------------------------------------------------------------------------------


def metric_windows(records: Sequence[RequestRecord], options: MetricOptions) -> list[Window]:
    """The windows the fairness figures are computed over (see the module doc)."""
    if not records:
        return []
    horizon = max(r.arrival for r in records)
    if horizon <= 0:
        horizon = max((r.finished for r in records if r.finished is not None), default=0.0)
    count = (
        math.floor((horizon - options.warmup_s) / options.window_s)
        if horizon > options.warmup_s
        else 0
    )
    if count < 1:
        return [(0.0, horizon)] if horizon > 0 else []
    return [
        (options.warmup_s + k * options.window_s, options.warmup_s + (k + 1) * options.window_s)
        for k in range(count)
    ]


def _overlap(start: float, end: float, window: Window) -> float:
    return max(0.0, min(end, window[1]) - max(start, window[0]))


def _served_fraction(record: RequestRecord, start: float, end: float) -> float:
    """Fraction of a served record's service delivered in [start, end)."""
    first, last = record.first_token, record.finished
    assert first is not None and last is not None
    if last <= first:
        return 1.0 if start <= first < end else 0.0
    return _overlap(first, last, (start, end)) / (last - first)


def _window_span(windows: Sequence[Window], start: float, end: float) -> range:
    """Indices of the windows that [start, end] can touch (windows are sorted)."""
    lo, hi = 0, len(windows)
    while lo < hi:  # first window ending after `start`
        mid = (lo + hi) // 2
        if windows[mid][1] <= start:
            lo = mid + 1
        else:
            hi = mid
    first = lo
    while lo < len(windows) and windows[lo][0] <= end:
        lo += 1
    return range(first, lo)


def service_per_window(
    records: Iterable[RequestRecord], windows: Sequence[Window], options: MetricOptions
) -> dict[str, list[float]]:
    """Service (cost units) each tenant received in each window."""
    service: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(windows))
    for record in records:
        if not record.served:
            continue
        cost = options.cost(record)
        for k in _window_span(windows, record.first_token, record.finished):
            part = _served_fraction(record, *windows[k])
            if part:
                service[record.tenant][k] += cost * part
    return dict(service)


def demand_per_window(
    records: Iterable[RequestRecord], windows: Sequence[Window], options: MetricOptions
) -> dict[str, list[float]]:
    """Cost of each tenant's requests that arrived in each window (VTC's demand)."""
    demand: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(windows))
    for record in records:
        for k in _window_span(windows, record.arrival, record.arrival):
            if windows[k][0] <= record.arrival < windows[k][1]:
                demand[record.tenant][k] += options.cost(record)
    return dict(demand)


def available_per_window(
    records: Iterable[RequestRecord], windows: Sequence[Window], options: MetricOptions
) -> dict[str, list[float]]:
    """Work each tenant could have been served in each window: the unserved remainder,
    at the window's start, of its served requests that arrived before the window's end."""
    available: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(windows))
    for record in records:
        if not record.served:
            continue
        cost = options.cost(record)
        for k in _window_span(windows, record.arrival, record.finished):
            start, end = windows[k]
            if record.arrival >= end:
                continue
            remainder = _served_fraction(record, start, math.inf)
            if remainder:
                available[record.tenant][k] += cost * remainder
    return dict(available)


def service_difference(
    service: Mapping[str, Sequence[float]],
    demand: Mapping[str, Sequence[float]],
    windows: Sequence[Window],
    weights: Mapping[str, float] | None = None,
) -> list[float]:
    """VTC's per-window service difference, in service units per second (per unit of
    weight: with `weights`, a tenant's service and demand are divided by its weight)."""
    tenants = sorted(set(service) | set(demand))
    weights = weights or {}
    diffs = []
    for k, (start, end) in enumerate(windows):
        length = end - start
        scale = {t: length * weights.get(t, 1.0) for t in tenants}
        rates = {t: service.get(t, [0.0] * len(windows))[k] / scale[t] for t in tenants}
        asked = {t: demand.get(t, [0.0] * len(windows))[k] / scale[t] for t in tenants}
        best = max(rates.values(), default=0.0)
        diffs.append(sum(min(best - rates[t], abs(asked[t] - rates[t])) for t in tenants))
    return diffs


def jain_per_window(
    service: Mapping[str, Sequence[float]],
    available: Mapping[str, Sequence[float]],
    windows: Sequence[Window],
    weights: Mapping[str, float] | None = None,
) -> list[float | None]:
    """Jain's index of service normalised by max-min fair share, per window."""
    indices: list[float | None] = []
    for k in range(len(windows)):
        work = {t: a[k] for t, a in available.items() if a[k] > 0}
        got = {t: service.get(t, [0.0] * len(windows))[k] for t in work}
        delivered = sum(got.values())
        if not work or delivered <= 0:
            indices.append(None)
            continue
        shares = max_min_shares(work, delivered, weights)
        indices.append(jain_index([got[t] / shares[t] for t in work if shares[t] > 0]))
    return indices


# -- the summary ----------------------------------------------------------------------------


def throughput_tokens_per_s(records: Sequence[RequestRecord]) -> float:
    """Input plus output tokens of served requests over first arrival to last finish."""
    served = [r for r in records if r.served]
    if not served:
        return 0.0
    span = max(r.finished for r in served) - min(r.arrival for r in records)
    tokens = sum(r.input_tokens + r.output_tokens for r in served)
    return tokens / span if span > 0 else 0.0


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def tenant_summary(records: Sequence[RequestRecord], options: MetricOptions) -> dict[str, Any]:
    by_tenant: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in records:
        by_tenant[record.tenant].append(record)
    tenants = {}
    for tenant in sorted(by_tenant):
        mine = by_tenant[tenant]
        served = [r for r in mine if r.served]
        outcomes: dict[str, int] = defaultdict(int)
        for r in mine:
            outcomes[r.outcome] += 1
        tenants[tenant] = {
            "count": len(mine),
            "served": len(served),
            "outcomes": dict(sorted(outcomes.items())),
            "queue_wait_s": latency_summary(
                r.dispatched - r.arrival for r in served if r.dispatched is not None
            ),
            "ttft_s": latency_summary(r.first_token - r.arrival for r in served),
            "service": float(sum(options.cost(r) for r in served)),
        }
    return tenants


def summarize(
    records: Sequence[RequestRecord],
    options: MetricOptions = DEFAULT_METRICS,
    weights: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The summary block of a result: throughput, fairness figures, per-tenant latency."""
    windows = metric_windows(records, options)
    service = service_per_window(records, windows, options)
    diffs = service_difference(
        service, demand_per_window(records, windows, options), windows, weights
    )
    jains = jain_per_window(
        service, available_per_window(records, windows, options), windows, weights
    )
    measured = [j for j in jains if j is not None]
    return {
        "service_unit": options.unit,
        "throughput_tokens_per_s": throughput_tokens_per_s(records),
        "service_diff_max": max(diffs, default=0.0),
        "service_diff_avg": _mean(diffs) or 0.0,
        "jain_index_mean": _mean(measured),
        "jain_index": jains,
        "windows": [list(w) for w in windows],
        "service_diff": diffs,
        "metric_options": asdict(options),
        "tenants": tenant_summary(records, options),
    }


def service_over_time(
    records: Iterable[RequestRecord],
    bin_s: float,
    end: float,
    options: MetricOptions = DEFAULT_METRICS,
) -> tuple[list[float], dict[str, list[float]]]:
    """Per-tenant service rate (units per second) in consecutive bins from 0 to `end`:
    (bin start times, tenant -> rates). For plots."""
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s!r}")
    count = max(1, math.ceil(end / bin_s))
    bins = [(k * bin_s, (k + 1) * bin_s) for k in range(count)]
    service = service_per_window(records, bins, options)
    return [b[0] for b in bins], {t: [s / bin_s for s in v] for t, v in service.items()}

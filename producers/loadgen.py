"""Workload generation: trace CSV files and seeded scenarios.

A trace CSV has the header `tenant,arrival_s,input_tokens,output_tokens` and optionally
`priority,deadline_s,session,max_tokens,endpoint` (any order; an empty optional cell
means "not set"). Every error names the file, the line and the column.

Scenarios are pure functions of their seed (Python's `random.Random`), so the same seed
always gives the same trace.
"""

from __future__ import annotations

import bisect
import csv
import datetime as dt
import itertools
import math
import random
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dispatcher.sim.trace import TraceRecord, TraceRecordError

REQUIRED_COLUMNS = ("tenant", "arrival_s", "input_tokens", "output_tokens")
OPTIONAL_COLUMNS = ("priority", "deadline_s", "session", "max_tokens", "endpoint")
COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace file that cannot be used, with the file, line and column named."""


# -- CSV -------------------------------------------------------------------------------


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


_PARSERS: dict[str, Callable[[str], Any]] = {
    "tenant": str,
    "arrival_s": _parse_float,
    "input_tokens": int,
    "output_tokens": int,
    "priority": int,
    "deadline_s": _parse_float,
    "session": str,
    "max_tokens": int,
    "endpoint": str,
}


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Read a trace CSV; records keep the file's order (the simulator sorts by arrival)."""
    path = Path(path)
    try:
        # utf-8-sig: a byte-order mark (spreadsheet exports) is not part of the header.
        with path.open(newline="", encoding="utf-8-sig") as handle:
            return _read_rows(csv.reader(handle), str(path))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text: {exc.reason}") from exc
    except csv.Error as exc:
        raise TraceError(f"{path}: malformed CSV: {exc}") from exc


def _read_rows(rows: Iterable[list[str]], source: str) -> list[TraceRecord]:
    rows = iter(rows)
    header = next(rows, None)
    if header is None:
        raise TraceError(
            f"{source}: line 1: empty file; expected the header {','.join(REQUIRED_COLUMNS)}"
        )
    header = [name.strip() for name in header]
    unknown = [name for name in header if name not in COLUMNS]
    if unknown:
        raise TraceError(
            f"{source}: line 1: unknown column {unknown[0]!r}; known columns: {', '.join(COLUMNS)}"
        )
    missing = [name for name in REQUIRED_COLUMNS if name not in header]
    if missing:
        raise TraceError(f"{source}: line 1: missing required column {missing[0]!r}")
    duplicate = next((n for n in header if header.count(n) > 1), None)
    if duplicate:
        raise TraceError(f"{source}: line 1: column {duplicate!r} appears twice")
    records = []
    for line, row in enumerate(rows, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue  # blank line
        if len(row) != len(header):
            raise TraceError(
                f"{source}: line {line}: {len(row)} cells, expected "
                f"{len(header)} ({','.join(header)})"
            )
        records.append(_parse_row(dict(zip(header, row, strict=True)), source, line))
    return records


def _parse_row(cells: dict[str, str], source: str, line: int) -> TraceRecord:
    values: dict[str, Any] = {}
    for column, text in cells.items():
        text = text.strip()
        if not text:
            if column in REQUIRED_COLUMNS:
                raise TraceError(f"{source}: line {line}: column {column!r} is empty")
            continue
        try:
            values[column] = _PARSERS[column](text)
        except ValueError:
            kind = "an integer" if _PARSERS[column] is int else "a number"
            raise TraceError(
                f"{source}: line {line}: column {column!r}: expected {kind}, got {text!r}"
            ) from None
    try:
        return TraceRecord(**values)
    except TraceRecordError as exc:
        raise TraceError(f"{source}: line {line}: column {exc.column!r}: {exc.reason}") from None


def write_trace(records: Sequence[TraceRecord], path: str | Path) -> None:
    """Write records as CSV, with the optional columns some record uses."""
    used = [c for c in OPTIONAL_COLUMNS if any(_is_set(r, c) for r in records)]
    header = list(REQUIRED_COLUMNS) + used
    with Path(path).open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(header)
        for record in records:
            writer.writerow([_cell(getattr(record, c)) for c in header])


def _is_set(record: TraceRecord, column: str) -> bool:
    value = getattr(record, column)
    return value is not None and not (column == "priority" and value == 0)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(round(value, 6))
    return str(value)


# -- request sizes ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SizeModel:
    """Log-normal input and output lengths, clipped to [min, max].

    The defaults are short chat turns (median 250 input and 120 output tokens). For
    the longer, context-heavy requests of the Azure conversation trace (median input
    about 1,000 tokens) replay that trace instead (`assign_azure_trace`).
    """

    input_median: float = 250.0
    input_sigma: float = 0.6
    input_range: tuple[int, int] = (16, 2048)
    output_median: float = 120.0
    output_sigma: float = 0.6
    output_range: tuple[int, int] = (4, 1024)

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return (
            _lognormal(rng, self.input_median, self.input_sigma, self.input_range),
            _lognormal(rng, self.output_median, self.output_sigma, self.output_range),
        )


def _lognormal(rng: random.Random, median: float, sigma: float, bounds: tuple[int, int]) -> int:
    value = round(rng.lognormvariate(math.log(median), sigma))
    return min(max(value, bounds[0]), bounds[1])


def tenant_names(count: int, first: int = 0) -> list[str]:
    """ "A", "B", ... "Z", then "T27", "T28", ...: short names valid on the wire."""
    return [
        string.ascii_uppercase[i] if i < 26 else f"T{i + 1}" for i in range(first, first + count)
    ]


# -- scenarios -----------------------------------------------------------------------------


def noisy_neighbour(
    seed: int,
    noisy_requests: int = 10_000,
    small_tenants: int = 4,
    small_rate: float = 0.5,
    duration_s: float = 300.0,
    sizes: SizeModel = SizeModel(),
    max_tokens: int | None = None,
    noisy_rate: float | None = None,
) -> list[TraceRecord]:
    """Tenant "A" sends `noisy_requests` at t=0 (or, with `noisy_rate`, as Poisson
    arrivals at that rate from t=0); tenants "B", "C", ... send Poisson arrivals at
    `small_rate` requests per second each, for `duration_s`.

    Every tenant draws its arrivals and sizes from its own random stream (seeded from
    `seed` and its name), so one tenant's requests do not change when another's
    parameters do. Records are ordered by arrival, then tenant.
    """
    if noisy_requests < 0 or small_tenants < 0:
        raise ValueError("noisy_requests and small_tenants must be >= 0")
    for name, rate in (("small_rate", small_rate), ("noisy_rate", noisy_rate)):
        if rate is not None and not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"{name} must be finite and > 0, got {rate!r}")
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"duration_s must be finite and > 0, got {duration_s!r}")
    noisy, *small = tenant_names(1 + small_tenants)
    rng = _stream(seed, noisy)
    clock = 0.0
    records = []
    for _ in range(noisy_requests):
        if noisy_rate is not None:
            clock += rng.expovariate(noisy_rate)
        records.append(_record(noisy, clock, sizes.sample(rng), max_tokens))
    for tenant in small:
        rng = _stream(seed, tenant)
        clock = rng.expovariate(small_rate)
        while clock < duration_s:
            records.append(_record(tenant, clock, sizes.sample(rng), max_tokens))
            clock += rng.expovariate(small_rate)
    records.sort(key=lambda r: (r.arrival_s, r.tenant))
    return records


def sample_trace() -> list[TraceRecord]:
    """What configs/sample_trace.csv holds: a noisy tenant A (400 requests, Poisson 8/s,
    just within the example config's free-tier limits) and small tenants B-E (0.5 req/s
    each for 60 s); every request asks for max_tokens=256."""
    return noisy_neighbour(7, noisy_requests=400, noisy_rate=8.0, duration_s=60.0, max_tokens=256)


def _stream(seed: int, name: str) -> random.Random:
    return random.Random(f"{seed}:{name}")  # str seeds hash with SHA-512: stable


def _record(
    tenant: str, arrival: float, size: tuple[int, int], max_tokens: int | None
) -> TraceRecord:
    return TraceRecord(tenant, round(arrival, 6), size[0], size[1], max_tokens=max_tokens)


def zipf_weights(count: int, exponent: float) -> list[float]:
    """P(rank k) proportional to 1 / k**exponent, k = 1..count."""
    raw = [1.0 / k**exponent for k in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def assign_azure_trace(
    path: str | Path,
    seed: int,
    tenants: int = 20,
    zipf_s: float = 1.1,
    noisy_share: float = 0.25,
    noisy_start_s: float = 600.0,
    noisy_window_s: float = 300.0,
    noisy_tenant: str = "noisy",
    max_tokens: int | None = None,
) -> list[TraceRecord]:
    """The Azure conversation trace with tenants assigned, plus one synthetic noisy tenant.

    Exactly how, with `rng = random.Random(f"{seed}:azure")`:
    1. every trace row keeps its arrival (TIMESTAMP minus the first row's TIMESTAMP),
       its ContextTokens as input and its GeneratedTokens as output, and is given to
       tenant `t01`..`t<tenants>` with probability proportional to 1 / rank**zipf_s
       (one `rng.random()` draw per row, in file order, through the cumulative weights);
    2. the noisy tenant adds round(noisy_share * rows) *extra* requests: for each, one
       row of the trace is drawn uniformly (`rng.randrange`) for its input and output
       sizes, and one arrival uniformly in [noisy_start_s, noisy_start_s +
       noisy_window_s) (`rng.uniform`). The real traffic stays intact; the flood
       comes on top of it, as a misbehaving client's would.
    Records are ordered by arrival (stable: trace rows before noisy requests at ties).
    Rows with a zero token count (the engine needs at least one of each) are dropped.
    """
    if tenants < 1:
        raise ValueError(f"tenants must be >= 1, got {tenants!r}")
    if not (zipf_s >= 0 and math.isfinite(zipf_s)):
        raise ValueError(f"zipf_s must be finite and >= 0, got {zipf_s!r}")
    if not (noisy_share >= 0 and math.isfinite(noisy_share)):
        raise ValueError(f"noisy_share must be finite and >= 0, got {noisy_share!r}")
    if not (noisy_start_s >= 0 and noisy_window_s >= 0):
        raise ValueError("noisy_start_s and noisy_window_s must be >= 0")
    rows = read_azure_trace(path)
    rng = random.Random(f"{seed}:azure")
    names = [f"t{k:02d}" for k in range(1, tenants + 1)]
    cumulative = list(itertools.accumulate(zipf_weights(tenants, zipf_s)))
    records = []
    for arrival, input_tokens, output_tokens in rows:
        rank = min(bisect.bisect_right(cumulative, rng.random()), tenants - 1)
        records.append(
            TraceRecord(names[rank], arrival, input_tokens, output_tokens, max_tokens=max_tokens)
        )
    for _ in range(round(noisy_share * len(rows))):
        _, input_tokens, output_tokens = rows[rng.randrange(len(rows))]
        arrival = round(rng.uniform(noisy_start_s, noisy_start_s + noisy_window_s), 6)
        records.append(
            TraceRecord(noisy_tenant, arrival, input_tokens, output_tokens, max_tokens=max_tokens)
        )
    records.sort(key=lambda r: r.arrival_s)  # stable
    return records


def read_azure_trace(path: str | Path) -> list[tuple[float, int, int]]:
    """(arrival_s relative to the earliest TIMESTAMP, context tokens, generated tokens)
    per row, in file order; rows with a zero token count are dropped."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(
            f"{path}: Azure trace not found. It is the public Azure LLM inference trace "
            "(AzurePublicDataset, conversation service, 2023), not part of fairq: "
            "docs/benchmarks.md says where to fetch it"
        )
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.reader(handle)
            header = [c.strip() for c in next(reader, [])]
            if tuple(header[:3]) != AZURE_COLUMNS:
                raise TraceError(
                    f"{path}: line 1: expected the header "
                    f"{','.join(AZURE_COLUMNS)}, got {','.join(header)!r}"
                )
            parsed = [
                _azure_row(row, path, line) for line, row in enumerate(reader, start=2) if row
            ]
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror}") from exc
    if not parsed:
        raise TraceError(f"{path}: the trace has no rows")
    start = min(stamp for stamp, _, _ in parsed)
    rows = [
        (round((stamp - start).total_seconds(), 6), inputs, outputs)
        for stamp, inputs, outputs in parsed
        if inputs >= 1 and outputs >= 1
    ]
    if not rows:
        raise TraceError(f"{path}: the trace has no usable rows")
    return rows


def _azure_row(row: list[str], path: Path, line: int) -> tuple[dt.datetime, int, int]:
    if len(row) < 3:
        raise TraceError(f"{path}: line {line}: {len(row)} cells, expected 3")
    try:
        # Seven fractional digits: keep microseconds, fromisoformat takes at most six.
        stamp = dt.datetime.fromisoformat(row[0].strip()[:26])
    except ValueError:
        raise TraceError(
            f"{path}: line {line}: column 'TIMESTAMP': not a timestamp: {row[0]!r}"
        ) from None
    counts = []
    for column, text in zip(AZURE_COLUMNS[1:], row[1:3], strict=True):
        try:
            counts.append(int(text))
        except ValueError:
            raise TraceError(
                f"{path}: line {line}: column {column!r}: expected an integer, got {text!r}"
            ) from None
    return stamp, counts[0], counts[1]

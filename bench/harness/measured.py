"""What a benchmark run records: the requests it sends (`Arrival`) and what happened to
each one (`Measured`), for the recorder (`bench.harness.recorder`) and the load generator
(`bench.harness.firehose`) alike.

Times are wall seconds since the run's start. A request's id is `<tenant>-<n>` for the
tenant's n-th arrival. Its outcome is `done`, an error code, `refused` (the broker did
not store it) or `lost` (stored, but no final event within the run's bound).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from broker_config.wire import ErrorEvent, FinalEvent
from dispatcher.sim.fairness import RequestRecord
from dispatcher.sim.trace import TraceRecord

LOST = "lost"
DONE = "done"
REFUSED = "refused"  # the broker did not store it (the publisher was told)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request to send: `offset_s` wall seconds after the start."""

    tenant: str
    offset_s: float
    input_tokens: int
    max_tokens: int
    streamed: bool = True


def arrivals_from_trace(
    trace: Sequence[TraceRecord], time_scale: float, collected: Collection[str] = ()
) -> list[Arrival]:
    """The trace's requests on the wall clock: arrivals compressed by `time_scale` like the
    engine's time, so the load relative to capacity is the trace's. Each asks for
    max_tokens = the record's max_tokens, else its output_tokens. Tenants in
    `collected` submit without `Fq-Reply`."""
    return [
        Arrival(
            r.tenant,
            r.arrival_s * time_scale,
            r.input_tokens,
            r.max_tokens or r.output_tokens,
            streamed=r.tenant not in collected,
        )
        for r in trace
    ]


@dataclass(slots=True)
class Measured:
    """One request end to end. Times are wall seconds since the replay's start."""

    id: str
    tenant: str
    offset_s: float
    streamed: bool
    input_tokens: int
    max_tokens: int
    submitted: float | None = None
    acked: float | None = None  # the PubAck arrived: the broker stored it
    dispatched: float | None = None
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int | None = None
    # "done", an error code, "refused" (not stored), or "lost" (stored, but no final
    # event within the replay's bound).
    outcome: str = LOST
    # The done event's timings (seconds since the request was queued).
    queued_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None

    @property
    def done(self) -> bool:
        return self.outcome == DONE

    def settle(self, event: FinalEvent, finished: float, first_token: float | None) -> None:
        """Record the final event; `first_token` None places it from the event's timings."""
        self.finished = finished
        if isinstance(event, ErrorEvent):
            self.outcome = str(event.code)
            return
        self.outcome = DONE
        timings = event.timings
        self.queued_s, self.ttft_s, self.total_s = (
            timings.queued_s,
            timings.ttft_s,
            timings.total_s,
        )
        self.input_tokens = event.usage.input_tokens
        self.output_tokens = event.usage.output_tokens
        if timings.ttft_s is None:  # no token: dispatch is placed from the finish
            self.first_token = None
            self.dispatched = finished - (timings.total_s - timings.queued_s)
            return
        if first_token is None:
            first_token = finished - (timings.total_s - timings.ttft_s)
        self.first_token = first_token
        self.dispatched = first_token - (timings.ttft_s - timings.queued_s)

    def request_record(self, time_scale: float = 1.0) -> RequestRecord:
        """As `dispatcher.sim.fairness` records: arrival = submit, times divided by
        `time_scale` (the engine model's seconds). A done request without a token is
        recorded as not served, as in the simulator."""

        def scaled(value: float | None) -> float | None:
            return None if value is None else value / time_scale

        submitted = self.submitted if self.submitted is not None else self.offset_s
        return RequestRecord(
            id=self.id,
            tenant=self.tenant,
            arrival=submitted / time_scale,
            dispatched=scaled(self.dispatched),
            first_token=scaled(self.first_token),
            finished=scaled(self.finished),
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens or 0,
            outcome="admitted" if self.done else self.outcome,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Replay:
    measured: list[Measured]
    # Wall seconds from the start until the last request finished (or the bound).
    wall_s: float
    # How late the worst submit was against its schedule, per tenant.
    max_lateness_s: dict[str, float]
    # Unix time of the start, from which every time in `measured` counts.
    started_at: float

    def counts(self) -> dict[str, int]:
        outcomes: dict[str, int] = defaultdict(int)
        for m in self.measured:
            outcomes[m.outcome] += 1
        return dict(sorted(outcomes.items()))


def describe_outcomes(counts: dict[str, int]) -> str:
    """`Replay.counts()` as text: "10568 done", "98 done, 2 lost"."""
    return ", ".join(f"{count} {outcome}" for outcome, count in counts.items()) or "none"


def to_measure(arrivals: Sequence[Arrival]) -> list[Measured]:
    """One record per arrival, with its request id `<tenant>-<n>` for the tenant's n-th
    arrival: a tenant's requests keep their ids whatever the other tenants send (the
    simulated engine draws each request's output length from its id)."""
    numbers: Counter[str] = Counter()
    measured = []
    for a in arrivals:
        measured.append(
            Measured(
                f"{a.tenant}-{numbers[a.tenant]}",
                a.tenant,
                a.offset_s,
                a.streamed,
                a.input_tokens,
                a.max_tokens,
            )
        )
        numbers[a.tenant] += 1
    return measured

"""The simulator's view of one trace record while it runs, and what it reports of it:
the usage a worker would send on completion and the record the metrics read."""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.units import Usage
from dispatcher.core.endpoint import EndpointQueues
from dispatcher.core.types import Outcome, Request
from dispatcher.sim.fairness import RequestRecord
from dispatcher.sim.trace import TraceRecord


@dataclass(slots=True)
class Entry:
    """One trace record's request, mutable while the simulation runs."""

    request: Request
    output_tokens: int  # what the engine will generate
    record: TraceRecord
    outcome: Outcome = Outcome.ADMITTED
    first_token: float | None = None
    finished: float | None = None
    cached_tokens: int = 0  # input tokens its replica's prefix cache held
    worker: str = ""  # the replica it ran on
    engine_s: float = 0.0  # the engine time its replica attributed to it

    def usage(self, queues: EndpointQueues) -> Usage:
        """What the request consumed, as a worker reports it: its other units (images)
        too, else the correction of its charge would refund their cost."""
        request = self.request
        return Usage(
            request.input_tokens,
            self.output_tokens,
            queues.model_units(
                request.input_tokens, self.output_tokens, request.other_units, self.cached_tokens
            ),
            other_units=request.other_units,
            cached_input_tokens=self.cached_tokens,
            engine_s=self.engine_s,
        )

    def to_record(self) -> RequestRecord:
        request = self.request
        return RequestRecord(
            id=request.id,
            tenant=request.tenant,
            arrival=request.arrival,
            dispatched=request.dispatched_at,
            first_token=self.first_token,
            finished=self.finished,
            input_tokens=request.input_tokens,
            output_tokens=self.output_tokens,
            outcome=self.outcome.value,
            endpoint=request.endpoint,
            cached_tokens=self.cached_tokens,
            worker=self.worker,
            engine_s=self.engine_s,
        )

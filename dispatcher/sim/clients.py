"""Closed-loop clients of the simulator: well-behaved load that never builds a backlog."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dispatcher.sim.trace import TraceRecord


@dataclass(slots=True, frozen=True)
class ClosedLoop:
    """A well-behaved client that keeps its endpoint busy without ever building a backlog.

    From `start_s` on, whenever the endpoint's requests in flight (every tenant's,
    running or queued) leave a sequence slot free outside the newcomer reserve, the next
    of `records` arrives, so the engine is as full as the reserve allows. The records'
    own arrival times are ignored. Clients on one endpoint fill it in the order they are
    listed.
    """

    records: Sequence[TraceRecord]
    start_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"start_s must be finite and >= 0, got {self.start_s!r}")
        if len({r.endpoint for r in self.records}) > 1:
            raise ValueError("a closed-loop client sends to one endpoint")


@dataclass(slots=True, eq=False)
class Client:
    """A `ClosedLoop` client while it runs."""

    endpoint: str
    start_s: float
    slots: int  # the endpoint's sequence slots outside the newcomer reserve
    waiting: list[int]  # indexes of its entries not yet sent, the next one last

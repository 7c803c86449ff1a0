"""Plain data shared by every stage of the scheduling core.

Times are floats in seconds on whatever clock the caller uses (wall clock in the
dispatcher, virtual clock in the simulator); the core never reads a clock itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Outcome(enum.Enum):
    """Every way a request can leave admission or the queue.

    This enum is also the only metrics label for outcomes, so keep it small.
    """

    ADMITTED = "admitted"
    INVALID = "invalid"
    UNKNOWN_ENDPOINT = "unknown_endpoint"
    UNKNOWN_TENANT = "unknown_tenant"
    RATE_LIMITED = "rate_limited"
    QUOTA_EXCEEDED = "quota_exceeded"
    OVERLOADED = "overloaded"
    QUEUE_FULL = "queue_full"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"
    # The edge could not decide: its limiter store did not answer (retryable).
    INTERNAL = "internal"

    @property
    def error_code(self) -> str:
        """The wire contract's error code for a rejection with this outcome."""
        return _ERROR_CODES[self]


_ERROR_CODES = {
    Outcome.ADMITTED: "",
    Outcome.INVALID: "invalid_request",
    Outcome.UNKNOWN_ENDPOINT: "unknown_endpoint",
    Outcome.UNKNOWN_TENANT: "unknown_tenant",
    Outcome.RATE_LIMITED: "rate_limited",
    Outcome.QUOTA_EXCEEDED: "quota_exceeded",
    Outcome.OVERLOADED: "overloaded",
    # A full per-tenant queue is overload from the client's point of view.
    Outcome.QUEUE_FULL: "overloaded",
    Outcome.DEADLINE_EXCEEDED: "deadline_exceeded",
    Outcome.CANCELLED: "cancelled",
    Outcome.UNAVAILABLE: "unavailable",
    Outcome.INTERNAL: "internal",
}


@dataclass(slots=True)
class Request:
    """The scheduler's view of one request.

    `payload` is opaque to the core: the network service keeps its JetStream message
    there, the simulator its trace record.
    """

    id: str
    tenant: str
    endpoint: str
    arrival: float
    input_tokens: int
    max_tokens: int
    priority: int = 0
    deadline: float | None = None
    session: str | None = None
    # Routing key: the worker that served it before may still cache its prefix
    # (`placement.affinity_key`); None routes to the least loaded worker.
    affinity: str | None = None
    other_units: float = 0.0
    payload: Any = None
    # Filled in by the scheduler on admission and dispatch.
    # What its tenant was charged so far, in the endpoint's cost unit: the prompt at
    # dispatch, output as it is reported, the rest on completion.
    charged_cost: float = 0.0
    output_charged: int = 0  # output tokens included in `charged_cost`
    model_units: float = 0.0  # estimated model units, for throttle, routing and capacity
    dispatched_at: float | None = None
    # Dispatched while its tenant ran less than its fair share: the worker asks the
    # engine to schedule it ahead of the rest (engine priority), so a newcomer's first
    # token does not wait behind a flooding tenant's prefills.
    expedited: bool = False
    # Placed in a worker's newcomer reserve (it fitted nowhere else): it holds one of
    # the reserve's sequences until it completes, so the reserve lets in a bounded
    # number of requests at a time.
    in_reserve: bool = False
    # The limiter checks admission charged it (dispatcher.core.limits.charged), which
    # its completion settles: in their month, at what they really took.
    charges: tuple[Any, ...] = ()


@dataclass(slots=True, frozen=True)
class Decision:
    """The answer of admission: admitted, or rejected with an outcome and a hint."""

    outcome: Outcome
    message: str = ""
    retry_after_s: float | None = None

    @property
    def admitted(self) -> bool:
        return self.outcome is Outcome.ADMITTED


ADMITTED = Decision(Outcome.ADMITTED)


@dataclass(slots=True)
class Selection:
    """What `next_batch` hands back: requests to send, and requests it dropped."""

    requests: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)

"""A trace record: one request as the simulator and the load generators replay it."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class TraceRecord:
    """One request of a trace.

    `arrival_s` and `deadline_s` are on the trace's clock (seconds; the deadline is
    absolute, like the wire contract's). `output_tokens` is what the engine produces;
    the scheduler sees only `max_tokens` (None: the endpoint's cap). `endpoint` None
    means the config's first endpoint.
    """

    tenant: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    priority: int = 0
    deadline_s: float | None = None
    session: str | None = None
    max_tokens: int | None = None
    endpoint: str | None = None
    # The prompt's cacheable parts, for the simulator's prefix cache: its first
    # `prefix_tokens` are a prompt shared across sessions (`prefix_id`, a system
    # prompt), the next `history_tokens` its session's context before this turn.
    prefix_id: str | None = None
    prefix_tokens: int = 0
    history_tokens: int = 0

    def __post_init__(self) -> None:
        check_trace_record(self)

    def context_blocks(self, block_tokens: int) -> tuple[list[Hashable], list[Hashable]]:
        """The prompt's cacheable KV blocks (those a replica that served the shared
        prefix or this session's earlier turns may hold), and every block this request
        leaves behind (prompt and answer: the next turn's context)."""
        shared = (
            [("prefix", self.prefix_id, i) for i in range(self.prefix_tokens // block_tokens)]
            if self.prefix_id is not None
            else []
        )
        if self.session is None:
            return shared, shared
        after = self.input_tokens - self.prefix_tokens + self.output_tokens
        context = [("session", self.session, i) for i in range(after // block_tokens)]
        return shared + context[: self.history_tokens // block_tokens], shared + context


class TraceRecordError(ValueError):
    """A trace record the simulator cannot run; `column` names the bad field."""

    def __init__(self, column: str, message: str) -> None:
        super().__init__(f"{column}: {message}")
        self.column = column
        self.reason = message


def check_trace_record(record: TraceRecord) -> None:
    """Raise TraceRecordError if `record` cannot be simulated."""
    if not record.tenant:
        raise TraceRecordError("tenant", "must not be empty")
    if not (math.isfinite(record.arrival_s) and record.arrival_s >= 0):
        raise TraceRecordError("arrival_s", f"must be finite and >= 0, got {record.arrival_s!r}")
    for column in ("input_tokens", "output_tokens", "max_tokens"):
        value = getattr(record, column)
        if value is not None and value < 1:
            raise TraceRecordError(column, f"must be >= 1, got {value!r}")
    for column in ("prefix_tokens", "history_tokens"):
        if getattr(record, column) < 0:
            raise TraceRecordError(column, f"must be >= 0, got {getattr(record, column)!r}")
    if record.prefix_tokens + record.history_tokens > record.input_tokens:
        raise TraceRecordError(
            "history_tokens", "prefix_tokens + history_tokens must not exceed input_tokens"
        )
    if record.deadline_s is not None and not math.isfinite(record.deadline_s):
        raise TraceRecordError("deadline_s", f"must be finite, got {record.deadline_s!r}")

"""Stage 4, the priority selector: one ordered queue per tenant.

Order: higher priority first, then earliest deadline (none last), then arrival. Push
and pop are O(log n); cancel is O(1) and leaves a tombstone that pop skips.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from itertools import count

from dispatcher.core.types import Request

_arrival_order = count()
Key = tuple[int, float, float, int]
OrderKey = Callable[[Request], Key]


def priority_order(request: Request) -> Key:
    """fairq's order: priority (higher first), deadline (earliest first), arrival.

    Arrival time comes before the counter so a request put back after a worker failure
    keeps its place.
    """
    deadline = math.inf if request.deadline is None else request.deadline
    return (-request.priority, deadline, request.arrival, next(_arrival_order))


def arrival_order(request: Request) -> Key:
    """The FIFO baseline's order: arrival only."""
    return (0, 0.0, request.arrival, next(_arrival_order))


class TenantQueue:
    """Requests of one tenant on one endpoint, best first."""

    __slots__ = ("_heap", "_live", "_order", "queued_model_units")

    def __init__(self, order: OrderKey = priority_order) -> None:
        self._order = order
        # Entries are [*key, request-or-None]; None marks a cancelled request.
        self._heap: list[list] = []
        self._live: dict[str, list] = {}
        self.queued_model_units = 0.0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def push(self, request: Request) -> None:
        entry = [*self._order(request), request]
        heapq.heappush(self._heap, entry)
        self._live[request.id] = entry
        self.queued_model_units += request.model_units

    def peek(self) -> Request | None:
        heap = self._heap
        while heap:
            request = heap[0][4]
            if request is not None:
                return request
            heapq.heappop(heap)
        return None

    def head_rank(self) -> tuple[float, int]:
        """(arrival, counter) of the head entry, after `peek` found one: FIFO's order."""
        head = self._heap[0]
        return head[2], head[3]

    def pop(self) -> Request:
        """Remove and return the head; call only after `peek` returned a request."""
        request = heapq.heappop(self._heap)[4]
        self._forget(request)
        return request

    def remove(self, request_id: str) -> Request | None:
        entry = self._live.get(request_id)
        if entry is None:
            return None
        request = entry[4]
        entry[4] = None
        self._forget(request)
        return request

    def oldest_arrival(self) -> float | None:
        return min((e[4].arrival for e in self._live.values()), default=None)

    def position(self, request_id: str) -> int | None:
        """How many requests of this tenant leave before this one (O(n), for status)."""
        entry = self._live.get(request_id)
        if entry is None:
            return None
        key = entry[:4]
        return sum(1 for e in self._live.values() if e[:4] < key)

    def _forget(self, request: Request) -> None:
        del self._live[request.id]
        if self._live:
            self.queued_model_units -= request.model_units
        else:  # reset so float error cannot accumulate over a long life
            self.queued_model_units = 0.0

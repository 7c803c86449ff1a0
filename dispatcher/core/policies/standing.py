"""Standings: the state fairq's tier stage and the VTC baseline share.

A flow's *standing* is what it was charged divided by its weight. The backlogged flow of
least standing sends next: Deficit Round Robin in its virtual-time form (each flow's
finishing time in a fluid share of the server), which is also the Virtual Token Counter
(Sheng et al., OSDI 2024). The policies differ only in what they charge (fairq: the
endpoint's cost unit, corrected at completion; VTC: weighted tokens) and on ties.

Idle time earns nothing. A flow that becomes backlogged is lifted to the *floor*: the
least standing of the backlogged flows, or, with none backlogged, the standing of the
last flow that left. The floor never falls (it is kept as a mark), so a standing at or
below it is indistinguishable from a new flow's and may be forgotten. A standing above
the floor on return is a debt, and it is kept: the flow waits while the others catch up.
"""

from __future__ import annotations

import heapq
import itertools

from dispatcher.core.flow import TenantFlow

# Heap order after the standing: a flow that just joined goes before one that was
# already served, on a tie (fairq: a sparse tenant's request leaves at once).
_JOINED, _SERVED = 0, 1


class StandingHeap:
    """The flows of one group (one tier, or the whole endpoint) by standing."""

    __slots__ = (
        "standing",
        "newcomers_first",
        "_heap",
        "_entry",
        "_ties",
        "_moved",
        "_aside",
        "_mark",
        "_last_left",
        "_backlogged",
    )

    def __init__(self, newcomers_first: bool) -> None:
        self.standing: dict[TenantFlow, float] = {}
        self.newcomers_first = newcomers_first
        # (standing, rank, tie, flow) of held flows. An entry is valid while it is the
        # flow's entry in `_entry`; others are stale and skipped when they surface.
        self._heap: list[tuple[float, int, int, TenantFlow]] = []
        self._entry: dict[TenantFlow, tuple[float, int, int]] = {}
        self._ties = itertools.count()
        # Standings raised since their last entry, in order (a set's order would vary
        # between runs, and the ties with it): pushed once by the next `select`, not
        # once per output token.
        self._moved: dict[TenantFlow, None] = {}
        self._aside: list[TenantFlow] = []
        self._mark = 0.0
        self._last_left = 0.0
        self._backlogged: set[TenantFlow] = set()

    def __bool__(self) -> bool:
        return bool(self._backlogged)

    def floor(self) -> float:
        """What a flow that becomes backlogged now is lifted to (and never falls)."""
        if self._backlogged:
            least = self._least_backlogged()
        else:
            least = self._last_left
        return max(self._mark, least)

    def at_floor(self, flow: TenantFlow) -> bool:
        """No backlogged flow was charged less per unit of weight than `flow`: it stands
        where a flow that joins now would."""
        return self.standing.get(flow, 0.0) <= self.floor()

    def activate(self, flow: TenantFlow) -> None:
        if flow.in_ring:
            return
        self._mark = self.floor()
        self.standing[flow] = max(self.standing.get(flow, 0.0), self._mark)
        flow.in_ring = True
        self._backlogged.add(flow)
        self._push(flow, _JOINED if self.newcomers_first else _SERVED)

    def select(self) -> TenantFlow | None:
        while (flow := self._top()) is not None:
            if flow.queue.peek() is not None:
                return flow
            self.leave(flow)  # emptied by cancels
        return None

    def add(self, flow: TenantFlow, amount: float) -> None:
        """Charge `flow` `amount` of its policy's measure (negative: give it back)."""
        self.standing[flow] = self.standing.get(flow, self._mark) + amount / flow.weight
        if flow.in_ring and flow in self._entry:
            self._moved[flow] = None

    def leave_if_empty(self, flow: TenantFlow) -> None:
        """After the selected flow lost its head: let it go if nothing is queued."""
        if flow.queue.peek() is None:
            self.leave(flow)

    def leave(self, flow: TenantFlow) -> None:
        """Let `flow` go: it keeps its standing, so a debt survives and credit is lost
        on its return."""
        flow.in_ring = False
        self._backlogged.discard(flow)
        self._entry.pop(flow, None)
        self._moved.pop(flow, None)
        self._last_left = self.standing[flow]

    def set_aside(self, flow: TenantFlow) -> None:
        """Skip the selected `flow` until `restore_set_aside`."""
        self._entry.pop(flow, None)
        self._moved.pop(flow, None)
        self._aside.append(flow)

    def restore_set_aside(self) -> None:
        while self._aside:
            flow = self._aside.pop()
            if flow.in_ring:
                self._push(flow, _SERVED)

    def forget(self, idle: list[TenantFlow], forgive: set[TenantFlow]) -> list[TenantFlow]:
        """The idle flows a new one would replace (standing at or below the floor, where
        any return lifts them), and the forgiven; their standings are dropped."""
        floor = self._mark if self._backlogged else max(self._mark, self._last_left)
        gone = [flow for flow in idle if flow in forgive or self.standing.get(flow, 0.0) <= floor]
        for flow in gone:
            self.standing.pop(flow, None)
        return gone

    def withdraw(self, flow: TenantFlow) -> float:
        """Take `flow` out for good (its tenant left the group): its debt, what it
        stands above the floor, which `adopt` carries elsewhere."""
        floor = self.floor()
        if flow.in_ring:
            self.leave(flow)
        if flow in self._aside:
            self._aside.remove(flow)
        return max(self.standing.pop(flow, 0.0) - floor, 0.0)

    def adopt(self, flow: TenantFlow, debt: float) -> None:
        """Take in `flow` owing `debt` (its tenant moved here), backlogged if it has work."""
        self.standing[flow] = self.floor() + debt
        if len(flow.queue):
            self.activate(flow)

    def _least_backlogged(self) -> float:
        top = self._top()
        standings = [self.standing[flow] for flow in self._aside if flow.in_ring]
        if top is not None:
            standings.append(self.standing[top])
        return min(standings, default=self._last_left)

    def _top(self) -> TenantFlow | None:
        """The held flow of least standing (after the moved ones are pushed again)."""
        for flow in self._moved:
            self._push(flow, _SERVED)
        self._moved.clear()
        heap = self._heap
        while heap:
            standing, rank, tie, flow = heap[0]
            if self._entry.get(flow) == (standing, rank, tie):
                return flow
            heapq.heappop(heap)  # stale: the flow moved on, left or was set aside
        return None

    def _push(self, flow: TenantFlow, rank: int) -> None:
        standing = self.standing[flow]
        entry = self._entry.get(flow)
        if entry is not None and entry[0] == standing:
            return  # its entry in the heap is valid as it is
        self._entry[flow] = (standing, rank, next(self._ties))
        heapq.heappush(self._heap, (*self._entry[flow], flow))

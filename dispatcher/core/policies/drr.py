"""Stage 3, Deficit Round Robin between the tenants of one tier.

Each backlogged tenant (a flow) sits in a ring. The flow at the head receives its
quantum once per visit and sends requests while its deficit covers their cost; then the
visit ends and the ring turns. A flow whose queue empties leaves the ring and keeps no
positive deficit (no credit hoarded while idle), but keeps any debt: completion
corrections may drive a deficit negative, and the flow then sits out whole rounds until
its quanta have repaid it.

This module is the only writer of `TenantFlow.deficit`: the ring's own turns here, and
what the scheduler reports after dispatch (output as generated, the correction at
completion, a refund) through the static `charge_output`, `correct` and `refund`.
"""

from __future__ import annotations

import math
from collections import deque

from dispatcher.core.flow import TenantFlow
from dispatcher.core.types import Request


class DrrRing:
    """The backlogged flows of one tier on one endpoint, in two lanes (as in FQ-CoDel).

    A flow that becomes backlogged joins the *new* lane, served before the *old* one,
    and may send while its deficit is positive, so a sparse tenant's request leaves at
    once instead of after a whole round of a flooding tenant's. What it sends beyond
    its quantum is debt carried into the old lane, where plain DRR applies: a tenant
    gains nothing in the long run by arriving in bursts.

    A flow that leaves in debt repays it while idle as if it had stayed: on its return
    it is credited a quantum for each round the ring turned meanwhile, up to its debt
    (as VTC lifts a returning client's counter to the backlogged ones'). Otherwise a
    sparse tenant, whose output is charged after its queue emptied, would pay for its
    last request again with rounds of waiting on its next.
    """

    __slots__ = ("new", "flows", "round")

    def __init__(self) -> None:
        self.new: deque[TenantFlow] = deque()
        self.flows: deque[TenantFlow] = deque()
        # Rounds of the old lane so far: each grant of a quantum is 1/len(old lane) of one.
        self.round = 0.0

    def __bool__(self) -> bool:
        return bool(self.flows or self.new)

    def activate(self, flow: TenantFlow) -> None:
        """A flow that just became backlogged: to the new lane, with a fresh quantum."""
        if not flow.in_ring:
            if flow.deficit < 0:
                idle_rounds = self.round - flow.left_at_round
                flow.deficit = min(0.0, flow.deficit + idle_rounds * flow.quantum)
            flow.in_ring = True
            flow.granted = True
            flow.deficit += flow.quantum
            flow.lane = self.new
            self.new.append(flow)

    def select(self) -> TenantFlow | None:
        """The flow whose head request goes next, or None if the ring is empty."""
        new = self.new
        while new:
            flow = new[0]
            if flow.queue.peek() is None:  # emptied by cancels
                self._leave(new.popleft())
            elif flow.deficit > 0:
                return flow
            else:  # its first quantum is spent: on to the old lane
                new.popleft()
                flow.granted = False
                flow.lane = self.flows
                self.flows.append(flow)
        ring = self.flows
        misses = 0
        while ring:
            flow = ring[0]
            request = flow.queue.peek()
            if request is None:  # emptied by cancels since it was last visited
                self._leave(ring.popleft())
                continue
            if not flow.granted:
                flow.deficit += flow.quantum
                flow.granted = True
                self.round += 1 / len(ring)
            if request.charged_cost <= flow.deficit:
                return flow
            flow.granted = False
            ring.rotate(-1)
            misses += 1
            if misses >= len(ring):
                self._skip_idle_rounds()
                misses = 0
        return None

    def repaid(self, flow: TenantFlow) -> bool:
        """Would an idle `flow` return exactly as a new one would (no debt left after
        the rounds the ring turned since it left)? Its deficit is never above 0 then."""
        return flow.deficit + (self.round - flow.left_at_round) * flow.quantum >= 0

    def charge(self, flow: TenantFlow, request: Request) -> None:
        """Account for `request`, just popped from the selected flow's queue."""
        flow.deficit -= request.charged_cost
        if flow.queue.peek() is None:
            self._leave(flow.lane.popleft())

    def drop_if_empty(self, flow: TenantFlow) -> None:
        """After the selected flow lost a request without being charged (expiry)."""
        if flow.queue.peek() is None:
            self._leave(flow.lane.popleft())

    def withdraw(self, flow: TenantFlow) -> None:
        """Take `flow` out wherever it waits (its tenant left the tier): its visit ends,
        its debt stays with it."""
        flow.lane.remove(flow)
        self._leave(flow)

    def set_aside(self) -> TenantFlow:
        """Take the selected flow out for the rest of a batch (its request does not fit)."""
        lane = self.new if self.new else self.flows
        return lane.popleft()

    def restore(self, flow: TenantFlow) -> None:
        """Put a set-aside flow back at the head of its lane, its visit state intact."""
        flow.lane.appendleft(flow)

    def adopt(self, flow: TenantFlow) -> None:
        """Take in `flow`, out of any ring (its tenant moved here from another tier): its
        debt is repaid here from now on, and it joins at once if it has work queued."""
        flow.left_at_round = self.round
        if len(flow.queue):
            self.activate(flow)

    # What the scheduler reports after dispatch; the same for a flow in any ring.

    @staticmethod
    def charge_output(flow: TenantFlow, cost: float) -> None:
        """Charge `flow` the `cost` of output one of its running requests generated."""
        flow.deficit -= cost

    @staticmethod
    def correct(flow: TenantFlow, correction: float) -> None:
        """Charge `flow` the `correction` of a completed request (real cost minus what it
        was charged). Out of the ring it keeps a debt but gains no credit."""
        flow.deficit -= correction
        if not flow.in_ring:
            flow.deficit = min(flow.deficit, 0.0)

    @staticmethod
    def refund(flow: TenantFlow, cost: float) -> None:
        """Give `flow` back the `cost` charged for a request that returns to its queue."""
        flow.deficit += cost

    def _leave(self, flow: TenantFlow) -> None:
        flow.left_at_round = self.round
        flow.in_ring = False
        flow.granted = False
        flow.lane = None
        flow.deficit = min(flow.deficit, 0.0)

    def _skip_idle_rounds(self) -> None:
        # A whole pass sent nothing: every flow is in debt or short of its head's cost.
        # Grant at once the rounds after which the first flow can send, instead of
        # turning the ring that many times.
        rounds = min(
            math.ceil((flow.queue.peek().charged_cost - flow.deficit) / flow.quantum)
            for flow in self.flows
        )
        if rounds > 1:
            self.round += rounds - 1
            for flow in self.flows:
                flow.deficit += (rounds - 1) * flow.quantum

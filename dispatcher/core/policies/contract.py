"""The contract every dispatch policy keeps: `Selector`.

A selector answers one question for batch assembly: which tenant's flow sends its head
request next. The scheduler owns the flows' queues and running work, prices every
request in the endpoint's cost unit (`request.charged_cost`) and keeps each flow's
`served_cost`; the selector owns its fairness state (fairq's and VTC's standings,
FIFO's heap of heads) and changes it only when the scheduler calls it.
`tests/core/test_policy_conformance.py` runs every policy of `POLICIES` through the
clauses below.

The caller's side: it calls `activate` for a flow each time it queues a request there;
it calls `charge`, `drop_if_empty` or `set_aside` only for the flow the last `select`
returned, right after it (a `select` may also be followed by none of them); it calls
`set_aside` only if `blocks_on_misfit` is False, and calls `restore_set_aside` before
any call but `select`, `charge`, `drop_if_empty` and `set_aside`; it asks `forget` only
about idle flows.

What a selector MUST do:

1. Work conservation. `select` returns a flow whenever some flow has a queued request
   and is not set aside, and None only when there is none. The flow it returns has a
   queued request and is not set aside.
2. Holding. `flow.in_ring` is True from `activate` until the selector lets the flow go
   because its queue is empty: at once in `charge` and `drop_if_empty`, or when
   `select` passes a flow that cancels emptied (and when a reload moves its tenant to
   another tier). A flow not held with nothing queued or running is idle.
3. Charges. A charge is an amount in the endpoint's cost unit, priced by the scheduler:
   `request.charged_cost` at dispatch (`charge`; it includes an output estimate unless
   `charges_output_as_generated`), the cost of output as it is generated (`progress`;
   its model units on a model-units endpoint where `charges_output_as_generated`, else
   0), and at completion the correction: the real cost of the usage minus what the
   request was charged so far (`complete`; negative if it was overcharged). Each policy
   charges in its own measure (fairq: these amounts; VTC: weighted prompt and output
   tokens; FIFO: nothing), but a charge never favours the flow charged: charged
   more, it is served no sooner. Output reported by `progress` and output first seen
   at completion weigh the same once the request completed. `refund` gives back what
   a request that returns to its queue was charged, in the policy's measure (fairq:
   its `charged_cost`; VTC and FIFO keep what they charged).
4. Reset. A flow that leaves keeps no credit: activated again, it is served no sooner
   than a new flow would be, ties included. A debt may be kept. Nor does a flow that
   joins gain from the service the others had before it came. fairq and VTC
   (standing.py): a flow that becomes backlogged has its standing lifted to a floor
   that never falls (the least backlogged standing, or the last that left when none
   is backlogged); a standing above the floor is a debt, kept. A flow that a reload
   moves to another tier carries its debt over that tier's floor to the new one.
5. Set aside. After `set_aside(flow)` (the selected flow's head does not fit),
   `select` does not return that flow until `restore_set_aside`, which puts back every
   flow set aside with its standing (though it may now lose a tie it won before); with
   nothing set aside it changes nothing. Setting aside charges
   nothing.
6. Forget. `forget(idle, forgive)` returns the flows of `idle` that the endpoint may
   drop, a returning tenant getting a new flow: every flow of `forgive` (idle for
   `DEBT_MEMORY_S`, whatever it owes), and otherwise only flows a new flow would be
   indistinguishable from (no debt left). The selector drops its own state for them.
7. Floor. `at_floor(flow)`, for a held flow: True if no held flow was charged less
   per unit of weight, in the policy's measure (where a flow that joins now would
   stand); a flow just activated with no debt is at the floor. FIFO keeps no
   standing: always True.
"""

from __future__ import annotations

from typing import Protocol

from costmodel.units import Usage
from dispatcher.core.flow import TenantFlow
from dispatcher.core.types import Request


class Selector(Protocol):
    # True for the naive queue: a head request that does not fit stops the batch, and
    # `set_aside` is never called.
    blocks_on_misfit: bool
    # True if tiers are strict: a lower tier may use only the newcomer reserve while a
    # higher tier has work waiting (the scheduler keeps the rest of the room for it).
    strict_tiers: bool
    # True if the policy charges output as it is generated (`progress`) instead of an
    # estimate at dispatch.
    charges_output_as_generated: bool

    def activate(self, flow: TenantFlow) -> None:
        """`flow` got a request; nothing if the selector already holds it."""

    def select(self) -> TenantFlow | None:
        """The flow whose head request is next, or None when no flow can send (clause 1)."""

    def charge(self, flow: TenantFlow, request: Request) -> None:
        """`request` was just popped from the selected `flow` and dispatched, charged
        `request.charged_cost`; let the flow go if its queue is empty."""

    def progress(self, flow: TenantFlow, request: Request, tokens: int, cost: float) -> None:
        """Running `request` of `flow` generated `tokens` more output tokens, which
        added `cost` to `request.charged_cost` (0 where output is not priced)."""

    def complete(self, flow: TenantFlow, request: Request, usage: Usage, correction: float) -> None:
        """`request` of `flow` finished having used `usage`; `correction` is its real
        cost minus what it was charged so far."""

    def refund(self, flow: TenantFlow, request: Request) -> None:
        """Running `request`, charged `request.charged_cost`, goes back to a queue (its
        worker failed); `activate` follows if `flow` is still its tenant's."""

    def drop_if_empty(self, flow: TenantFlow) -> None:
        """The selected `flow` lost its head without dispatch (its deadline passed):
        nothing is charged; let the flow go if its queue is empty."""

    def set_aside(self, flow: TenantFlow) -> None:
        """Skip the selected `flow` until `restore_set_aside` (its head does not fit)."""

    def restore_set_aside(self) -> None:
        """Put back every flow set aside since the last call."""

    def forget(self, idle: list[TenantFlow], forgive: set[TenantFlow]) -> list[TenantFlow]:
        """Of the idle flows, those that may be dropped (clause 6)."""

    def at_floor(self, flow: TenantFlow) -> bool:
        """No held flow was charged less per unit of weight than `flow` (clause 7)."""

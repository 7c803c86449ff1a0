"""Dispatch policies: which tenant's request goes next, each behind one `Selector`
contract (contract.py, with its MUST clauses). By name:

    fairq   fairq.py   strict tiers, least charge per weight (standing.py) inside each
    fifo    fifo.py    one shared queue in arrival order: the naive baseline
    vtc     vtc.py     the Virtual Token Counter (OSDI 2024): the fair-serving baseline

A new policy is a module here and an entry in `_SELECTORS` (and `Policy`);
tests/core/test_policy_conformance.py then runs it through the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from dispatcher.core.policies.contract import Selector
from dispatcher.core.policies.fairq import TierLadder
from dispatcher.core.policies.fifo import FifoSelector
from dispatcher.core.policies.vtc import VtcSelector

Policy = Literal["fairq", "fifo", "vtc"]

# Each policy's selector for one endpoint, made from the number of tiers.
_SELECTORS: dict[Policy, Callable[[int], Selector]] = {
    "fairq": TierLadder,
    "fifo": lambda tier_count: FifoSelector(),
    "vtc": lambda tier_count: VtcSelector(),
}
POLICIES: tuple[Policy, ...] = tuple(_SELECTORS)


def selector_for(policy: Policy, tier_count: int) -> Selector:
    return _SELECTORS[policy](tier_count)

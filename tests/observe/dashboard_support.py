"""What the dashboard's tests feed `QueueWatch`: admission counts and a stand-in for the
scheduler's read-only queries (dispatcher/core/view.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from dispatcher.core.view import FlowRow
from dispatcher.observe.dashboard import QueueWatch, Snapshot


@dataclass
class Count:
    admitted: int = 0
    rejected: int = 0


@dataclass
class Queues:
    tiers: dict[str, str]  # tenant -> tier
    order: list[str]
    flows: list[FlowRow] = field(default_factory=list)
    units: dict[str, str] = field(default_factory=dict)

    def flow_rows(self) -> list[FlowRow]:
        return list(self.flows)

    def cost_units(self) -> dict[str, str]:
        return dict(self.units)

    def tier_of(self, tenant: str) -> str | None:
        return self.tiers.get(tenant)

    def tier_names(self) -> list[str]:
        return list(self.order)


def snapshot(watch: QueueWatch) -> Snapshot:
    return msgspec.json.decode(watch.read(), type=Snapshot)


def watched(endpoints: list[str]) -> QueueWatch:
    """A watch whose page is open: it builds a snapshot at every refresh."""
    watch = QueueWatch(endpoints)
    watch.read()
    return watch

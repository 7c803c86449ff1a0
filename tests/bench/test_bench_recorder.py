"""The benchmark recorder's well-behaved client against a real stack (nats-server,
dispatcher and a simulated worker, each a process of `bench.harness.stack`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness.recorder import Arrival, WellBehaved, replay
from bench.harness.stack import Stack, StackSpec

pytestmark = pytest.mark.integration

SLOTS = 8


async def test_the_well_behaved_client_fills_its_free_slots_at_once(
    nats_binary: Path, tmp_path: Path
) -> None:
    """Its first SLOTS requests are all published before the first of them is
    acknowledged (one at a time, the first fill lets other tenants slip in: the
    noisy-neighbour reference then depended on the recorder's speed), and no more than
    SLOTS are ever in flight."""
    spec = StackSpec(mode="fairq", workers=1, time_scale=0.02)
    requests = [
        Arrival("A", 0.0, input_tokens=50, max_tokens=20, streamed=False) for _ in range(3 * SLOTS)
    ]
    async with Stack(spec, tmp_path / "logs") as stack:
        result = await replay(
            stack.url,
            [],
            endpoint=spec.endpoint,
            settings=stack.settings,
            timeout_s=60.0,
            alive=stack.check_alive,
            well_behaved=WellBehaved(requests, SLOTS),
        )
    assert result.counts() == {"done": 3 * SLOTS}, result.counts()
    first = sorted(result.measured, key=lambda m: m.submitted)[:SLOTS]
    assert max(m.submitted for m in first) < min(m.acked for m in first)
    for m in result.measured:
        in_flight = sum(
            1 for other in result.measured if other.submitted <= m.submitted < other.finished
        )
        assert in_flight <= SLOTS, (m.id, in_flight)

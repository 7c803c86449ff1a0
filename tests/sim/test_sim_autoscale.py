"""The simulator's autoscaled fleet: replicas follow demand after a cold start, are
given back after the quiet window, and an endpoint scaled to zero comes back."""

from __future__ import annotations

import msgspec
import pytest

from broker_config.config import EXAMPLE_CONFIG, load_config
from costmodel.capacity import ScalingPolicy
from costmodel.engine_model import EngineParams
from dispatcher.core.limits import scheduling_only
from dispatcher.sim.simulator import Simulation, simulate
from dispatcher.sim.trace import TraceRecord

CONFIG = scheduling_only(load_config(EXAMPLE_CONFIG))
ENDPOINT = next(iter(CONFIG.endpoints))


def requests(start: float, end: float, per_s: float, tenant: str = "t") -> list[TraceRecord]:
    count = int((end - start) * per_s)
    return [TraceRecord(tenant, start + i / per_s, 500, 200, max_tokens=200) for i in range(count)]


def scaling(**fields) -> ScalingPolicy:
    return ScalingPolicy(
        **(
            dict(
                min_replicas=1,
                max_replicas=8,
                cold_start_s=20.0,
                scale_down_after_s=60.0,
                rate_window_s=10.0,
                drain_s=20.0,
            )
            | fields
        )
    )


def decisions(summary: dict) -> list[tuple[float, int]]:
    return [(t, n) for t, endpoint, n in summary["simulation"]["scaling"] if endpoint == ENDPOINT]


def test_a_burst_scales_the_fleet_up_and_the_quiet_after_it_back_down() -> None:
    trace = requests(0, 120, 1) + requests(120, 240, 12) + requests(240, 600, 1)
    result = simulate(trace, CONFIG, replicas=1, autoscale=scaling())
    assert all(r.finished is not None for r in result.records)
    changes = decisions(result.summary)
    counts = [n for _, n in changes]
    assert max(counts) > 1 and counts[-1] == 1, changes
    up = next(t for t, n in changes if n > 1)
    down = next(t for t, n in changes if t > up and n == 1)
    assert 120 <= up <= 135 and down >= 240 + 60, changes
    static = simulate(trace, CONFIG, replicas=max(counts))
    assert (
        result.summary["simulation"]["gpu_seconds"]
        < 0.7 * static.summary["simulation"]["gpu_seconds"]
    )


def test_an_endpoint_scaled_to_zero_serves_its_next_request_after_a_cold_start() -> None:
    trace = requests(0, 10, 1) + requests(300, 301, 1)
    simulation = Simulation(
        trace, CONFIG, replicas=1, autoscale=scaling(min_replicas=0, cold_start_s=30.0)
    )
    records = simulation.run()
    assert all(r.finished is not None for r in records)
    late = records[-1]
    assert late.first_token - late.arrival >= 30.0  # it waited for a replica to start
    chat = [r for r in simulation.replicas if r.worker.endpoint == ENDPOINT]
    # The replica serving the first requests went at the quiet window's end (to zero),
    # and the late request started another.
    assert len(chat) == 2 and 10 + 60 <= chat[0].retired_at < 300
    assert chat[1].started_at >= 300


def test_an_autoscaled_fleet_is_one_engine_kind() -> None:
    with pytest.raises(ValueError, match="autoscaled"):
        Simulation([], CONFIG, fleet=[EngineParams()], autoscale=scaling())
    with pytest.raises(ValueError, match="tick_s"):
        Simulation([], CONFIG, autoscale=scaling(), scale_tick_s=0.0)


def test_demand_turned_away_during_a_cold_start_still_brings_a_worker_back() -> None:
    """Scaled to zero with a cold start (60 s) longer than the latency target (30 s):
    admission rejects what arrives as `overloaded`, honestly; that offered load is
    what starts a replica, and what arrives once it serves is admitted."""
    spec = CONFIG.endpoints[ENDPOINT]
    strict = msgspec.structs.replace(
        CONFIG,
        endpoints={
            **CONFIG.endpoints,
            ENDPOINT: msgspec.structs.replace(spec, latency_target_s=30.0),
        },
    )
    trace = requests(0, 10, 1) + requests(400, 520, 1)
    simulation = Simulation(
        trace, strict, replicas=1, autoscale=scaling(min_replicas=0, cold_start_s=60.0)
    )
    records = simulation.run()
    late = [r for r in records if r.arrival >= 400]
    assert any(r.outcome == "overloaded" for r in late)
    assert all(r.finished is not None for r in late if r.arrival >= 400 + 60 + 5)
    chat = [r for r in simulation.replicas if r.worker.endpoint == ENDPOINT]
    assert chat[-1].started_at >= 400

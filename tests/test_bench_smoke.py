"""Smoke versions of the end-to-end benchmarks (bench/): the real stack in separate
processes, a few seconds each, generous bounds. A regression that breaks fairness or
loses requests fails here; the figures themselves are docs/benchmarks.md's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench import scenario_noisy, scenario_rate

pytestmark = pytest.mark.integration


async def test_noisy_neighbour_smoke(nats_binary: Path, tmp_path: Path) -> None:
    summary = await scenario_noisy.run_all(scenario_noisy.QUICK, tmp_path,
                                           "tests/test_bench_smoke.py")
    print(scenario_noisy.render(summary))
    for name, run in summary["runs"].items():
        sent = sum(row["count"] for row in run["tenants"].values())
        assert run["outcomes"] == {"done": sent}, f"{name}: not every request finished done"
    fairq, naive = (summary["ratios"][mode] for mode in ("fairq", "naive"))
    assert set(fairq) == set(naive) == set(scenario_noisy.TENANTS[1:])
    # Behind a FIFO the small tenants wait for the whole flood (over 100x their time
    # alone in this variant); fairq keeps them within a few times of it.
    assert max(fairq.values()) * 4 < min(naive.values())


async def test_dispatch_rate_smoke(nats_binary: Path, tmp_path: Path) -> None:
    settings = replace(scenario_rate.QUICK, requests=2_000, naive=False)
    summary = await scenario_rate.run_all(settings, tmp_path, "tests/test_bench_smoke.py")
    print(scenario_rate.render(summary))
    outcomes = {run["mode"]: run["outcomes"] for run in summary["runs"]}
    assert outcomes == {"raw": {"published": settings.requests},
                        "fairq": {"done": settings.requests}}
    # About 40% of the raw broker path on 2 shared cores; a throughput collapse (a
    # per-request stall, a serialised round trip) falls far below a tenth of it.
    assert summary["fairq_over_raw"]["median"] >= 0.1

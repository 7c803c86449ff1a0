"""Smoke runs of the routing benchmarks (the full runs are commands: docs/benchmarks.md)."""

from __future__ import annotations

import json

from bench.sim import affinity, spread


def test_the_affinity_benchmark_reports_both_routings(tmp_path, capsys) -> None:
    assert affinity.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| affinity |" in out and "| least-loaded |" in out
    runs = json.loads((tmp_path / "smoke.json").read_text())
    assert runs["affinity"]["cached_token_ratio"] > runs["least-loaded"]["cached_token_ratio"]
    assert runs["affinity"]["max_over_mean_load"] <= 1.25


def test_work_spreads_in_proportion_to_each_replicas_capacity_with_or_without_keys(
    tmp_path,
) -> None:
    """Without keys by least-utilised routing; with keys because the ring gives each
    replica keys in proportion to its size (the run is seeded: no noise between runs)."""
    assert spread.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "smoke.json").read_text())
    for run in ("no key", "conversations"):
        for figures in runs[run].values():
            assert abs(figures["served_share"] / figures["capacity_share"] - 1) <= 0.10, runs

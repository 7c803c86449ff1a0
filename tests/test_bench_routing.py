"""Smoke runs of the routing benchmarks (the full runs are commands: docs/benchmarks.md)."""

from __future__ import annotations

import json

from bench import affinity, spread


def test_the_affinity_benchmark_reports_both_routings(tmp_path, capsys) -> None:
    assert affinity.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| affinity |" in out and "| least-loaded |" in out
    runs = json.loads((tmp_path / "smoke.json").read_text())
    assert runs["affinity"]["cached_token_ratio"] > runs["least-loaded"]["cached_token_ratio"]
    assert runs["affinity"]["max_over_mean_load"] <= 1.25


def test_work_without_keys_spreads_in_proportion_to_each_replicas_capacity(tmp_path) -> None:
    assert spread.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "smoke.json").read_text())
    for figures in runs["no key"].values():
        assert abs(figures["served_share"] / figures["capacity_share"] - 1) <= 0.10, runs
    # With keys, a replica's share of keys is even and the load bound lets the small
    # ones carry up to 1.25x their share.
    for figures in runs["conversations"].values():
        assert figures["served_share"] <= 1.25 * figures["capacity_share"], runs

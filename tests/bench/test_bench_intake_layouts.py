"""bench.archive.intake_layouts, its quick variant at 10 tenants for two layouts, on nats-server
processes of its own (free ports): the figures must be real, every message counted once,
and the head-of-line property must show (a shard shares A's backlog, a tenant's own
consumer does not)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.archive import intake_layouts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

LAYOUTS = ("pull-per-tenant", "pull-shards-16")
BACKLOG = 500


def test_the_quick_variant_counts_every_message_and_shows_head_of_line_blocking(
    nats_binary: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        intake_layouts.main(
            [
                "--quick",
                "--tenants",
                "10",
                "--layouts",
                ",".join(LAYOUTS),
                "--backlog",
                str(BACKLOG),
                "--out-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    summary = json.loads((tmp_path / "quick.json").read_text())
    rows = {row["layout"]: row for row in summary["rows"]}
    assert set(rows) == set(LAYOUTS)
    published = intake_layouts.QUICK.messages
    for name, row in rows.items():
        assert row["tenants"] == 10
        assert row["published"] == row["consumed"] == row["deliveries"] == published, name
        assert row["left_in_stream"] == 0, name  # every message acked, so removed
        assert row["msgs_per_s"] > 0 and row["publish_msgs_per_s"] > 0, name
        assert row["server_cpu_us_per_msg"] > 0 and row["server_rss_kb"] > 0, name
        assert row["head_of_line"]["newcomer_after_s"] > 0, name
    assert rows["pull-per-tenant"]["consumers"] == 10
    shards = {intake_layouts.shard_of(t, 16) for t in intake_layouts.tenant_names(10)}
    assert rows["pull-shards-16"]["consumers"] == len(shards)  # the occupied shards
    # A's own consumer lets out at most its window before B's consumer delivers; a shard
    # that holds both delivers in stream order, all of A's backlog first.
    own, shard = (rows[name]["head_of_line"] for name in LAYOUTS)
    assert not own["newcomer_shares_consumer"]
    assert own["delivered_before_newcomer"] <= intake_layouts.WINDOW
    assert shard["newcomer_shares_consumer"]
    assert shard["delivered_before_newcomer"] == BACKLOG
    table = capsys.readouterr().out
    assert all(f"| {name} | 10 |" in table for name in LAYOUTS)

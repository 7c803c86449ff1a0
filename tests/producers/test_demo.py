"""`fairq demo` against `fairq up`, as the README's first minute runs it (issue 44): its
short variant, through real nats-server, simulated workers and the example config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.paths import REPO
from bench.harness.up import fairq_up
from producers.demo import TTFT_BOUND

pytestmark = pytest.mark.integration


@pytest.mark.solo  # a latency ratio: the other tests' processes would weigh on one phase
@pytest.mark.timeout(180)
def test_the_quick_demo_shows_small_tenants_near_their_solo_ttft_and_no_rate_limit(
    nats_binary: Path, tmp_path: Path
) -> None:
    with fairq_up(tmp_path / "logs") as up:
        demo = subprocess.run(
            [sys.executable, "-m", "producers.cli", "demo", "--quick"],
            cwd=REPO,
            env={**os.environ, "NATS_URL": up.values["NATS_URL"]},
            capture_output=True,
            text=True,
            timeout=120,
        )
    print(demo.stdout, demo.stderr)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    lines = demo.stdout.splitlines()
    table = [line for line in lines if line.startswith(("hooli ", "umbrella "))]
    rows = {line.split()[0]: line for line in table}
    for tenant in ("hooli", "umbrella"):
        ratio = float(rows[tenant].split("x ")[0].split()[-1])
        assert ratio <= TTFT_BOUND, rows[tenant]
    assert "rate_limited" not in demo.stdout
    assert any("of the service" in line and "weight's share" in line for line in lines)
    assert lines[-1].startswith("fair:")

"""The soak benchmark (bench/scenarios/soak.py): its load mix, its garbage, and a short run on the
real stack. The ten-minute figures are docs/benchmarks.md's."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from bench.scenarios import soak
from broker_config import wire
from broker_config.subjects import HDR_MSG_ID, HDR_REPLY, Subjects


@pytest.mark.parametrize("body", soak.GARBAGE)
def test_every_garbage_body_breaks_the_contract_and_can_be_answered(body: bytes) -> None:
    headers = {HDR_MSG_ID: "garbage0-1", HDR_REPLY: "_INBOX.soak.1"}
    with pytest.raises(wire.WireError) as caught:
        wire.parse_submission("fq.req.chat.garbage0", body, headers, Subjects())
    error = caught.value
    assert error.code == wire.ErrorCode.INVALID_REQUEST
    assert (error.reply, error.request_id) == ("_INBOX.soak.1", "garbage0-1")


def test_the_mix_is_seeded_has_every_kind_and_stays_within_the_load() -> None:
    settings = soak.Settings()

    def mix(seed: int) -> tuple[list[soak.Tenant], list]:
        rng = random.Random(seed)
        tenants = soak.make_tenants(settings, rng)
        return tenants, soak.schedule(tenants, settings, rng)

    tenants, arrivals = mix(1)
    assert (tenants, arrivals) == mix(1) and arrivals != mix(2)[1]
    kinds = Counter(t.kind for t in tenants)
    assert len(tenants) == settings.tenants and set(kinds) == {"steady", *soak.SHARED}
    assert len({t.name for t in tenants}) == settings.tenants
    unlisted = sum(not t.listed for t in tenants) / settings.tenants
    assert 0.1 < unlisted < 0.3
    assert all(0 <= a.offset_s < settings.duration_s for a in arrivals)
    # Idle tenants go quiet well before the warm-up ends.
    kind_of = {t.name: t.kind for t in tenants}
    assert all(a.offset_s < settings.idle_within_s for a in arrivals if kind_of[a.tenant] == "idle")
    # A few hundred requests per second at most, on average.
    assert 50 < len(arrivals) / settings.duration_s < 300


def test_churn_adds_unlisted_tenants_that_send_once() -> None:
    settings = soak.Settings(minutes=1.0, warmup_s=30.0, churn_per_s=5.0)
    rng = random.Random(1)
    tenants = soak.make_tenants(settings, rng)
    once = [t for t in tenants if t.kind == "once"]
    assert len(tenants) == settings.tenants + 300 and len(once) == 300
    assert not any(t.listed for t in once)
    sent = Counter(a.tenant for a in soak.schedule(tenants, settings, rng))
    assert all(sent[t.name] == 1 for t in once)


@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_soak_smoke(nats_binary: Path, tmp_path: Path) -> None:
    """45 s of the mix with 100 tenants: nothing lost, every well-formed request done,
    every garbage one answered invalid_request, samples taken, consumers bounded."""
    plot = tmp_path / "smoke.png"
    summary = await soak.run_named(
        "smoke", soak.SMOKE, tmp_path, plot, "tests/bench/test_bench_soak.py"
    )
    print(soak.render(summary))
    figures = summary["figures"]
    # A 45-s run says nothing about memory growth: that goal is the full soak's.
    assert set(summary["failed"]) <= {"rss_growth"}, summary["failed"]
    assert figures["lost"] == figures["refused"] == figures["well_formed_not_done"] == 0
    assert figures["garbage"] > 0 and figures["garbage_answered"] == figures["garbage"]
    assert figures["outcomes"] == {
        "done": figures["well_formed"],
        "invalid_request": figures["garbage"],
    }
    samples = figures["samples"]
    assert len(samples) >= soak.SMOKE.duration_s / soak.SMOKE.sample_s
    assert all(s["rss_kb"]["dispatcher"] > 0 and s["rss_kb"]["nats-server"] > 0 for s in samples)
    assert samples[-1]["published"] == figures["requests"]
    # One consumer per shard, nothing per tenant; a parked consumer only for a tenant
    # that sent more than its window at once.
    consumers = figures["consumers"]
    assert consumers["requests"]["min"] == consumers["requests"]["max"] == figures["shards"]
    tenants = figures["tenants"]
    assert consumers["parked"]["max"] <= tenants["flood"]["count"] + tenants["bursty"]["count"]
    assert json.loads((tmp_path / "smoke.json").read_text())["name"] == "smoke"
    assert plot.stat().st_size > 0

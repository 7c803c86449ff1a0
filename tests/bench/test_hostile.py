"""Hostile input through the live stack (bench/scenarios/hostile.py): a 1,000-probe sample here, the
full 10,000 as `python -m bench.scenarios.hostile` (figures in docs/benchmarks.md)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from bench.scenarios import hostile
from bench.scenarios.hostile_inputs import KINDS, LIMITS, Probe, Send, generate

pytestmark = pytest.mark.integration

SAMPLE = 1000


async def test_a_thousand_hostile_inputs_get_what_the_contract_promises(
    nats_binary: Path, tmp_path: Path
) -> None:
    result = await hostile.run(
        SAMPLE, seed=7, concurrency=64, log_dir=tmp_path, flood_backlog=1000, flood_calls=400
    )
    # Generous for a sample: its baseline is taken after only 100 probes.
    assert hostile.failures(result, max_rss_growth_pct=25.0) == [], result["mismatches"][:5]
    assert result["inputs"] == SAMPLE and result["messages"] > SAMPLE
    outcomes = result["outcomes"]
    # Every class of answer was reached, not only the easy ones.
    for outcome in (
        "done",
        "error:invalid_request",
        "error:unknown_endpoint",
        "error:unknown_tenant",
        "unanswered",
        "closed",
        "status:unknown",
        "cancel:false",
        "refused:MaxPayloadError",
        "refused:NoStreamResponseError",
        "refused:NoRespondersError",
    ):
        assert outcomes.get(outcome, 0) > 0, (outcome, outcomes)
    assert result["unanswered_counted"] == result["unanswered_sent"] > 0
    assert result["requests_left_in_stream"] == 0
    # The flood: more calls in flight than a tenant may have; the rest answered at once.
    answers = result["flood"]["answers"]
    assert answers.get("error:rate_limited", 0) > 0 and answers.get("status:unknown", 0) > 0
    assert sum(answers.values()) == 400


def test_the_probes_are_the_same_for_a_seed_and_cover_every_kind() -> None:
    first, again = generate(300, 5), generate(300, 5)
    assert first == again and first != generate(300, 6)
    names = {kind.__name__ for kind, _ in KINDS}
    drawn = Counter(probe.kind for probe in first)
    assert len(drawn) >= len(names), drawn
    assert all(send.expect for probe in first for send in probe.sends)


def test_a_body_over_a_limit_names_it() -> None:
    over = [
        send for probe in generate(400, 1) if probe.kind == "over a limit" for send in probe.sends
    ]
    assert over and {send.detail for send in over} <= set(LIMITS.__struct_fields__)


def test_failures_name_every_broken_promise() -> None:
    report = hostile.Report()
    probe = Probe("valid", (Send("fq.req.chat.acme", b"{}", "done"),))
    report.check(probe, probe.sends[0], "error:internal", "boom")
    result = {
        "mismatches": report.mismatches,
        "leaks": ["a message on a forged reply"],
        "unanswered_sent": 2,
        "unanswered_counted": 1.0,
        "requests_left_in_stream": 3,
        "dispatcher_rss_mib": {"growth_pct": 12.0},
        "flood": {"answers": {"no answer": 3}, "victim_during": {"status_s": {"max": 4.0}}},
    }
    problems = hostile.failures(result, max_rss_growth_pct=10.0)
    assert len(problems) == 7, problems
    assert report.mismatches[0]["got"] == "error:internal"

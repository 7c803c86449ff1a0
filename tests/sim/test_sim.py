"""The virtual-clock simulator, its fairness metrics, the trace tools and `fairq sim`."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from bench.sim import fairness_ablation, fairness_matrix
from bench.sim import noisy as sim_noisy
from bench.sim.noisy import noisy_config, p95_ttft
from broker_config.config import EXAMPLE_CONFIG, load_config, parse_config
from costmodel.engine_model import EngineParams
from dispatcher.sim.fairness import (
    MetricOptions,
    RequestRecord,
    jain_index,
    max_min_shares,
    percentile,
    summarize,
)
from dispatcher.sim.simulator import ClosedLoop, SimResult, simulate
from dispatcher.sim.trace import TraceRecord
from producers.cli import main
from producers.loadgen import (
    TraceError,
    assign_azure_trace,
    noisy_neighbour,
    read_trace,
    sample_trace,
    write_trace,
)

SAMPLE_TRACE = Path(__file__).resolve().parents[2] / "configs" / "sample_trace.csv"


# -- the noisy-neighbour acceptance scenario (bench.sim.noisy) ---------------------------

# Tenant A sends 10,000 requests at t=0; B-E send Poisson 0.5 req/s each for 300 s.
# A's backlog takes about 1,100 s of virtual time to drain, so it stays backlogged for
# the whole arrival period; 300 s gives B about 150 requests, enough for a stable p95,
# and each run takes about a second.


@pytest.fixture(scope="module")
def reference_runs() -> dict[int, dict[str, SimResult]]:
    """Per seed: B alone, next to a well-behaved A (the same 10,000 requests closed
    loop, every sequence slot outside the newcomer reserve busy, no backlog), next to
    A's flood with fairq, and with the FIFO baseline."""
    return {seed: sim_noisy.reference_runs(seed) for seed in (1, 2, 3)}


@pytest.fixture(scope="module")
def noisy_runs(reference_runs) -> dict[str, SimResult]:
    return reference_runs[1]


def test_noisy_tenant_stays_backlogged_through_the_arrival_period(noisy_runs) -> None:
    for policy in ("flood", "fifo"):
        a_records = [r for r in noisy_runs[policy].records if r.tenant == "A"]
        assert len(a_records) == 10_000
        assert all(r.outcome == "admitted" and r.served for r in a_records)
        last_dispatch = max(r.dispatched for r in a_records)
        assert last_dispatch > sim_noisy.NOISY_DURATION_S + 60


def test_fifo_baseline_makes_the_small_tenant_wait_behind_the_flood(noisy_runs) -> None:
    alone, fifo = p95_ttft(noisy_runs["alone"], "B"), p95_ttft(noisy_runs["fifo"], "B")
    assert fifo >= 20 * alone, (fifo, alone)


def test_flood_costs_the_small_tenant_no_more_than_an_equally_busy_engine(reference_runs) -> None:
    """Issue 10's bound: B's p95 TTFT next to the flood <= 1.2x its p95 next to a
    well-behaved A that keeps the engine as busy. (Against B alone the ratio is
    1.8-2.7x: a full continuous batch makes every step longer, which belongs to sharing
    the engine, not to the flood's backlog; see docs/benchmarks.md.)"""
    for seed, runs in reference_runs.items():
        beside, flood = p95_ttft(runs["beside"], "B"), p95_ttft(runs["flood"], "B")
        print(
            f"seed {seed}: B p95 TTFT beside a well-behaved A {beside:.3f} s, "
            f"beside the flood {flood:.3f} s ({flood / beside:.2f}x)"
        )
        assert flood <= 1.2 * beside, (seed, flood, beside)


def test_fifo_is_far_from_the_equally_busy_reference(reference_runs) -> None:
    for seed, runs in reference_runs.items():
        beside, fifo = p95_ttft(runs["beside"], "B"), p95_ttft(runs["fifo"], "B")
        assert fifo >= 50 * beside, (seed, fifo, beside)


def test_the_well_behaved_neighbour_keeps_the_engine_as_busy_without_a_backlog(
    reference_runs,
) -> None:
    """The reference is only fair if A really fills the engine: same throughput as the
    flood, every one of A's requests dispatched the instant it arrives."""
    for runs in reference_runs.values():
        beside, flood = runs["beside"].summary, runs["flood"].summary
        assert beside["throughput_tokens_per_s"] >= 0.99 * flood["throughput_tokens_per_s"]
        a_records = [r for r in runs["beside"].records if r.tenant == "A"]
        assert len(a_records) == 10_000
        assert all(r.dispatched == r.arrival for r in a_records)


def test_a_closed_loop_client_fills_the_slots_outside_the_reserve_and_never_queues() -> None:
    """4 sequences and a 25% reserve leave 3 slots; B runs one long request from t=0, so
    A, starting at t=1, keeps 2 in flight while B runs and 3 after, each request sent
    the moment a slot frees and dispatched at the next step boundary."""
    engine = EngineParams(max_sequences=4)
    a_records = [TraceRecord("A", 0.0, 10, 20, max_tokens=20) for _ in range(60)]
    result = simulate(
        [TraceRecord("B", 0.0, 10, 400, max_tokens=400)],
        noisy_config(0.25),
        engine,
        closed_loop=[ClosedLoop(a_records, start_s=1.0)],
    )
    b_ends = next(r.finished for r in result.records if r.tenant == "B")
    a_runs = [r for r in result.records if r.tenant == "A"]
    assert len(a_runs) == 60 and all(r.outcome == "admitted" for r in a_runs)
    # No backlog, ever: a request waits at most for the engine step under way.
    assert all(r.dispatched - r.arrival < engine.decode_step_base_s for r in a_runs)
    assert sum(r.arrival == 1.0 for r in a_runs) == 2

    def a_in_flight(at: float) -> int:
        return sum(r.dispatched <= at < r.finished for r in a_runs)

    instants = sorted({r.dispatched for r in a_runs})
    assert max(a_in_flight(t) for t in instants if t < b_ends) == 2
    assert max(a_in_flight(t) for t in instants if t >= b_ends) == 3
    assert all(a_in_flight(t) >= 2 for t in instants if t < b_ends)


def test_a_closed_loop_client_sends_on_past_rejected_requests() -> None:
    """A request that can never fit the KV cache is rejected `invalid` and takes no slot:
    the client goes on with the next one at once, and every record is accounted for."""
    engine = EngineParams(max_sequences=4, kv_cache_tokens=1_000)
    records = [TraceRecord("A", 0.0, 10 if n % 2 else 2_000, 20, max_tokens=20) for n in range(6)]
    result = simulate([], noisy_config(0.25), engine, closed_loop=[ClosedLoop(records)])
    outcomes = [r.outcome for r in result.records]
    assert outcomes == ["invalid", "admitted"] * 3
    assert all(r.finished is not None for r in result.records if r.outcome == "admitted")


def test_a_closed_loop_client_is_checked() -> None:
    with pytest.raises(ValueError, match="one endpoint"):
        ClosedLoop(
            [
                TraceRecord("A", 0.0, 1, 1, endpoint="chat"),
                TraceRecord("A", 0.0, 1, 1, endpoint="embed"),
            ]
        )
    with pytest.raises(ValueError, match="unknown endpoint"):
        simulate(
            [],
            noisy_config(),
            closed_loop=[ClosedLoop([TraceRecord("A", 0.0, 1, 1, endpoint="nowhere")])],
        )


def test_newcomer_reserve_costs_under_3_percent_when_one_tenant_floods_alone() -> None:
    flood = noisy_neighbour(1, noisy_requests=2_000, small_tenants=0)
    with_reserve = simulate(flood, noisy_config(0.03)).summary
    without = simulate(flood, noisy_config(0.0)).summary
    cost = 1 - with_reserve["throughput_tokens_per_s"] / without["throughput_tokens_per_s"]
    print(f"newcomer reserve 0.03: throughput cost {cost:.2%} when one tenant floods alone")
    assert 0 < cost < 0.03  # > 0: the reserve really held capacity back from the flood


# -- summary shape and metric sanity ---------------------------------------------------------


def test_result_has_the_documented_shape(noisy_runs) -> None:
    document = json.loads(json.dumps(noisy_runs["flood"].to_dict()))
    assert set(document) == {"records", "summary"}
    record = document["records"][0]
    assert {
        "tenant",
        "arrival",
        "dispatched",
        "first_token",
        "finished",
        "input_tokens",
        "output_tokens",
        "outcome",
    } <= set(record)
    summary = document["summary"]
    for key in (
        "throughput_tokens_per_s",
        "service_diff_max",
        "service_diff_avg",
        "jain_index_mean",
    ):
        assert isinstance(summary[key], float), key
    assert set(summary["tenants"]) == {"A", "B", "C", "D", "E"}
    for row in summary["tenants"].values():
        assert isinstance(row["count"], int) and isinstance(row["service"], float)
        for metric in ("queue_wait_s", "ttft_s"):
            assert set(row[metric]) == {"p50", "p95", "p99"}
            assert 0 <= row[metric]["p50"] <= row[metric]["p95"] <= row[metric]["p99"]


def test_fairness_figures_are_sane_and_separate_the_policies(noisy_runs) -> None:
    fairq, fifo = noisy_runs["flood"].summary, noisy_runs["fifo"].summary
    for summary in (fairq, fifo):
        assert len(summary["windows"]) == math.floor((sim_noisy.NOISY_DURATION_S - 30) / 60)
        assert all(j is None or 0 < j <= 1 + 1e-12 for j in summary["jain_index"])
        assert all(d >= 0 for d in summary["service_diff"])
        assert summary["throughput_tokens_per_s"] > 0
    assert fifo["service_diff_max"] > fairq["service_diff_max"]
    assert fifo["service_diff_avg"] > 2 * fairq["service_diff_avg"]
    assert fifo["jain_index_mean"] < fairq["jain_index_mean"]


def test_served_records_are_consistent(noisy_runs) -> None:
    trace_cap = noisy_config().endpoints["chat"].max_tokens_cap
    for record in noisy_runs["flood"].records:
        assert record.served
        assert record.arrival <= record.dispatched < record.first_token <= record.finished
        assert 1 <= record.output_tokens <= trace_cap


def record(
    tenant: str,
    arrival: float,
    first: float | None,
    finished: float | None,
    input_tokens: int = 100,
    output_tokens: int = 50,
) -> RequestRecord:
    served = first is not None
    return RequestRecord(
        f"{tenant}{arrival}",
        tenant,
        arrival,
        first if served else None,
        first,
        finished,
        input_tokens,
        output_tokens,
        "admitted",
    )


def test_service_difference_counts_what_a_starved_tenant_asked_for() -> None:
    options = MetricOptions(window_s=10.0, warmup_s=0.0)
    # A is served evenly over [0, 10]; B asks for 200 units at t=1 and is served only
    # after the window. One window [0, 10): s_A = 20/s, s_B = 0, d_A = 20/s, d_B = 20/s.
    records = [
        record("A", 0.0, 0.0, 10.0),
        record("B", 1.0, 12.0, 13.0),
        record("A", 10.0, 10.0, 11.0),
    ]
    summary = summarize(records, options)
    assert summary["windows"] == [[0.0, 10.0]]
    assert summary["service_diff"] == [pytest.approx(20.0)]  # min(20 - 0, |20 - 0|)
    # Served as soon as asked: no difference.
    fair = [record("A", 0.0, 0.0, 10.0), record("B", 0.0, 0.0, 10.0), record("A", 10.0, 10.0, 11.0)]
    assert summarize(fair, options)["service_diff"] == [pytest.approx(0.0)]


def test_service_difference_is_counted_per_unit_of_weight() -> None:
    options = MetricOptions(window_s=10.0, warmup_s=0.0)
    # Both backlogged over [0, 10): A (weight 1) gets 200 units, B (weight 2) 400.
    records = [
        record("A", 0.0, 0.0, 10.0, 200, 0),
        record("B", 0.0, 0.0, 10.0, 400, 0),
        record("A", 0.0, 20.0, 21.0, 1000, 0),
        record("B", 0.0, 20.0, 21.0, 1000, 0),
        record("A", 10.0, 10.0, 11.0),
    ]
    # s_A = 20/s, s_B = 40/s; demand far above both.
    assert summarize(records, options)["service_diff"] == [pytest.approx(20.0)]
    weighted = summarize(records, options, {"A": 1.0, "B": 2.0})
    assert weighted["service_diff"] == [pytest.approx(0.0)]
    # Served 1:2 while the weights say 2:1: A gets 10/s per unit of weight, B 40/s.
    even = summarize(records, options, {"A": 2.0, "B": 1.0})
    assert even["service_diff"] == [pytest.approx(30.0)]


def test_jain_index_normalises_by_max_min_fair_share() -> None:
    assert jain_index([1.0, 1.0, 1.0]) == 1.0
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert max_min_shares({"small": 10.0, "big": 1000.0}, 100.0) == {"small": 10.0, "big": 90.0}
    assert max_min_shares({"a": 100.0, "b": 100.0}, 90.0, {"a": 2.0}) == {
        "a": pytest.approx(60.0),
        "b": pytest.approx(30.0),
    }
    options = MetricOptions(window_s=10.0, warmup_s=0.0)
    # A small tenant that got all it asked for and a big one that got the rest: fair.
    fair = [
        record("S", 0.0, 0.0, 10.0),
        record("A", 0.0, 0.0, 10.0, 1000, 1000),
        record("A", 10.0, 10.0, 20.0),
    ]
    assert summarize(fair, options)["jain_index"] == [pytest.approx(1.0)]
    # The same demands, but S waits until after the window: unfair.
    unfair = [
        record("S", 0.0, 11.0, 12.0),
        record("A", 0.0, 0.0, 10.0, 1000, 1000),
        record("A", 10.0, 10.0, 20.0),
    ]
    assert summarize(unfair, options)["jain_index"][0] == pytest.approx(0.5)


def test_percentile_interpolates_between_ranks() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 95) == pytest.approx(4.8)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


# -- determinism and simulator behaviour -----------------------------------------------------


def test_same_inputs_give_the_same_result_and_seeds_change_scenarios() -> None:
    config = load_config(EXAMPLE_CONFIG)
    first = json.dumps(simulate(sample_trace(), config, replicas=2).to_dict())
    second = json.dumps(simulate(sample_trace(), config, replicas=2).to_dict())
    assert first == second
    assert noisy_neighbour(5, noisy_requests=50) == noisy_neighbour(5, noisy_requests=50)
    assert noisy_neighbour(5, noisy_requests=50) != noisy_neighbour(6, noisy_requests=50)


def test_shipped_sample_trace_is_the_documented_scenario() -> None:
    assert read_trace(SAMPLE_TRACE) == sample_trace()


def test_rejections_and_drops_are_recorded_with_their_outcome() -> None:
    config = parse_config("""
[profiles.p]
alpha = 0.000125
beta = 0.025
[endpoints.chat]
profile = "p"
cost = "model_units"
latency_target_s = 1e9
max_tokens_cap = 512
[[tiers]]
name = "t"
limits = { rpm = 60, rpm_burst = 1 }
[tenants.known]
tier = "t"
""")
    trace = [
        TraceRecord("known", 0.0, 100, 10),
        TraceRecord("known", 0.0, 100, 10),  # second within the burst of 1: rate limited
        TraceRecord("stranger", 0.0, 100, 10),  # unlisted tenants are rejected
        TraceRecord("known", 0.0, 200_000, 10),  # can never fit the KV cache
        TraceRecord("known", 0.0, 100, 10, endpoint="nope"),
        TraceRecord("known", 2.0, 100, 2000, max_tokens=64),  # the engine stops at 64
    ]
    records = simulate(trace, config).records
    assert [r.outcome for r in records] == [
        "admitted",
        "rate_limited",
        "unknown_tenant",
        "invalid",
        "unknown_endpoint",
        "admitted",
    ]
    assert records[0].served and records[5].served and records[5].output_tokens == 64
    assert not any(r.served or r.dispatched is not None for r in records[1:5])


def test_deadline_passes_while_queued_behind_a_full_engine() -> None:
    config = noisy_config()
    flood = [TraceRecord("A", 0.0, 100, 500) for _ in range(200)]
    late = TraceRecord("B", 0.0, 100, 10, deadline_s=0.001)
    records = simulate([*flood, late], config, policy="fifo").records
    assert records[-1].outcome == "deadline_exceeded" and not records[-1].served


def test_more_replicas_finish_a_backlog_sooner() -> None:
    trace = noisy_neighbour(3, noisy_requests=600, small_tenants=0)
    config = noisy_config()
    one = simulate(trace, config, replicas=1).summary["simulation"]["makespan_s"]
    two = simulate(trace, config, replicas=2).summary["simulation"]["makespan_s"]
    assert two < 0.6 * one


# -- trace files ------------------------------------------------------------------------------


def test_trace_round_trips_through_csv(tmp_path: Path) -> None:
    records = [
        TraceRecord("a", 0.5, 10, 20),
        TraceRecord(
            "b",
            1.25,
            30,
            40,
            priority=2,
            deadline_s=9.0,
            session="s1",
            max_tokens=64,
            endpoint="chat",
        ),
    ]
    path = tmp_path / "t.csv"
    write_trace(records, path)
    assert (
        path.read_text().splitlines()[0]
        == "tenant,arrival_s,input_tokens,output_tokens,priority,deadline_s,session,"
        "max_tokens,endpoint"
    )
    assert read_trace(path) == records


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "line 1: empty file"),
        ("tenant,arrival_s,input_tokens\n", "line 1: missing required column 'output_tokens'"),
        ("tenant,arrival_s,input_tokens,output_tokens,colour\n", "line 1: unknown column 'colour'"),
        ("tenant,arrival_s,input_tokens,output_tokens,tenant\n", "column 'tenant' appears twice"),
        (
            "tenant,arrival_s,input_tokens,output_tokens\na,0,10,5\na,1,ten,5\n",
            "line 3: column 'input_tokens': expected an integer, got 'ten'",
        ),
        (
            "tenant,arrival_s,input_tokens,output_tokens\na,-1,10,5\n",
            "line 2: column 'arrival_s': must be finite and >= 0",
        ),
        (
            "tenant,arrival_s,input_tokens,output_tokens\na,nan,10,5\n",
            "line 2: column 'arrival_s': expected a number, got 'nan'",
        ),
        (
            "tenant,arrival_s,input_tokens,output_tokens\na,0,10,0\n",
            "line 2: column 'output_tokens': must be >= 1",
        ),
        (
            "tenant,arrival_s,input_tokens,output_tokens\n,0,10,5\n",
            "line 2: column 'tenant' is empty",
        ),
        ("tenant,arrival_s,input_tokens,output_tokens\na,0,10\n", "line 2: 3 cells, expected 4"),
        (
            "tenant,arrival_s,input_tokens,output_tokens,max_tokens\na,0,10,5,-3\n",
            "line 2: column 'max_tokens': must be >= 1",
        ),
    ],
)
def test_bad_trace_errors_name_file_line_and_column(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as error:
        read_trace(path)
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)


def test_missing_trace_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "absent.csv")
    with pytest.raises(TraceError, match="Azure trace not found"):
        assign_azure_trace(tmp_path / "absent.csv", seed=1)


def test_azure_assignment_is_seeded_zipf_plus_an_extra_noisy_flood(tmp_path: Path) -> None:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [
        f"2023-11-16 18:{m:02d}:{s:02d}.5000000,{100 + s},{10 + m}"
        for m in range(10)
        for s in range(0, 60, 3)
    ]  # 200 rows, one every 3 s
    rows.append("2023-11-16 18:10:00.0000000,0,5")  # no input: dropped
    path = tmp_path / "azure.csv"
    path.write_text("\n".join(rows) + "\n")
    records = assign_azure_trace(
        path,
        seed=3,
        tenants=5,
        zipf_s=1.1,
        noisy_share=0.5,
        noisy_start_s=60.0,
        noisy_window_s=30.0,
    )
    assert records == assign_azure_trace(
        path,
        seed=3,
        tenants=5,
        zipf_s=1.1,
        noisy_share=0.5,
        noisy_start_s=60.0,
        noisy_window_s=30.0,
    )
    real = [r for r in records if r.tenant != "noisy"]
    noisy = [r for r in records if r.tenant == "noisy"]
    assert len(real) == 200 and len(noisy) == 100
    assert real[0].arrival_s == 0.0 and real[-1].arrival_s == pytest.approx(597.0)
    assert all(60.0 <= r.arrival_s < 90.0 for r in noisy)
    counts = {t: sum(r.tenant == t for r in real) for t in ("t01", "t02", "t03", "t04", "t05")}
    assert counts["t01"] > counts["t05"] and set(counts) == {r.tenant for r in real}
    assert [r.arrival_s for r in records] == sorted(r.arrival_s for r in records)


# -- the command ---------------------------------------------------------------------------------


def test_fairq_sim_writes_json_and_png(tmp_path: Path, capsys) -> None:
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    code = main(
        [
            "sim",
            "--trace",
            str(SAMPLE_TRACE),
            "--policy",
            "fairq",
            "--out",
            str(out),
            "--plot",
            str(plot),
            "--replicas",
            "1",
            "--seed",
            "4",
        ]
    )
    assert code == 0
    document = json.loads(out.read_text())
    assert len(document["records"]) == len(sample_trace())
    assert document["summary"]["simulation"]["policy"] == "fairq"
    assert set(document["summary"]["tenants"]) == {"A", "B", "C", "D", "E"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "throughput" in capsys.readouterr().out


def test_fairq_sim_runs_a_generated_scenario(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    # On the example config the free tier's limits and the throttle reject most of A's
    # flood; --scheduling-only admits it all, so the run is about dispatch order.
    for flag, a_admitted in (([], False), (["--scheduling-only"], True)):
        assert (
            main(
                [
                    "sim",
                    "--scenario",
                    "noisy-neighbour",
                    "--policy",
                    "fifo",
                    "--out",
                    str(out),
                    *flag,
                ]
            )
            == 0
        )
        summary = json.loads(out.read_text())["summary"]
        assert summary["simulation"]["source"] == "scenario:noisy-neighbour"
        a_row = summary["tenants"]["A"]
        assert a_row["count"] == 10_000
        assert (a_row["outcomes"] == {"admitted": 10_000}) is a_admitted


def test_fairq_sim_reports_bad_input_without_a_traceback(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("tenant,arrival_s\n")
    assert main(["sim", "--trace", str(bad), "--out", str(tmp_path / "r.json")]) == 2
    assert "missing required column" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_fairq_sim_runs_the_vtc_baseline(tmp_path: Path) -> None:
    ttft_p95 = {}
    for policy in ("vtc", "fifo"):
        out = tmp_path / f"{policy}.json"
        assert (
            main(
                [
                    "sim",
                    "--scenario",
                    "noisy-neighbour",
                    "--policy",
                    policy,
                    "--scheduling-only",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        tenants = json.loads(out.read_text())["summary"]["tenants"]
        assert all(row["outcomes"] == {"admitted": row["count"]} for row in tenants.values())
        ttft_p95[policy] = {name: row["ttft_s"]["p95"] for name, row in tenants.items()}
    # The Virtual Token Counter serves the small tenants beside A's flood; FIFO makes
    # them wait for it.
    for tenant in "BCDE":
        assert ttft_p95["vtc"][tenant] * 100 < ttft_p95["fifo"][tenant], ttft_p95


def test_the_fairness_matrix_compares_the_three_policies(tmp_path: Path) -> None:
    out = tmp_path / "matrix.json"
    assert fairness_matrix.main(["--quick", "--out", str(out), "--plot-dir", str(tmp_path)]) == 0
    assert (tmp_path / fairness_matrix.PLOT).stat().st_size > 10_000
    shapes = json.loads(out.read_text())["shapes"]
    assert set(shapes) == {"prefill-heavy", "weights"}
    cell = shapes["prefill-heavy"]["1"]
    assert set(cell) == {"fairq", "fifo", "vtc"}
    # Both fair policies are far from FIFO on a flooded, prefill-heavy engine...
    for policy in ("fairq", "vtc"):
        assert cell[policy]["service_diff_avg"] * 2 < cell["fifo"]["service_diff_avg"]
    # ...and serve 1:2:4 by weight (Jain's index on weighted shares), FIFO does not.
    weights = shapes["weights"]["1"]
    assert weights["fairq"]["jain_index_mean"] > 0.95 > weights["fifo"]["jain_index_mean"]


def test_the_ablation_reruns_fairq_with_each_suspect_removed(tmp_path: Path) -> None:
    out = tmp_path / "ablation.json"
    assert (
        fairness_ablation.main(["--shapes", "prefill-heavy", "--seeds", "1", "--out", str(out)])
        == 0
    )
    cells = json.loads(out.read_text())["shapes"]["prefill-heavy"]["1"]
    assert set(cells) == {*fairness_ablation.VARIANTS, "VTC", "FIFO"}
    # Every variant is a different run, still far fairer than FIFO in model units.
    assert len({c["mu_service_diff_avg"] for c in cells.values()}) == len(cells)
    for name in fairness_ablation.VARIANTS:
        assert cells[name]["mu_service_diff_avg"] * 2 < cells["FIFO"]["mu_service_diff_avg"]


def test_fairq_is_at_least_as_fair_as_vtc_in_engine_time(tmp_path: Path) -> None:
    """Issue 36's goal on four shapes of its matrix (the Azure one where the public trace
    is present), seeds 1-3: fairq's average service difference in engine time (the judge,
    and the unit fairq charges on the example's batched profile) is at most VTC's on the
    mean over the seeds and on at least two of them (one seed alone is a coin toss: two
    fair orders that break one tie differently part ways for good); sequence slots sit
    empty while queued work would fit at most 1% of the time beyond the 3% newcomer
    reserve; the lighter tenants get their first token no later than with VTC where
    tenants come and go; and where every tenant stays backlogged the adaptive reserve
    keeps throughput within 0.5% of FIFO's (on Azure traffic the reserve stays held for
    the small tenants and costs 0.7%: docs/benchmarks.md)."""
    out = tmp_path / "matrix.json"
    shapes = ("prefill-heavy", "decode-heavy", "heavy-tailed", "azure-conversation")
    seeds = ("1", "2", "3")
    assert fairness_matrix.main(["--shapes", *shapes, "--seeds", *seeds, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert set(summary["shapes"]) | set(summary["skipped"]) == set(shapes)

    def mean(cells: dict, policy: str, metric: str) -> float:
        return statistics.fmean(cells[seed][policy][metric] for seed in seeds)

    for shape, cells in summary["shapes"].items():
        metric = "engine_service_diff_avg"
        wins = sum(cells[seed]["fairq"][metric] <= cells[seed]["vtc"][metric] for seed in seeds)
        assert mean(cells, "fairq", metric) <= mean(cells, "vtc", metric) and wins >= 2, (
            shape,
            {seed: (cells[seed]["fairq"][metric], cells[seed]["vtc"][metric]) for seed in seeds},
        )
        for seed in seeds:
            assert cells[seed]["fairq"]["idle_while_waiting"] <= 0.01 + 0.03, (shape, seed)
        if shape in ("heavy-tailed", "azure-conversation"):
            light = "light_tenants_p95_ttft_s"
            assert mean(cells, "fairq", light) <= mean(cells, "vtc", light), shape
        if shape != "azure-conversation":
            tokens = "throughput_tokens_per_s"
            assert mean(cells, "fairq", tokens) >= 0.995 * mean(cells, "fifo", tokens), shape

"""Example-based tests of the scheduling core and its configuration."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from broker_config.config import (
    BrokerSettings,
    ConfigError,
    DispatcherOptions,
    WorkerOptions,
    load_config,
    parse_config,
)
from broker_config.limits import InputLimits
from broker_config.registry import Registry
from costmodel.units import Capacity, Usage
from dispatcher.core.endpoint import PAID_AT_DISPATCH
from dispatcher.core.limits import MemoryLimiterStore, month_end, month_key
from dispatcher.core.scheduler import Scheduler
from dispatcher.core.types import Outcome
from tests.core_support import ONE_SLOT, make_config, req

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"asyncio", "nats", "redis", "vllm"}


@pytest.mark.parametrize("package", ["dispatcher/core", "costmodel"])
def test_pure_packages_import_no_io_libraries(package):
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path} imports {name}"


def admit_all(scheduler, requests, now=0.0):
    store = MemoryLimiterStore()
    return [scheduler.admit(r, now, store) for r in requests]


# -- configuration ---------------------------------------------------------------


def test_example_config_has_the_promised_shape():
    config = load_config()
    assert [t.name for t in config.tiers] == ["enterprise", "standard", "free"]
    assert config.endpoints["chat"].cost == "model_units"
    assert config.endpoints["embed"].cost == "token"
    registry = Registry(config)
    assert registry.tenant("acme").tier == "enterprise"
    assert registry.tenant("globex").tier == "standard"
    assert registry.tenant("initech").tier == "free"
    stranger = registry.tenant("someone-new")
    assert (stranger.tier, stranger.weight) == ("free", 1.0)
    for tenant in ("acme", "globex", "initech", "someone-new"):  # one tenant per tier
        for endpoint in config.endpoints:
            assert registry.tenant(tenant).limits_for(endpoint).rpm >= 600


@pytest.mark.parametrize(
    "body, field, value",
    [
        ('[endpoints.chat]\nquantum = "x"\n[[tiers]]\nname = "a"', "endpoints.chat.quantum", "'x'"),
        ('[endpoints.chat]\n[[tiers]]\nname = "a"\nweight = -1', "tiers[0].weight", "-1"),
        (
            '[endpoints.chat]\n[[tiers]]\nname = "a"\n[tenants.t]\ntier = "zz"',
            "tenants.t.tier",
            "'zz'",
        ),
        (
            '[endpoints.chat]\ncost = "tokens"\n[[tiers]]\nname = "a"',
            "endpoints.chat.cost",
            "'tokens'",
        ),
        (
            '[endpoints.chat]\n[[tiers]]\nname = "a"\n[tenants.t]\ntier = "a"\nlimits.chat = '
            '{ rpm = "f" }',
            "tenants.t.limits.chat.rpm",
            "'f'",
        ),
    ],
)
def test_config_errors_name_file_field_and_value(body, field, value):
    with pytest.raises(ConfigError) as info:
        parse_config(body, source="bad.toml")
    message = str(info.value)
    assert message.startswith("bad.toml: ")
    assert f"`{field}`" in message
    assert value in message


def test_token_mode_on_an_endpoint_that_generates_is_refused_naming_the_mode_to_use():
    with pytest.raises(ConfigError) as info:
        parse_config('[endpoints.chat]\ncost = "token"\n[[tiers]]\nname = "a"', source="c.toml")
    assert "`endpoints.chat.cost`" in str(info.value)
    assert "model_units" in str(info.value)
    embed = '[endpoints.e]\nkind = "embed"\ncost = "token"\n[[tiers]]\nname = "a"'
    assert parse_config(embed, source="c.toml").endpoints["e"].cost == "token"


MINIMAL = '[endpoints.chat]\n[[tiers]]\nname = "a"\n'


def test_service_tables_default_when_absent():
    config = parse_config(MINIMAL)
    assert config.broker == BrokerSettings()
    assert config.dispatcher == DispatcherOptions()
    assert config.workers == WorkerOptions()
    assert config.subjects.prefix == config.broker.prefix == "fq"


def test_broker_dispatcher_and_workers_tables_are_decoded():
    config = parse_config(
        MINIMAL
        + "\n".join(
            [
                "[broker]",
                'prefix = "acme"',
                "max_queued_per_subject = 50",
                'storage = "memory"',
                "[dispatcher]",
                "tenant_window = 8",
                "max_ack_pending = 16",
                "ack_wait_s = 12.5",
                "grace_s = 0",
                "tenant_inboxes = true",
                "[workers]",
                "heartbeat_interval_s = 0.2",
                "drain_timeout_s = 3",
            ]
        )
    )
    assert config.broker == BrokerSettings(
        prefix="acme", max_queued_per_subject=50, storage="memory"
    )
    assert config.subjects.prefix == "acme"
    assert config.subjects.requests_stream == BrokerSettings(prefix="acme").subjects.requests_stream
    assert config.dispatcher == DispatcherOptions(
        tenant_window=8, max_ack_pending=16, ack_wait_s=12.5, grace_s=0.0, tenant_inboxes=True
    )
    assert config.workers == WorkerOptions(heartbeat_interval_s=0.2, drain_timeout_s=3.0)


@pytest.mark.parametrize(
    "table, field, value",
    [
        ("[dispatcher]\ntenant_window = 0", "dispatcher.tenant_window", "0"),
        ("[dispatcher]\nack_wait_s = -1", "dispatcher.ack_wait_s", "-1"),
        ("[workers]\nheartbeat_interval_s = 0", "workers.heartbeat_interval_s", "0"),
        ("[workers]\ndrain_timeout_s = -2", "workers.drain_timeout_s", "-2"),
        ('[broker]\nprefix = "a.b"', "broker.prefix", "'a.b'"),
        ('[broker]\nstorage = "disk"', "broker.storage", "'disk'"),
    ],
)
def test_service_table_errors_name_the_field(table, field, value):
    with pytest.raises(ConfigError) as info:
        parse_config(MINIMAL + table, source="bad.toml")
    message = str(info.value)
    assert message.startswith("bad.toml: ")
    assert f"`{field}`" in message
    assert value in message


@pytest.mark.parametrize(
    "table, match",
    [
        ("[dispatcher]\nfrobnicate = 1", "frobnicate"),
        ("[workers]\nheartbeat = 1", "heartbeat"),
        ("[broker]\nprefx = 'x'", "prefx"),
        ("[dispatcher.drift]\nlo = 0.5", "lo"),
        ("[dispatcher.input]\nmax_imgs = 3", "max_imgs"),
    ],
)
def test_service_tables_refuse_unknown_fields(table, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(MINIMAL + table, source="bad.toml")


@pytest.mark.parametrize(
    "table, match",
    [
        ("[dispatcher]\ntenant_window = 2000\nmax_ack_pending = 1000", "tenant_window"),
        ("[broker]\nmax_age_s = 1\nduplicate_window_s = 5", "duplicate_window_s"),
        ("[dispatcher.drift]\nlow = 1.5", "dispatcher.drift.*band"),
    ],
)
def test_cross_field_checks_of_service_tables_are_config_errors(table, match):
    with pytest.raises(ConfigError, match=f"bad.toml: .*{match}"):
        parse_config(MINIMAL + table, source="bad.toml")


def test_a_config_that_still_sets_a_quantum_loads_with_a_warning(caplog):
    """The quantum went with the ring of quanta (issue 36): old configs keep loading."""
    body = '[endpoints.chat]\nquantum = 8.0\n[[tiers]]\nname = "a"\n'
    with caplog.at_level("WARNING", logger="broker_config.config"):
        config = parse_config(body, source="old.toml")
    assert config.endpoints["chat"].quantum == 8.0
    assert "old.toml: field `endpoints.chat.quantum` is deprecated and ignored" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="broker_config.config"):
        parse_config(MINIMAL)
    assert "deprecated" not in caplog.text


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.toml"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[endpoints\n")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_config(broken)


# -- admission -----------------------------------------------------------------------


def test_admission_outcomes():
    scheduler = Scheduler(make_config(limits="rpm = 60, rpm_burst = 2, max_queued = 3"))
    store = MemoryLimiterStore()
    assert scheduler.admit(req("zz", 1), 0.0, store).outcome is Outcome.UNKNOWN_TENANT
    assert (
        scheduler.admit(req("a", 1, endpoint="nope"), 0.0, store).outcome
        is Outcome.UNKNOWN_ENDPOINT
    )
    assert (
        scheduler.admit(req("a", 1, deadline=0.0), 1.0, store).outcome is Outcome.DEADLINE_EXCEEDED
    )
    assert scheduler.admit(req("a", 1), 0.0, store).admitted
    assert scheduler.admit(req("a", 1), 0.0, store).outcome is Outcome.INVALID  # duplicate
    assert scheduler.admit(req("a", 2), 0.0, store).admitted
    limited = scheduler.admit(req("a", 3), 0.0, store)
    assert limited.outcome is Outcome.RATE_LIMITED
    assert limited.retry_after_s == pytest.approx(1.0)
    assert scheduler.admit(req("a", 3), 1.0, store).admitted
    full = scheduler.admit(req("a", 4), 10.0, store)
    assert full.outcome is Outcome.QUEUE_FULL and full.outcome.error_code == "overloaded"


def test_quota_is_charged_with_max_tokens_and_refunded_with_real_usage():
    scheduler = Scheduler(make_config(limits="monthly_quota_tokens = 100"))
    store = MemoryLimiterStore()
    assert scheduler.admit(req("a", 1, input_tokens=10, max_tokens=40), 0.0, store).admitted
    assert scheduler.admit(req("a", 2, input_tokens=10, max_tokens=40), 0.0, store).admitted
    refused = scheduler.admit(req("a", 3, input_tokens=10, max_tokens=40), 0.0, store)
    assert refused.outcome is Outcome.QUOTA_EXCEEDED
    assert refused.retry_after_s == pytest.approx(month_end(0.0))
    first = scheduler.next_batch("ep", ONE_SLOT, 0.0).requests[0]
    # Profile p: alpha 1, beta 2, so 10 input and 5 output tokens are 20 model units.
    completed = scheduler.complete("a", first.id, Usage(10, 5, 20.0), 1.0)
    store.settle(completed.settlement, 1.0)  # 35 unused tokens come back
    assert scheduler.admit(req("a", 3, input_tokens=10, max_tokens=25), 1.0, store).admitted


def test_usage_beyond_the_charge_is_charged_on_completion_even_past_the_quota():
    """An under-declared input pays for the truth when its request finishes."""
    scheduler = Scheduler(make_config(limits="monthly_quota_tokens = 100"))
    store = MemoryLimiterStore()
    assert scheduler.admit(req("a", 1, input_tokens=1, max_tokens=10), 0.0, store).admitted
    first = scheduler.next_batch("ep", ONE_SLOT, 0.0).requests[0]
    # Charged 11 at admission; it really read 120 tokens and wrote 10.
    completed = scheduler.complete("a", first.id, Usage(120, 10, 140.0), 1.0)
    assert [check.cost for check in completed.settlement.charge] == [119.0]
    store.settle(completed.settlement, 1.0)
    refused = scheduler.admit(req("a", 2, input_tokens=1, max_tokens=1), 1.0, store)
    assert refused.outcome is Outcome.QUOTA_EXCEEDED


def test_a_tenant_quota_across_endpoints_holds_on_every_endpoint():
    scheduler = Scheduler(
        parse_config(
            """
        [endpoints.ep]
        [endpoints.ep2]
        [[tiers]]
        name = "gold"
        monthly_quota_tokens = 1000
        [tenants.a]
        tier = "gold"
        monthly_quota_tokens = 100
        [tenants.b]
        tier = "gold"
    """,
            source="test.toml",
        )
    )
    store = MemoryLimiterStore()
    assert scheduler.admit(req("a", 1, input_tokens=10, max_tokens=50), 0.0, store).admitted
    assert scheduler.admit(
        req("a", 2, input_tokens=10, max_tokens=30, endpoint="ep2"), 0.0, store
    ).admitted
    refused = scheduler.admit(
        req("a", 3, input_tokens=10, max_tokens=10, endpoint="ep2"), 0.0, store
    )
    assert refused.outcome is Outcome.QUOTA_EXCEEDED
    assert "100 tokens" in refused.message
    # b has its tier's 1,000 across endpoints.
    assert scheduler.admit(req("b", 1, input_tokens=400, max_tokens=400), 0.0, store).admitted
    assert scheduler.admit(
        req("b", 2, input_tokens=100, max_tokens=100, endpoint="ep2"), 0.0, store
    ).admitted
    assert (
        scheduler.admit(
            req("b", 3, input_tokens=1, max_tokens=1, endpoint="ep2"), 0.0, store
        ).outcome
        is Outcome.QUOTA_EXCEEDED
    )


def test_month_boundaries_are_utc_calendar_months():
    feb = 1_709_251_199.0  # 2024-02-29T23:59:59Z
    assert month_key(feb) == "2024-02"
    assert month_end(feb) == 1_709_251_200.0
    assert month_key(month_end(feb)) == "2024-03"


def test_throttle_rejects_when_the_backlog_misses_the_latency_target():
    scheduler = Scheduler(make_config(cost="model_units", latency_target_s=10.0))
    scheduler.set_capacity("ep", 100.0)  # model units per second
    store = MemoryLimiterStore()
    # Each request: 10 input + 10 max_tokens * 0.5 prior ratio * beta 2 = 20 model units.
    decisions = [scheduler.admit(req("a", i), 0.0, store) for i in range(60)]
    admitted = sum(d.admitted for d in decisions)
    # Alone, tenant a has all 100 mu/s: 10 s of backlog is 1000 mu = 50 requests (+1).
    assert admitted == 51
    rejected = decisions[-1]
    assert rejected.outcome is Outcome.OVERLOADED and rejected.retry_after_s > 0
    # A second tenant halves a's share, but its own empty queue passes.
    assert scheduler.admit(req("b", 0), 0.0, store).admitted
    # A deadline tighter than the target is held to the same standard.
    # b's backlog is one request: 20 mu at its half share of 50 mu/s = 0.4 s.
    assert scheduler.admit(req("b", 1, deadline=1.0), 0.0, store).admitted
    tight = scheduler.admit(req("b", 2, deadline=0.5), 0.0, store)  # now 0.8 s ahead
    assert tight.outcome is Outcome.OVERLOADED and "deadline" in tight.message
    assert tight.retry_after_s == pytest.approx(0.3)


def test_admission_counts_the_wait_and_the_backlog_outside_the_scheduler():
    scheduler = Scheduler(
        make_config(cost="model_units", latency_target_s=10.0, limits="max_queued = 5")
    )
    scheduler.set_capacity("ep", 100.0)
    store = MemoryLimiterStore()
    assert scheduler.admit(req("a", 1), 0.0, store).admitted
    # Four of a's requests still wait in the broker: with one queued here, a is at its cap.
    full = scheduler.check(req("a", 2), 0.0, waiting_elsewhere=4)
    assert full.outcome is Outcome.QUEUE_FULL
    assert isinstance(scheduler.check(req("a", 2), 0.0, waiting_elsewhere=3), list)
    # b's queue is empty: a request that waited 9.9 s in the broker still makes the
    # 10 s target, as nothing is ahead of it.
    assert scheduler.admit(req("b", 1), 9.9, store, waited_s=9.9).admitted
    # The next one would wait for b's first (20 mu at b's half share of 100 mu/s:
    # 0.4 s): with 9.9 s already spent in the broker, it can no longer make it...
    stale = scheduler.check(req("b", 2), 9.9, waited_s=9.9)
    assert stale.outcome is Outcome.OVERLOADED and stale.retry_after_s > 0
    assert "waiting in the broker" in stale.message
    # ...while the same request published just now passes.
    assert isinstance(scheduler.check(req("b", 2), 9.9), list)
    # A deadline counts from now, so the broker's wait is not counted against it twice:
    # 0.4 s ahead fits a deadline 1 s away, whatever the request waited before.
    assert isinstance(scheduler.check(req("b", 3, deadline=10.9), 9.9, waited_s=5.0), list)


# -- queues, cancel, expiry, requeue ---------------------------------------------------


def test_cancel_and_expire_remove_queued_requests():
    scheduler = Scheduler(make_config())
    admit_all(scheduler, [req("a", 1), req("a", 2, deadline=5.0), req("a", 3)])
    assert scheduler.state("a", "3") == ("queued", 2)
    assert scheduler.cancel("a", "1").id == "1"
    assert scheduler.cancel("a", "1") is None
    assert scheduler.state("a", "3") == ("queued", 1)
    assert [r.id for r in scheduler.expire(6.0)] == ["2"]
    batch = scheduler.next_batch("ep", Capacity(8, 10**6, 1e9), 6.0)
    assert [r.id for r in batch.requests] == ["3"]
    assert scheduler.state("a", "3") == ("running", None)
    assert scheduler.depth(6.0)[0].running == 1


def test_next_batch_drops_expired_heads():
    scheduler = Scheduler(make_config())
    admit_all(scheduler, [req("a", 1, deadline=2.0), req("a", 2)])
    batch = scheduler.next_batch("ep", Capacity(8, 10**6, 1e9), 3.0)
    assert [r.id for r in batch.expired] == ["1"]
    assert [r.id for r in batch.requests] == ["2"]


def test_requeue_puts_a_running_request_back_in_its_place():
    scheduler = Scheduler(make_config())
    admit_all(scheduler, [req("a", 1, arrival=0.0), req("a", 2, arrival=1.0)])
    first = scheduler.next_batch("ep", ONE_SLOT, 0.0).requests[0]
    assert scheduler.requeue("a", first.id) is first
    again = scheduler.next_batch("ep", ONE_SLOT, 0.0).requests[0]
    assert again.id == "1"


def test_model_units_charge_the_prompt_at_dispatch_and_output_as_it_is_generated():
    # Profile p: alpha 1, beta 2. The estimate (half of max_tokens 10) is not charged.
    scheduler = Scheduler(make_config(cost="model_units"))
    standing = scheduler.endpoints["ep"].selector.standing
    admit_all(scheduler, [req("a", 1, input_tokens=10, max_tokens=10), req("a", 2)])
    request = scheduler.next_batch("ep", ONE_SLOT, 0.0).requests[0]
    flow = scheduler.flow("ep", "a")
    assert (request.charged_cost, standing(flow)) == (10.0, 10.0)
    scheduler.progress([(("a", "1"), 3)])  # three tokens: 6 more
    scheduler.progress([(("a", "1"), 2), (("b", "1"), 5)])  # stale, unknown: nothing
    assert (request.charged_cost, request.output_charged, standing(flow)) == (16.0, 3, 16.0)
    assert flow.served_cost == 16.0
    scheduler.complete("a", "1", Usage(10, 7, 0.0), 1.0)  # 10 + 2 x 7: 8 more
    assert (standing(flow), flow.served_cost) == (24.0, 24.0)


def test_a_requeued_request_is_charged_afresh_when_it_runs_again():
    scheduler = Scheduler(make_config(cost="model_units"))
    standing = scheduler.endpoints["ep"].selector.standing
    admit_all(scheduler, [req("a", 1, input_tokens=10, max_tokens=10), req("a", 2)])
    request = scheduler.next_batch("ep", ONE_SLOT, 0.0).requests[0]
    scheduler.progress([(("a", "1"), 4)])
    flow = scheduler.flow("ep", "a")
    assert standing(flow) == 10 + 8
    assert scheduler.requeue("a", "1") is request
    assert (request.charged_cost, request.output_charged, standing(flow)) == (10.0, 0, 0.0)


def test_token_and_request_modes_charge_no_output():
    for cost, charged in (("token", 10.0), ("request", 1.0)):
        scheduler = Scheduler(make_config(cost=cost))
        admit_all(scheduler, [req("a", 1, input_tokens=10, max_tokens=10)])
        request = scheduler.next_batch("ep", ONE_SLOT, 0.0).requests[0]
        scheduler.progress([(("a", "1"), 5)])
        assert request.charged_cost == charged, cost


def test_a_cancelled_tenant_is_let_go_without_breaking_the_order():
    scheduler = Scheduler(make_config())
    admit_all(scheduler, [req("a", 1), req("b", 1), req("b", 2)])
    scheduler.cancel("a", "1")
    batch = scheduler.next_batch("ep", Capacity(8, 10**6, 1e9), 0.0)
    assert [(r.tenant, r.id) for r in batch.requests] == [("b", "1"), ("b", "2")]


# -- batch assembly ------------------------------------------------------------------


def test_a_request_larger_than_a_whole_batch_goes_alone_when_the_worker_is_idle():
    scheduler = Scheduler(make_config(tokens=100))
    total = Capacity(4, 100, 1e12)
    admit_all(scheduler, [req("a", "big", input_tokens=500), req("b", "small")])
    busy = scheduler.next_batch("ep", Capacity(3, 80, 1e12), 0.0, total)
    assert busy.requests == []  # held: the worker drains for the oversized head
    idle = scheduler.next_batch("ep", total, 0.0, total)
    assert [r.id for r in idle.requests] == ["big"]
    rest = scheduler.next_batch("ep", total, 0.0, total)
    assert [r.id for r in rest.requests] == ["small"]


def test_a_head_that_does_not_fit_is_set_aside_and_keeps_its_turn():
    scheduler = Scheduler(make_config())
    total = Capacity(4, 100, 1e12)
    admit_all(
        scheduler,
        [req("a", 1, input_tokens=60, max_tokens=10), req("b", 1, input_tokens=5, max_tokens=5)],
    )
    batch = scheduler.next_batch("ep", Capacity(4, 50, 1e12), 0.0, total)
    assert [r.tenant for r in batch.requests] == ["b"]
    batch = scheduler.next_batch("ep", total, 0.0, total)
    assert [r.tenant for r in batch.requests] == ["a"]


def test_fifo_baseline_blocks_on_its_head():
    scheduler = Scheduler(make_config(), policy="fifo")
    total = Capacity(4, 100, 1e12)
    admit_all(
        scheduler,
        [req("a", 1, arrival=0.0, input_tokens=60), req("b", 1, arrival=1.0, input_tokens=5)],
    )
    assert scheduler.next_batch("ep", Capacity(4, 50, 1e12), 0.0, total).requests == []


def test_newcomer_reserve_is_kept_for_tenants_below_their_share():
    scheduler = Scheduler(make_config(reserve=0.25))
    total = Capacity(8, 10**6, 1e12)
    admit_all(scheduler, [req("a", i) for i in range(20)])
    first = scheduler.next_batch("ep", total, 0.0, total)
    # The flooding tenant alone may use all but the reserve (2 of 8 sequences); its
    # first request counts as a newcomer's.
    assert len(first.requests) == 6
    admit_all(scheduler, [req("b", 1)])
    second = scheduler.next_batch("ep", Capacity(2, 10**6, 1e12), 0.0, total)
    assert [r.tenant for r in second.requests] == ["b"]


def test_newcomer_reserve_is_lifted_once_every_tenant_is_backlogged_and_none_came_or_went():
    scheduler = Scheduler(make_config(reserve=0.25))  # newcomer_window_s 60 by default
    total = Capacity(8, 10**6, 1e12)
    admit_all(scheduler, [req("a", i) for i in range(20)])
    assert len(scheduler.next_batch("ep", total, 0.0, total).requests) == 6
    # a arrived at 0 s: for 60 s others may follow it.
    assert scheduler.next_batch("ep", Capacity(2, 10**6, 1e12), 30.0, total).requests == []
    # Then a, backlogged, is the only tenant: the reserve would only sit idle.
    assert len(scheduler.next_batch("ep", Capacity(2, 10**6, 1e12), 61.0, total).requests) == 2


def test_newcomer_reserve_is_held_while_a_present_tenant_has_nothing_queued():
    scheduler = Scheduler(make_config(reserve=0.25))
    total = Capacity(8, 10**6, 1e12)
    admit_all(scheduler, [req("b", "b1")] + [req("a", i) for i in range(20)])
    started = scheduler.next_batch("ep", total, 0.0, total).requests
    assert sorted(r.tenant for r in started) == ["a"] * 5 + ["b"]
    # b runs below its share with nothing queued: its next request may come any moment.
    assert scheduler.next_batch("ep", Capacity(2, 10**6, 1e12), 100.0, total).requests == []
    scheduler.complete("b", "b1", Usage(10, 10, 0.0), 101.0)
    # b has left: of three free slots a may take one, the reserve being held for the
    # window in case b returns; then it is lifted.
    assert len(scheduler.next_batch("ep", Capacity(3, 10**6, 1e12), 150.0, total).requests) == 1
    assert len(scheduler.next_batch("ep", Capacity(2, 10**6, 1e12), 162.0, total).requests) == 2


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        Scheduler(make_config(), policy="lifo")


def _sparse_tenant_with_debt(picks_while_away: int) -> list[str]:
    """b sends one request (5 MU of prompt), leaves, and is charged 40 MU of output
    afterwards; a and c stay backlogged with 5 MU requests. After `picks_while_away`
    single-slot dispatches b sends again; returns who gets the next 8 slots."""
    tenants = {name: ("gold", 1.0) for name in "abc"}
    scheduler = Scheduler(make_config(cost="model_units", tenants=tenants))
    admit_all(scheduler, [req("b", "b1", input_tokens=5, max_tokens=20)])
    admit_all(
        scheduler,
        [req(t, f"{t}{i}", input_tokens=5, max_tokens=1) for i in range(40) for t in "ac"],
    )
    (first,) = scheduler.next_batch("ep", ONE_SLOT, 0.0).requests
    assert first.tenant == "b"
    scheduler.progress([(("b", "b1"), 20)])  # beta 2: 40 MU of debt
    scheduler.complete("b", "b1", Usage(5, 20, 45.0), 0.0)
    for _ in range(picks_while_away):
        scheduler.next_batch("ep", ONE_SLOT, 0.0)
    admit_all(scheduler, [req("b", "b2", input_tokens=5, max_tokens=1)])
    return [scheduler.next_batch("ep", ONE_SLOT, 0.0).requests[0].tenant for _ in range(8)]


def test_a_sparse_tenant_returning_at_once_waits_out_its_debt():
    # b stands at 45 on its return, a and c at 0: nine requests each before b's turn.
    assert "b" not in _sparse_tenant_with_debt(picks_while_away=0)


def test_a_sparse_tenant_repays_its_debt_while_the_others_are_served():
    # Twenty picks while b was away: a and c stand at 50, above b's 45; b is lifted to
    # their floor and, joining, goes first on the tie.
    assert _sparse_tenant_with_debt(picks_while_away=20)[0] == "b"


def test_the_reserve_follows_the_standing_of_a_tenant_paid_at_dispatch():
    """Below its share of sequences, a tenant whose requests are charged mostly at
    dispatch (long prompts) may take the newcomer reserve only at the floor; one charged
    mostly as it generates, whatever its standing."""
    scheduler = Scheduler(make_config(cost="model_units"))  # alpha 1, beta 2
    endpoint = scheduler.endpoints["ep"]
    admit_all(scheduler, [req(t, i, input_tokens=10) for i in (1, 2) for t in "ab"])
    a, b = scheduler.flow("ep", "a"), scheduler.flow("ep", "b")
    assert endpoint.may_use_reserve(a) and endpoint.may_use_reserve(b)  # both at the floor
    (first,) = scheduler.next_batch("ep", ONE_SLOT, 0.0).requests
    assert first.tenant == "a"  # a now stands 10 above b, who was charged nothing
    assert not endpoint.may_use_reserve(a) and endpoint.may_use_reserve(b)
    scheduler.complete("a", "1", Usage(10, 0, 0.0), 1.0)  # all of it paid at dispatch
    assert a.paid_at_dispatch == 1.0 and not endpoint.may_use_reserve(a)
    for n in range(4):  # 10 of 210 at dispatch, the rest as generated
        endpoint.observe_payment(a, req("a", f"x{n}", input_tokens=10), 210.0)
    assert a.paid_at_dispatch < PAID_AT_DISPATCH and endpoint.may_use_reserve(a)


def test_input_limits_come_from_the_dispatcher_input_table():
    config = parse_config(MINIMAL + "[dispatcher.input]\nmax_images = 2\nmax_body_bytes = 4096")
    limits = config.dispatcher.input
    assert (limits.max_images, limits.max_body_bytes) == (2, 4096)
    assert limits.max_messages == 1024  # the rest keep their defaults
    with pytest.raises(ConfigError, match="max_images"):
        parse_config(MINIMAL + "[dispatcher.input]\nmax_images = -1")


def test_max_image_pixels_comes_from_the_dispatcher_input_table():
    assert InputLimits().max_image_pixels == 1 << 25
    config = parse_config(MINIMAL + "[dispatcher.input]\nmax_image_pixels = 1000000")
    assert config.dispatcher.input.max_image_pixels == 1_000_000
    with pytest.raises(ConfigError, match="max_image_pixels"):
        parse_config(MINIMAL + "[dispatcher.input]\nmax_image_pixels = 0")


def test_a_request_larger_than_the_tpm_bucket_settles_against_what_it_was_charged():
    """Admission takes at most a full bucket; settlement starts from that, not from the
    request's size, so a large request pays for what it used and gets back only what it
    was charged and did not use."""
    scheduler = Scheduler(make_config(limits="tpm = 600, tpm_burst = 100"))
    store = MemoryLimiterStore()
    assert scheduler.admit(req("a", 1, input_tokens=300, max_tokens=10), 0.0, store).admitted
    assert scheduler.admit(req("b", 2, input_tokens=300, max_tokens=10), 0.0, store).admitted
    scheduler.next_batch("ep", ONE_SLOT, 0.0)
    scheduler.next_batch("ep", ONE_SLOT, 0.0)
    used_all = scheduler.complete("a", "1", Usage(300, 10, 320.0), 1.0).settlement
    assert [(c.key, c.cost) for c in used_all.charge] == [("tpm:ep:a", 210.0)]
    used_little = scheduler.complete("b", "2", Usage(30, 2, 34.0), 1.0).settlement
    assert [(c.key, c.cost) for c in used_little.refund] == [("tpm:ep:b", 68.0)]
    # The month a quota is settled in is the one it was charged in, whatever `now` is.
    monthly = Scheduler(make_config(limits="monthly_quota_tokens = 1000"))
    late = req("a", 3, input_tokens=10, max_tokens=10)
    assert monthly.admit(late, 1_706_745_599.0, store).admitted  # 2024-01-31T23:59:59Z
    monthly.next_batch("ep", ONE_SLOT, 1_706_745_599.0)
    settled = monthly.complete("a", "3", Usage(10, 2, 14.0), 1_706_745_700.0).settlement
    assert [c.key for c in settled.refund] == ["quota:ep:a:2024-01"]

"""The engine-time unit: the batched decode curve of a profile, the engine model's
attribution of every step to the sequences in it, and charges settled in engine time."""

from __future__ import annotations

import random

import msgspec
import pytest

from costmodel.engine_model import BatchingEngineModel, EngineParams, engine_time_profile
from costmodel.units import Capacity, ModelProfile, Usage, dump_profile, load_profile
from dispatcher.core.limits import MemoryLimiterStore
from dispatcher.core.scheduler import Scheduler
from tests.core_support import make_config, req

# 1 ms per prompt token, 50 ms per image; a decode step of n costs 10 ms + 1 ms x n.
PARAMS = EngineParams(
    max_sequences=4,
    max_batched_tokens=100,
    kv_cache_tokens=10_000,
    prefill_tokens_per_s=1000.0,
    decode_step_base_s=0.01,
    decode_step_per_seq_s=0.001,
    image_s=0.05,
)


def run(engine: BatchingEngineModel) -> tuple[float, dict[object, float]]:
    """Step until idle: the total duration and each sequence's attributed time."""
    total, attributed = 0.0, {}
    while not engine.idle:
        step = engine.step()
        total += step.duration_s
        attributed.update(step.engine_s)
    return total, attributed


def test_a_mixed_batch_with_a_chunked_prefill_and_an_image_is_attributed_by_hand() -> None:
    engine = BatchingEngineModel(PARAMS)
    engine.add("a", 150, 3, images=1)
    engine.add("b", 30, 2)
    # Step 0: a's first chunk of 100 (0.1 s) and its image (0.05 s); b waits for budget.
    # Step 1: a's last 50 (0.05 s), b's 30 (0.03 s); both emit: 0.012 s, 0.006 each.
    # Step 2: both decode: 0.006 each; b finishes. Step 3: a alone, 0.011; a finishes.
    total, attributed = run(engine)
    assert attributed["a"] == pytest.approx(0.15 + 0.05 + 0.006 + 0.006 + 0.011)
    assert attributed["b"] == pytest.approx(0.03 + 0.006 + 0.006)
    assert total == pytest.approx(0.15 + 0.092 + 0.012 + 0.011)
    assert sum(attributed.values()) == pytest.approx(total)


def test_a_single_token_answer_and_a_cached_prefix_pay_only_what_they_ran() -> None:
    engine = BatchingEngineModel(PARAMS)
    engine.add("one", 20, 1)
    engine.add("cached", 80, 2, cached_tokens=60)  # prefills 20 of its 80
    total, attributed = run(engine)
    # Step 0: 20 + 20 prefilled (0.04 s), both emit (0.012 s); "one" leaves.
    # Step 1: "cached" alone decodes its last token (0.011 s).
    assert attributed["one"] == pytest.approx(0.02 + 0.006)
    assert attributed["cached"] == pytest.approx(0.02 + 0.006 + 0.011)
    assert sum(attributed.values()) == pytest.approx(total)


def test_a_running_sequence_reports_its_time_so_far() -> None:
    engine = BatchingEngineModel(PARAMS)
    engine.add("a", 50, 5)
    engine.step()  # prefill 0.05 s and the first token alone: 0.011 s
    engine.step()
    assert engine.engine_s("a") == pytest.approx(0.05 + 0.011 + 0.011)
    assert engine.engine_s("unknown") == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_attribution_adds_up_to_the_steps_whatever_the_mix(seed: int) -> None:
    """Every step's time goes to some sequence: nothing is lost or made up."""
    rng = random.Random(seed)
    engine = BatchingEngineModel(PARAMS)
    for n in range(30):
        engine.add(
            n,
            rng.randint(1, 400),
            rng.randint(1, 40),
            images=rng.choice((0, 0, 1, 2)),
            priority=rng.randint(0, 1),
            cached_tokens=rng.choice((0, 64)),
        )
    total, attributed = run(engine)
    assert len(attributed) == 30
    assert sum(attributed.values()) == pytest.approx(total)


def test_a_profile_prices_a_decode_token_at_the_batch_it_runs() -> None:
    profile = engine_time_profile(PARAMS)
    assert profile.beta == pytest.approx(0.011)  # batch 1: the whole step
    assert profile.decode_token_s(1) == pytest.approx(0.011)
    assert profile.decode_token_s(10) == pytest.approx(0.001 + 0.001)
    assert profile.decode_token_s() == pytest.approx(0.01 / 4 + 0.001)  # operating batch 4
    assert profile.model_units(100, 10, other=1, occupancy=10) == pytest.approx(0.1 + 0.02 + 0.05)
    assert profile.batched


def test_an_old_profile_keeps_its_flat_batch_1_price(tmp_path) -> None:
    path = tmp_path / "old.toml"
    path.write_text('name = "old"\nalpha = 0.001\nbeta = 0.025\ncapacity_mu_per_s = 30.0\n')
    profile = load_profile(path)
    assert profile.decode_token_s(64) == profile.decode_token_s(1) == 0.025
    assert not profile.batched
    assert ModelProfile().beta == 1.0  # the default of before the curve


def test_a_profile_round_trips_with_its_curve(tmp_path) -> None:
    profile = engine_time_profile(PARAMS, name="rt")
    dump_profile(profile, tmp_path / "p.toml")
    assert load_profile(tmp_path / "p.toml") == profile


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"decode_base_s": 0.02}, "needs decode_per_seq_s"),
        ({"decode_per_seq_s": 0.001}, "needs decode_base_s"),
        ({"decode_base_s": 0.02, "decode_per_seq_s": 0.001, "beta": 0.5}, "batch-1 price"),
        ({"decode_base_s": -1.0, "decode_per_seq_s": 0.001}, "decode_base_s must be"),
        ({"decode_base_s": 0.02, "decode_per_seq_s": 0.001, "operating_batch": 0}, "operating"),
    ],
)
def test_a_bad_curve_is_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        msgspec.convert({"name": "x", **fields}, ModelProfile)


def batched_scheduler() -> Scheduler:
    config = make_config(cost="model_units")
    profile = ModelProfile(
        name="p", alpha=0.001, decode_base_s=0.02, decode_per_seq_s=0.001, operating_batch=64
    )
    return Scheduler(msgspec.structs.replace(config, profiles={"p": profile}))


def dispatch_one(scheduler: Scheduler) -> None:
    scheduler.admit(req("a", 1, input_tokens=100, max_tokens=50), 0.0, MemoryLimiterStore())
    batch = scheduler.next_batch("ep", Capacity(8, 10**9, 1e12), 0.0)
    assert [r.id for r in batch.requests] == ["1"]


def test_output_is_charged_at_the_batch_its_worker_runs_and_settled_in_engine_time() -> None:
    scheduler = batched_scheduler()
    dispatch_one(scheduler)
    flow = scheduler.endpoints["ep"].flows["a"]
    assert flow.served_cost == pytest.approx(0.1)  # the prompt, at dispatch
    scheduler.progress([(("a", "1"), 10)], occupancy=20)
    assert flow.served_cost == pytest.approx(0.1 + 10 * (0.02 / 20 + 0.001))
    scheduler.complete("a", "1", Usage(100, 30, 0.0, engine_s=0.25), 1.0)
    assert flow.served_cost == pytest.approx(0.25)


def test_a_flat_profile_settles_in_its_own_unit_not_engine_time() -> None:
    scheduler = Scheduler(make_config(cost="model_units"))  # alpha 1, beta 2
    dispatch_one(scheduler)
    scheduler.complete("a", "1", Usage(100, 30, 0.0, engine_s=0.25), 1.0)
    assert scheduler.endpoints["ep"].flows["a"].served_cost == pytest.approx(100 + 2 * 30)


def test_queued_work_is_priced_at_the_batch_the_workers_report() -> None:
    scheduler = batched_scheduler()
    scheduler.admit(req("a", 1, input_tokens=100, max_tokens=50), 0.0, MemoryLimiterStore())
    operating = scheduler.endpoints["ep"].queued_model_units()
    full, room = Capacity(8, 10_000, 1e12), Capacity(0, 2_000, 1e12)
    for _ in range(200):
        scheduler.observe_occupancy("ep", 8, full, room)
    scheduler.observe_occupancy("ep", 0, full, full)  # an idle worker says nothing
    # Half idle: its small batch is not the price of a full replica's work.
    scheduler.observe_occupancy("ep", 2, full, Capacity(6, 8_000, 1e12))
    assert scheduler.endpoints["ep"].occupancy == pytest.approx(8)
    scheduler.admit(req("a", 2, input_tokens=100, max_tokens=50), 0.0, MemoryLimiterStore())
    queued = scheduler.endpoints["ep"].queued_model_units() - operating
    output = queued - 0.1  # the estimate's output part, at the reported batch
    assert output / (operating - 0.1) == pytest.approx((0.02 / 8 + 0.001) / (0.02 / 64 + 0.001))
    # A worker whose KV cache is all but taken is full at fewer sequences.
    scheduler.observe_occupancy("ep", 4, full, Capacity(4, 500, 1e12))
    assert scheduler.endpoints["ep"].occupancy < 8


def test_completions_teach_the_output_estimate_that_prices_queued_work() -> None:
    """The scheduler feeds each completion to its output estimator, per tenant: a
    tenant whose answers come out short has its next requests priced by what it really
    generates (the backlog admission and the autoscaler read), another keeps the prior."""
    scheduler = Scheduler(make_config(cost="model_units"))  # alpha 1, beta 2
    store, queues = MemoryLimiterStore(), scheduler.endpoints["ep"]

    def priced(tenant: str, index: int) -> float:
        before = queues.queued_model_units()
        request = req(tenant, index, input_tokens=10, max_tokens=100)
        assert scheduler.admit(request, 0.0, store).admitted
        return queues.queued_model_units() - before

    assert priced("a", 0) == priced("b", 0) == 10 + 2 * 50  # the prior: half of max_tokens
    for index in range(1, 30):
        priced("a", index)
    while batch := scheduler.next_batch("ep", Capacity(64, 10**6, 1e12), 0.0).requests:
        for request in batch:
            if request.tenant == "a":
                scheduler.complete("a", request.id, Usage(10, 5, 0.0), 0.0)
    assert priced("a", 100) == pytest.approx(10 + 2 * 5, abs=2)  # about 5 tokens now
    assert priced("b", 100) == 10 + 2 * 50

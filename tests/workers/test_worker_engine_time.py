"""The engine time workers attribute to requests: the simulated engine's exact share of
its steps, the worker's occupancy-based measure for engines that give none (vLLM), and
both on the done event's usage through a real worker service."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from broker_config.wire import DoneEvent, Sampling
from costmodel.engine_model import EngineParams
from costmodel.units import UNLIMITED_MODEL_UNITS, Capacity, ModelProfile
from tests.workers.test_worker_service import (
    PARAMS,
    PROFILE,
    Recorder,
    S,
    completion_of,
    completions,
    final_of,
    item,
    running_worker,
    send_batch,
    tokens_of,
    worker_service,
)
from workers.engine import Delta, EngineRequest
from workers.engine_time import (
    EngineTimeMeter,
    decode_engine_s,
    measures,
    prefill_engine_s,
)
from workers.images import PreparedImage
from workers.sim_engine import Faults, SimEngine

pytestmark = pytest.mark.timeout(30)

# Round numbers, so that the attribution can be worked out by hand.
HAND = EngineParams(
    prefill_tokens_per_s=1000.0,  # 1 ms per input token
    decode_step_base_s=0.01,
    decode_step_per_seq_s=0.002,
    image_s=0.05,
)
# A profile with a batched curve: a decode token costs 0.02 / n + 0.002 at occupancy n.
CURVE = ModelProfile(
    name="curve", alpha=0.001, decode_base_s=0.02, decode_per_seq_s=0.002, gamma=0.5
)
IMAGE = PreparedImage(1, 1, b"\0\0\0")


async def finals(engine: SimEngine, *requests: EngineRequest) -> dict[str, Delta]:
    """Run requests together, admitted in order before the first step; their final deltas."""

    async def final(request: EngineRequest) -> Delta:
        async for delta in engine.generate(request):
            if delta.finished:
                return delta
        raise AssertionError("no final delta")

    engine.faults.hang = True  # no step until every request is in
    tasks = {}
    for request in requests:
        tasks[request.id] = asyncio.create_task(final(request))
        while engine.waiting < len(tasks):
            await asyncio.sleep(0.001)
    engine.faults.hang = False
    return {rid: await task for rid, task in tasks.items()}


# -- the simulated engine: exact attribution ---------------------------------------------


async def test_sim_engine_reports_each_requests_share_of_the_steps_it_ran_in() -> None:
    a = EngineRequest("a", 8, prompt="x", input_tokens=100, target_output_tokens=3)
    b = EngineRequest("b", 8, prompt="y", input_tokens=200, target_output_tokens=2, images=[IMAGE])
    async with SimEngine(HAND, time_scale=0.0) as engine:
        done = await finals(engine, a, b)
        total = engine.engine_time_s
    # Step 0: both prefill (a 0.1 s; b 0.2 s + 0.05 s image) and emit their first token,
    #         a decode step of 2 costing 0.014 s, 0.007 s each.
    # Step 1: both decode, 0.007 s each; b's last token.
    # Step 2: a decodes alone, 0.012 s; its last token.
    assert done["a"].engine_s == pytest.approx(0.1 + 0.007 + 0.007 + 0.012)
    assert done["b"].engine_s == pytest.approx(0.2 + 0.05 + 0.007 + 0.007)
    assert total == pytest.approx((0.3 + 0.05 + 0.014) + 0.014 + 0.012)
    assert done["a"].engine_s + done["b"].engine_s == pytest.approx(total)
    # The time scale paces the steps; what a request costs is the model's time.
    async with SimEngine(HAND, time_scale=0.01) as scaled:
        again = await finals(scaled, a, b)
    assert {k: d.engine_s for k, d in again.items()} == pytest.approx(
        {k: d.engine_s for k, d in done.items()}
    )


async def test_sim_engine_requests_ended_early_still_add_up_to_the_engines_time() -> None:
    """Aborted, cut by a stop string, or finished: every step is paid for, once."""
    long = EngineRequest("long", 10_000, prompt="x", input_tokens=50, target_output_tokens=10_000)
    stopped = EngineRequest(
        "stopped", 200, prompt="y", target_output_tokens=200, sampling=Sampling(stop=["queue"])
    )
    short = EngineRequest("short", 8, prompt="z", input_tokens=30, target_output_tokens=5)
    async with SimEngine(HAND, time_scale=0.0) as engine:
        run = asyncio.create_task(finals(engine, long, stopped, short))
        while engine.engine_time_s < 0.5:  # well into the long one's decode
            await asyncio.sleep(0.001)
        await engine.abort("long")
        done = await run
        total = engine.engine_time_s
    assert done["long"].finish_reason == "abort"
    assert done["stopped"].finish_reason == "stop" and done["stopped"].output_tokens < 200
    assert all(final.engine_s > 0 for final in done.values())
    assert sum(final.engine_s for final in done.values()) == pytest.approx(total)


async def test_sim_engine_request_aborted_while_waiting_ran_no_engine_time() -> None:
    one_slot = EngineParams(max_sequences=1)
    first = EngineRequest("first", 8, prompt="x", target_output_tokens=5)
    second = EngineRequest("second", 8, prompt="y", target_output_tokens=5)
    async with SimEngine(one_slot, time_scale=0.0, faults=Faults(hang=True)) as engine:
        streams = [engine.generate(first), engine.generate(second)]
        waiting = [asyncio.create_task(anext(stream)) for stream in streams]
        while engine.waiting < 2:
            await asyncio.sleep(0.001)
        await engine.abort("second")  # never admitted
        engine.faults.hang = False
        done = []
        for stream, pending in zip(streams, waiting, strict=True):
            deltas = [await pending] + [delta async for delta in stream]
            done.append(deltas[-1])
    assert done[1].finish_reason == "abort" and done[1].engine_s == 0
    assert done[0].finish_reason == "stop" and done[0].engine_s > 0
    assert done[0].engine_s == pytest.approx(engine.engine_time_s)


# -- the worker's measure: occupancy and the profile's curve -----------------------------


def test_decode_tokens_pay_their_share_of_the_step_at_their_occupancy() -> None:
    # 3 tokens alone (0.022 s each), 4 beside one other (0.012), 2 in a batch of 4 (0.007).
    emissions = [(3, 1), (4, 2), (2, 4)]
    assert decode_engine_s(CURVE, emissions) == pytest.approx(3 * 0.022 + 4 * 0.012 + 2 * 0.007)
    assert decode_engine_s(CURVE, []) == 0


def test_prefill_is_charged_once_for_the_computed_input_and_the_images() -> None:
    assert prefill_engine_s(CURVE, 100, 0, 0) == pytest.approx(0.1)
    # A cached prefix is not computed again: whatever the price, it took no engine time.
    assert prefill_engine_s(CURVE, 100, 40, 2) == pytest.approx(0.06 + 1.0)
    assert prefill_engine_s(CURVE, 100, 500, 0) == 0


def test_only_a_profile_with_a_batched_curve_measures() -> None:
    assert measures(CURVE)
    assert not measures(None)
    # A flat profile prices a token the same at any occupancy: the price is the measure.
    assert not measures(ModelProfile(alpha=0.001, beta=0.02))
    assert EngineTimeMeter(ModelProfile(beta=0.02)).emitted("a", 5) == 0
    assert EngineTimeMeter(None).engine_s(0.0, 100, 0, 1) == 0


def test_meter_counts_the_requests_decoding_when_each_token_arrives() -> None:
    meter = EngineTimeMeter(CURVE)
    a = meter.emitted("a", 1)  # alone
    b = meter.emitted("b", 1)  # a and b decode
    a += meter.emitted("a", 2)
    c = meter.emitted("c", 1)  # three of them
    a += meter.emitted("a", 1)
    a += meter.emitted("a", 0)  # a final delta without a token: nothing
    meter.ended("a")
    b += meter.emitted("b", 1)  # b and c
    meter.ended("c")
    b += meter.emitted("b", 3)  # b alone again
    meter.ended("b")
    meter.ended("b")  # ending twice is harmless
    assert meter.occupancy == 0
    token = CURVE.decode_token_s
    assert a == pytest.approx(token(1) + 2 * token(2) + token(3))
    assert b == pytest.approx(token(2) + token(2) + 3 * token(1))
    assert c == pytest.approx(token(3))
    assert meter.engine_s(a, 100, 40, 1) == pytest.approx(a + 0.06 + 0.5)


# -- through a worker service on a real nats-server --------------------------------------


def done_of(rec: Recorder, request_id: str) -> DoneEvent:
    final = final_of(rec, request_id)
    assert isinstance(final, DoneEvent), final
    return final


@pytest.mark.integration
async def test_done_event_carries_the_sim_engines_engine_time(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder
) -> None:
    async with running_worker(nc, results) as (_, engine):
        await send_batch(nc, [item("alone", input_tokens=400)])
        await internal.until(lambda _: completion_of(internal, "alone"))
        await send_batch(nc, [item(f"r{i}", input_tokens=100 * i + 50) for i in range(4)])
        await internal.until(lambda _: len(completions(internal)) == 5)
        total = engine.engine_time_s
    alone = done_of(inbox, "alone")
    # Alone, a request pays its whole prefill and a decode step of one per token.
    expected = 400 * PARAMS.alpha + alone.usage.output_tokens * PARAMS.beta
    assert alone.usage.engine_s == pytest.approx(expected)
    # The profile's price of the same usage stays what model_units says.
    assert alone.usage.model_units == pytest.approx(
        PROFILE.model_units(400, len(tokens_of(inbox, "alone")))
    )
    together = [done_of(inbox, f"r{i}").usage for i in range(4)]
    assert all(usage.engine_s > 0 for usage in together)
    assert alone.usage.engine_s + sum(u.engine_s for u in together) == pytest.approx(total)
    for request_id in ("alone", "r0", "r3"):
        completion = completion_of(internal, request_id)
        assert completion is not None
        assert completion.usage == done_of(inbox, request_id).usage


class ScriptedEngine:
    """An engine that reports no engine time and emits what the test feeds it, when."""

    def __init__(self) -> None:
        self.feeds: dict[str, asyncio.Queue[Delta]] = {}

    @property
    def capacity(self) -> Capacity:
        return Capacity(8, 100_000, UNLIMITED_MODEL_UNITS)

    @property
    def healthy(self) -> bool:
        return True

    @property
    def accepts_images(self) -> bool:
        return False

    async def __aenter__(self) -> ScriptedEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None

    def count_tokens(self, request: EngineRequest) -> int:
        return 1

    def feed(self, key: str) -> asyncio.Queue[Delta]:
        return self.feeds.setdefault(key, asyncio.Queue())

    async def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        feed = self.feed(request.id)
        while not (delta := await feed.get()).finished:
            yield delta
        yield delta

    async def abort(self, request_id: str) -> None:
        return None


def token() -> Delta:
    return Delta(" tok", 1)


def last(input_tokens: int, output_tokens: int, cached: int = 0) -> Delta:
    return Delta(
        " end",
        1,
        finished=True,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_input_tokens=cached,
        finish_reason="stop",
    )


@pytest.mark.integration
@pytest.mark.parametrize("profile", [CURVE, ModelProfile(alpha=0.001, beta=0.022)])
async def test_worker_measures_engine_time_for_an_engine_that_reports_none(
    nc: Client, results: KeyValue, inbox: Recorder, internal: Recorder, profile: ModelProfile
) -> None:
    engine = ScriptedEngine()
    a, b = S.result_key("acme", "a"), S.result_key("acme", "b")
    async with worker_service(nc, engine, results, profile=profile):
        await send_batch(nc, [item("a"), item("b")])

        async def step(key: str, delta: Delta, request_id: str, events: int) -> None:
            engine.feed(key).put_nowait(delta)
            await inbox.until(lambda _: len(tokens_of(inbox, request_id)) >= events)

        await step(a, token(), "a", 1)  # a alone: occupancy 1
        await step(b, token(), "b", 1)  # a and b: 2
        await step(a, token(), "a", 2)  # 2
        engine.feed(a).put_nowait(last(100, 3, cached=40))  # 2, then a leaves
        await internal.until(lambda _: completion_of(internal, "a"))
        await step(b, token(), "b", 2)  # b alone: 1
        engine.feed(b).put_nowait(last(50, 3))  # 1
        await internal.until(lambda _: completion_of(internal, "b"))
    usage_a, usage_b = done_of(inbox, "a").usage, done_of(inbox, "b").usage
    if not measures(profile):
        assert usage_a.engine_s == usage_b.engine_s == 0  # absent: priced by the profile
        return
    alone, beside = profile.decode_token_s(1), profile.decode_token_s(2)
    assert usage_a.engine_s == pytest.approx(0.001 * 60 + alone + 2 * beside)
    assert usage_b.engine_s == pytest.approx(0.001 * 50 + beside + 2 * alone)
    assert usage_a.cached_input_tokens == 40

"""workers.sim_engine: the simulated continuous-batching engine and its fault modes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import msgspec
import pytest

from broker_config.wire import ChatMessage
from costmodel.engine_model import BatchingEngineModel, EngineParams
from costmodel.units import CHARS_PER_TOKEN, UNLIMITED_MODEL_UNITS, Capacity
from workers.engine import Delta, Engine, EngineError, EngineRequest
from workers.sim_engine import Faults, SimEngine

pytestmark = pytest.mark.timeout(30)

PARAMS = EngineParams()
# Fast enough for tests, slow enough that a step (0.025 s at scale 1) is measurable.
SCALE = 0.1
# Long enough to stay running for the whole of a test that interrupts it.
LONG = 10_000


def request(
    rid: str,
    max_tokens: int = 64,
    target: int | None = None,
    prompt: str = "hello world",
    **kwargs: object,
) -> EngineRequest:
    return EngineRequest(rid, max_tokens, prompt=prompt, target_output_tokens=target, **kwargs)  # type: ignore[arg-type]


async def collect(
    engine: SimEngine, req: EngineRequest, into: list[Delta] | None = None
) -> list[Delta]:
    """Every delta of a request; `into` shows them to the test while they arrive."""
    deltas = [] if into is None else into
    async for delta in engine.generate(req):
        deltas.append(delta)
    return deltas


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.002)


def check_stream(deltas: list[Delta], output_tokens: int, finish_reason: str) -> Delta:
    """One token per delta, then exactly one final delta with matching usage."""
    *tokens, final = deltas
    assert final.finished and final.finish_reason == finish_reason
    assert final.output_tokens == output_tokens == len(tokens)
    assert all(
        not d.finished and d.token_count == 1 and d.text.startswith(" ") and len(d.text) > 1
        for d in tokens
    )
    return final


def predicted(
    input_tokens: int, output_tokens: int, images: int = 0, params: EngineParams = PARAMS
) -> tuple[float, float]:
    """(time to first token, total) of a request alone, by the timing model itself."""
    model = BatchingEngineModel(params)
    model.add("r", input_tokens, output_tokens, images)
    clock, ttft = 0.0, 0.0
    while not model.idle:
        result = model.step()
        clock += result.duration_s
        if result.first_tokens:
            ttft = clock
    return ttft, clock


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    async with SimEngine(time_scale=SCALE) as running:
        yield running


@pytest.fixture
async def one_slot() -> AsyncIterator[SimEngine]:
    """An engine that runs one sequence at a time, so the next one waits."""
    params = msgspec.structs.replace(PARAMS, max_sequences=1)
    async with SimEngine(params, time_scale=SCALE) as running:
        yield running


# -- protocol, lifecycle, validation ---------------------------------------------------


async def test_implements_the_engine_protocol_and_reports_capacity() -> None:
    params = msgspec.structs.replace(PARAMS, max_sequences=8, kv_cache_tokens=5000)
    sim = SimEngine(params)
    assert isinstance(sim, Engine)
    # No measured model-unit limit: model units never bind.
    assert sim.capacity == Capacity(sequences=8, tokens=5000, model_units=UNLIMITED_MODEL_UNITS)
    assert not sim.healthy
    async with sim as running:
        assert running is sim and sim.healthy
        with pytest.raises(RuntimeError, match="already running"):
            await sim.__aenter__()
    assert not sim.healthy
    with pytest.raises(EngineError, match="not running"):
        await anext(sim.generate(request("late")))


@pytest.mark.parametrize("time_scale", [-0.1, float("inf"), float("nan")])
def test_rejects_a_bad_time_scale(time_scale: float) -> None:
    with pytest.raises(ValueError, match="time_scale"):
        SimEngine(time_scale=time_scale)


@pytest.mark.parametrize("slow_factor", [0.0, -2.0, float("nan"), float("inf"), "fast"])
def test_faults_reject_a_bad_slow_factor_at_init_and_at_runtime(slow_factor: object) -> None:
    with pytest.raises(ValueError, match="slow_factor"):
        Faults(slow_factor=slow_factor)  # type: ignore[arg-type]
    faults = Faults()
    with pytest.raises(ValueError, match="slow_factor"):
        faults.slow_factor = slow_factor  # type: ignore[assignment]
    assert faults.slow_factor == 1.0


def test_count_tokens_is_character_based_and_includes_chat_roles() -> None:
    sim = SimEngine()
    assert sim.count_tokens(request("a", prompt="")) == 1
    assert sim.count_tokens(request("a", prompt="abcd" * 10)) == 10
    assert sim.count_tokens(request("a", prompt="abcd" * 10 + "e")) == 11
    content = "x" * 40
    chat = EngineRequest(
        "c", 8, messages=[ChatMessage("system", content), ChatMessage("user", content)]
    )
    assert sim.count_tokens(chat) > 2 * len(content) // CHARS_PER_TOKEN
    assert sim.count_tokens(chat) == sim.count_tokens(chat)


@pytest.mark.parametrize(
    ("req", "match"),
    [
        (EngineRequest("r", 8), "neither a prompt nor messages"),
        (EngineRequest("r", 8, prompt="p", messages=[ChatMessage("user", "m")]), "both"),
        (EngineRequest("r", 8, messages=[]), "empty message list"),
    ],
)
async def test_malformed_requests_raise_value_error(
    engine: SimEngine, req: EngineRequest, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        engine.count_tokens(req)
    with pytest.raises(ValueError, match=match):
        await collect(engine, req)


@pytest.mark.parametrize(
    ("req", "match"),
    [
        (request("r", max_tokens=0), "'r': max_tokens must be >= 1"),
        (request("r", target=0), "'r': output_tokens must be >= 1"),
        (request("r", max_tokens=100, input_tokens=950), "'r'.*never fit the KV cache"),
    ],
)
async def test_impossible_requests_raise_value_error(req: EngineRequest, match: str) -> None:
    params = msgspec.structs.replace(PARAMS, kv_cache_tokens=1000)
    async with SimEngine(params, time_scale=SCALE) as sim:
        with pytest.raises(ValueError, match=match):
            await collect(sim, req)
        assert sim.active_requests == 0
        assert sim.free_kv_tokens == 1000


async def test_a_running_request_id_cannot_be_reused(engine: SimEngine) -> None:
    async with aclosing(engine.generate(request("dup", target=LONG, max_tokens=LONG))) as first:
        await anext(first)
        with pytest.raises(ValueError, match="'dup' is already running"):
            await collect(engine, request("dup"))
    # Once the first has gone, the id is free again.
    check_stream(await collect(engine, request("dup", target=3)), 3, "stop")


# -- streaming and usage ---------------------------------------------------------------


async def test_streams_tokens_then_one_final_delta_with_usage(engine: SimEngine) -> None:
    req = request("r1", max_tokens=64, target=12, prompt="a" * 400)
    deltas = await collect(engine, req)
    final = check_stream(deltas, 12, "stop")
    assert final.input_tokens == engine.count_tokens(req) == 100
    assert final.ttft_s is not None and final.ttft_s > 0
    assert (final.text, final.token_count) == ("", 0)
    assert engine.active_requests == 0  # per-request state is gone


async def test_given_input_tokens_replace_counting(engine: SimEngine) -> None:
    deltas = await collect(engine, request("r", target=2, prompt="", input_tokens=700))
    assert deltas[-1].input_tokens == 700


async def test_a_declared_zero_input_runs_as_one_token(engine: SimEngine) -> None:
    """The contract allows `input_tokens: 0`; an engine prefills at least one token."""
    deltas = await collect(engine, request("r", target=2, prompt="", input_tokens=0))
    check_stream(deltas, 2, "stop")
    assert deltas[-1].input_tokens == 1


async def test_max_tokens_caps_output_with_finish_reason_length(engine: SimEngine) -> None:
    check_stream(await collect(engine, request("cap", max_tokens=7, target=50)), 7, "length")
    check_stream(await collect(engine, request("exact", max_tokens=7, target=7)), 7, "length")


async def test_output_length_and_text_are_deterministic_per_seed_and_id() -> None:
    async def run(seed: int) -> list[tuple[str, int]]:
        """(text, output tokens) per request; timings are real and vary."""
        async with SimEngine(time_scale=0, seed=seed) as sim:
            results = await asyncio.gather(
                *(collect(sim, request(f"r{i}", max_tokens=20)) for i in range(40))
            )
        for deltas in results:
            n = deltas[-1].output_tokens
            check_stream(deltas, n, "length" if n == 20 else "stop")
        return [("".join(d.text for d in deltas), deltas[-1].output_tokens) for deltas in results]

    first, again, other = await run(1), await run(1), await run(2)
    assert first == again
    lengths = [n for _, n in first]
    assert all(1 <= n <= 20 for n in lengths)
    assert len(set(lengths)) > 5
    # Text depends on the request id (short outputs may share words from the small list).
    assert len({text for text, _ in first}) > 30
    assert lengths != [n for _, n in other]


# -- timing ----------------------------------------------------------------------------


@pytest.mark.parametrize("slow_factor", [1.0, 3.0])
async def test_timing_follows_the_model_scaled_by_time_scale_and_slow_factor(
    engine: SimEngine, slow_factor: float
) -> None:
    engine.faults.slow_factor = slow_factor  # set at runtime, as reliability tests do
    scale = SCALE * slow_factor
    ttft, total = (t * scale for t in predicted(1600, 20, images=1))
    started = time.monotonic()
    deltas = await collect(engine, request("t", target=20, input_tokens=1600, images=[b"img"]))
    elapsed = time.monotonic() - started
    final = check_stream(deltas, 20, "stop")
    # Never faster than the model; slower only by scheduling noise on a shared machine.
    assert total * 0.98 <= elapsed <= total + 0.2
    assert final.ttft_s is not None
    assert ttft * 0.98 <= final.ttft_s <= ttft + 0.1


async def test_time_scale_zero_runs_without_compute_time() -> None:
    async with SimEngine(time_scale=0) as sim:
        started = time.monotonic()
        results = await asyncio.gather(
            *(collect(sim, request(f"r{i}", max_tokens=32)) for i in range(200))
        )
        elapsed = time.monotonic() - started
        # At scale 1 this workload takes several seconds of simulated GPU time.
        assert elapsed < 2.0
        for deltas in results:
            check_stream(deltas, deltas[-1].output_tokens, deltas[-1].finish_reason or "")
        assert sim.active_requests == 0


async def test_concurrent_requests_are_batched(engine: SimEngine) -> None:
    started = time.monotonic()
    check_stream(await collect(engine, request("alone", target=20)), 20, "stop")
    single = time.monotonic() - started

    started = time.monotonic()
    results = await asyncio.gather(
        *(collect(engine, request(f"r{i}", target=20)) for i in range(16))
    )
    together = time.monotonic() - started
    for deltas in results:
        check_stream(deltas, 20, "stop")
    # Sequentially this is 16 * single; batched, about 1.2 * single.
    assert together < 4 * single


async def test_a_higher_priority_waiting_request_is_admitted_first(one_slot: SimEngine) -> None:
    finished: list[str] = []

    async def run(req: EngineRequest) -> None:
        await collect(one_slot, req)
        finished.append(req.id)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(run(request("busy", target=LONG, max_tokens=LONG)))
        await until(lambda: one_slot.free_sequences == 0)
        tg.create_task(run(request("low", target=2, priority=0)))
        await until(lambda: one_slot.waiting == 1)
        tg.create_task(run(request("high", target=2, priority=5)))
        await until(lambda: one_slot.waiting == 2)
        await one_slot.abort("busy")
    assert finished == ["busy", "high", "low"]


# -- abort and cancellation ------------------------------------------------------------


async def test_abort_of_a_running_request(engine: SimEngine) -> None:
    deltas: list[Delta] = []
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(
            collect(engine, request("run", target=LONG, max_tokens=LONG), into=deltas)
        )
        await until(lambda: len(deltas) >= 3)
        await engine.abort("run")
    final = check_stream(task.result(), len(deltas) - 1, "abort")
    assert 3 <= final.output_tokens < LONG
    assert final.ttft_s is not None
    assert engine.free_sequences == PARAMS.max_sequences
    assert engine.free_kv_tokens == PARAMS.kv_cache_tokens
    assert engine.active_requests == 0


async def test_abort_of_a_waiting_request(one_slot: SimEngine) -> None:
    running: list[Delta] = []
    async with asyncio.TaskGroup() as tg:
        first = tg.create_task(
            collect(one_slot, request("first", target=LONG, max_tokens=LONG), into=running)
        )
        await until(lambda: bool(running))
        second = tg.create_task(collect(one_slot, request("second", target=5)))
        await until(lambda: one_slot.waiting == 1)
        await one_slot.abort("second")
        aborted = check_stream(await second, 0, "abort")
        assert aborted.ttft_s is None
        assert one_slot.waiting == 0
        # The running request was not disturbed: it still holds the slot and streams.
        streamed = len(running)
        await until(lambda: len(running) > streamed)
        assert not first.done() and one_slot.free_sequences == 0
        await one_slot.abort("first")
    check_stream(first.result(), len(running) - 1, "abort")
    assert one_slot.free_sequences == 1


async def test_abort_of_an_unknown_or_finished_request_is_a_no_op(engine: SimEngine) -> None:
    await engine.abort("nobody")
    check_stream(await collect(engine, request("done", target=2)), 2, "stop")
    await engine.abort("done")
    check_stream(await collect(engine, request("done", target=2)), 2, "stop")


async def test_consumer_cancellation_frees_capacity(engine: SimEngine) -> None:
    deltas: list[Delta] = []
    task = asyncio.create_task(
        collect(engine, request("c", target=LONG, max_tokens=LONG), into=deltas)
    )
    await until(lambda: len(deltas) >= 2)
    assert engine.free_sequences == PARAMS.max_sequences - 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.free_sequences == PARAMS.max_sequences
    assert engine.free_kv_tokens == PARAMS.kv_cache_tokens
    assert engine.active_requests == 0


async def test_closing_the_generator_frees_capacity(engine: SimEngine) -> None:
    stream = engine.generate(request("g", target=LONG, max_tokens=LONG))
    await anext(stream)
    assert engine.free_sequences == PARAMS.max_sequences - 1
    await stream.aclose()
    assert engine.free_sequences == PARAMS.max_sequences
    assert engine.active_requests == 0


# -- faults ----------------------------------------------------------------------------


async def test_crash_fails_current_and_new_requests_until_cleared(engine: SimEngine) -> None:
    deltas: list[Delta] = []
    task = asyncio.create_task(
        collect(engine, request("cur", target=LONG, max_tokens=LONG), into=deltas)
    )
    await until(lambda: len(deltas) >= 2)
    engine.faults.crash = True
    assert not engine.healthy
    with pytest.raises(EngineError, match="'cur'.*crash"):
        await asyncio.wait_for(task, 5)
    with pytest.raises(EngineError, match="'new'.*crash"):
        await collect(engine, request("new", target=2))
    assert engine.free_sequences == PARAMS.max_sequences
    assert engine.active_requests == 0

    engine.faults.crash = False
    assert engine.healthy
    check_stream(await collect(engine, request("after", target=3)), 3, "stop")


async def test_hang_stalls_requests_while_healthy_and_recovers(engine: SimEngine) -> None:
    deltas: list[Delta] = []
    task = asyncio.create_task(collect(engine, request("h", target=40), into=deltas))
    await until(lambda: len(deltas) >= 2)
    engine.faults.hang = True
    await asyncio.sleep(0.05)  # the step in progress may still deliver its token
    stalled_at = len(deltas)
    done, _ = await asyncio.wait([task], timeout=0.3)
    assert not done and len(deltas) == stalled_at < 40
    assert engine.healthy  # only an end-to-end probe can tell

    # A request arriving during the hang does not start either.
    probe = asyncio.create_task(collect(engine, request("probe", target=1)))
    done, _ = await asyncio.wait([probe], timeout=0.2)
    assert not done

    engine.faults.hang = False
    check_stream(await asyncio.wait_for(task, 5), 40, "stop")
    check_stream(await asyncio.wait_for(probe, 5), 1, "stop")


async def test_a_failing_step_loop_fails_requests_and_surfaces_on_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim = SimEngine(time_scale=SCALE)

    def broken_step() -> None:
        raise ZeroDivisionError("model bug")

    with pytest.raises(ZeroDivisionError, match="model bug"):
        async with sim:
            monkeypatch.setattr(sim._model, "step", broken_step)
            with pytest.raises(EngineError, match="'r'.*simulated engine failed"):
                await collect(sim, request("r", target=3))
            assert not sim.healthy
            with pytest.raises(EngineError, match="not running"):
                await collect(sim, request("again", target=3))


# -- shutdown --------------------------------------------------------------------------


async def test_clean_shutdown_with_requests_in_flight() -> None:
    params = msgspec.structs.replace(PARAMS, max_sequences=4)
    seen: list[list[Delta]] = [[] for _ in range(6)]
    async with asyncio.TaskGroup() as tg:
        async with SimEngine(params, time_scale=SCALE) as sim:
            tasks = [
                tg.create_task(
                    collect(sim, request(f"r{i}", target=LONG, max_tokens=LONG), into=seen[i])
                )
                for i in range(6)
            ]
            await until(lambda: all(seen[i] for i in range(4)) and sim.waiting == 2)
    # Running and waiting requests all end with an abort delta, none hangs.
    for task in tasks:
        check_stream(task.result(), task.result()[-1].output_tokens, "abort")
    assert sim.active_requests == 0 and not sim.healthy
    assert asyncio.all_tasks() == {asyncio.current_task()}

"""costmodel.engine_model: the continuous-batching timing model and its calibration."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.calibrate import Sample, fit_profile, grid
from costmodel.engine_model import (
    BatchingEngineModel,
    EngineParams,
    StepResult,
    load_engine_params,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PARAMS = EngineParams()
# Prefill-only timing: a step's duration is the number of input tokens it prefilled.
TOKENS_AS_SECONDS = EngineParams(
    prefill_tokens_per_s=1.0, decode_step_base_s=0.0, decode_step_per_seq_s=0.0, image_s=0.0
)


def run(engine: BatchingEngineModel, max_steps: int = 100_000) -> list[StepResult]:
    """Step until idle; bounded so a bug cannot hang the test."""
    results = []
    while not engine.idle:
        assert len(results) < max_steps, "engine did not drain"
        results.append(engine.step())
    return results


def alone(
    input_tokens: int, output_tokens: int, images: int = 0, params: EngineParams = PARAMS
) -> tuple[float, float]:
    """(time to first token, total time) of one request on an empty engine."""
    engine = BatchingEngineModel(params)
    engine.add("r", input_tokens, output_tokens, images)
    clock, ttft = 0.0, None
    for result in run(engine):
        clock += result.duration_s
        if result.first_tokens:
            ttft = clock
    assert ttft is not None
    return ttft, clock


# -- parameters ------------------------------------------------------------------------


def test_defaults_match_example_profile() -> None:
    example = msgspec.toml.decode((CONFIGS / "example.toml").read_bytes())
    profile = example["profiles"]["llama-7b-sim"]
    assert PARAMS.alpha == pytest.approx(profile["alpha"], rel=1e-12)
    assert PARAMS.decode_step_base_s == pytest.approx(profile["decode_base_s"], rel=1e-12)
    assert PARAMS.decode_step_per_seq_s == pytest.approx(profile["decode_per_seq_s"], rel=1e-12)
    assert PARAMS.max_sequences == profile["operating_batch"]
    assert PARAMS.gamma == pytest.approx(profile["gamma"], rel=1e-12)


def test_shipped_engine_toml_holds_the_defaults() -> None:
    assert load_engine_params(CONFIGS / "engine.toml") == EngineParams()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("max_sequences = 0\n", "max_sequences must be >= 1"),
        ("prefill_tokens_per_s = 0.0\n", "prefill_tokens_per_s must be finite and > 0"),
        ("image_s = -1.0\n", "image_s must be finite and >= 0"),
        ("decode_step_base_s = inf\n", "decode_step_base_s must be finite"),
        ("max_seqs = 4\n", "max_seqs"),
        ("max_sequences = 'many'\n", "max_sequences"),
    ],
)
def test_load_engine_params_rejects_bad_files(tmp_path, text: str, match: str) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_engine_params(path)


def test_load_engine_params_missing_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_engine_params(tmp_path / "nope.toml")


# -- single request timing -------------------------------------------------------------


@pytest.mark.parametrize(
    ("input_tokens", "output_tokens", "images"),
    [
        (1, 1, 0),
        (512, 1, 0),
        (100, 64, 0),
        (4096, 10, 2),  # exactly one full prefill chunk
        (10_000, 5, 3),  # three chunks
        (20_000, 300, 0),
    ],
)
def test_single_request_timing_is_exact(input_tokens: int, output_tokens: int, images: int) -> None:
    ttft, total = alone(input_tokens, output_tokens, images)
    step1 = PARAMS.decode_step_base_s + PARAMS.decode_step_per_seq_s
    prefill = input_tokens / PARAMS.prefill_tokens_per_s + images * PARAMS.image_s
    assert ttft == pytest.approx(prefill + step1, rel=1e-12)
    assert total == pytest.approx(prefill + output_tokens * step1, rel=1e-12)


@given(
    input_tokens=st.integers(1, 50_000),
    output_tokens=st.integers(1, 500),
    images=st.integers(0, 5),
    budget=st.integers(1, 8192),
)
@settings(max_examples=40, deadline=None)
def test_single_request_timing_does_not_depend_on_chunk_budget(
    input_tokens: int, output_tokens: int, images: int, budget: int
) -> None:
    params = msgspec.structs.replace(PARAMS, max_batched_tokens=budget, kv_cache_tokens=60_000)
    _, total = alone(input_tokens, output_tokens, images, params)
    expected = PARAMS.alpha * input_tokens + PARAMS.beta * output_tokens + PARAMS.gamma * images
    assert total == pytest.approx(expected, rel=1e-9)


# -- batching --------------------------------------------------------------------------


def decode_throughput(batch: int) -> float:
    """Output tokens per second of `batch` identical requests run together."""
    engine = BatchingEngineModel(PARAMS)
    for i in range(batch):
        engine.add(i, 16, 200)
    results = run(engine)
    tokens = sum(len(r.tokens) + len(r.first_tokens) for r in results)
    assert tokens == batch * 200
    return tokens / sum(r.duration_s for r in results)


def test_decode_throughput_grows_with_batch_size() -> None:
    rates = [decode_throughput(n) for n in (1, 4, 16, 64)]
    assert rates == sorted(rates)
    assert rates[-1] > 20 * rates[0]


def test_decode_step_cost_is_base_plus_per_sequence() -> None:
    engine = BatchingEngineModel(PARAMS)
    for i in range(10):
        engine.add(i, 8, 5)
    first = engine.step()
    assert first.first_tokens == list(range(10))
    assert first.duration_s == pytest.approx(80 / 8000 + PARAMS.decode_step_s(10))
    second = engine.step()
    assert second.tokens == list(range(10)) and second.first_tokens == []
    assert second.duration_s == pytest.approx(0.0247 + 0.0003 * 10)


def test_prefill_only_step_has_no_decode_cost() -> None:
    engine = BatchingEngineModel(PARAMS)
    engine.add("long", 10_000, 2)
    result = engine.step()
    assert result == StepResult(4096 / 8000)


# -- limits ----------------------------------------------------------------------------


def test_sequence_slots_are_respected() -> None:
    engine = BatchingEngineModel(msgspec.structs.replace(PARAMS, max_sequences=4))
    for i in range(10):
        engine.add(i, 10, 3)
    assert engine.waiting == 10 and engine.running == 0
    assert engine.step().first_tokens == [0, 1, 2, 3]
    assert engine.running == 4 and engine.waiting == 6 and engine.free_sequences == 0
    finished: list[int] = []
    while not engine.idle:
        finished += engine.step().finished
        assert engine.running <= 4
    assert finished == list(range(10))
    assert engine.free_sequences == 4


def test_kv_cache_is_respected() -> None:
    engine = BatchingEngineModel(msgspec.structs.replace(PARAMS, kv_cache_tokens=1000))
    for i in range(5):
        engine.add(i, 300, 100)  # 400 KV tokens each: two fit at once
    engine.step()
    assert engine.running == 2 and engine.free_kv_tokens == 200
    while not engine.idle:
        engine.step()
        assert engine.running <= 2 and engine.free_kv_tokens >= 0
    assert engine.free_kv_tokens == 1000


def test_head_of_queue_is_not_overtaken() -> None:
    engine = BatchingEngineModel(msgspec.structs.replace(PARAMS, kv_cache_tokens=1000))
    engine.add("big-running", 500, 100)
    engine.step()
    engine.add("big-waiting", 400, 100)  # 500 more: does not fit beside the first
    engine.add("small", 10, 10)  # would fit, but must not jump the queue
    engine.step()
    assert engine.running == 1 and engine.waiting == 2


def test_request_larger_than_kv_cache_is_refused() -> None:
    engine = BatchingEngineModel(msgspec.structs.replace(PARAMS, kv_cache_tokens=1000))
    with pytest.raises(ValueError, match="never fit"):
        engine.add("huge", 900, 101)
    engine.add("fits", 900, 100)


def test_chunked_prefill_budget_is_respected() -> None:
    engine = BatchingEngineModel(msgspec.structs.replace(TOKENS_AS_SECONDS, max_batched_tokens=100))
    for i, n in enumerate((250, 30, 45, 120)):
        engine.add(i, n, 2)
    results = run(engine)
    prefilled = [r.duration_s for r in results]
    assert prefilled[:5] == [100, 100, 100, 100, 45]
    assert sum(prefilled) == 445
    # Prefill in admission order; a first token comes in the step the prefill completes.
    firsts = [(step, seq) for step, r in enumerate(results) for seq in r.first_tokens]
    assert firsts == [(2, 0), (2, 1), (3, 2), (4, 3)]


def test_images_are_charged_once_when_prefill_starts() -> None:
    engine = BatchingEngineModel(msgspec.structs.replace(PARAMS, max_batched_tokens=1000))
    engine.add("img", 2500, 1, images=4)
    durations = [r.duration_s for r in run(engine)]
    assert durations[0] == pytest.approx(1000 / 8000 + 4 * 0.05)
    assert durations[1] == pytest.approx(1000 / 8000)
    assert durations[2] == pytest.approx(500 / 8000 + PARAMS.beta)


def test_images_wait_for_their_prefill_chunk() -> None:
    params = msgspec.structs.replace(TOKENS_AS_SECONDS, max_batched_tokens=1000, image_s=1e6)
    engine = BatchingEngineModel(params)
    engine.add("long", 2500, 1)
    engine.add("img", 100, 1, images=4)  # starts prefill only in the third step
    durations = [r.duration_s for r in run(engine)]
    assert durations == [1000, 1000, 500 + 100 + 4e6]


# -- admission order and abort ---------------------------------------------------------


def test_admission_by_priority_then_arrival() -> None:
    engine = BatchingEngineModel(msgspec.structs.replace(PARAMS, max_sequences=1))
    for seq, priority in (("a", 0), ("b", 0), ("c", 5), ("d", -1), ("e", 5)):
        engine.add(seq, 10, 2, priority=priority)
    order = [seq for r in run(engine) for seq in r.first_tokens]
    assert order == ["c", "e", "a", "b", "d"]


def test_abort_running_frees_capacity() -> None:
    engine = BatchingEngineModel(msgspec.structs.replace(PARAMS, max_sequences=1))
    engine.add("a", 10, 1000)
    engine.add("b", 10, 2)
    engine.step()
    assert engine.running == 1 and engine.waiting == 1
    assert engine.abort("a")
    assert engine.free_sequences == 1 and engine.free_kv_tokens == PARAMS.kv_cache_tokens
    results = run(engine)
    assert [r.first_tokens for r in results][0] == ["b"]
    assert all("a" not in r.tokens for r in results)
    assert "a" not in engine


def test_abort_waiting_and_unknown() -> None:
    engine = BatchingEngineModel(msgspec.structs.replace(PARAMS, max_sequences=1))
    engine.add("a", 10, 2)
    engine.add("b", 10, 2)
    assert engine.abort("b")
    assert engine.waiting == 1
    assert not engine.abort("b")
    assert not engine.abort("never-added")
    seen = {seq for r in run(engine) for seq in r.first_tokens + r.tokens + r.finished}
    assert seen == {"a"}


def test_aborted_id_can_be_added_again() -> None:
    engine = BatchingEngineModel(PARAMS)
    engine.add("x", 10, 3)
    engine.step()  # first token; finish scheduled two steps later
    engine.abort("x")
    engine.add("x", 10, 5)
    results = run(engine)
    finished_at = [step for step, r in enumerate(results) if "x" in r.finished]
    assert finished_at == [4]  # a stale finish of the first "x" is ignored


def test_add_rejects_bad_sequences() -> None:
    engine = BatchingEngineModel(PARAMS)
    engine.add("a", 10, 2)
    with pytest.raises(ValueError, match="already"):
        engine.add("a", 10, 2)
    with pytest.raises(ValueError, match="output_tokens"):
        engine.add("b", 10, 0)
    with pytest.raises(ValueError, match="input_tokens"):
        engine.add("b", 0, 1)
    with pytest.raises(ValueError, match="images"):
        engine.add("b", 1, 1, images=-1)


def test_idle_engine_step_is_empty() -> None:
    engine = BatchingEngineModel(PARAMS)
    assert engine.idle
    assert engine.step() == StepResult(0.0)


workloads = st.lists(
    st.tuples(st.integers(1, 300), st.integers(1, 40), st.integers(-2, 2), st.booleans()),
    min_size=1,
    max_size=40,
)


@given(
    workload=workloads,
    max_sequences=st.integers(1, 8),
    budget=st.integers(1, 256),
    kv=st.integers(341, 2000),
    abort_every=st.integers(3, 50),
)
@settings(max_examples=60, deadline=None)
def test_every_sequence_emits_exactly_its_tokens(
    workload: list[tuple[int, int, int, bool]],
    max_sequences: int,
    budget: int,
    kv: int,
    abort_every: int,
) -> None:
    params = msgspec.structs.replace(
        TOKENS_AS_SECONDS,
        max_sequences=max_sequences,
        max_batched_tokens=budget,
        kv_cache_tokens=kv,
    )
    engine = BatchingEngineModel(params)
    for i, (inp, out, priority, _) in enumerate(workload):
        engine.add(i, inp, out, priority=priority)
    to_abort = [i for i, (*_, abort) in enumerate(workload) if abort]
    emitted: Counter[int] = Counter()
    finished: set[int] = set()
    aborted: set[int] = set()
    steps = 0
    while not engine.idle:
        steps += 1
        assert steps < 100_000
        if steps % abort_every == 0 and to_abort:
            seq = to_abort.pop()
            if seq not in finished and engine.abort(seq):
                aborted.add(seq)
        result = engine.step()
        assert result.duration_s <= budget  # prefill tokens within the chunk budget
        assert engine.running <= max_sequences
        assert 0 <= engine.free_kv_tokens <= kv
        for seq in result.first_tokens:
            assert emitted[seq] == 0
        for seq in result.tokens:
            assert emitted[seq] >= 1
        for seq in result.first_tokens + result.tokens:
            emitted[seq] += 1
        for seq in result.finished:
            assert emitted[seq] == workload[seq][1] and seq not in finished
            finished.add(seq)
    assert finished | aborted == set(range(len(workload)))
    assert not finished & aborted
    assert engine.free_kv_tokens == kv and engine.free_sequences == max_sequences


# -- calibration -----------------------------------------------------------------------


def test_calibration_recovers_engine_parameters() -> None:
    points = grid([64, 512, 2048, 8192], [1, 16, 128], images=(0, 1, 3))
    samples = [Sample(i, o, g, alone(i, o, g)[1]) for i, o, g in points]
    fit = fit_profile(samples)
    assert fit.alpha == pytest.approx(PARAMS.alpha, rel=0.01)
    assert fit.beta == pytest.approx(PARAMS.beta, rel=0.01)
    assert fit.gamma == pytest.approx(PARAMS.gamma, rel=0.01)
    assert fit.r2 > 0.999

"""workers.calibrate_runs: the decode step from token timestamps, as vLLM's streams would
give them (staggered admission, merged deltas), and the batch sizes a plan runs."""

from __future__ import annotations

import msgspec
import pytest

from costmodel.engine_model import EngineParams
from costmodel.units import Capacity
from workers.calibrate import Plan
from workers.calibrate_runs import (
    MIN_DECODE_STEPS,
    CalibrationError,
    Requests,
    Shape,
    Trace,
    batch_room,
    measure_decode_step,
    shared_step,
)
from workers.sim_engine import SimEngine

pytestmark = pytest.mark.timeout(30)

STEP = 0.01


def trace(first_at: float, tokens: int, step: float = STEP) -> Trace:
    """A request whose first token comes at `first_at`, then one token per step."""
    return [(first_at + k * step, k + 1) for k in range(tokens)]


def test_one_request_decodes_at_its_token_rate() -> None:
    assert shared_step([trace(0.5, 32)]) == (pytest.approx(STEP), 31)


def test_only_the_window_where_all_decode_counts() -> None:
    # Admitted three steps apart: before the second's first token the first one decoded
    # alone at another step time, and after the first's last token the second does.
    alone = [(k * 0.03, k + 1) for k in range(3)]
    early = alone + [(0.06 + (k - 3) * STEP, k) for k in range(4, 33)]
    late = [(0.06 + k * STEP, k) for k in range(1, 33)]
    late += [(late[-1][0] + k * 0.005, 32 + k) for k in range(1, 10)]
    step, steps = shared_step([early, late])
    assert step == pytest.approx(STEP)
    # From the second's first token to the first's last: the second's tokens 1 to 29.
    assert steps == 28


def test_a_consumer_that_falls_behind_reads_merged_deltas() -> None:
    # It reads tokens 10 to 12 at once, at the time of the 12th.
    tokens = trace(0.0, 40)
    merged = tokens[:9] + tokens[11:]
    step, steps = shared_step([tokens, merged])
    assert step == pytest.approx(STEP)
    assert steps == 39


def test_requests_that_never_decode_together_share_no_steps() -> None:
    assert shared_step([trace(0.0, 20), trace(1.0, 20)])[1] == 0


class Overstated(SimEngine):
    """Claims eight sequence slots but runs one request at a time."""

    @property
    def capacity(self) -> Capacity:
        return msgspec.structs.replace(super().capacity, sequences=8)


async def test_a_batch_the_engine_does_not_run_at_once_fails_the_calibration() -> None:
    async with Overstated(EngineParams(max_sequences=1), time_scale=0.001) as engine:
        with pytest.raises(CalibrationError, match="decoded together for 0 steps"):
            await measure_decode_step(engine, Requests(engine), Shape(16, 16), 4, 0.001)


async def test_a_batch_that_runs_at_once_measures_the_engines_step() -> None:
    params = EngineParams(decode_step_base_s=0.02, decode_step_per_seq_s=0.002)
    async with SimEngine(params, time_scale=0.2) as engine:
        run = await measure_decode_step(engine, Requests(engine), Shape(16, 24), 8, 0.2)
    assert (run.batch, run.shape) == (8, Shape(16, 24))
    assert run.step_s == pytest.approx(params.decode_step_s(8), rel=0.05)
    assert MIN_DECODE_STEPS <= run.steps <= 23


@pytest.mark.parametrize(
    "room, sizes",
    [(1, [1]), (2, [1, 2]), (5, [1, 4, 5]), (8, [1, 4, 8]), (64, [1, 4, 16, 64])],
)
def test_default_batch_sizes_grow_fourfold_up_to_the_engines_room(
    room: int, sizes: list[int]
) -> None:
    assert Plan(inputs=(64, 256)).batch_sizes(room) == sizes


def test_given_batch_sizes_are_capped_at_the_engines_room() -> None:
    plan = Plan(inputs=(64, 256), batches=(64, 1, 8, 32))
    assert plan.batch_sizes(256) == [1, 8, 32, 64]
    assert plan.batch_sizes(16) == [1, 8, 16]
    assert plan.batch_sizes(1) == [1]


def test_the_room_is_the_sequence_slots_or_what_the_kv_cache_holds() -> None:
    engine = SimEngine(EngineParams(max_sequences=64, kv_cache_tokens=4200))
    assert batch_room(engine, Shape(16, 32)) == 64  # 87 fit the KV cache
    assert batch_room(engine, Shape(64, 32)) == 43  # 43 * 96 <= 4200
    with pytest.raises(ValueError, match="does not fit the engine's KV cache of 4200"):
        batch_room(engine, Shape(4096, 200))

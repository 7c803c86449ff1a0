"""Capacity invariance (issue 36): one full replica completes about one engine-second per
second whatever the traffic mix, priced from real usage at the endpoint's occupancy;
today's flat model units do not (`bench.sim.capacity`, quick variant)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.sim.capacity import (
    BOUND,
    LONG_PROMPT,
    MARGIN,
    QUICK,
    Settings,
    engine_profile,
    measure_all,
    shape_records,
)
from broker_config.config import EXAMPLE_ENGINE
from costmodel.engine_model import load_engine_params


@pytest.fixture(scope="module")
def quick() -> dict:
    # Prefill-heavy (KV-bound, ~29 sequences), decode-heavy, mixed, chat sizes (weights)
    # and 2,000-token prompts with 50-token answers; one seed, a 120 s window.
    return measure_all(QUICK, None)


def test_engine_time_per_second_is_the_same_on_every_mix_and_flat_units_are_not(
    quick: dict,
) -> None:
    spread = quick["invariance"]["means"]
    assert spread["engine_mu_per_s"] <= BOUND, spread
    # Today's unit prices a decode token at batch 1: a decode-heavy replica "completes"
    # ten times the model units of a prefill-heavy one. Far above the bound.
    assert spread["flat_mu_per_s"] > 3 * BOUND, spread


def test_the_replica_is_full_and_the_endpoint_prices_what_the_engine_spent(quick: dict) -> None:
    assert quick["invariance"]["full_through_window"]
    for shape, cells in quick["shapes"].items():
        cell = cells["1"]
        assert cell["busy_fraction"] >= 0.99, (shape, cell)
        assert 0.9 <= cell["engine_mu_per_s"] <= 1.1, (shape, cell)
        # The drift reading, priced at the occupancy the endpoint read, is within 2% of
        # the worker's attribution to the same requests; priced at the operating batch
        # (no occupancy reading) prefill-heavy, at ~29 sequences, is ~5% under it.
        assert cell["engine_mu_per_s"] == pytest.approx(cell["attributed_per_s"], rel=0.02), (
            shape,
            cell,
        )
    prefill = quick["shapes"]["prefill-heavy"]["1"]
    assert prefill["mean_emitting_per_step"] < 40, prefill  # KV-bound: below 64 sequences
    assert prefill["engine_op_mu_per_s"] < 0.97 * prefill["attributed_per_s"], prefill


def test_long_prompt_requests_are_2000_tokens_in_and_50_out_and_last_the_window() -> None:
    params = load_engine_params(EXAMPLE_ENGINE)
    records = shape_records(LONG_PROMPT, 1, MARGIN * QUICK.end_s, engine_profile(params), None)
    assert {(r.input_tokens, r.output_tokens) for r in records} == {(2000, 50)}
    assert len({r.tenant for r in records}) == 21
    at_batch = engine_profile(params).model_units(2000, 50)
    assert len(records) * at_batch >= MARGIN * QUICK.end_s


def test_the_azure_shape_is_skipped_and_says_why_without_a_trace(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("FQ_AZURE_TRACE", raising=False)
    summary = measure_all(
        Settings(seeds=(1,), shapes=("azure-conversation",), warmup_s=5.0, measure_s=5.0),
        tmp_path / "absent.csv",
    )
    assert summary["shapes"] == {}
    assert "no such file" in summary["skipped"]["azure-conversation"]

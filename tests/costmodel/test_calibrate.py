"""workers.calibrate and `fairq calibrate`: on the simulated engine, in real time, the fit
recovers the engine's own parameters; on vLLM (marked `vllm`) it calibrates the tiny model."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from broker_config.config import EXAMPLE_CONFIG
from costmodel.engine_model import BatchingEngineModel, EngineParams, load_engine_params
from costmodel.units import load_profile
from producers import cli
from workers.calibrate import CalibrationError, Plan, Shape, calibrate, synthetic_prompt
from workers.engine import Delta, EngineRequest
from workers.sim_engine import SimEngine

VLLM_PRESENT = importlib.util.find_spec("vllm") is not None
if VLLM_PRESENT:
    # The vLLM engine tests' offline environment and tiny model (module-scoped fixtures).
    from tests.workers.test_vllm_engine import model_dir, vllm_env  # noqa: F401

pytestmark = pytest.mark.timeout(60)

ENGINE_TOML = EXAMPLE_CONFIG.parent / "engine.toml"
# The shipped engine, with few sequence slots so the capacity run takes a fraction of a second.
PARAMS = msgspec.structs.replace(load_engine_params(ENGINE_TOML), max_sequences=8)


def batch_seconds(params: EngineParams, shape: Shape, requests: int) -> float:
    """How long `requests` of `shape` submitted together take, by the timing model itself."""
    model = BatchingEngineModel(params)
    for n in range(requests):
        model.add(n, shape.input_tokens, shape.output_tokens, shape.images)
    seconds = 0.0
    while not model.idle:
        seconds += model.step().duration_s
    return seconds


async def test_calibration_recovers_the_simulated_engines_parameters() -> None:
    plan = Plan(inputs=(64, 256, 1024), outputs=(1, 4, 16), images=(0, 2))
    async with SimEngine(PARAMS) as engine:
        result = await calibrate(engine, plan, "sim-7b")
    fit = result.fit
    assert fit.n == len(result.samples) == 18
    assert fit.alpha == pytest.approx(PARAMS.alpha, rel=0.05)
    assert fit.beta == pytest.approx(PARAMS.beta, rel=0.05)
    assert fit.gamma == pytest.approx(PARAMS.gamma, rel=0.05)
    assert fit.r2 > 0.999
    run = result.capacity_run
    assert run is not None
    # The grid's middle shape, as many at once as the engine has sequence slots.
    assert (run.shape, run.requests) == (Shape(256, 4, 0), 8)
    assert run.seconds == pytest.approx(batch_seconds(PARAMS, run.shape, 8), rel=0.05)
    assert run.mu_per_s > 1, "batching should complete more than one model unit per second"
    assert result.profile == fit.to_profile("sim-7b", run.mu_per_s)


def test_the_command_writes_a_loadable_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profiles" / "sim.toml"
    # At time scale 0.5 the engine runs twice as fast; the profile must still be unscaled.
    code = cli.main(
        [
            "calibrate",
            "--engine",
            "sim",
            "--engine-config",
            str(ENGINE_TOML),
            "--inputs",
            "256,1024,4096",
            "--outputs",
            "4,8,16",
            "--time-scale",
            "0.5",
            "--capacity-mu-per-s",
            "12.5",
            "--name",
            "llama-7b-sim",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    profile = load_profile(out)
    assert (profile.name, profile.capacity_mu_per_s, profile.gamma) == ("llama-7b-sim", 12.5, 0)
    assert profile.alpha == pytest.approx(PARAMS.alpha, rel=0.05)
    assert profile.beta == pytest.approx(PARAMS.beta, rel=0.05)
    assert "R^2" in printed and f"wrote {out}" in printed


@pytest.mark.parametrize(
    "args, message",
    [
        (["--repeats", "0"], "repeats must be an integer >= 1"),
        (["--inputs", "0,64"], "input_lengths must be integers >= 1"),
        (["--time-scale", "0"], "time scale must be finite and > 0"),
        (["--capacity-mu-per-s", "-1"], "capacity_mu_per_s must be finite and > 0"),
        (["--capacity-shape", "64"], "--capacity-shape takes IN,OUT or IN,OUT,IMAGES"),
        (["--model", "m"], "--model is for --engine vllm"),
        (["--engine-config", "/nonexistent/engine.toml"], "cannot read"),
        (["--engine", "vllm"], "needs --model DIR"),
        (["--engine", "vllm", "--model", "m", "--time-scale", "0.5"], "--time-scale is for"),
        (["--engine", "vllm", "--model", "m", "--images", "0,1"], "runs text requests only"),
        # Found by the fit, after the engine ran: one grid point cannot separate coefficients.
        (["--inputs", "64", "--outputs", "1"], "at least 3 samples"),
    ],
)
def test_unusable_input_exits_2_without_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "p.toml"
    assert cli.main(["calibrate", *args, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_malformed_length_list_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["calibrate", "--inputs", "64,lots", "--out", "p.toml"])
    assert exited.value.code == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


class Tokenizer:
    """An engine's token count only: BOS plus one token per word, two for `q x z` words."""

    def count_tokens(self, request: EngineRequest) -> int:
        assert request.prompt is not None
        return 1 + sum(2 if word in "qxz" else 1 for word in request.prompt.split())


class EvenTokenizer:
    """Every word is two tokens: an odd count cannot be hit."""

    def count_tokens(self, request: EngineRequest) -> int:
        assert request.prompt is not None
        return 2 * len(request.prompt.split())


class CappedTokenizer:
    """Counts at most 5 tokens, however long the prompt."""

    def count_tokens(self, request: EngineRequest) -> int:
        assert request.prompt is not None
        return min(5, len(request.prompt.split()))


def count(engine: Any, prompt: str) -> int:
    return engine.count_tokens(EngineRequest(id="c", max_tokens=1, prompt=prompt))


# Only count_tokens is used, so bare tokenizers stand in for engines.
@pytest.mark.parametrize("engine", [SimEngine(), Tokenizer()], ids=["sim", "bos-and-pairs"])
def test_synthetic_prompts_have_exactly_the_asked_for_tokens(engine: Any) -> None:
    for tokens in (2, 3, 7, 64, 1000):
        assert count(engine, synthetic_prompt(engine, tokens, seed=tokens)) == tokens
    # Different requests share no prefix (a prefix cache would shorten their prefill).
    openings = {tuple(synthetic_prompt(engine, 64, seed=n).split()[:8]) for n in range(20)}
    assert len(openings) == 20


@pytest.mark.parametrize(
    "engine, possible, impossible",
    [(EvenTokenizer(), 8, 7), (CappedTokenizer(), 5, 6)],
    ids=["skips-odd-counts", "stops-growing"],
)
def test_a_count_the_tokenizer_cannot_hit_is_an_error(
    engine: Any, possible: int, impossible: int
) -> None:
    assert count(engine, synthetic_prompt(engine, possible)) == possible
    with pytest.raises(ValueError, match=f"exactly {impossible} input tokens"):
        synthetic_prompt(engine, impossible)


class StopsEarly(SimEngine):
    """Ends every request after one token, as vLLM would at EOS without ignore_eos."""

    def generate(self, request: EngineRequest) -> AsyncIterator[Delta]:
        return super().generate(dataclasses.replace(request, target_output_tokens=1))


async def test_an_engine_that_cuts_outputs_short_fails_the_calibration() -> None:
    plan = Plan(inputs=(64, 128, 256), outputs=(2, 3, 4), capacity_mu_per_s=1.0)
    async with StopsEarly(PARAMS, time_scale=0) as engine:
        with pytest.raises(
            CalibrationError,
            match="asked for 64 input and 2 output tokens, the engine ran 64 and 1",
        ):
            await calibrate(engine, plan, "x")


def require_vllm() -> None:
    """The vLLM tests' policy: skipped where vllm is missing, a failure in CI with FQ_VLLM=1."""
    if VLLM_PRESENT:
        return
    why = "vllm is not installed here: run this test with the python of .ci/vllm-env.sh"
    if os.environ.get("CI") == "true" and os.environ.get("FQ_VLLM") == "1":
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_the_command_calibrates_the_tiny_model_on_vllm(
    request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_vllm()
    model: Path = request.getfixturevalue("model_dir")
    config = tmp_path / "engine.toml"
    config.write_text("max_num_seqs = 4\nmax_model_len = 2048\nkv_cache_bytes = 67108864\n")
    out = tmp_path / "tiny.toml"
    code = cli.main(
        [
            "calibrate",
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--engine-config",
            str(config),
            "--outputs",
            "8,32,64",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    profile = load_profile(out)
    assert profile.name == model.name
    # Decoding a token costs a whole engine step; prefilling one is a share of a step.
    assert 0 < profile.alpha < profile.beta
    with capsys.disabled():
        report = [
            line
            for line in printed.splitlines()
            if line.startswith(("alpha", "beta", "R^2", "capacity"))
        ]
        print("\nfairq calibrate on the tiny model:", *report, sep="\n  ")

"""workers.calibrate and `fairq calibrate`: on the simulated engine, in real time, the fit
recovers the engine's own parameters; on vLLM (marked `vllm`) it calibrates the tiny model."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from broker_config.config import EXAMPLE_CONFIG
from costmodel.engine_model import BatchingEngineModel, EngineParams, load_engine_params
from costmodel.units import load_profile
from producers import cli
from workers.calibrate import Plan, calibrate
from workers.calibrate_runs import CalibrationError, Shape, synthetic_prompt
from workers.engine import Delta, EngineRequest
from workers.sim_engine import SimEngine

VLLM_PRESENT = importlib.util.find_spec("vllm") is not None
if VLLM_PRESENT:
    # The vLLM engine tests' offline environment and tiny model (module-scoped fixtures).
    from tests.workers.test_vllm_engine import model_dir, vllm_env  # noqa: F401

pytestmark = pytest.mark.timeout(60)

ENGINE_TOML = EXAMPLE_CONFIG.parent / "engine.toml"
# The shipped engine: 64 sequence slots, which the decode curve's slope needs to show.
PARAMS = load_engine_params(ENGINE_TOML)
# Another engine, whose KV cache holds fewer capacity-run requests than it has slots.
OTHER = EngineParams(
    max_sequences=64,
    kv_cache_tokens=4200,
    prefill_tokens_per_s=4000.0,
    decode_step_base_s=0.04,
    decode_step_per_seq_s=0.001,
    image_s=0.1,
)
# Steps last a fifth of their modelled time: a test takes about two seconds.
TIME_SCALE = 0.2


def batch_seconds(params: EngineParams, shape: Shape, requests: int) -> float:
    """How long `requests` of `shape` submitted together take, by the timing model itself."""
    model = BatchingEngineModel(params)
    for n in range(requests):
        model.add(n, shape.input_tokens, shape.output_tokens, shape.images)
    seconds = 0.0
    while not model.idle:
        seconds += model.step().duration_s
    return seconds


@pytest.mark.parametrize(
    "params, inputs, images, room",
    [
        (PARAMS, (256, 1024, 4096), 8, 64),
        # 4200 KV tokens hold 43 requests of 64 + 32 tokens.
        (OTHER, (128, 512, 2048), 4, 43),
    ],
    ids=["shipped", "other"],
)
async def test_calibration_recovers_the_simulated_engines_parameters(
    params: EngineParams, inputs: tuple[int, ...], images: int, room: int
) -> None:
    capacity_shape = Shape(64, 32)
    # Prefill and images take about half a second more at the longest input and with
    # images, and each point runs twice, the faster counting: a busy test machine then
    # rarely moves a figure by a percent.
    plan = Plan(
        inputs=inputs,
        images=(0, images),
        repeats=2,
        time_scale=TIME_SCALE,
        capacity_shape=capacity_shape,
    )
    async with SimEngine(params, time_scale=TIME_SCALE) as engine:
        result = await calibrate(engine, plan, "sim-7b")
    fit, curve, profile = result.fit, result.curve, result.profile
    assert fit.n == len(result.samples) == 6  # the faster of each point's two runs
    assert fit.alpha == pytest.approx(params.alpha, rel=0.05)
    assert fit.gamma == pytest.approx(params.gamma, rel=0.05)
    # Batch sizes 1, 4, 16 and the decode shape's room, 64 sequence slots in both.
    assert [run.batch for run in result.decode_runs] == [1, 4, 16, 64]
    assert curve.base_s == pytest.approx(params.decode_step_base_s, rel=0.05)
    assert curve.per_seq_s == pytest.approx(params.decode_step_per_seq_s, rel=0.05)
    assert curve.r2 > 0.999 and curve.max_residual < 0.02
    assert profile.operating_batch == room
    run = result.capacity_run
    assert run is not None
    assert (run.shape, run.requests) == (capacity_shape, room)
    assert run.seconds == pytest.approx(batch_seconds(params, capacity_shape, room), rel=0.05)
    # A model unit is an engine-second at the operating point: a full replica completes
    # about one per second.
    assert 0.9 < run.mu_per_s < 1.1
    assert profile == fit.to_profile("sim-7b", run.mu_per_s, curve, room)


def test_the_command_writes_a_loadable_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profiles" / "sim.toml"
    # At time scale 0.25 the engine runs four times as fast; the profile must still be
    # unscaled.
    code = cli.main(
        [
            "calibrate",
            "--engine",
            "sim",
            "--engine-config",
            str(ENGINE_TOML),
            "--inputs",
            "256,1024,4096",
            # 100 is more than the engine's 64 sequence slots: it runs at 64.
            "--batches",
            "1,8,100",
            # Three runs a point, the fastest counting: one slowed step on a busy CI
            # host bent the decode slope 10% with two.
            "--repeats",
            "3",
            "--time-scale",
            "0.25",
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
    assert profile.operating_batch == PARAMS.max_sequences
    assert profile.alpha == pytest.approx(PARAMS.alpha, rel=0.05)
    assert profile.decode_base_s == pytest.approx(PARAMS.decode_step_base_s, rel=0.05)
    assert profile.decode_per_seq_s == pytest.approx(PARAMS.decode_step_per_seq_s, rel=0.05)
    assert profile.beta == pytest.approx(PARAMS.beta, rel=0.05)
    assert "R^2" in printed and f"wrote {out}" in printed
    measured = re.findall(r"^  n = +(\d+): ", printed, re.MULTILINE)
    assert measured == ["1", "8", "64"]


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
        (["--batches", "8"], "batches must be 2 or more different integers >= 1"),
        (["--batches", "0,8"], "batches must be 2 or more different integers >= 1"),
        (["--decode-shape", "16"], "--decode-shape takes IN,OUT"),
        (["--decode-shape", "16,8"], "the decode shape needs at least 16 output tokens"),
        # Found by the fit, after the engine ran: one input length cannot separate alpha
        # from the per-request constant.
        (["--inputs", "64"], "at least 3 samples"),
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
    # The prefill runs ask for one token; the decode runs are the first to be cut short.
    plan = Plan(inputs=(64, 128, 256), capacity_mu_per_s=1.0)
    async with StopsEarly(PARAMS, time_scale=0) as engine:
        with pytest.raises(
            CalibrationError,
            match="asked for 16 input and 32 output tokens, the engine ran 16 and 1",
        ):
            await calibrate(engine, plan, "x")


def test_an_engine_with_room_for_one_decode_request_cannot_fit_the_curve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "engine.toml"
    config.write_text("max_sequences = 1\n")
    out = tmp_path / "p.toml"
    code = cli.main(["calibrate", "--engine-config", str(config), "--out", str(out)])
    assert code == 2
    assert "the decode curve needs two batch sizes" in capsys.readouterr().err
    assert not out.exists()


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
    config.write_text("max_num_seqs = 8\nmax_model_len = 2048\nkv_cache_bytes = 67108864\n")
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
            "--decode-shape",
            "16,64",
            # The faster of two: prefill slopes on a CPU are small beside its noise.
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    profile = load_profile(out)
    assert profile.name == model.name
    # Decode batches of 1, 4 and the engine's 8 slots; 8 requests of the capacity shape
    # fit its KV cache of 32768 tokens.
    assert re.findall(r"^  n = +(\d+): ", printed, re.MULTILINE) == ["1", "4", "8"]
    assert profile.operating_batch == 8
    assert profile.decode_base_s is not None and profile.decode_per_seq_s is not None
    assert profile.decode_base_s > 0 and profile.decode_per_seq_s >= 0
    # Batching amortises a step's fixed cost: a token at batch 8 costs less than alone.
    assert profile.decode_token_s(8) < profile.decode_token_s(1)
    # Decoding a token alone costs a whole engine step; prefilling one is a share of a step.
    assert 0 < profile.alpha < profile.beta
    # The steps lie near a line: no measured step is more than a quarter off the fit.
    residual = re.search(r"largest residual ([\d.]+)% of a measured step", printed)
    assert residual is not None and float(residual.group(1)) < 25
    # Priced at the operating batch, a full replica completes about an engine-second per
    # second (loosely: on a CPU, overheads weigh a lot beside a tiny model's steps).
    assert 0.25 < profile.capacity_mu_per_s < 4
    with capsys.disabled():
        report = [
            line
            for line in printed.splitlines()
            if line.startswith(("alpha", "decode", "  n =", "R^2", "capacity"))
        ]
        print("\nfairq calibrate on the tiny model:", *report, sep="\n  ")

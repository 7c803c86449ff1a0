"""Model units: engine-seconds of one replica of a model at its operating point.

    model_units = alpha * input_tokens            (prefill; cached tokens discounted)
                + decode_token_s(n) * output_tokens
                + gamma * other                   (images)

A decode step of n sequences costs `decode_base_s + decode_per_seq_s * n` and each of
the n sequences that emits a token in it pays an equal share, so a decode token costs
`decode_base_s / n + decode_per_seq_s` at occupancy n. Prefill does not batch: a prompt
token costs `alpha` at any occupancy. Priced at the occupancy a full replica runs at
(`operating_batch`), one model unit is one engine-second, and a replica completes about
one per second whatever the traffic mix (`capacity_mu_per_s`, measured by `calibrate`).
Pricing a decode token at batch 1 instead overstates it by the batch size next to
prefill (docs/architecture.md, "The cost unit").

Profiles from before the curve give `beta`, a decode token's batch-1 price: they keep
working and price a decode token at `beta` at every occupancy (curve base 0).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TypeVar

import msgspec

T = TypeVar("T")

# How close a given `beta` must be to the curve's batch-1 price when both are given.
_BETA_TOLERANCE = 1e-6


class ModelProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Cost coefficients of one model on one hardware profile."""

    name: str = "default"
    # Seconds per prefilled input token (prefill does not batch).
    alpha: float = 1.0
    # Seconds per output token at batch 1. Derived from the curve when the curve is
    # given; alone (old profiles), a decode token costs it at every occupancy.
    beta: float | None = None
    # The batched decode curve: a step of n sequences costs base + per_seq * n.
    decode_base_s: float | None = None
    decode_per_seq_s: float | None = None
    # Sequences a full replica decodes at once: the occupancy work is priced at where no
    # worker says what it runs (admission, the autoscaler, drift, queued work).
    operating_batch: int = 1
    # Seconds per image (vision encoding).
    gamma: float = 0.0
    # Replica throughput in model units per second, for routing and autoscaling.
    capacity_mu_per_s: float = 1.0
    # Fraction of a cached input token's cost that is still charged (1.0 = no discount).
    cached_input_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "alpha",
            "beta",
            "decode_base_s",
            "decode_per_seq_s",
            "gamma",
            "capacity_mu_per_s",
            "cached_input_factor",
        ):
            value = getattr(self, name)
            # `not value >= 0` also catches NaN, which compares false with everything;
            # a form not given (None) is settled from the other below.
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(
                    f"profile {self.name!r}: {name} must be finite and >= 0, got {value!r}"
                )
        if self.capacity_mu_per_s == 0:
            raise ValueError(f"profile {self.name!r}: capacity_mu_per_s must be > 0")
        self._settle_curve()
        if self.operating_batch < 1:
            raise ValueError(
                f"profile {self.name!r}: operating_batch must be >= 1, got {self.operating_batch!r}"
            )
        if self.cached_input_factor > 1:
            raise ValueError(
                f"profile {self.name!r}: cached_input_factor must be <= 1 "
                f"(a discount), got {self.cached_input_factor!r}"
            )

    def _settle_curve(self) -> None:
        """Fill in the form not given: beta from the curve, or the flat curve of beta."""
        base, per_seq = self.decode_base_s, self.decode_per_seq_s
        if (base is None) != (per_seq is None):
            missing = "decode_per_seq_s" if per_seq is None else "decode_base_s"
            raise ValueError(
                f"profile {self.name!r}: the decode curve needs {missing} too "
                "(`fairq calibrate` fits both)"
            )
        if base is None or per_seq is None:
            beta = 1.0 if self.beta is None else self.beta
            msgspec.structs.force_setattr(self, "beta", beta)
            msgspec.structs.force_setattr(self, "decode_base_s", 0.0)
            msgspec.structs.force_setattr(self, "decode_per_seq_s", beta)
            return
        batch_1 = base + per_seq
        if self.beta is not None and not math.isclose(
            self.beta, batch_1, rel_tol=_BETA_TOLERANCE, abs_tol=1e-12
        ):
            raise ValueError(
                f"profile {self.name!r}: beta {self.beta!r} is not the curve's batch-1 "
                f"price decode_base_s + decode_per_seq_s = {batch_1!r}; give one or the other"
            )
        msgspec.structs.force_setattr(self, "beta", batch_1)

    @property
    def batched(self) -> bool:
        """Does the profile price decode by the batch (a curve), or at batch 1 (flat)?"""
        return self.decode_base_s > 0  # type: ignore[operator]

    def decode_token_s(self, occupancy: float | None = None) -> float:
        """Engine-seconds of one output token at `occupancy` sequences decoding together
        (the operating batch if None)."""
        batch = self.operating_batch if occupancy is None else max(occupancy, 1.0)
        return self.decode_base_s / batch + self.decode_per_seq_s  # type: ignore[operator]

    def model_units(
        self,
        input_tokens: float,
        output_tokens: float,
        other: float = 0.0,
        cached_input_tokens: float = 0.0,
        occupancy: float | None = None,
    ) -> float:
        """Cost of one request at `occupancy` (the operating batch if None); cached input
        tokens are charged at `cached_input_factor`."""
        cached = min(max(cached_input_tokens, 0.0), input_tokens)
        effective_input = input_tokens - cached + cached * self.cached_input_factor
        return (
            self.alpha * effective_input
            + self.decode_token_s(occupancy) * output_tokens
            + self.gamma * other
        )


class Capacity(msgspec.Struct, frozen=True):
    """Room on a worker in the three dimensions a batch can run out of: sequences, KV-cache
    tokens (input plus output over all running sequences) and model units.

    One definition for the engine's limits, the heartbeat on the wire and the scheduler's
    batch room.
    """

    sequences: int
    tokens: int
    model_units: float

    def fits(self, need: Capacity) -> bool:
        return (
            need.sequences <= self.sequences
            and need.tokens <= self.tokens
            and need.model_units <= self.model_units
        )

    def minus(self, used: Capacity) -> Capacity:
        return Capacity(
            self.sequences - used.sequences,
            self.tokens - used.tokens,
            self.model_units - used.model_units,
        )

    def scaled(self, factor: float) -> Capacity:
        return Capacity(
            round(self.sequences * factor),
            round(self.tokens * factor),
            self.model_units * factor,
        )


NO_CAPACITY = Capacity(0, 0, 0.0)
# An engine's model-unit limit when nothing measured one: model units never bind.
UNLIMITED_MODEL_UNITS = 1e9


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a request really consumed, as the worker measured it.

    The `usage` of a done event (wire contract) and what the scheduler corrects its
    charge with. `other_units` (images and the like), `cached_input_tokens` (input
    tokens the engine's prefix cache held) and `engine_s` are absent on the wire when
    zero.
    """

    input_tokens: int
    output_tokens: int
    model_units: float
    other_units: float = 0.0
    cached_input_tokens: int = 0
    # Engine-seconds the worker attributed to the request while it ran (its prefill,
    # images and share of each decode step); 0 where the worker did not measure it.
    engine_s: float = 0.0

    def __post_init__(self) -> None:
        # A NaN or negative count from a faulty worker would corrupt every running sum
        # it enters (deficits, served cost, the drift reading) for good.
        if not (
            min(self.input_tokens, self.output_tokens, self.cached_input_tokens) >= 0
            and 0 <= self.model_units < math.inf
            and 0 <= self.other_units < math.inf
            and 0 <= self.engine_s < math.inf
        ):
            raise ValueError(f"usage counts must be finite and >= 0, got {self!r}")


def read_toml(path: str | Path, type_: type[T]) -> T:
    """Decode a TOML file into `type_`; every failure is a ValueError naming the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        return msgspec.toml.decode(data, type=type_)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


# Characters per token of the rough count used where no tokenizer is at hand (admission
# before the worker's engine has counted, and the simulated engine).
CHARS_PER_TOKEN = 4


def approx_tokens(text: str) -> int:
    """A tokenizer-free token count: one per CHARS_PER_TOKEN characters, at least 1."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def load_profile(path: str | Path) -> ModelProfile:
    """Read a profile TOML (the format `dump_profile` and `fairq calibrate` write)."""
    return read_toml(path, ModelProfile)


def dump_profile(profile: ModelProfile, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.toml.encode(profile))

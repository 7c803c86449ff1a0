"""Model units: the cost of a request on one replica of a model, per hardware profile.

model_units = alpha * input_tokens + beta * output_tokens + gamma * other

With coefficients fitted by `calibrate` in seconds of a replica at batch size 1, one
model unit is one replica-second of work; `capacity_mu_per_s` says how many of those a
replica completes per second once batching overlaps requests.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TypeVar

import msgspec

T = TypeVar("T")


class ModelProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Cost coefficients of one model on one hardware profile."""

    name: str = "default"
    alpha: float = 1.0
    beta: float = 1.0
    gamma: float = 0.0
    # Replica throughput in model units per second, for routing and autoscaling.
    capacity_mu_per_s: float = 1.0
    # Fraction of a cached input token's cost that is still charged (1.0 = no discount).
    cached_input_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "capacity_mu_per_s", "cached_input_factor"):
            value = getattr(self, name)
            # `not value >= 0` also catches NaN, which compares false with everything.
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(
                    f"profile {self.name!r}: {name} must be finite and >= 0, got {value!r}"
                )
        if self.capacity_mu_per_s == 0:
            raise ValueError(f"profile {self.name!r}: capacity_mu_per_s must be > 0")
        if self.cached_input_factor > 1:
            raise ValueError(
                f"profile {self.name!r}: cached_input_factor must be <= 1 "
                f"(a discount), got {self.cached_input_factor!r}"
            )

    def model_units(
        self,
        input_tokens: float,
        output_tokens: float,
        other: float = 0.0,
        cached_input_tokens: float = 0.0,
    ) -> float:
        """Cost of one request; cached input tokens are charged at `cached_input_factor`."""
        cached = min(max(cached_input_tokens, 0.0), input_tokens)
        effective_input = input_tokens - cached + cached * self.cached_input_factor
        return self.alpha * effective_input + self.beta * output_tokens + self.gamma * other


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
    charge with. `other_units` (images and the like) and `cached_input_tokens` (input
    tokens the engine's prefix cache held) are absent on the wire when zero.
    """

    input_tokens: int
    output_tokens: int
    model_units: float
    other_units: float = 0.0
    cached_input_tokens: int = 0

    def __post_init__(self) -> None:
        # A NaN or negative count from a faulty worker would corrupt every running sum
        # it enters (deficits, served cost, the drift reading) for good.
        if not (
            min(self.input_tokens, self.output_tokens, self.cached_input_tokens) >= 0
            and 0 <= self.model_units < math.inf
            and 0 <= self.other_units < math.inf
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

"""Model units: the cost of a request on one replica of a model, per hardware profile.

model_units = alpha * input_tokens + beta * output_tokens + gamma * other

With coefficients fitted by `calibrate` in seconds of a replica at batch size 1, one
model unit is one replica-second of work; `capacity_mu_per_s` says how many of those a
replica completes per second once batching overlaps requests.
"""

from __future__ import annotations

from pathlib import Path

import msgspec


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
            if getattr(self, name) < 0:
                raise ValueError(f"profile {self.name!r}: {name} must be >= 0")
        if self.capacity_mu_per_s <= 0:
            raise ValueError(f"profile {self.name!r}: capacity_mu_per_s must be > 0")

    def model_units(
        self,
        input_tokens: float,
        output_tokens: float,
        other: float = 0.0,
        cached_input_tokens: float = 0.0,
    ) -> float:
        """Cost of one request; cached input tokens are charged at `cached_input_factor`."""
        cached = min(cached_input_tokens, input_tokens)
        effective_input = input_tokens - cached + cached * self.cached_input_factor
        return self.alpha * effective_input + self.beta * output_tokens + self.gamma * other


def load_profile(path: str | Path) -> ModelProfile:
    """Read a profile TOML (the format `dump_profile` and `fairq calibrate` write)."""
    data = Path(path).read_bytes()
    try:
        return msgspec.toml.decode(data, type=ModelProfile)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def dump_profile(profile: ModelProfile, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.toml.encode(profile))

"""Builders shared by the scheduling-core tests."""

from __future__ import annotations

from broker_config.config import Config, parse_config
from costmodel.units import Capacity
from dispatcher.core.types import Request

ONE_SLOT = Capacity(1, 10**9, 1e12)


def make_config(
    *,
    cost: str = "token",
    reserve: float = 0.0,
    tenants: dict[str, tuple[str, float]] | None = None,
    tiers: tuple[str, ...] = ("gold", "silver", "bronze"),
    limits: str = "",
    latency_target_s: float = 1e9,
    sequences: int = 64,
    tokens: int = 10**9,
) -> Config:
    """A one-endpoint (`ep`) config; `tenants` maps name -> (tier, weight)."""
    tenants = tenants or {"a": ("gold", 1.0), "b": ("gold", 1.0)}
    lines = [
        "[profiles.p]",
        "alpha = 1.0",
        "beta = 2.0",
        "gamma = 0.0",
        "[endpoints.ep]",
        # Token mode charges input alone: only an endpoint that generates nothing has it.
        f'kind = "{"embed" if cost == "token" else "generate"}"',
        'profile = "p"',
        f'cost = "{cost}"',
        f"latency_target_s = {latency_target_s}",
        "max_tokens_cap = 100000",
        f"newcomer_reserve = {reserve}",
        f"batch = {{ sequences = {sequences}, tokens = {tokens}, model_units = 1e12 }}",
    ]
    for tier in tiers:
        lines += ["[[tiers]]", f'name = "{tier}"']
        if limits:
            lines.append(f"limits = {{ {limits} }}")
    for name, (tier, weight) in tenants.items():
        lines += [f"[tenants.{name}]", f'tier = "{tier}"', f"weight = {weight}"]
    return parse_config("\n".join(lines), source="test.toml")


def req(
    tenant: str,
    rid: str | int,
    *,
    arrival: float = 0.0,
    input_tokens: int = 10,
    max_tokens: int = 10,
    priority: int = 0,
    deadline: float | None = None,
    endpoint: str = "ep",
) -> Request:
    return Request(
        str(rid),
        tenant,
        endpoint,
        arrival,
        input_tokens,
        max_tokens,
        priority=priority,
        deadline=deadline,
    )

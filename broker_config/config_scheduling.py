"""The scheduling core's sections of the config: endpoints, tiers, tenants, their limits.

`[endpoints.<name>]`, `[[tiers]]`, `[tenants.<name>]` and `[unlisted_tenants]`, each
default written once, on its field. tenant_registry.py resolves them per tenant.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from broker_config.config_types import Name, Positive, PositiveInt
from costmodel.capacity import ScalingPolicy
from costmodel.units import UNLIMITED_MODEL_UNITS

CostMode = Literal["request", "token", "model_units"]


class Limits(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Per tenant and endpoint. Absent fields inherit; absent everywhere means unlimited.

    Token counts for `tpm` and `monthly_quota_tokens` are input tokens plus the
    request's max_tokens at admission (input counted by the endpoint's tokenizer when it
    has one, else as declared); on completion both are settled at the engine's real
    usage: what the request did not use is given back, what it used beyond the charge
    (an under-declared input) is charged on top, even past the limit.
    """

    rpm: Positive | None = None
    rpm_burst: PositiveInt | None = None
    tpm: Positive | None = None
    tpm_burst: PositiveInt | None = None
    monthly_quota_tokens: PositiveInt | None = None
    max_queued: PositiveInt | None = None

    def merged_over(self, base: Limits) -> Limits:
        """These limits, with every unset field taken from `base`."""
        values = {
            f: getattr(self, f) if getattr(self, f) is not None else getattr(base, f)
            for f in self.__struct_fields__
        }
        return Limits(**values)


class BatchCapacity(msgspec.Struct, forbid_unknown_fields=True):
    """A worker's default capacity for an endpoint, until its heartbeats say otherwise."""

    sequences: PositiveInt = 64
    tokens: PositiveInt = 262_144
    model_units: Positive = UNLIMITED_MODEL_UNITS


EndpointKind = Literal["generate", "embed"]


class Endpoint(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    # "embed": its workers pool each input into a vector (the done event's `embedding`)
    # and generate no text.
    kind: EndpointKind = "generate"
    profile: str = "default"
    # A profile TOML as `fairq calibrate --out` writes it, relative to the config file;
    # instead of `profile` (dispatcher and workers read the same file).
    profile_file: str | None = None
    # A Hugging Face `tokenizer.json` (relative to the config file): the dispatcher counts
    # each request's input tokens with it instead of trusting the declared count.
    tokenizer: str | None = None
    cost: CostMode = "request"
    quantum: Positive = 1.0
    latency_target_s: Positive = 30.0
    max_tokens_cap: PositiveInt = 4096
    batch: BatchCapacity = msgspec.field(default_factory=BatchCapacity)
    # Share of each worker's capacity that only tenants below their fair share may use,
    # so a newcomer never waits for a flooding tenant's sequences to finish.
    newcomer_reserve: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.03
    # Lent out while every present tenant is backlogged and none came or went this long.
    newcomer_window_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    # Routing (dispatcher/core/placement.py): a request's session, else its prompt's
    # first block of this many tokens, keeps it on one worker while that worker stays
    # within affinity_load_bound x its share of the endpoint's load; `affinity = false`
    # sends every request to the least utilised worker.
    affinity: bool = True
    affinity_block_tokens: PositiveInt = 128
    affinity_load_bound: Annotated[float, msgspec.Meta(gt=1)] = 1.25
    # Autoscaling of its workers on model-unit utilisation (costmodel/capacity.py).
    autoscale: ScalingPolicy | None = None


# omit_defaults: written back as TOML (bench/harness/stack.py), which has no null for an
# unset field.
class Tier(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: Name
    weight: Positive = 1.0
    limits: Limits = msgspec.field(default_factory=Limits)
    endpoint_limits: dict[Name, Limits] = msgspec.field(default_factory=dict)
    # Input plus output tokens a tenant may use per calendar month (UTC) on all endpoints
    # together, besides any per-endpoint `monthly_quota_tokens`.
    monthly_quota_tokens: PositiveInt | None = None


class Tenant(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    tier: Name
    weight: Positive | None = None
    limits: dict[Name, Limits] = msgspec.field(default_factory=dict)
    # Across endpoints; overrides its tier's.
    monthly_quota_tokens: PositiveInt | None = None


class UnlistedTenants(msgspec.Struct, forbid_unknown_fields=True):
    policy: Literal["reject", "admit"] = "reject"
    tier: Name | None = None
    weight: Positive = 1.0

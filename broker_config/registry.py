"""The tenant registry: each tenant's tier, weight and limits, resolved once from the
configuration (never from a request)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from broker_config.config import Config, Limits
from costmodel.units import ModelProfile


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """What the registry says about one tenant: resolved once, used on every request."""

    name: str
    tier: str
    tier_rank: int  # 0 is the highest tier
    weight: float
    limits: dict[str, Limits]  # per endpoint, fully merged
    monthly_quota_tokens: int | None = None  # across endpoints

    def limits_for(self, endpoint: str) -> Limits:
        return self.limits[endpoint]


class Registry:
    """Server-side tenant registry: tier, weight and limits come from here, never a request."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.tier_rank = {tier.name: rank for rank, tier in enumerate(config.tiers)}
        self._tiers = {tier.name: tier for tier in config.tiers}
        self._policies = {
            name: self._resolve(name, t.tier, t.weight, t.limits, t.monthly_quota_tokens)
            for name, t in config.tenants.items()
        }
        unlisted = config.unlisted_tenants
        # Unlisted tenants differ only by name: resolved once, not kept per name (there
        # is no bound on the names that reach admission).
        self._unlisted = (
            None
            if unlisted.policy == "reject"
            else self._resolve("", unlisted.tier, unlisted.weight, {})
        )

    def profile(self, endpoint: str) -> ModelProfile:
        name = self.config.endpoints[endpoint].profile
        return self.config.profiles.get(name) or ModelProfile(name=name)

    def tenant(self, name: str) -> TenantPolicy | None:
        """The tenant's policy; None when it is unlisted and unlisted tenants are rejected."""
        policy = self._policies.get(name)
        if policy is not None or self._unlisted is None:
            return policy
        return replace(self._unlisted, name=name)

    def _resolve(
        self,
        name: str,
        tier_name: str,
        weight: float | None,
        own: dict[str, Limits],
        quota: int | None = None,
    ) -> TenantPolicy:
        tier = self._tiers[tier_name]
        limits = {}
        for endpoint in self.config.endpoints:
            merged = tier.limits
            if endpoint in tier.endpoint_limits:
                merged = tier.endpoint_limits[endpoint].merged_over(merged)
            if endpoint in own:
                merged = own[endpoint].merged_over(merged)
            limits[endpoint] = merged
        return TenantPolicy(
            name,
            tier_name,
            self.tier_rank[tier_name],
            weight if weight is not None else tier.weight,
            limits,
            quota if quota is not None else tier.monthly_quota_tokens,
        )

"""The fairq configuration: one TOML file parsed into typed, validated structures.

Every part reads its settings from here: the scheduling core (endpoints, tiers,
tenants, profiles: config_scheduling.py), the broker (`[broker]`), the dispatcher
service (`[dispatcher]`), the workers (`[workers]`) and the HTTP front (`[front]`), whose
sections are in config_services.py. This module holds the root, loads the file and
checks what no single field can: references between sections.

Errors name the file, the field (as a path such as `tenants.acme.weight`) and the bad
value, so a typo in production config is found from the message alone.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec

from broker_config.config_errors import describe_validation_error
from broker_config.config_scheduling import Endpoint, Tenant, Tier, UnlistedTenants
from broker_config.config_services import (
    BrokerSettings,
    DispatcherOptions,
    FrontOptions,
    WorkerOptions,
)
from broker_config.config_types import Name
from broker_config.subjects import Subjects
from costmodel.units import ModelProfile, load_profile

EXAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "example.toml"
# The simulated engine's timing (a costmodel.engine_model.EngineParams TOML).
EXAMPLE_ENGINE = EXAMPLE_CONFIG.parent / "engine.toml"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class ConfigError(ValueError):
    """A configuration file that cannot be used, with the file, field and value named."""


class Config(msgspec.Struct, forbid_unknown_fields=True):
    endpoints: dict[Name, Endpoint]
    tiers: list[Tier]
    profiles: dict[Name, ModelProfile] = msgspec.field(default_factory=dict)
    tenants: dict[Name, Tenant] = msgspec.field(default_factory=dict)
    unlisted_tenants: UnlistedTenants = msgspec.field(default_factory=UnlistedTenants)
    broker: BrokerSettings = msgspec.field(default_factory=BrokerSettings)
    dispatcher: DispatcherOptions = msgspec.field(default_factory=DispatcherOptions)
    workers: WorkerOptions = msgspec.field(default_factory=WorkerOptions)
    front: FrontOptions = msgspec.field(default_factory=FrontOptions)

    @property
    def subjects(self) -> Subjects:
        return self.broker.subjects


def load_config(path: str | Path = EXAMPLE_CONFIG) -> Config:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
    return parse_config(raw, source=str(path), base_dir=path.parent)


def parse_config(
    raw: bytes | str, source: str = "<config>", base_dir: Path | None = None
) -> Config:
    """`base_dir`: where relative `profile_file`s are (default: the working directory)."""
    try:
        document = msgspec.toml.decode(raw)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    try:
        config = msgspec.convert(document, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(describe_validation_error(source, document, exc, Config)) from exc
    except ValueError as exc:  # raised by __post_init__ checks, e.g. in ModelProfile
        raise ConfigError(f"{source}: {exc}") from exc
    config = _with_profile_files(config, source, base_dir or Path.cwd())
    config = _with_tokenizer_paths(config, base_dir or Path.cwd())
    _check_references(config, source)
    return config


def _with_profile_files(config: Config, source: str, base_dir: Path) -> Config:
    """Each endpoint's `profile_file` read and registered under the profile's own name,
    which the endpoint then uses."""
    profiles, endpoints = dict(config.profiles), dict(config.endpoints)
    for name, spec in config.endpoints.items():
        if spec.profile_file is None:
            continue
        field = f"endpoints.{name}.profile_file"
        if spec.profile != "default":
            raise ConfigError(
                f"{source}: field `{field}`: set `profile` or `profile_file`, "
                f"not both (value: {spec.profile_file!r})"
            )
        try:
            profile = load_profile(base_dir / spec.profile_file)
        except ValueError as exc:
            raise ConfigError(f"{source}: field `{field}`: {exc}") from exc
        if profiles.get(profile.name, profile) != profile:
            raise ConfigError(
                f"{source}: field `{field}`: its profile {profile.name!r} "
                "differs from the one of that name already defined"
            )
        profiles[profile.name] = profile
        # Self-contained from here: written back out (bench/harness/stack.py), it needs no file.
        endpoints[name] = msgspec.structs.replace(spec, profile=profile.name, profile_file=None)
    return msgspec.structs.replace(config, profiles=profiles, endpoints=endpoints)


def _with_tokenizer_paths(config: Config, base_dir: Path) -> Config:
    """Each endpoint's `tokenizer` as an absolute path. Only the dispatcher reads the file
    (dispatcher/admission/tokens.py, at start): workers and clients parse the same config without
    it."""
    endpoints = {
        name: spec
        if spec.tokenizer is None
        else msgspec.structs.replace(spec, tokenizer=str((base_dir / spec.tokenizer).resolve()))
        for name, spec in config.endpoints.items()
    }
    return msgspec.structs.replace(config, endpoints=endpoints)


def _check_references(config: Config, source: str) -> None:
    def fail(field: str, value: object, why: str) -> None:
        raise ConfigError(f"{source}: field `{field}`: {why} (value: {value!r})")

    if not config.tiers:
        fail("tiers", [], "at least one tier is required")
    if not config.endpoints:
        fail("endpoints", {}, "at least one endpoint is required")
    tier_names = [t.name for t in config.tiers]
    if len(set(tier_names)) != len(tier_names):
        fail("tiers", tier_names, "tier names must be unique")
    for i, tier in enumerate(config.tiers):
        for endpoint in tier.endpoint_limits:
            if endpoint not in config.endpoints:
                fail(f"tiers[{i}].endpoint_limits", endpoint, "unknown endpoint")
    for name, endpoint in config.endpoints.items():
        if endpoint.profile not in config.profiles and endpoint.cost == "model_units":
            fail(
                f"endpoints.{name}.profile",
                endpoint.profile,
                "a model_units endpoint needs a profile defined under [profiles]",
            )
    for name, tenant in config.tenants.items():
        if tenant.tier not in tier_names:
            fail(f"tenants.{name}.tier", tenant.tier, f"unknown tier; known: {tier_names}")
        for endpoint in tenant.limits:
            if endpoint not in config.endpoints:
                fail(f"tenants.{name}.limits", endpoint, "unknown endpoint")
    unlisted = config.unlisted_tenants
    if unlisted.policy == "admit":
        if unlisted.tier is None:
            fail("unlisted_tenants.tier", None, "required when policy is 'admit'")
        if unlisted.tier not in tier_names:
            fail("unlisted_tenants.tier", unlisted.tier, f"unknown tier; known: {tier_names}")
    hashes = [key.sha256 for key in config.front.keys]
    if len(set(hashes)) != len(hashes):
        fail("front.keys", "(hashes)", "every key must be distinct")
    for i, key in enumerate(config.front.keys):
        if key.tenant not in config.tenants and unlisted.policy == "reject":
            fail(
                f"front.keys[{i}].tenant",
                key.tenant,
                "not a tenant of [tenants], and unlisted tenants are rejected",
            )
    for name, profile in config.profiles.items():
        if not math.isfinite(profile.alpha + profile.beta + profile.gamma):
            fail(f"profiles.{name}", profile, "coefficients must be finite")

"""The fairq configuration: one TOML file parsed into typed, validated structures.

Every part reads its settings from here: the scheduling core (endpoints, tiers,
tenants, profiles), the broker (`[broker]`), the dispatcher service (`[dispatcher]`) and
the workers (`[workers]`). Each default is written once, on its field; command-line
flags only override what the file says.

Errors name the file, the field (as a path such as `tenants.acme.weight`) and the bad
value, so a typo in production config is found from the message alone.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from broker_config.config_errors import describe_validation_error
from broker_config.limits import InputLimits
from broker_config.subjects import TOKEN_PATTERN, Subjects
from costmodel.capacity import DriftPolicy, ScalingPolicy
from costmodel.units import UNLIMITED_MODEL_UNITS, ModelProfile, load_profile

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]

CostMode = Literal["request", "token", "model_units"]
EXAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "example.toml"
# The simulated engine's timing (a costmodel.engine_model.EngineParams TOML).
EXAMPLE_ENGINE = EXAMPLE_CONFIG.parent / "engine.toml"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class ConfigError(ValueError):
    """A configuration file that cannot be used, with the file, field and value named."""


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
    # Deprecated and ignored: tenants are served by least charge per unit of weight, which
    # needs no quantum (docs/architecture.md, stage 3). Accepted so old configs load.
    quantum: Positive | None = None
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


# -- the services' settings ([broker], [dispatcher], [workers]) ---------------------------

# The server rejects shorter duplicate windows.
MIN_DUPLICATE_WINDOW_S = 0.1
# Durations are finite: a year is longer than any setting means.
MAX_SECONDS = 365 * 86_400.0
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
ByteLimit = Annotated[int, msgspec.Meta(ge=-1)]  # -1: unlimited


class BrokerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The broker's knobs (`[broker]`): subjects, the requests stream, the results bucket."""

    prefix: Annotated[str, msgspec.Meta(pattern=f"^{TOKEN_PATTERN}$")] = "fq"
    # Per (endpoint, tenant): unfinished requests the broker holds before refusing more.
    max_queued_per_subject: PositiveInt = 20_000
    # Same Nats-Msg-Id within this window is stored once. The window is stream-wide, not
    # per tenant, so it is kept at the server's minimum: the dispatcher de-duplicates by
    # (tenant, id) itself, and a long window would drop another tenant's request that
    # happens to reuse an id (docs/protocol.md, "Deduplication").
    duplicate_window_s: Annotated[float, msgspec.Meta(ge=MIN_DUPLICATE_WINDOW_S)] = 0.1
    # 0 keeps unfinished requests until acked; otherwise they are dropped after this age.
    max_age_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    max_bytes: ByteLimit = -1
    max_msg_size: ByteLimit = -1
    # The requests stream stores each tenant's requests in one of this many shards, read
    # by one consumer each (dispatcher/intake/shards.py): nats-server's cost per message grows
    # with the number of consumers, so it is kept well below the number of tenants.
    intake_shards: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    # Consumers per stream (the parked stream has one per tenant with parked requests).
    # Set explicitly: nats-server 2.15 caps a stream without it at 1,000 consumers. Each
    # costs about 50 KB in the server.
    max_consumers: PositiveInt = 10_000
    storage: Literal["file", "memory"] = "file"
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    results_ttl_s: Annotated[float, msgspec.Meta(ge=1)] = 86_400.0
    results_max_bytes: ByteLimit = -1

    def __post_init__(self) -> None:
        if self.max_age_s and self.duplicate_window_s > self.max_age_s:
            raise ValueError(
                f"duplicate_window_s ({self.duplicate_window_s}) must not exceed "
                f"max_age_s ({self.max_age_s})"
            )

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)


class DispatcherOptions(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True
):
    """The dispatcher service's knobs (`[dispatcher]`). Defaults are left out when it is
    written back as TOML, which has no null for an unset option."""

    # Arrived requests handed to admission at once (one results lookup round trip).
    intake_batch: PositiveInt = 256
    # Per tenant: waiting requests held in the dispatcher (the rest stay in the stream).
    tenant_window: PositiveInt = 64
    # Per tenant: parked requests held at all, waiting or running (its parked consumer's
    # max_ack_pending; must exceed what one tenant may run at once).
    max_ack_pending: PositiveInt = 1_000
    # Per shard of the requests stream: requests held at all, waiting or running (the
    # shard consumer's max_ack_pending; must exceed what a shard's tenants run at once).
    max_held_per_shard: PositiveInt = 10_000
    # How often the streams' subjects are listed: backlog counts, and tenants whose
    # requests wait behind a full tenant's in a shard that is not being read.
    discover_s: PositiveSeconds = 0.25
    # JetStream redelivers what is not acked within this; held messages are marked in
    # progress every third of it.
    ack_wait_s: PositiveSeconds = 60.0
    # A worker silent this long is out of rotation and its work is taken back.
    worker_timeout_s: PositiveSeconds = 5.0
    # When set, an endpoint no worker has served for this long (and that does not
    # autoscale) turns new requests away as `unavailable` instead of queueing them;
    # counted from the dispatcher's start too. Unset: requests wait for a worker.
    no_worker_grace_s: PositiveSeconds | None = None
    # Health probes (one token through the worker's engine) go to a worker holding work
    # with no completion or new token for probe_stall_s, or idle for probe_idle_s; one
    # unanswered in probe_timeout_s fails; probe_failures in a row evict the worker.
    probe_stall_s: PositiveSeconds = 1.5
    probe_idle_s: PositiveSeconds = 30.0
    probe_timeout_s: PositiveSeconds = 3.0
    probe_failures: PositiveInt = 2
    # A lost worker's (evicted, silent, restarted) requests that streamed no token yet run
    # elsewhere; the others end with `internal` and this retry hint (a stream cannot take
    # text back).
    lost_worker_retry_after_s: Seconds = 1.0
    # After a (re)start, wait this long for heartbeats before dispatching, so requests
    # still running on workers are recognised instead of run twice.
    settle_s: Seconds = 1.5
    # `python -m dispatcher` takes the deployment's lease before dispatching, renews it
    # every quarter of this and stands by while another process holds it; a holder that
    # dies is replaced after at most this long (broker_config/lease_key.py). 0: no lease (one
    # dispatcher only, its batches unfenced).
    lease_ttl_s: Seconds = 2.0
    # On SIGTERM, how long running requests may finish before the rest is handed back.
    grace_s: Seconds = 30.0
    # Period of the maintenance loop (deadlines, silent workers, ack-wait extensions).
    tick_s: PositiveSeconds = 0.25
    # The broker runs with per-tenant users: `Fq-Reply` must lie in the tenant's inbox.
    tenant_inboxes: bool = False
    # Without Redis: how often monthly usage is written to the limits bucket
    # (dispatcher/admission/kv_store.py). A kill -9 loses at most this much of it; each write of
    # 1,000 busy tenants' counters costs the dispatcher about 0.1 s of CPU
    # (docs/benchmarks.md, "Limiter stores").
    usage_flush_s: PositiveSeconds = 2.0
    # When a profile's capacity counts as off from what the workers really do
    # (`fairq_model_unit_drift`, and a warning in the log).
    drift: DriftPolicy = msgspec.field(default_factory=DriftPolicy)
    # What one submitted request may hold; over it: `invalid_request`.
    input: InputLimits = msgspec.field(default_factory=InputLimits)

    def __post_init__(self) -> None:
        if not 2 <= self.tenant_window <= self.max_ack_pending:
            raise ValueError(
                f"tenant_window ({self.tenant_window}) must be at least 2 and at "
                f"most max_ack_pending ({self.max_ack_pending})"
            )


class ImageOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a worker makes a request's images ready for its engine (`[workers.images]`,
    workers/images.py): decoded, turned upright, RGB, scaled down to `max_edge`."""

    # Processes of the pool that prepares them, started at the first image.
    processes: PositiveInt = 1
    # Width x height of each image, by its header, checked before anything is decoded
    # (the dispatcher's `[dispatcher.input]` limit, checked again where the pixels are).
    max_image_pixels: PositiveInt = 1 << 25
    # The longer side of a prepared image; larger ones are scaled down, never up.
    max_edge: PositiveInt = 1024
    # A request's images that take longer end it with `invalid_request`; the pool is
    # restarted, so a hostile image cannot hold a process.
    timeout_s: PositiveSeconds = 10.0


class WorkerOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every worker's knobs (`[workers]`)."""

    heartbeat_interval_s: PositiveSeconds = 1.0
    # On SIGTERM, how long in-flight requests may take to finish.
    drain_timeout_s: Seconds = 30.0
    images: ImageOptions = msgspec.field(default_factory=ImageOptions)


SHA256_HEX = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class FrontKey(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One API key of the OpenAI-compatible front, stored hashed: `sha256` is the hex
    SHA-256 of the key (`fairq front-key` makes a key and prints both)."""

    tenant: Name
    sha256: SHA256_HEX


class FrontOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The OpenAI-compatible HTTP front (`[front]`, producers/openai_front)."""

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    keys: list[FrontKey] = []
    # A request body larger than this is refused (413) before it is read to the end.
    max_body_bytes: PositiveInt = 4 << 20
    # A connection that sends no request for this long is closed.
    idle_timeout_s: Positive = 30.0
    # How long a client may take to send a request's headers and body.
    request_read_timeout_s: Positive = 30.0
    # Bound on each wait for a request's next event (a stalled request answers 504).
    event_timeout_s: Positive = 600.0


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
    _warn_deprecated(config, source)
    return config


def _warn_deprecated(config: Config, source: str) -> None:
    for name, spec in config.endpoints.items():
        if spec.quantum is not None:
            logging.getLogger(__name__).warning(
                "%s: field `endpoints.%s.quantum` is deprecated and ignored: tenants are "
                "served by least charge per unit of weight; remove it",
                source,
                name,
            )


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
        if endpoint.cost == "token" and endpoint.kind == "generate":
            fail(
                f"endpoints.{name}.cost",
                endpoint.cost,
                "token mode charges input tokens alone and this endpoint generates "
                'output nobody would pay for: use cost = "model_units" (engine time, '
                'output included) or "request", or kind = "embed"',
            )
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

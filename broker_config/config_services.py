"""The services' sections of the config: `[broker]`, `[dispatcher]`, `[workers]`, `[front]`.

Each default is written once, on its field; command-line flags only override them.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from broker_config.config_types import Name, Positive, PositiveInt
from broker_config.limits import InputLimits
from broker_config.subjects import TOKEN_PATTERN, Subjects
from costmodel.capacity import DriftPolicy

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

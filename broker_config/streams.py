"""JetStream resources fairq needs, declared once and applied idempotently.

- Stream `<PREFIX>_REQUESTS` over `<prefix>.req.*.*`, stored as
  `<prefix>.q.<shard>.<endpoint>.<tenant>` (a subject transform: one shard per tenant,
  `Subjects.stored_request_transform`), work-queue retention: a message stays until the
  dispatcher acks it, which it does only once the request's final event is stored (or
  once it moved it to the parked stream). So the messages on one subject are exactly
  that tenant's unfinished requests to that endpoint still in this stream, and
  `max_msgs_per_subject` with discard-new-per-subject is the per-tenant queue cap,
  enforced at the publisher (see `is_backlog_full`).
- Stream `<PREFIX>_PARKED` over `<prefix>.park.*.*`, work-queue retention: a flooding
  tenant's requests that the dispatcher moved out of a shard so that the shard's other
  tenants are not stuck behind them (dispatcher/intake/shards.py).
- KV bucket `<PREFIX>_RESULTS`: final events by `Subjects.result_key(tenant, id)`,
  history 1, kept `results_ttl_s` (24 h by default).
- KV bucket `<PREFIX>_LIMITS`: monthly token usage per quota, for the embedded limiter
  store (`dispatcher.admission.kv_store`), so that a restart keeps it.

`provision` is safe on every start: it creates what is missing and updates what exists
to the current settings (a setting the server cannot change in place, such as the
storage type, raises ProvisionError naming it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
    SubjectTransform,
)
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from broker_config import jetstream
from broker_config.config import BrokerSettings
from broker_config.subjects import Subjects

# A move to the parked stream is repeated only when the dispatcher died between the
# parked copy's acknowledgement and the original's ack, then redelivered it (ack wait).
PARK_DUPLICATE_WINDOW_S = 120.0
# nats-py's own KV duplicate window; a bucket whose TTL is shorter must use the TTL.
_KV_DUPLICATE_WINDOW_S = 120.0


class ProvisionError(RuntimeError):
    """A stream, bucket or consumer that cannot be brought to the configured settings."""


def requests_stream_config(settings: BrokerSettings) -> StreamConfig:
    subjects = settings.subjects
    return StreamConfig(
        name=subjects.requests_stream,
        description="fairq submitted requests, until their final event is stored",
        subjects=[subjects.all_requests],
        subject_transform=SubjectTransform(
            *subjects.stored_request_transform(settings.intake_shards)
        ),
        retention=RetentionPolicy.WORK_QUEUE,
        max_msgs_per_subject=settings.max_queued_per_subject,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        duplicate_window=settings.duplicate_window_s,
        max_age=settings.max_age_s,
        max_bytes=settings.max_bytes,
        max_msg_size=settings.max_msg_size,
        max_consumers=settings.max_consumers,
        storage=StorageType(settings.storage),
        num_replicas=settings.replicas,
        # The dispatcher reads requests still in the stream (the parked one too) for
        # status and cancel (broker_config.direct_get.DirectBatchGet.scan).
        allow_direct=True,
    )


def parked_stream_config(settings: BrokerSettings) -> StreamConfig:
    """The requests stream's limits (a tenant's moved requests are capped per subject
    like its stored ones), over the parked subjects, without the transform."""
    subjects = settings.subjects
    return replace(
        requests_stream_config(settings),
        name=subjects.parked_stream,
        description="fairq requests moved out of a shard behind which others waited",
        subjects=[subjects.all_parked],
        subject_transform=None,
        # The dispatcher publishes each move with the stored request's sequence as its id,
        # so a move repeated after a crash is stored once.
        duplicate_window=(
            min(PARK_DUPLICATE_WINDOW_S, settings.max_age_s)
            if settings.max_age_s
            else PARK_DUPLICATE_WINDOW_S
        ),
    )


def results_bucket_config(settings: BrokerSettings) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=settings.subjects.results_bucket,
        description="fairq final events by <tenant>.<request id>",
        history=1,
        ttl=settings.results_ttl_s,
        max_bytes=settings.results_max_bytes,
        storage=StorageType(settings.storage),
        replicas=settings.replicas,
        direct=True,  # batch lookups by the dispatcher (broker_config.direct_get)
    )


# A month's usage counter must outlive its month; the TTL counts from its last write.
LIMITS_TTL_S = 40 * 86_400.0


def limits_bucket_config(settings: BrokerSettings) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=settings.subjects.limits_bucket,
        description="fairq monthly token usage by quota (dispatcher.admission.kv_store)",
        history=1,
        ttl=LIMITS_TTL_S,
        storage=StorageType(settings.storage),
        replicas=settings.replicas,
    )


@dataclass(frozen=True, slots=True)
class Provisioned:
    requests: StreamInfo
    parked: StreamInfo
    results: KeyValue


async def provision(js: JetStreamContext, settings: BrokerSettings) -> Provisioned:
    """Create or update the requests and parked streams and the results bucket."""
    requests = await apply_stream(js, requests_stream_config(settings))
    await remove_retired_consumers(js, settings)
    parked = await apply_stream(js, parked_stream_config(settings))
    results = await apply_key_value(js, results_bucket_config(settings))
    return Provisioned(requests, parked, results)


async def remove_retired_consumers(js: JetStreamContext, settings: BrokerSettings) -> None:
    """Delete the requests stream's consumers of earlier releases: one over every request
    (`<prefix>~requests`) and one per tenant (`<prefix>~tenant~<tenant>`). On a
    work-queue stream they would overlap the consumer the dispatcher reads requests
    stored before the shards with (`<prefix>.req.*.*`). What they held but had not acked
    stays in the stream for it."""
    stream = settings.subjects.requests_stream
    retired = (f"{settings.prefix}~requests", f"{settings.prefix}~tenant")
    for info in await js.consumers_info(stream):
        if info.name.startswith(retired):
            with contextlib.suppress(NotFoundError):
                await js.delete_consumer(stream, info.name)


async def reset_consumers(js: JetStreamContext, settings: BrokerSettings) -> None:
    """Delete every consumer of the requests and parked streams, so that what a dispatcher
    that died (or was paused past its lease) held but had not acked is delivered again at
    once to the consumers made next, not after the ack wait."""
    for stream in (settings.subjects.requests_stream, settings.subjects.parked_stream):
        while infos := await js.consumers_info(stream):  # a page at a time (256)
            for info in infos:
                with contextlib.suppress(NotFoundError):
                    await js.delete_consumer(stream, info.name)


async def apply_stream(js: JetStreamContext, config: StreamConfig) -> StreamInfo:
    """Create the stream, or update it in place if it exists with another config.

    Its replicas are raised, never lowered (`_replicas`)."""
    try:
        return await js.add_stream(config)
    except ServiceUnavailableError:
        raise  # no JetStream leader at the moment (a cluster's election): not a setting
    except APIError as exc:
        if exc.err_code != jetstream.ERR_STREAM_NAME_IN_USE:
            raise ProvisionError(f"stream {config.name}: cannot create: {exc.description}") from exc
    try:
        current = (await js.stream_info(config.name)).config
        return await js.update_stream(
            config.evolve(num_replicas=_replicas(current.num_replicas, config.num_replicas))
        )
    except ServiceUnavailableError:
        raise  # an election, as above
    except APIError as exc:
        raise ProvisionError(f"stream {config.name}: cannot update: {exc.description}") from exc


async def apply_key_value(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    """Create the bucket, or update its limits in place if it exists with others.

    nats-py has no KV update, so the update edits the bucket's backing stream, keeping
    every KV convention nats-py set on it and changing only the limits, and its replicas
    as a stream's (`_replicas`).
    """
    try:
        return await js.create_key_value(config)
    except ServiceUnavailableError:
        raise
    except APIError as exc:
        if exc.err_code != jetstream.ERR_STREAM_NAME_IN_USE:
            raise ProvisionError(
                f"bucket {config.bucket}: cannot create: {exc.description}"
            ) from exc
    stream = jetstream.kv_stream(config.bucket)
    try:
        current = (await js.stream_info(stream)).config
        window = min(_KV_DUPLICATE_WINDOW_S, config.ttl) if config.ttl else _KV_DUPLICATE_WINDOW_S
        await js.update_stream(
            current.evolve(
                max_age=config.ttl,
                max_msgs_per_subject=config.history,
                max_bytes=config.max_bytes,
                duplicate_window=window,
                allow_direct=config.direct,
                num_replicas=_replicas(current.num_replicas, config.replicas),
            )
        )
    except ServiceUnavailableError:
        raise  # an election, as above
    except APIError as exc:
        raise ProvisionError(f"bucket {config.bucket}: cannot update: {exc.description}") from exc
    return await js.key_value(config.bucket)


def _replicas(current: int | None, configured: int | None) -> int:
    """Raised, never lowered: a part started with a one-node config (a standby given the
    default file) must not thin out a cluster's copies; fewer is an operator's decision
    (`nats stream edit`)."""
    return max(current or 1, configured or 1)


# -- consumers -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConsumerLimits:
    """Delivery limits of a durable pull consumer.

    `ack_wait_s` must outlast a request's processing unless the holder marks it in
    progress (`msg.in_progress()`) more often than that; `max_ack_pending` bounds the
    requests the dispatcher holds from this consumer, hence its memory per tenant.
    """

    ack_wait_s: float = 60.0
    max_ack_pending: int = 1_000
    max_deliver: int = -1
    # Remove the durable after this long without pulls (None: never), for idle tenants.
    inactive_threshold_s: float | None = None


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    durable: str
    filter_subject: str
    limits: ConsumerLimits = ConsumerLimits()

    @classmethod
    def for_shard(
        cls, subjects: Subjects, shard: int | str, limits: ConsumerLimits = ConsumerLimits()
    ) -> ConsumerSpec:
        """One shard of the requests stream (the dispatcher's intake)."""
        return cls(subjects.shard_consumer(shard), subjects.shard_filter(shard), limits)

    @classmethod
    def for_parked(
        cls, subjects: Subjects, tenant: str, limits: ConsumerLimits = ConsumerLimits()
    ) -> ConsumerSpec:
        """One tenant's parked requests to every endpoint (the dispatcher's intake)."""
        return cls(subjects.parked_consumer(tenant), subjects.parked_tenant_filter(tenant), limits)

    def config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.durable,
            filter_subject=self.filter_subject,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.limits.ack_wait_s,
            max_ack_pending=self.limits.max_ack_pending,
            max_deliver=self.limits.max_deliver,
            inactive_threshold=self.limits.inactive_threshold_s,
        )


async def ensure_consumer(js: JetStreamContext, stream: str, spec: ConsumerSpec) -> ConsumerInfo:
    """Create the durable pull consumer, or update its limits if it exists.

    On a work-queue stream the filters of all consumers must not overlap: a message goes
    to one consumer only, so the server refuses a consumer whose filter shares subjects
    with another's.
    """
    try:
        return await js.add_consumer(stream, spec.config())
    except ServiceUnavailableError:
        raise
    except APIError as exc:
        hint = (
            f" (another consumer's filter overlaps {spec.filter_subject}: on a work-queue "
            "stream consumer filters must not overlap)"
            if exc.err_code == jetstream.ERR_CONSUMER_NOT_UNIQUE
            else ""
        )
        raise ProvisionError(
            f"consumer {spec.durable} on {stream}: {exc.description}{hint}"
        ) from exc


def is_backlog_full(exc: BaseException) -> bool:
    """True for the publish error of a full per-(endpoint, tenant) backlog.

    nats-py raises `nats.js.errors.ServiceUnavailableError` (code 503) with err_code
    10077, "maximum messages per subject exceeded"; the code alone is not enough, since
    503 also means JetStream is unavailable.
    """
    return isinstance(exc, APIError) and exc.err_code == jetstream.ERR_MAX_MSGS_PER_SUBJECT

"""Ways of reading the requests stream that only benchmarks and tests use.

fairq itself reads the stream through one consumer per shard (`ConsumerSpec.for_shard`)
with standing pulls (`dispatcher.intake.shards`). The naive baseline (`bench.harness.naive_worker`)
instead shares one consumer per endpoint among its workers, and the benchmarks and tests
fetch batches through nats-py's pull subscription.
"""

from __future__ import annotations

from nats.js import JetStreamContext

from broker_config.streams import ConsumerLimits, ConsumerSpec, ensure_consumer
from broker_config.subjects import Subjects, check_token


def endpoint_consumer(
    subjects: Subjects, endpoint: str, limits: ConsumerLimits = ConsumerLimits()
) -> ConsumerSpec:
    """Every tenant's requests to one endpoint, in stream order: the naive shared queue.
    On the work-queue stream it cannot coexist with the dispatcher's shard consumers
    (their filters overlap). `~` never occurs in a token, so the name cannot collide."""
    check_token(endpoint, "endpoint")
    return ConsumerSpec(
        f"{subjects.prefix}~req~{endpoint}", f"{subjects.prefix}.q.*.{endpoint}.*", limits
    )


def tenant_consumer(
    subjects: Subjects, tenant: str, limits: ConsumerLimits = ConsumerLimits()
) -> ConsumerSpec:
    """One tenant's stored requests to every endpoint, in stream order (tests that play
    the dispatcher's part for one tenant)."""
    return ConsumerSpec(
        f"{subjects.prefix}~test~{check_token(tenant, 'tenant')}",
        subjects.stored_tenant_filter(tenant),
        limits,
    )


async def pull_subscription(
    js: JetStreamContext, stream: str, spec: ConsumerSpec
) -> JetStreamContext.PullSubscription:
    """Ensure the consumer and bind a pull subscription to it (then `fetch` batches)."""
    await ensure_consumer(js, stream, spec)
    return await js.pull_subscribe_bind(spec.durable, stream)

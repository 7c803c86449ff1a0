"""The embedded limiter store's monthly usage in a NATS KV bucket
(dispatcher/admission/kv_store.py),
against a real nats-server: it outlives the store, dispatchers sharing the bucket add up,
and an unreachable bucket is an error, never a decision. The decisions themselves are the
contract tests' (tests/admission/test_limiter_contract.py runs them on this store too)."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import nats
import pytest

from broker_config.config import BrokerSettings
from broker_config.server import EmbeddedNatsServer
from dispatcher.admission.kv_store import KvLimiterStore, StoredUsage
from dispatcher.admission.redis_store import LimiterUnavailable
from dispatcher.core.limits import QuotaCheck, RateCheck, Settlement, quota_check
from dispatcher.core.types import ADMITTED, Outcome

pytestmark = pytest.mark.integration

NOW = 1_700_000_000.0


def spend(tokens: float, tenant: str = "acme") -> QuotaCheck:
    return quota_check(tenant, "chat", 1000, tokens, NOW)


async def stored(nc: nats.NATS, check: QuotaCheck) -> StoredUsage:
    kv = await nc.jetstream().key_value(BrokerSettings().subjects.limits_bucket)
    entry = await kv.get(check.key.replace(":", "."))
    return msgspec.json.decode(entry.value, type=StoredUsage)


async def test_monthly_usage_outlives_the_store(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        first = await KvLimiterStore.open(nc, BrokerSettings(), flush_s=0.5)
        assert await first.apply([spend(600)], NOW) == ADMITTED
        await first.settle(Settlement(refund=(spend(100),)), NOW)  # used: 500
        await first.aclose()  # a graceful stop writes what is pending
        assert (await stored(nc, spend(0))).used == 500

        second = await KvLimiterStore.open(nc, BrokerSettings(), flush_s=0.5)
        assert await second.apply([spend(500)], NOW) == ADMITTED
        refused = await second.apply([spend(1)], NOW)
        assert refused.outcome is Outcome.QUOTA_EXCEEDED
        # Rate limits are not kept: their state lasts seconds.
        rpm = RateCheck("rpm:chat:acme", per_minute=60, burst=1, cost=1)
        assert await second.apply([rpm], NOW) == ADMITTED
        await second.aclose()
    finally:
        await nc.close()


async def test_usage_is_written_behind_without_a_stop(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    store = await KvLimiterStore.open(nc, BrokerSettings(), flush_s=0.05)
    try:
        assert await store.apply([spend(250)], NOW) == ADMITTED
        await store.settle(Settlement(charge=(spend(50),)), NOW)
        async with asyncio.timeout(5):
            while True:
                with contextlib.suppress(nats.js.errors.KeyNotFoundError):  # not written yet
                    if (await stored(nc, spend(0))).used == 300:
                        break
                await asyncio.sleep(0.02)
    finally:
        await store.aclose()
        await nc.close()


async def test_dispatchers_sharing_the_bucket_add_up(nats_url: str) -> None:
    """Two stores (two dispatchers) charging the same quota: the stored value is the sum,
    and each learns the other's usage at its next write."""
    a_nc, b_nc = await nats.connect(nats_url), await nats.connect(nats_url)
    a = await KvLimiterStore.open(a_nc, BrokerSettings(), flush_s=3600)
    b = await KvLimiterStore.open(b_nc, BrokerSettings(), flush_s=3600)
    try:
        for _ in range(20):  # interleaved, so their compare-and-sets conflict
            assert await a.apply([spend(10)], NOW) == ADMITTED
            assert await b.apply([spend(15)], NOW) == ADMITTED
            await asyncio.gather(a.flush(), b.flush())
        assert (await stored(a_nc, spend(0))).used == 20 * 25
        # 500 used in all; a learns b's last charge at its own next write.
        assert await a.apply([spend(1)], NOW) == ADMITTED
        await a.flush()
        assert await a.apply([spend(499)], NOW) == ADMITTED
        assert (await a.apply([spend(1)], NOW)).outcome is Outcome.QUOTA_EXCEEDED
    finally:
        await a.aclose()
        await b.aclose()
        await a_nc.close()
        await b_nc.close()


async def test_an_unreachable_bucket_is_an_error_not_a_decision() -> None:
    async with EmbeddedNatsServer() as server:
        nc = await nats.connect(server.url, max_reconnect_attempts=0)
        store = await KvLimiterStore.open(nc, BrokerSettings(), flush_s=0.5)
        assert await store.apply([spend(10, "known")], NOW) == ADMITTED
        await nc.close()
        with pytest.raises(LimiterUnavailable, match="limits bucket unavailable"):
            await store.apply([spend(10, "new")], NOW)
        # A counter already read decides from memory; its write waits for the broker.
        assert await store.apply([spend(10, "known")], NOW) == ADMITTED
        await store.aclose()


async def test_a_stop_during_a_slow_write_loses_nothing(nats_url: str) -> None:
    """Closing the store while its flush loop waits on the broker: the write completes
    (or stays pending and is written by the last round), it is not dropped."""
    nc = await nats.connect(nats_url)
    store = await KvLimiterStore.open(nc, BrokerSettings(), flush_s=0.01)
    slow = store._kv.create

    async def slow_create(key: str, value: bytes) -> int:
        await asyncio.sleep(0.2)
        return await slow(key, value)

    store._kv.create = slow_create
    try:
        assert await store.apply([spend(70)], NOW) == ADMITTED
        await asyncio.sleep(0.05)  # the loop's flush is waiting on the slow create
        await store.aclose()
        assert (await stored(nc, spend(0))).used == 70
    finally:
        await nc.close()


async def test_a_counter_that_is_not_usage_fails_closed(nats_url: str) -> None:
    """Something else written over a counter is never read as a fresh quota: the tenant's
    admissions fail (`internal`, retryable) until an operator fixes it."""
    nc = await nats.connect(nats_url)
    store = await KvLimiterStore.open(nc, BrokerSettings(), flush_s=0.5)
    try:
        kv = await nc.jetstream().key_value(BrokerSettings().subjects.limits_bucket)
        await kv.put(spend(0, "victim").key.replace(":", "."), b'{"id":"zz","state":"x"}')
        with pytest.raises(LimiterUnavailable, match="unreadable"):
            await store.apply([spend(10, "victim")], NOW)
        assert await store.apply([spend(10, "other")], NOW) == ADMITTED
    finally:
        await store.aclose()
        await nc.close()


async def test_a_settlement_naming_one_counter_many_times_is_stored_once_each(
    nats_url: str,
) -> None:
    """Several requests settled in one call (a completions message, a stop giving back
    what its queue was charged) often name the same counter."""
    nc = await nats.connect(nats_url)
    store = await KvLimiterStore.open(nc, BrokerSettings(), flush_s=3600)
    try:
        for _ in range(3):
            assert await store.apply([spend(100)], NOW) == ADMITTED
        await store.settle(Settlement(refund=(spend(20), spend(30))), NOW)
        await store.flush()
        assert (await stored(nc, spend(0))).used == 250
    finally:
        await store.aclose()
        await nc.close()

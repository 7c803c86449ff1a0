"""The dispatchers' lease and the workers' epoch fence, against a real nats-server."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats
import pytest

from broker_config import lease_key as lease_module
from broker_config.config import BrokerSettings
from broker_config.lease_key import (
    LEASE_KEY,
    EpochWatch,
    LeaseRecord,
    ensure_leases_bucket,
    leases_bucket_config,
)
from broker_config.streams import apply_key_value
from dispatcher.ha.lease import VALID_SHARE, Lease

pytestmark = pytest.mark.integration

TTL_S = 1.0


@pytest.fixture
async def kv(nats_url):
    nc = await nats.connect(nats_url)
    bucket = await apply_key_value(nc.jetstream(), leases_bucket_config(BrokerSettings(), TTL_S))
    yield bucket
    await nc.drain()


async def within(seconds: float, step):
    return await asyncio.wait_for(step, seconds)


async def test_one_holder_at_a_time_and_a_release_hands_over_at_once(kv):
    first, second = Lease("first", ttl_s=TTL_S), Lease("second", ttl_s=TTL_S)
    assert await within(2, first.acquire(kv)) is True  # not released: take back what it held
    assert first.valid() and first.epoch > 0
    standby = asyncio.create_task(second.acquire(kv))
    await asyncio.sleep(3 * TTL_S)  # renewals keep it: the standby waits
    assert not standby.done() and first.valid()
    released_at = time.monotonic()
    await first.release()
    assert await within(2, standby) is False  # released: nothing to take back
    assert time.monotonic() - released_at < 0.5
    assert second.epoch > first.epoch and second.valid()
    assert not first.valid() and first.lost.is_set()
    await second.release()


async def test_a_holder_that_stops_renewing_is_replaced_after_the_ttl(kv):
    first, second = Lease("first", ttl_s=TTL_S), Lease("second", ttl_s=TTL_S)
    await first.acquire(kv)
    await first._stop_renewals()  # as a process killed with -9 would
    stopped_at = time.monotonic()
    assert await within(5, second.acquire(kv)) is True  # what the dead one held
    waited = time.monotonic() - stopped_at
    assert TTL_S * 0.5 < waited < TTL_S + 2.0, waited
    # By its own clock the old holder stopped counting on it before the server let go.
    assert not first.valid()
    await second.release()


async def test_a_paused_holder_finds_its_lease_gone_and_says_so(kv):
    now = [0.0]
    first = Lease("first", ttl_s=TTL_S, clock=lambda: now[0])
    await first.acquire(kv)
    now[0] += VALID_SHARE * TTL_S  # a pause, by the local clock: stop dispatching
    assert not first.valid()
    await first._stop_renewals()
    second = Lease("second", ttl_s=TTL_S)
    await within(5, second.acquire(kv))
    first._renewals = asyncio.create_task(first._renew_loop())  # the process wakes up
    await within(3, first.lost.wait())
    assert second.valid() and not second.lost.is_set()
    await first.release()  # lost: nothing to release, the new holder keeps it
    await asyncio.sleep(0.1)
    entry = await kv.get(LEASE_KEY)
    assert msgspec.json.decode(entry.value, type=LeaseRecord).holder == "second"
    await second.release()


async def test_a_holder_that_could_not_renew_takes_its_lease_back_with_nothing_to_take(kv):
    """A broker that took no renewals for a TTL (a cluster's election): the lease is lost,
    and taken back by the same process, whose own requests it handed back itself."""
    lease = Lease("first", ttl_s=TTL_S)
    await lease.acquire(kv)
    lease._lose("the broker did not answer", to_another=False)
    await lease._stop_renewals()
    assert await within(5, lease.acquire(kv)) is False
    await lease.release()
    # Held by someone else in between: whatever that one held must be taken back.
    other = Lease("other", ttl_s=TTL_S)
    await lease.acquire(kv)
    lease._lose("the broker did not answer", to_another=False)
    await lease._stop_renewals()
    await within(5, other.acquire(kv))
    await other._stop_renewals()  # and dies
    assert await within(5, lease.acquire(kv)) is True
    await lease.release()


async def test_a_renewal_whose_answer_was_lost_keeps_the_lease(kv):
    lease = Lease("first", ttl_s=TTL_S)
    await lease.acquire(kv)
    await lease._stop_renewals()
    # Stored by the server, its answer never seen: the revision held here is stale.
    await kv.put(LEASE_KEY, msgspec.json.encode(LeaseRecord(holder="first", epoch=lease.epoch)))
    lease._renewals = asyncio.create_task(lease._renew_loop())
    await asyncio.sleep(3 * TTL_S)
    assert lease.valid() and not lease.lost.is_set()
    await lease.release()


async def test_a_worker_fence_follows_the_newest_epoch(nats_url, kv):
    nc = await nats.connect(nats_url)
    try:
        async with EpochWatch(nc.jetstream(), BrokerSettings().subjects) as fence:
            assert fence.admits(0)  # nobody holds the lease yet: unfenced
            first = Lease("first", ttl_s=TTL_S)
            await first.acquire(kv)
            await within(2, _until(lambda: fence.epoch == first.epoch))
            assert fence.admits(first.epoch) and not fence.admits(0)
            await first.release()
            second = Lease("second", ttl_s=TTL_S)
            await second.acquire(kv)
            # Seen from the watch alone, before the new holder sent anything.
            await within(2, _until(lambda: fence.epoch == second.epoch))
            assert not fence.admits(first.epoch)
            assert fence.admits(second.epoch)
            await second.release()
    finally:
        await nc.drain()


async def test_without_a_leases_bucket_every_epoch_is_admitted_until_one_is_seen(nats_url):
    nc = await nats.connect(nats_url)
    try:
        async with EpochWatch(nc.jetstream(), BrokerSettings(prefix="nolease").subjects) as f:
            assert f.admits(0) and f.admits(7)
            assert not f.admits(6)
    finally:
        await nc.drain()


async def test_a_worker_started_before_the_bucket_exists_is_fenced_once_it_does(
    nats_url, monkeypatch
):
    monkeypatch.setattr(lease_module, "BUCKET_POLL_S", 0.1)
    nc = await nats.connect(nats_url)
    settings = BrokerSettings(prefix="late")
    try:
        async with EpochWatch(nc.jetstream(), settings.subjects) as fence:
            await asyncio.sleep(0.3)  # looked for, not there yet
            kv, ttl_s = await ensure_leases_bucket(nc.jetstream(), settings, TTL_S)
            first = Lease("first", ttl_s=TTL_S)
            await first.acquire(kv, ttl_s)
            await within(3, _until(lambda: fence.epoch == first.epoch))
            assert not fence.admits(first.epoch - 1)
            await first.release()
    finally:
        await nc.drain()


async def test_a_standby_with_a_shorter_ttl_never_shortens_the_holders(kv, nats_url):
    """The bucket's TTL is raised, never lowered: else the holder's key would age out
    while it still counts on it, and two dispatchers would dispatch."""
    nc = await nats.connect(nats_url)
    try:
        _, ttl_s = await ensure_leases_bucket(nc.jetstream(), BrokerSettings(), TTL_S / 4)
        assert ttl_s == TTL_S
        _, ttl_s = await ensure_leases_bucket(nc.jetstream(), BrokerSettings(), 2 * TTL_S)
        assert ttl_s == 2 * TTL_S
        info = await nc.jetstream().stream_info(f"KV_{BrokerSettings().subjects.leases_bucket}")
        assert info.config.max_age == 2 * TTL_S
    finally:
        await nc.drain()


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.02)

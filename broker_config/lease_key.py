"""The dispatchers' lease and its epoch: which dispatcher process may dispatch, and the
fence that keeps any other from doing it.

The lease is one key (`LEASE_KEY`) in the KV bucket `<PREFIX>_LEASES`, whose TTL is the
lease's: a holder renews it by compare-and-set on the revision it last wrote, and a key
its holder stopped renewing ages out, so a standby's create succeeds. Its *epoch* is the
revision of the create that began the tenure (stream sequences only grow, so a later
tenure always has a larger epoch); renewals carry it in the record.

Dispatchers put their epoch in every batch, abort and eviction (`wire_internal.Batch.epoch`...);
a worker watches the key and refuses what carries an epoch older than the newest it has
seen (`EpochWatch`), so a dispatcher that was paused past its lease and wakes up cannot
send work a second time. Epoch 0 means unfenced (a dispatcher run without a lease).

Why one key for the whole deployment (docs/operations.md): intake reads the requests
stream through shard consumers that each cover every endpoint, and consumer filters on a
work-queue stream cannot overlap, so endpoints cannot be shared out among dispatchers
without a consumer per (shard, endpoint) and a lease per endpoint group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from broker_config.config import BrokerSettings
from broker_config.jetstream import kv_stream
from broker_config.streams import apply_key_value
from broker_config.subjects import Subjects

log = logging.getLogger("fairq.lease")

LEASE_KEY = "dispatch"
# A lease watch that ended is made again after this long; a missing bucket looked for.
WATCH_RETRY_S = 1.0
BUCKET_POLL_S = 5.0


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True):
    holder: str
    # 0 in the create that begins a tenure (whose revision is the epoch), then that epoch.
    epoch: int = 0


def epoch_of(value: bytes | None, revision: int) -> int:
    """The epoch of a lease entry; 0 for an entry that is not a lease record."""
    try:
        record = msgspec.json.decode(value or b"", type=LeaseRecord)
    except msgspec.DecodeError:
        return 0
    return record.epoch or revision


async def ensure_leases_bucket(
    js: JetStreamContext, settings: BrokerSettings, ttl_s: float
) -> tuple[KeyValue, float]:
    """The leases bucket and the TTL its key really has. Made with `ttl_s` if missing,
    its TTL raised to `ttl_s` if lower, never lowered: a standby configured with a
    shorter TTL must not make the holder's key age out before the holder thinks it
    could (to lower it, delete the bucket while no dispatcher runs). Its replicas are
    raised as every bucket's are (`apply_key_value`)."""
    config = leases_bucket_config(settings, ttl_s)
    try:
        info = await js.stream_info(kv_stream(config.bucket))
    except NotFoundError:
        return await apply_key_value(js, config), ttl_s
    kept_ttl = info.config.max_age
    if kept_ttl is not None and kept_ttl >= ttl_s:
        if (info.config.num_replicas or 1) >= settings.replicas:
            return await js.key_value(config.bucket), kept_ttl
        config = leases_bucket_config(settings, kept_ttl)  # more copies, the same TTL
        return await apply_key_value(js, config), kept_ttl
    return await apply_key_value(js, config), ttl_s


def leases_bucket_config(settings: BrokerSettings, ttl_s: float) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=settings.subjects.leases_bucket,
        description="fairq: which dispatcher dispatches (broker_config.lease_key)",
        history=1,
        ttl=ttl_s,
        storage=StorageType(settings.storage),
        replicas=settings.replicas,
    )


class EpochWatch:
    """The newest lease epoch, as a worker sees it: from a watch of the lease key and
    from the epochs of what dispatchers send (`admits`).

        async with EpochWatch(js, subjects) as fence:
            if fence.admits(batch.epoch): ...

    Until the bucket exists (a worker started before any dispatcher made it, or
    dispatchers without a lease) it is looked for every BUCKET_POLL_S, and every epoch
    is admitted until one is seen."""

    def __init__(self, js: JetStreamContext, subjects: Subjects) -> None:
        self.js = js
        self.bucket = subjects.leases_bucket
        self.epoch = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EpochWatch:
        self._task = asyncio.create_task(self._watch(), name="lease-epoch-watch")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def admits(self, epoch: int) -> bool:
        """True unless `epoch` is older than the newest seen; a newer one is noted."""
        if epoch < self.epoch:
            return False
        self.epoch = epoch
        return True

    async def _watch(self) -> None:
        while True:
            try:
                kv = await self.js.key_value(self.bucket)
            except (BucketNotFoundError, NotFoundError):
                await asyncio.sleep(BUCKET_POLL_S)
                continue
            except nats.errors.Error as exc:  # a cluster electing a leader: ask again
                log.warning("cannot open the dispatchers' lease bucket: %r", exc)
                await asyncio.sleep(WATCH_RETRY_S)
                continue
            try:
                # The watch delivers the current record first.
                watcher = await kv.watch(LEASE_KEY, ignore_deletes=True)
                try:
                    async for entry in watcher:
                        if entry is not None and entry.value:
                            self.admits(epoch_of(entry.value, entry.revision or 0))
                finally:
                    with contextlib.suppress(Exception):
                        await watcher.stop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # made again below; batches still carry epochs
                log.warning("watching the dispatchers' lease failed: %r", exc)
            await asyncio.sleep(WATCH_RETRY_S)

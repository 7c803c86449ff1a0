"""The embedded default limiter store: decisions in memory, monthly usage kept in NATS.

Without Redis a dispatcher used to forget every tenant's monthly usage when it
restarted. This store decides exactly as `MemoryLimiterStore` (the same arithmetic,
so the same contract tests hold) and keeps each quota counter in the KV bucket
`<PREFIX>_LIMITS` as well, under its key with `:` as `.`:

- A counter is read from the bucket the first time this process uses it; admission
  waits on the broker only then (an unreachable bucket is `LimiterUnavailable`).
- What decisions add to or give back from a counter is written behind, every
  `flush_s`: the change since the last write is added to the stored value with a
  compare-and-set on its revision (retried on a conflict), so dispatchers sharing the
  bucket add up instead of overwriting each other, and each one learns the others'
  usage at its next write. A write that fails stays pending for the next round.
- Rate limits (RPM, TPM) stay in memory: their state lasts seconds, not a month.

What this costs: a kill -9 loses at most the last `flush_s` of charges (a graceful
stop writes everything first), and dispatchers sharing one bucket may together admit
up to one flush period's worth past a quota. A write whose acknowledgement is lost
(the broker stored it, the answer timed out) is written again, counting that change
twice; the tenant is overcharged, never undercharged. The Redis store has none of these
gaps.

Drain order on exit (`aclose`): the flush loop ends after one last round, which writes
what is pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Self

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from broker_config.config import BrokerSettings, Config
from broker_config.streams import ProvisionError, apply_key_value, limits_bucket_config
from dispatcher.admission.redis_store import (
    AsyncLimiterStore,
    LimiterUnavailable,
    RedisLimiterStore,
    validate_checks,
)
from dispatcher.core.limits import (
    Check,
    MemoryLimiterStore,
    QuotaCheck,
    Settlement,
)
from dispatcher.core.types import Decision

log = logging.getLogger("fairq.dispatcher")

# Compare-and-set rounds per counter and write before it waits for the next flush.
MAX_CAS_ATTEMPTS = 8
# Counters written at once: bounds the acks in flight with many tenants.
FLUSH_CONCURRENCY = 64


class StoredUsage(msgspec.Struct, frozen=True):
    used: float
    exp: float  # the end of the counter's period (unix time)


class KvLimiterStore:
    def __init__(self, kv: KeyValue, *, flush_s: float) -> None:
        self._kv = kv
        self._flush_s = flush_s
        self._memory = MemoryLimiterStore()
        # Counters read from the bucket since start -> their period's end.
        self._loaded: dict[str, float] = {}
        # Counter -> (revision, value) as this process last read or wrote it (0: none).
        self._revisions: dict[str, tuple[int, float]] = {}
        # Per counter: what decisions changed since the last write, and its period's end.
        self._pending: dict[str, tuple[float, float]] = {}
        self._load_lock = asyncio.Lock()
        self._flush_lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, nc: NATS, settings: BrokerSettings, *, flush_s: float) -> Self:
        """Create or update the bucket, and start writing behind."""
        try:
            kv = await apply_key_value(nc.jetstream(), limits_bucket_config(settings))
        except (ProvisionError, nats.errors.Error) as exc:
            raise LimiterUnavailable(f"limits bucket unavailable: {exc!r}") from exc
        store = cls(kv, flush_s=flush_s)
        store._flusher = asyncio.create_task(store._flush_loop(), name="fairq-limits-flush")
        return store

    async def apply(self, checks: Sequence[Check], now: float) -> Decision:
        validate_checks(checks, now)
        quotas = [check for check in checks if isinstance(check, QuotaCheck)]
        await self._load(quotas)
        before = self._used(quotas, now)
        decision = self._memory.apply(list(checks), now)
        self._note(quotas, before, now)
        return decision

    async def settle(self, settlement: Settlement, now: float) -> None:
        checks = (*settlement.charge, *settlement.refund)
        validate_checks(checks, now)
        quotas = [check for check in checks if isinstance(check, QuotaCheck)]
        await self._load(quotas)
        before = self._used(quotas, now)
        self._memory.settle(settlement, now)
        self._note(quotas, before, now)

    async def aclose(self) -> None:
        self._stopping.set()
        if self._flusher is not None:
            await self._flusher  # never cancelled: a write under way completes
        await self.flush()  # what was charged while the loop's last round ran
        if self._pending:
            log.error("monthly usage of %d quota counters could not be stored", len(self._pending))

    async def flush(self) -> None:
        """Add each counter's pending change to its stored value; what could not be
        written (an error, or the flush cancelled) stays pending."""
        async with self._flush_lock:
            pending, self._pending = self._pending, {}
            items = list(pending.items())
            written: set[str] = set()
            try:
                for first in range(0, len(items), FLUSH_CONCURRENCY):
                    await asyncio.gather(
                        *(
                            self._flush_one(key, change, expires_at, written)
                            for key, (change, expires_at) in items[
                                first : first + FLUSH_CONCURRENCY
                            ]
                        )
                    )
            finally:
                for key, (change, expires_at) in items:
                    if key not in written:
                        self._add_pending(key, change, expires_at)

    async def _flush_one(
        self, key: str, change: float, expires_at: float, written: set[str]
    ) -> None:
        try:
            stored = await self._add_stored(key, change, expires_at)
        except Exception as exc:  # kept pending by the caller, written next round
            log.warning("quota counter %s not stored yet: %r", key, exc)
            return
        written.add(key)
        # The stored value has every dispatcher's usage; this one's since the swap is
        # still pending, and counts here too.
        self._memory.set_quota_used(key, stored + self._pending.get(key, (0.0, 0.0))[0], expires_at)

    async def _flush_loop(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):  # a period passed: write what is pending
                await asyncio.wait_for(self._stopping.wait(), self._flush_s)
            await self.flush()
            self._forget_ended(time.time())

    def _forget_ended(self, now: float) -> None:
        """Counters whose period ended are read again if they are ever used again."""
        self._loaded = {
            key: end for key, end in self._loaded.items() if end > now or key in self._pending
        }
        self._revisions = {
            key: seen for key, seen in self._revisions.items() if key in self._loaded
        }

    async def _load(self, quotas: list[QuotaCheck]) -> None:
        missing = [check for check in quotas if check.key not in self._loaded]
        if not missing:
            return
        async with self._load_lock:
            for check in missing:
                if check.key in self._loaded:  # read meanwhile
                    continue
                # Nothing was decided on this counter before: its value is the stored one.
                stored = await self._read(check.key)
                if stored is not None:
                    self._memory.set_quota_used(check.key, stored.used, stored.exp)
                self._loaded[check.key] = check.expires_at

    def _used(self, quotas: list[QuotaCheck], now: float) -> dict[str, float]:
        return {check.key: self._memory.quota_used(check.key, now) for check in quotas}

    def _note(self, quotas: list[QuotaCheck], before: dict[str, float], now: float) -> None:
        """Pend what the decision changed, once per counter (several settled requests
        may name the same one)."""
        periods = {check.key: check.expires_at for check in quotas}
        for key, expires_at in periods.items():
            change = self._memory.quota_used(key, now) - before[key]
            if change:
                self._add_pending(key, change, expires_at)

    def _add_pending(self, key: str, change: float, expires_at: float) -> None:
        earlier, _ = self._pending.get(key, (0.0, expires_at))
        self._pending[key] = (earlier + change, expires_at)

    async def _read(self, key: str) -> StoredUsage | None:
        try:
            return await self._get(key)
        except (TimeoutError, nats.errors.Error) as exc:
            raise LimiterUnavailable(f"limits bucket unavailable: {exc!r}") from exc

    async def _get(self, key: str) -> StoredUsage | None:
        """The stored counter, its revision remembered for the next write."""
        try:
            entry = await self._kv.get(_kv_key(key))
        except KeyNotFoundError:
            self._revisions[key] = (0, 0.0)
            return None
        stored = _decode(key, entry.value)
        self._revisions[key] = (entry.revision, stored.used)
        return stored

    async def _add_stored(self, key: str, change: float, expires_at: float) -> float:
        """Add `change` to the stored counter (never below 0); its new value. Written on
        the revision this process last saw, so one round trip unless another dispatcher
        wrote since (then it reads and tries again)."""
        for _ in range(MAX_CAS_ATTEMPTS):
            if key not in self._revisions:
                await self._get(key)
            revision, used = self._revisions.pop(key)
            used = max(0.0, used + change)
            value = msgspec.json.encode(StoredUsage(used, expires_at))
            try:
                if revision == 0:
                    revision = await self._kv.create(_kv_key(key), value)
                else:
                    revision = await self._kv.update(_kv_key(key), value, last=revision)
            except KeyWrongLastSequenceError:
                continue  # another dispatcher wrote first: add to its value
            self._revisions[key] = (revision, used)
            return used
        raise nats.errors.Error(f"{MAX_CAS_ATTEMPTS} conflicting writes in a row")


async def open_limiter_store(redis_url: str | None, nc: NATS, config: Config) -> AsyncLimiterStore:
    """The Redis store for a redis:// (rediss://, unix://) URL, shared atomically by
    dispatchers; without one, this embedded store, its monthly usage kept in NATS and
    written every `[dispatcher] usage_flush_s`."""
    if redis_url is not None:
        return RedisLimiterStore.from_url(redis_url)
    return await KvLimiterStore.open(nc, config.broker, flush_s=config.dispatcher.usage_flush_s)


def _kv_key(key: str) -> str:
    # Limiter keys are `kind:endpoint:tenant:month` of name characters; KV keys take dots.
    return key.replace(":", ".")


def _decode(key: str, value: bytes | None) -> StoredUsage:
    """A stored counter. One that is not (written by something else) is an error, never
    read as 0: that would hand its tenant a fresh quota."""
    try:
        return msgspec.json.decode(value or b"", type=StoredUsage)
    except msgspec.DecodeError as exc:
        log.error(
            "quota counter %s holds %r, not usage: its tenant's admissions fail "
            "until an operator deletes or fixes it",
            key,
            (value or b"")[:100],
        )
        raise LimiterUnavailable(f"quota counter {key} is unreadable") from exc

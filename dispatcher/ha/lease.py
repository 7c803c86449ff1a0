"""One dispatcher process's hold on the deployment's lease (broker_config/lease_key.py).

    lease = Lease(holder_id(), ttl_s=2.0)
    take_back = await lease.acquire(kv) # stand by until it is free
    lease.valid()                       # renewed lately enough to dispatch
    await lease.lost.wait()             # not ours any more
    await lease.release()               # a planned handover: a standby takes it at once

`acquire` returns whether another holder may have left requests unacked: the lease was
not released (its holder died or was paused), and this process was not its last holder
(it loses its lease when the broker cannot take renewals, in a cluster's election, and
takes it back once it can). A dispatcher then makes JetStream deliver at once what the
other one held (dispatcher/service.py), instead of after the ack wait. (Should another
process have held it in between and died holding requests, those wait for the ack wait.)

Renewals are compare-and-set on the revision last written, every `ttl_s / 4`. The lease
counts as valid for `VALID_SHARE` of the TTL after a renewal was *sent*, by the local
monotonic clock, so it stops counting before the server can let it age out; a process
paused past that (SIGSTOP, a long stall) finds it invalid on waking, before its next
renewal tells it whether the lease is still its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

import msgspec
import nats.errors
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from broker_config.lease_key import LEASE_KEY, LeaseRecord, epoch_of

log = logging.getLogger("fairq.lease")

# The share of the TTL after a renewal was sent during which the lease counts as held.
VALID_SHARE = 0.75
# How often a standby tries to take the lease.
POLL_S = 0.1


def _holder(value: bytes | None) -> str | None:
    try:
        return msgspec.json.decode(value or b"", type=LeaseRecord).holder
    except msgspec.DecodeError:
        return None


def holder_id() -> str:
    """Names a dispatcher process in the lease record (and in the logs)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Lease:
    def __init__(
        self,
        holder: str,
        *,
        ttl_s: float,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv: KeyValue | None = None
        self.holder = holder
        self.ttl_s = ttl_s
        self.poll_s = poll_s
        self.clock = clock
        self.epoch = 0  # 0 until acquired
        self.lost = asyncio.Event()
        self.released = False  # given up by `release` (a planned stop), not lost
        self._revision = 0
        self._renewed_at = float("-inf")
        self._renewals: asyncio.Task[None] | None = None
        self._lost_it = False  # this process held the lease last and lost it
        self._standing_by = False  # said so since the lease was last unreadable

    async def acquire(self, kv: KeyValue, ttl_s: float | None = None) -> bool:
        """Wait until the lease is this process's; True if what its last holder held must
        be taken back (see the module doc). `ttl_s`: the TTL the bucket really has, if
        not this lease's own (`broker_config.lease_key.ensure_leases_bucket`)."""
        self.kv = kv
        self.ttl_s = ttl_s or self.ttl_s
        self.lost = asyncio.Event()
        self.released = False
        self.epoch = 0
        self._renewed_at = float("-inf")  # not valid on the last tenure's renewals
        waiting_since = self.clock()
        self._standing_by = False
        while True:
            sent = self.clock()
            taken = await self._take()
            if taken is None:
                await asyncio.sleep(self.poll_s)
                continue
            revision, released = taken
            take_back = not released and not self._lost_it
            self.epoch = self._revision = revision
            self._renewed_at = sent
            self._lost_it = False
            self._renewals = asyncio.create_task(self._renew_loop(), name="lease-renewals")
            log.info(
                "took the lease (epoch %d) after %.1f s%s",
                self.epoch,
                self.clock() - waiting_since,
                "" if take_back else ", nothing to take back from its last holder",
            )
            return take_back

    def valid(self) -> bool:
        return not self.lost.is_set() and self.clock() - self._renewed_at < VALID_SHARE * self.ttl_s

    async def release(self) -> None:
        """Give the lease up (a planned stop): a standby takes it within its poll."""
        await self._stop_renewals()
        if self.lost.is_set() or not self.epoch:
            return
        self.lost.set()  # not ours from here on: nothing may be dispatched under it
        try:
            await self.kv.delete(LEASE_KEY, last=self._revision)
        except (nats.errors.Error, KeyWrongLastSequenceError) as exc:
            # Not released: the next holder takes back what this one held.
            log.warning("could not release the lease (%r); it ages out in %.1f s", exc, self.ttl_s)
        else:
            self.released = True

    # -- internals -----------------------------------------------------------------------

    def _record(self, epoch: int) -> bytes:
        return msgspec.json.encode(LeaseRecord(holder=self.holder, epoch=epoch))

    async def _take(self) -> tuple[int, bool] | None:
        """Take the lease if it is free: (revision, whether its last holder released it,
        i.e. the write replaced a delete marker); None if someone holds it."""
        try:
            entry = await self.kv.get(LEASE_KEY)
            if _holder(entry.value) != self.holder:
                self._lost_it = False  # someone else held it since
            if not self._standing_by:
                log.info("standing by: another dispatcher holds the lease")
                self._standing_by = True
            return None
        except NotFoundError as exc:
            # nats-py reports a delete marker as not found, with the marker as its entry.
            marker = getattr(exc, "entry", None)
            last, released = (marker.revision or 0, True) if marker else (0, False)
        except nats.errors.Error as exc:
            log.warning("could not read the lease: %r", exc)
            self._standing_by = False  # said again once it can be read
            return None
        try:
            # Compare-and-set on what was read: taken by another standby meanwhile, it fails.
            return await self.kv.update(LEASE_KEY, self._record(0), last=last), released
        except (KeyWrongLastSequenceError, nats.errors.Error):
            return None

    async def _renew_loop(self) -> None:
        every = self.ttl_s / 4
        while True:
            await asyncio.sleep(every)
            sent = self.clock()
            try:
                self._revision = await asyncio.wait_for(
                    self.kv.update(LEASE_KEY, self._record(self.epoch), last=self._revision), every
                )
                self._renewed_at = sent
            except KeyWrongLastSequenceError:
                if not await self._still_ours():
                    self._lose(
                        "it expired (this process did not run for its TTL) or "
                        "another dispatcher took it",
                        to_another=True,
                    )
                    return
            except (TimeoutError, nats.errors.Error) as exc:
                if not self.valid():
                    self._lose(
                        f"could not renew the lease within its TTL ({exc!r})", to_another=False
                    )
                    return

    async def _still_ours(self) -> bool:
        """After a failed compare-and-set: a renewal whose answer was lost may have been
        stored; if the key still holds this tenure's record, carry on from its revision."""
        try:
            entry = await self.kv.get(LEASE_KEY)
        except nats.errors.Error:  # gone, deleted, or unreadable: not provably ours
            return False
        if (
            _holder(entry.value) != self.holder
            or epoch_of(entry.value, entry.revision or 0) != self.epoch
        ):
            return False
        self._revision = entry.revision or 0
        return True

    def _lose(self, why: str, *, to_another: bool) -> None:
        log.error("lost the lease (epoch %d): %s; dispatching stops", self.epoch, why)
        self._lost_it = not to_another
        self.lost.set()

    async def _stop_renewals(self) -> None:
        if self._renewals is not None:
            self._renewals.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewals
            self._renewals = None

"""Requests found by id in the streams, for the status and cancel APIs.

    lookup = StreamLookup(streams, subjects, held, parse)
    found = await lookup.find((tenant, request_id))   # InStream, or None
    await lookup.close()                               # before the readers close

A request not taken in yet is found only by reading its tenant's messages: in the parked
stream, then in the requests stream (batch direct gets, in stream order; a tenant's
parked requests are older than those still in its shard). That costs a read of the
tenant's whole backlog for an id that is not there. So that a flood of calls (for ids
never sent, say) cannot multiply that cost, the lookups of a tenant are batched: while
one scan of its messages runs, the ids asked for meanwhile wait and are all looked for
by the next one; and at most `max_scans` tenants are scanned at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from broker_config import wire
from broker_config.direct_get import DirectBatchGet, StoredMessage
from broker_config.subjects import HDR_CONTENT_TYPE, HDR_MSG_ID, Subjects
from dispatcher.core.pool import Key
from dispatcher.dispatch.held import HeldRequests
from dispatcher.intake.park import restored_headers

# Messages read per round trip.
SCAN_BATCH = 256
# Tenants whose messages are read at the same time.
MAX_SCANS = 4


@dataclass(frozen=True, slots=True)
class InStream:
    """A request found in a stream, not yet taken in by the dispatcher."""

    stream: str
    seq: int
    submission: wire.Submission | None  # None: it breaks the contract (intake answers it)
    waiting_before: int  # the tenant's requests to the same endpoint ahead of it


@dataclass(slots=True)
class _Batch:
    """Ids of one tenant waiting for the same scan."""

    wanted: dict[str, asyncio.Future[InStream | None]] = field(default_factory=dict)


class StreamLookup:
    def __init__(
        self,
        streams: tuple[tuple[DirectBatchGet, Callable[[str], str]], ...],
        subjects: Subjects,
        held: HeldRequests,
        parse: Callable[[StoredMessage], wire.Submission | None],
        max_scans: int = MAX_SCANS,
    ) -> None:
        self.streams = streams  # (reader, tenant -> its subject filter), oldest first
        self.subjects = subjects
        self.held = held
        self.parse = parse
        self._scans = asyncio.Semaphore(max_scans)
        self._next: dict[str, _Batch] = {}  # tenant -> the ids its next scan looks for
        self._latest: dict[str, asyncio.Task[None]] = {}  # tenant -> its latest scan
        self._tasks: set[asyncio.Task[None]] = set()

    async def find(self, key: Key) -> InStream | None:
        """The request's message if it is still in a stream. Raises what the broker
        raised (its other callers of the same scan get the same error)."""
        tenant, request_id = key
        batch = self._next.get(tenant)
        if batch is None:
            batch = self._next[tenant] = _Batch()
            previous = self._latest.get(tenant)
            task = asyncio.create_task(self._scan_after(previous, tenant, batch))
            self._latest[tenant] = task
            self._tasks.add(task)
            task.add_done_callback(lambda done: self._forget(tenant, done))
        pending = batch.wanted.get(request_id)
        if pending is None:
            pending = batch.wanted[request_id] = asyncio.get_running_loop().create_future()
        return await asyncio.shield(pending)

    async def close(self) -> None:
        """Stop the scans running (before the readers close); their callers' calls end."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _forget(self, tenant: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._latest.get(tenant) is task:
            del self._latest[tenant]

    async def _scan_after(
        self, previous: asyncio.Task[None] | None, tenant: str, batch: _Batch
    ) -> None:
        """Scan for `batch` once the tenant's previous scan is over; ids asked for until
        this one starts join it."""
        try:
            if previous is not None:
                await asyncio.wait([previous])
            async with self._scans:
                del self._next[tenant]  # from now on, ids asked for wait for the next scan
                found = await self._scan(tenant, set(batch.wanted))
        except asyncio.CancelledError:
            if self._next.get(tenant) is batch:  # cancelled before it started
                del self._next[tenant]
            for pending in batch.wanted.values():
                pending.cancel()
            raise
        except Exception as exc:
            for pending in batch.wanted.values():
                if not pending.done():
                    pending.set_exception(exc)
                    pending.exception()  # retrieved: a caller that gave up logs nothing
            return
        for request_id, pending in batch.wanted.items():
            if not pending.done():
                pending.set_result(found.get(request_id))

    async def _scan(self, tenant: str, wanted: set[str]) -> dict[str, InStream]:
        """The messages of `wanted` ids, read in stream order until all are found."""
        found: dict[str, InStream] = {}
        ahead: dict[str, int] = {}  # endpoint -> the tenant's messages ahead for it
        for reader, tenant_filter in self.streams:
            seq = 0
            while True:
                messages = await reader.scan(tenant_filter(tenant), seq + 1, SCAN_BATCH)
                for message in messages:
                    seq = message.seq
                    endpoint = message.subject.split(".")[-2]
                    if self.subjects.is_parked(message.subject):
                        message = replace(message, headers=restored_headers(message.headers))
                    request_id = request_id_of(message) or ""
                    if request_id in wanted and request_id not in found:
                        found[request_id] = InStream(
                            reader.stream, seq, self.parse(message), ahead.get(endpoint, 0)
                        )
                        if len(found) == len(wanted):
                            return found
                    if self.held.get((tenant, request_id)) is None:
                        ahead[endpoint] = ahead.get(endpoint, 0) + 1
                if len(messages) < SCAN_BATCH:
                    break
        return found


def request_id_of(message: StoredMessage) -> str | None:
    headers = message.headers or {}
    header_id = wire.header(headers, HDR_MSG_ID)
    if header_id is not None:
        return header_id
    try:  # no header: the id is in the body (rare; the contract asks for the header)
        encoding = wire.Encoding.from_content_type(wire.header(headers, HDR_CONTENT_TYPE))
        return wire.SUBMIT_REQUEST.decode(message.data, encoding).id
    except (ValueError, wire.WireError):
        return None

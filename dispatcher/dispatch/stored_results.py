"""Final events: stored in the results bucket (keyed `<tenant>.<id>`), then published to
the request's reply subject.

    async with Results(nc, subjects) as results:
        stored = await results.lookup(keys)        # one batch direct get for many
        await results.finish(msg, submission, event) # a request the dispatcher ends itself

Every store is create-only: a request has exactly one result, the first one stored.

Stored results answer `status` (async jobs) and redeliveries (a request that finished
before a restart is answered, not run again). Drain order on exit: the writer fails the
puts still waiting, then the reader closes.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError

from broker_config import jetstream, wire, wire_internal
from broker_config.direct_get import DirectBatchGet, DirectGetError
from broker_config.kv_writer import KeyValueWriter
from broker_config.subjects import HDR_CONTENT_TYPE, Subjects
from dispatcher.core.pool import Key

log = logging.getLogger("fairq.dispatcher")

STORE_ATTEMPTS = 3  # create-only puts of one result, when its key looks empty but is not
# What a broker that is unreachable or slow raises from the calls below.
BROKER_ERRORS = (DirectGetError, nats.errors.Error, TimeoutError)


class Results:
    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.bucket = subjects.results_bucket
        self.epoch = 0  # the lease epoch aborts carry (broker_config/lease_key.py)
        self._stack = contextlib.AsyncExitStack()
        self._reader: DirectBatchGet | None = None
        self._writer: KeyValueWriter | None = None

    async def __aenter__(self) -> Results:
        stack = self._stack
        self._reader = await stack.enter_async_context(
            DirectBatchGet(self.nc, jetstream.kv_stream(self.bucket))
        )
        self._writer = await stack.enter_async_context(KeyValueWriter(self.nc, self.bucket))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    def _subject(self, key: Key) -> str:
        return jetstream.kv_subject(self.bucket, self.subjects.result_key(*key))

    async def lookup(self, keys: list[Key]) -> dict[Key, wire_internal.StoredResult]:
        """The stored results among `keys`, in one round trip. Raises DirectGetError."""
        subjects = {self._subject(key): key for key in keys}
        found = await self._reader.last(list(subjects))
        results = {}
        for subject, data in found.items():
            try:
                results[subjects[subject]] = wire_internal.STORED_RESULT.decode(data)
            except msgspec.DecodeError:  # one bad entry must not fail the whole batch
                log.error(
                    "results bucket: %s holds no stored result (%d bytes); treated as absent",
                    subject,
                    len(data),
                )
        return results

    async def get(self, key: Key) -> wire_internal.StoredResult | None:
        return (await self.lookup([key])).get(key)

    async def store(
        self, tenant: str, endpoint: str, event: wire.FinalEvent, now: float
    ) -> wire.FinalEvent:
        """Store `event` as the request's result unless it has one: create-only, so a
        worker that finished it meanwhile keeps its result. The result that stands."""
        value = wire.encode(
            wire_internal.StoredResult(tenant=tenant, endpoint=endpoint, event=event, stored_at=now)
        )
        key = self.subjects.result_key(tenant, event.id)
        for _ in range(STORE_ATTEMPTS):
            try:
                await self._writer.create(key, value)
                return event
            except KeyWrongLastSequenceError:
                standing = await self.get((tenant, event.id))
                if standing is not None:
                    return standing.event
                # Gone since (its age passed), or a tombstone: try again.
        # Only a tombstone (an operator deleted the key) stays in the way of a create.
        await self._writer.put(key, value)
        return event

    async def publish(self, reply: str | None, encoding: wire.Encoding, event: Any) -> None:
        if reply:
            await self.nc.publish(
                reply,
                wire.encode(event, encoding),
                headers={HDR_CONTENT_TYPE: encoding.content_type},
            )

    async def abort(self, endpoint: str, key: Key, code: wire.ErrorCode) -> None:
        """Stop a running request wherever it runs: its worker ends it with `code` (and
        stores that only if it has no result yet)."""
        abort = wire_internal.Abort(
            endpoint=endpoint, tenant=key[0], ids=[key[1]], code=code, epoch=self.epoch
        )
        await self.nc.publish(
            self.subjects.abort(endpoint),
            wire.encode(abort),
            headers={HDR_CONTENT_TYPE: wire.Encoding.JSON.content_type},
        )

    async def finish(
        self, msg: Msg, submission: wire.Submission, event: wire.FinalEvent, now: float
    ) -> wire.FinalEvent:
        """End a request here, without a worker: store, tell the client, drop the message.
        If it has a result already (a worker stored one meanwhile), the client gets that.
        The result that stands. Raises one of BROKER_ERRORS."""
        event = await self.store(submission.tenant, submission.endpoint, event, now)
        await self.publish(submission.reply, submission.encoding, event)
        await msg.term()
        return event

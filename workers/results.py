"""A finished request's final event into the results bucket: create-only, with bounded
retries, so a request has exactly one result.

    results = FinalResults(nc, subjects, KeyValueWriter(nc, subjects.results_bucket))
    stored, reply = await results.store(key, item, event)

`stored` tells the dispatcher it may ack the request; `reply` is what the request's
reply subject gets: this run's event, or the one another run stored first (this worker
was thought lost and the request ran again elsewhere, or the dispatcher ended it), or
None when storing failed for good (the dispatcher then redelivers the request, and the
client must not have seen a final event).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.errors import KeyWrongLastSequenceError

from broker_config.jetstream import kv_stream, kv_subject
from broker_config.subjects import Subjects
from broker_config.wire import FinalEvent, encode
from broker_config.wire_internal import STORED_RESULT, BatchItem, StoredResult

log = logging.getLogger(__name__)

# Storing a final event: attempts, and the backoff before each retry (doubling, capped).
# Together about 13 s: longer than a cluster takes to elect the bucket's new leader after
# losing a node, so that a finished request is not run again for want of patience.
STORE_ATTEMPTS = 12
STORE_BACKOFF_S = 0.05
STORE_BACKOFF_MAX_S = 2.0


class ResultStore(Protocol):
    """Where final events go: `broker_config.kv_writer.KeyValueWriter` (or nats-py's
    KeyValue) on the results bucket. `create` returns once the value is stored, and
    raises KeyWrongLastSequenceError if the key holds a value already."""

    async def create(self, key: str, value: bytes) -> object: ...


class FinalResults:
    def __init__(self, nc: Client, subjects: Subjects, store: ResultStore) -> None:
        self._nc = nc
        self._bucket = subjects.results_bucket
        self._store = store

    async def store(
        self, key: str, item: BatchItem, event: FinalEvent
    ) -> tuple[bool, FinalEvent | None]:
        """(stored, the event for the reply subject) for the request `key` names."""
        value = encode(
            StoredResult(
                tenant=item.tenant, endpoint=item.endpoint, event=event, stored_at=time.time()
            )
        )
        delay = STORE_BACKOFF_S
        for attempt in range(1, STORE_ATTEMPTS + 1):
            try:
                await self._store.create(key, value)
                return True, event
            except KeyWrongLastSequenceError:
                # Also after a put whose ack was lost: then the standing result is ours.
                log.info("request %s has a result already; it stands", key)
                return True, await self._standing(key)
            except nats.errors.Error as exc:
                log.warning(
                    "storing the result of %s failed (attempt %d of %d): %r",
                    key,
                    attempt,
                    STORE_ATTEMPTS,
                    exc,
                )
            if attempt < STORE_ATTEMPTS:
                await asyncio.sleep(delay)
                delay = min(2 * delay, STORE_BACKOFF_MAX_S)
        log.error(
            "could not store the result of %s: reporting it unstored, so the "
            "dispatcher redelivers it",
            key,
        )
        return False, None

    async def _standing(self, key: str) -> FinalEvent | None:
        """The result stored for `key` (None if it cannot be read now: it is stored, so
        the request is still answered through `status`)."""
        try:
            msg = await self._nc.jetstream().get_last_msg(
                kv_stream(self._bucket), kv_subject(self._bucket, key)
            )
            return STORED_RESULT.decode(msg.data).event
        except (nats.errors.Error, msgspec.DecodeError) as exc:
            log.warning("cannot read the standing result of %s: %r", key, exc)
            return None

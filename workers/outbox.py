"""What a worker sends: a request's events to its reply subject, and the internal messages
(completions, heartbeats) to the dispatcher.

Events are at-most-once (the final one is also in the results bucket); internal messages
go as JSON with a `Content-Type` header. Completions of the requests that finish in one
turn of the event loop go out in one message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import nats.errors
from nats.aio.client import Client

from broker_config.subjects import HDR_CONTENT_TYPE
from broker_config.wire import Encoding, FinalEvent, TokenEvent, encode
from broker_config.wire_internal import BatchItem, Completion, Completions

log = logging.getLogger("workers.service")

INTERNAL_ENCODING = Encoding.JSON

Spawn = Callable[[Coroutine[Any, Any, None]], object]


class Outbox:
    def __init__(self, nc: Client, completions_subject: str) -> None:
        self._nc = nc
        self._completions_subject = completions_subject
        self._completions: list[Completion] = []

    async def event(self, item: BatchItem, event: TokenEvent | FinalEvent) -> None:
        if item.reply is None:
            return
        try:
            await self._nc.publish(
                item.reply,
                encode(event, item.encoding),
                headers={HDR_CONTENT_TYPE: item.encoding.content_type},
            )
        except nats.errors.Error as exc:
            # Events are at-most-once; the final one is also in the results bucket.
            log.warning("publishing an event of %s to %s failed: %r", item.id, item.reply, exc)

    async def internal(self, subject: str, message: object) -> None:
        try:
            await self._nc.publish(
                subject,
                encode(message, INTERNAL_ENCODING),
                headers={HDR_CONTENT_TYPE: INTERNAL_ENCODING.content_type},
            )
        except nats.errors.Error as exc:
            log.error("publishing to %s failed: %r", subject, exc)

    def report(self, completion: Completion, spawn: Spawn | None) -> None:
        """Queue a completion; the requests finishing in this turn of the event loop are
        reported in one message (one NATS message per request was a real share of both
        the worker's and the dispatcher's CPU when many finish together). `spawn` starts
        the task that sends them (None: the drain sends what is queued)."""
        self._completions.append(completion)
        if len(self._completions) == 1 and spawn is not None:
            spawn(self.send_completions())

    async def send_completions(self) -> None:
        await asyncio.sleep(0)  # let the other requests finishing now join
        if not self._completions:
            return  # sent already by the drain
        items, self._completions = self._completions, []
        await self.internal(self._completions_subject, Completions(items))

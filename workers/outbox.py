"""What a worker sends: a request's events to its reply subject, internal messages
(heartbeats, completions) to the dispatcher, and the Completions of the requests that
finish in one turn of the event loop gathered into one message.

A request's events go in the request's encoding, internal messages as JSON, each with a
`Content-Type` header. A failed publish is logged, not raised.
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

# The worker service's logger: its records keep one name, whichever module they come from.
log = logging.getLogger("workers.service")

_INTERNAL_ENCODING = Encoding.JSON

# Runs a job in a task of the service's task group (nothing once the service has left).
Spawn = Callable[[Callable[[], Coroutine[Any, Any, None]], str], None]


class Outbox:
    """One worker's outgoing messages on its connection; `completion_subject` is the
    worker's `Subjects.completion`."""

    def __init__(self, nc: Client, completion_subject: str, spawn: Spawn) -> None:
        self._nc = nc
        self._completion_subject = completion_subject
        self._spawn = spawn
        self._completions: list[Completion] = []

    async def send_event(self, item: BatchItem, event: TokenEvent | FinalEvent) -> None:
        """One event of a request to its reply subject, if it has one."""
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

    async def publish_internal(self, subject: str, message: object) -> None:
        try:
            await self._nc.publish(
                subject,
                encode(message, _INTERNAL_ENCODING),
                headers={HDR_CONTENT_TYPE: _INTERNAL_ENCODING.content_type},
            )
        except nats.errors.Error as exc:
            log.error("publishing to %s failed: %r", subject, exc)

    def report(self, completion: Completion) -> None:
        """Queue a completion; the requests finishing in this turn of the event loop are
        reported in one message (one NATS message per request was a real share of both
        the worker's and the dispatcher's CPU when many finish together)."""
        self._completions.append(completion)
        if len(self._completions) == 1:
            self._spawn(self.send_completions, "worker-completions")

    async def send_completions(self) -> None:
        """Send the queued completions (the drain calls it before the final heartbeat)."""
        await asyncio.sleep(0)  # let the other requests finishing now join
        if not self._completions:
            return  # sent already by the drain
        items, self._completions = self._completions, []
        await self.publish_internal(self._completion_subject, Completions(items))

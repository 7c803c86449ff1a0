"""Many messages of a stream in one round trip (JetStream batch direct gets).

    async with DirectBatchGet(nc, jetstream.kv_stream("FQ_RESULTS")) as reader:
        found = await reader.last([jetstream.kv_subject("FQ_RESULTS", "acme.r1")])  # subject: data
    async with DirectBatchGet(nc, "FQ_REQUESTS") as reader:
        page = await reader.scan("fq.req.*.acme", from_seq=1, batch=256)  # in stream order

One `$JS.API.DIRECT.GET.<stream>` request answers with one reply per message and ends
with a `204 EOB` status, or `404` if nothing matched. `last` (`multi_last`) gives the
newest message of each subject that has one: the dispatcher looks up stored results for
a whole intake batch this way instead of one KV get per request. `scan` (`next_by_subj`)
reads a subject filter's messages in order from a sequence: the dispatcher finds a
request still waiting in the stream this way. Needs `allow_direct` on the stream and
nats-server 2.11 or newer (`broker_config.server.MIN_NATS_SERVER`).

Replies of all requests come to one wildcard subscription, `<inbox>.<request number>`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from broker_config import jetstream


class DirectGetError(RuntimeError):
    """The server refused or did not answer a batch direct get."""


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """A message as the stream holds it."""

    subject: str
    seq: int
    headers: Mapping[str, str]
    data: bytes


class DirectBatchGet:
    def __init__(self, nc: NATS, stream: str, *, timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.stream = stream
        self.timeout_s = timeout_s
        self._inbox = ""
        self._subscription = None
        self._numbers = itertools.count()
        self._open: dict[str, tuple[list[StoredMessage], asyncio.Future[None]]] = {}

    async def __aenter__(self) -> DirectBatchGet:
        self._inbox = self.nc.new_inbox()
        self._subscription = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._subscription.unsubscribe()
        for _, done in self._open.values():
            if not done.done():
                done.set_exception(DirectGetError("reader closed"))

    async def last(self, subjects: list[str]) -> dict[str, bytes]:
        """subject -> data of its newest message, for the subjects that have one
        (KV tombstones, which carry no value, are left out)."""
        if not subjects:
            return {}
        found = await self._get(jetstream.direct_get_last(subjects))
        return {m.subject: m.data for m in found if jetstream.KV_OPERATION not in m.headers}

    async def scan(self, subject_filter: str, from_seq: int, batch: int) -> list[StoredMessage]:
        """Up to `batch` messages on `subject_filter` from `from_seq` on, in stream order."""
        return await self._get(jetstream.direct_get_next(subject_filter, from_seq, batch))

    async def _get(self, request: bytes) -> list[StoredMessage]:
        number = str(next(self._numbers))
        found: list[StoredMessage] = []
        done = asyncio.get_running_loop().create_future()
        self._open[number] = (found, done)
        try:
            await self.nc.publish(
                jetstream.direct_get_subject(self.stream), request, reply=f"{self._inbox}.{number}"
            )
            await asyncio.wait_for(done, self.timeout_s)
        except (TimeoutError, nats.errors.Error) as exc:
            raise DirectGetError(f"batch direct get on {self.stream}: {exc!r}") from exc
        finally:
            self._open.pop(number, None)
        return found

    async def _on_reply(self, msg: Msg) -> None:
        entry = self._open.get(msg.subject.rsplit(".", 1)[1])
        if entry is None:
            return  # a reply after its request timed out
        found, done = entry
        status, description = jetstream.status_of(msg)
        headers = msg.headers or {}
        if status is None:
            found.append(
                StoredMessage(
                    headers[jetstream.NATS_SUBJECT],
                    int(headers[jetstream.NATS_SEQUENCE]),
                    headers,
                    msg.data,
                )
            )
            return
        if done.done():
            return
        if status in (jetstream.END_OF_BATCH, jetstream.NOT_FOUND):
            done.set_result(None)
        else:
            done.set_exception(
                DirectGetError(f"batch direct get on {self.stream}: {status} {description}")
            )

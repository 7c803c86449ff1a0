"""Publishes into a JetStream stream or KV bucket, many in flight, each awaiting its ack,
cheaply.

    async with KeyValueWriter(nc, "FQ_RESULTS") as results:
        await results.put("acme.r1", value)     # returns once the server stored it
        await results.create("acme.r2", value)  # only if acme.r2 holds no value yet
    async with StreamWriter(nc, "FQ_PARKED") as parked:
        await parked.publish("fq.park.chat.acme", data, headers)

Same contract as nats-py's `KeyValue.put` and `JetStream.publish`, a JetStream request:
a random inbox token, a future and an `asyncio.wait_for` timer per call, and the ack
parsed as JSON. On the worker's hot path (one final event stored per request) that was
about a quarter of its CPU. Here acks come to one wildcard subscription keyed by a
counter, one sweep task fails puts that are overdue, and an ack is parsed only when it
is not a plain success.

Drain order on exit: stop the sweep, unsubscribe, fail the puts still waiting.
"""

from __future__ import annotations

import asyncio
import itertools

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError

from broker_config import jetstream


class PutError(nats.errors.Error):
    """The server refused a put, or its ack did not come in time. A nats-py error, so
    callers that retry on `nats.errors.Error` retry on this too."""


class Refused(PutError):
    """The stream answered with an error: sending the same again fails the same way
    (a per-subject limit, a header it refuses). `err_code` is JetStream's."""

    def __init__(self, message: str, err_code: int | None = None) -> None:
        super().__init__(message)
        self.err_code = err_code


class StreamWriter:
    def __init__(self, nc: NATS, name: str, *, timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.name = name  # of the stream or bucket, for errors
        self.timeout_s = timeout_s
        self._inbox = ""
        self._subscription = None
        self._tokens = itertools.count()
        self._waiting: dict[str, tuple[asyncio.Future[None], float]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    async def __aenter__(self) -> StreamWriter:
        self._inbox = self.nc.new_inbox()
        self._subscription = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_ack)
        self._sweeper = asyncio.create_task(self._sweep(), name=f"writer-{self.name}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._closed = True
        self._sweeper.cancel()
        await asyncio.gather(self._sweeper, return_exceptions=True)
        await self._subscription.unsubscribe()
        self._fail_all(PutError(f"writer for {self.name} closed"))

    async def publish(
        self, subject: str, value: bytes, headers: dict[str, str] | None = None
    ) -> None:
        """Returns once the stream stored it (or had stored it: a duplicate)."""
        if self._closed:
            raise PutError(f"writer for {self.name} closed")
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._waiting[token] = (done, loop.time() + self.timeout_s)
        try:
            await self.nc.publish(subject, value, reply=f"{self._inbox}.{token}", headers=headers)
            await done
        finally:
            self._waiting.pop(token, None)

    async def _on_ack(self, msg: Msg) -> None:
        entry = self._waiting.get(msg.subject.rsplit(".", 1)[1])
        if entry is None or entry[0].done():
            return  # an ack after its put timed out
        done, _ = entry
        status, description = jetstream.status_of(msg)
        if status is not None:  # 503: no stream listens on the subject
            done.set_exception(PutError(f"put into {self.name}: status {status} {description}"))
        elif jetstream.is_put_ack(msg.data):
            done.set_result(None)
        else:
            err_code, description = jetstream.ack_error(msg.data)
            done.set_exception(Refused(f"put into {self.name}: {description}", err_code))

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.timeout_s / 4)
            now = loop.time()
            for done, deadline in list(self._waiting.values()):
                if deadline < now and not done.done():
                    done.set_exception(
                        PutError(f"put into {self.name}: no ack within {self.timeout_s:g}s")
                    )

    def _fail_all(self, error: PutError) -> None:
        for done, _ in self._waiting.values():
            if not done.done():
                done.set_exception(error)


class KeyValueWriter(StreamWriter):
    def __init__(self, nc: NATS, bucket: str, *, timeout_s: float = 5.0) -> None:
        super().__init__(nc, bucket, timeout_s=timeout_s)
        self.bucket = bucket

    async def put(self, key: str, value: bytes) -> None:
        await self.publish(jetstream.kv_subject(self.bucket, key), value)

    async def create(self, key: str, value: bytes) -> None:
        """Store `value` only if `key` holds none; else raise nats-py's
        KeyWrongLastSequenceError, as `KeyValue.create` does. Unlike that, a deleted key
        is not re-created: fairq never deletes from the buckets it creates into."""
        try:
            await self.publish(
                jetstream.kv_subject(self.bucket, key),
                value,
                {jetstream.EXPECTED_LAST_SUBJECT_SEQUENCE: "0"},
            )
        except Refused as exc:
            if exc.err_code == jetstream.ERR_WRONG_LAST_SEQUENCE:
                raise KeyWrongLastSequenceError(f"{self.bucket}: {key} holds a value") from exc
            raise

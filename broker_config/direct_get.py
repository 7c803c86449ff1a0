"""The newest message of many subjects in one round trip (JetStream batch direct get).

    async with DirectBatchGet(nc, "KV_FQ_RESULTS") as reader:
        found = await reader.last(["$KV.FQ_RESULTS.acme.r1", ...])   # subject -> data

One `$JS.API.DIRECT.GET.<stream>` request with `multi_last` answers every subject that
has a message (one reply each) and ends with a `204 EOB` status, or `404` if none has;
subjects without a message are simply absent. The dispatcher looks up stored results for
a whole intake batch this way instead of one KV get per request. Needs `allow_direct` on
the stream (the results bucket is provisioned with it) and nats-server 2.11 or newer.

Replies of all requests come to one wildcard subscription, `<inbox>.<request number>`.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

KV_OPERATION = "KV-Operation"  # DEL or PURGE on a KV tombstone: no value
END_OF_BATCH = "204"
NO_RESULTS = "404"


class DirectGetError(RuntimeError):
    """The server refused or did not answer a batch direct get."""


class DirectBatchGet:
    def __init__(self, nc: NATS, stream: str, *, timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.stream = stream
        self.timeout_s = timeout_s
        self._inbox = ""
        self._subscription = None
        self._numbers = itertools.count()
        self._open: dict[str, tuple[dict[str, bytes], asyncio.Future[None]]] = {}

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
        """subject -> data of its newest message, for the subjects that have one."""
        if not subjects:
            return {}
        number = str(next(self._numbers))
        found: dict[str, bytes] = {}
        done = asyncio.get_running_loop().create_future()
        self._open[number] = (found, done)
        try:
            request = json.dumps({"multi_last": subjects, "batch": len(subjects)}).encode()
            await self.nc.publish(f"$JS.API.DIRECT.GET.{self.stream}", request,
                                  reply=f"{self._inbox}.{number}")
            await asyncio.wait_for(done, self.timeout_s)
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            raise DirectGetError(f"batch direct get on {self.stream}: {exc!r}") from exc
        finally:
            self._open.pop(number, None)
        return found

    async def _on_reply(self, msg: Msg) -> None:
        entry = self._open.get(msg.subject.rsplit(".", 1)[1])
        if entry is None:
            return  # a reply after its request timed out
        found, done = entry
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is None:
            if headers.get(KV_OPERATION) is None:
                found[headers["Nats-Subject"]] = msg.data
            return
        if done.done():
            return
        if status in (END_OF_BATCH, NO_RESULTS):
            done.set_result(None)
        else:
            done.set_exception(DirectGetError(
                f"batch direct get on {self.stream}: {status} {headers.get('Description', '')}"))

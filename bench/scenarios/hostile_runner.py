"""The hostile suite's sender (`bench.scenarios.hostile`): `Runner` sends the probes of
`bench.scenarios.hostile_inputs` on one connection, takes their events on one wildcard
inbox, and checks each message against the outcome the contract promises (`Report`);
`flood` is the status and cancel flood that follows the probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import nats
import nats.errors
from nats.aio.msg import Msg

from bench.scenarios.hostile_inputs import Probe, Send
from broker_config import wire
from broker_config.subjects import HDR_CONTENT_TYPE, HDR_MSG_ID, HDR_REPLY, is_request_id

# Bounds, so that a stalled dispatcher fails the run instead of hanging it.
PUBLISH_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 60.0
# The forged reply subjects a leak would reach (bench.scenarios.hostile_inputs.BAD_REPLIES).
WATCHED_REPLIES = ("fq.req.chat.globex", "$JS.API.STREAM.DELETE.>", "a.*", "a.>")
# The flood after the probes: its tenant's backlog waits on an endpoint without workers.
FLOOD_ENDPOINT = "embed"
FLOOD_TENANT = "initech"
VICTIM = "globex"
VICTIM_CALLS = 20
# Above the dispatcher's cap of a tenant's calls in flight (MAX_API_CALLS_PER_TENANT).
FLOOD_IN_FLIGHT = 256


@dataclass(slots=True)
class Report:
    sends: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    got: Counter[str] = field(default_factory=Counter)
    mismatches: list[dict[str, str]] = field(default_factory=list)
    valid_latency_s: list[float] = field(default_factory=list)
    unanswered: int = 0  # stored without a usable Fq-Reply

    def check(self, probe: Probe, send: Send, got: str, message: str) -> None:
        self.sends += 1
        self.got[got] += 1
        wanted = send.detail.lower()
        if got == "unanswered":
            self.unanswered += 1
        if got != send.expect or (wanted and wanted not in message.lower()):
            self.mismatches.append(
                {
                    "kind": probe.kind,
                    "expect": send.expect,
                    "detail": send.detail,
                    "got": got,
                    "message": message[:300],
                    "subject": send.subject[:120],
                    "body": repr(send.body[:120]),
                }
            )


class Runner:
    """Sends probes on one connection; events come back on one wildcard inbox."""

    def __init__(self, nc: nats.NATS, url: str, report: Report) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
        self.url = url
        self.report = report
        self.inbox = nc.new_inbox()
        self.numbers = itertools.count()
        self.waiting: dict[str, asyncio.Future[wire.FinalEvent]] = {}
        self.leaks: list[str] = []

    async def start(self) -> None:
        await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_event)
        for subject in WATCHED_REPLIES:
            await self.nc.subscribe(subject, cb=self._on_leak)

    async def run(self, probes: list[Probe], concurrency: int) -> None:
        slots = asyncio.Semaphore(concurrency)

        async def one(probe: Probe) -> None:
            async with slots:
                await self.probe(probe)

        async with asyncio.TaskGroup() as group:
            for probe in probes:
                group.create_task(one(probe))

    async def probe(self, probe: Probe) -> None:
        self.report.by_kind[probe.kind] += 1
        msg_id = None
        for send in probe.sends:
            await asyncio.sleep(send.pause_s)
            if not send.same_id_as_previous:
                msg_id = None if send.msg_id is None else f"{send.msg_id}{next(self.numbers)}"
            got, message, pending = await self._send(send, msg_id)
            if pending is not None:
                started = time.monotonic()
                got, message = await self._answer(pending, msg_id)
                if send.expect == "done":
                    self.report.valid_latency_s.append(time.monotonic() - started)
            self.report.check(probe, send, got, message)

    async def _send(
        self, send: Send, msg_id: str | None
    ) -> tuple[str, str, asyncio.Future[wire.FinalEvent] | None]:
        headers = dict(send.headers)
        if msg_id is not None:
            headers[HDR_MSG_ID] = msg_id
        if send.api:
            return (*await self._api(send), None)
        if send.expect == "closed":
            return (*await self._over_control_line(send, headers), None)
        pending = None
        if send.reply == "inbox":
            token = str(next(self.numbers))
            headers[HDR_REPLY] = f"{self.inbox}.{token}"
            pending = self.waiting[token] = asyncio.get_running_loop().create_future()
        elif send.reply != "none":
            headers[HDR_REPLY] = send.reply
        try:
            ack = await self.js.publish(send.subject, send.body, headers=headers)
        except Exception as exc:  # what the publisher is told is the finding
            return f"refused:{type(exc).__name__}", str(exc), None
        if ack.duplicate:
            return "duplicate", "", None
        return "unanswered", "", pending

    async def _answer(
        self, pending: asyncio.Future[wire.FinalEvent], msg_id: str | None
    ) -> tuple[str, str]:
        try:
            event = await asyncio.wait_for(pending, ANSWER_TIMEOUT_S)
        except TimeoutError:
            return "no answer", f"nothing within {ANSWER_TIMEOUT_S:g} s"
        if msg_id is not None and is_request_id(msg_id) and event.id != msg_id:
            return "wrong id", f"event for {event.id!r}, sent as {msg_id!r}"
        if isinstance(event, wire.DoneEvent):
            return "done", event.text
        return f"error:{event.code}", event.message

    async def _api(self, send: Send) -> tuple[str, str]:
        try:
            msg = await self.nc.request(send.subject, send.body, timeout=PUBLISH_TIMEOUT_S)
        except Exception as exc:
            return f"refused:{type(exc).__name__}", str(exc)
        return api_outcome(json.loads(msg.data))

    async def _over_control_line(self, send: Send, headers: dict[str, str]) -> tuple[str, str]:
        """A subject longer than the server's protocol line: the server closes the
        connection (with `-ERR 'Maximum Control Line Exceeded'`, which may or may not
        reach the client before the reset), so it goes on a connection of its own. The
        publisher must see its publish fail, never a success."""
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc) or type(exc).__name__)

        own = await nats.connect(
            self.url, error_cb=on_error, allow_reconnect=False, connect_timeout=5
        )
        try:
            await own.jetstream(timeout=2.0).publish(send.subject, send.body, headers=headers)
        except Exception as exc:
            errors.insert(0, f"{type(exc).__name__}: {exc}")
            return "closed", "; ".join(errors)
        finally:
            with contextlib.suppress(Exception):
                await own.close()
        return "stored", "the server took a subject over its control line"

    async def _on_event(self, msg: Msg) -> None:
        token = msg.subject.rsplit(".", 1)[1]
        try:
            encoding = wire.Encoding.from_content_type(wire.header(msg.headers, HDR_CONTENT_TYPE))
            event = wire.EVENT.decode(msg.data, encoding)
        except (ValueError, wire.WireError) as exc:
            self.leaks.append(f"undecodable event on {msg.subject}: {exc}")
            return
        if isinstance(event, wire.TokenEvent):
            return
        pending = self.waiting.pop(token, None)
        if pending is None:
            self.leaks.append(f"a second final event on {msg.subject}: {msg.data[:200]!r}")
        elif not pending.done():
            pending.set_result(event)

    async def _on_leak(self, msg: Msg) -> None:
        if wire.header(msg.headers, HDR_MSG_ID) is not None:
            return  # one of this run's own requests (an error event has no id header)
        self.leaks.append(f"a message on a forged reply subject {msg.subject}: {msg.data[:200]!r}")


async def flood(nc: nats.NATS, backlog: int, calls: int) -> dict[str, object]:
    """A status and cancel flood for ids never sent, `FLOOD_IN_FLIGHT` at a time, from a
    tenant with `backlog` requests waiting in the streams (on `FLOOD_ENDPOINT`, which no
    worker serves, so they stay): each lookup reads that backlog. Another tenant's
    requests and status calls are timed one after the other before the flood and
    during it."""
    js = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
    for n in range(backlog):
        await js.publish(
            f"fq.req.{FLOOD_ENDPOINT}.{FLOOD_TENANT}",
            b'{"prompt":"waits"}',
            headers={HDR_MSG_ID: f"backlog-{n}"},
        )
    slots = asyncio.Semaphore(FLOOD_IN_FLIGHT)
    answers: Counter[str] = Counter()

    async def call(n: int) -> None:
        kind = ("status", "cancel")[n % 2]
        async with slots:
            try:
                reply = await nc.request(
                    f"fq.api.{kind}.{FLOOD_TENANT}",
                    b'{"id":"never-sent-%d"}' % n,
                    timeout=ANSWER_TIMEOUT_S,
                )
                answers[api_outcome(json.loads(reply.data))[0]] += 1
            except nats.errors.TimeoutError:
                answers["no answer"] += 1

    before = await _victim(nc, VICTIM_CALLS)
    started = time.monotonic()
    calls_done = asyncio.gather(*(call(n) for n in range(calls)))
    during = await _victim(nc, VICTIM_CALLS)
    await calls_done
    return {
        "backlog": backlog,
        "calls": calls,
        "in_flight": FLOOD_IN_FLIGHT,
        "flood_s": round(time.monotonic() - started, 1),
        "answers": dict(answers),
        "victim_before": before,
        "victim_during": during,
    }


async def _victim(nc: nats.NATS, count: int) -> dict[str, dict[str, float | None]]:
    """Median and largest seconds of `count` requests of `VICTIM` to `done`, and of as
    many status calls, one after the other."""
    js = nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
    requests, calls = [], []
    for n in range(count):
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        started = time.monotonic()
        await js.publish(
            f"fq.req.chat.{VICTIM}",
            b'{"prompt":"x","max_tokens":1}',
            headers={HDR_MSG_ID: f"victim-{time.time_ns()}", HDR_REPLY: inbox},
        )
        while b'"done"' not in (await sub.next_msg(timeout=ANSWER_TIMEOUT_S)).data:
            pass
        requests.append(time.monotonic() - started)
        await sub.unsubscribe()
        started = time.monotonic()
        await nc.request(
            f"fq.api.status.{VICTIM}", b'{"id":"victim-%d"}' % n, timeout=ANSWER_TIMEOUT_S
        )
        calls.append(time.monotonic() - started)
    return {"request_s": _spread(requests), "status_s": _spread(calls)}


def _spread(seconds: list[float]) -> dict[str, float | None]:
    ordered = sorted(seconds)
    return {"p50": quantile(ordered, 0.5), "max": round(ordered[-1], 4) if ordered else None}


def api_outcome(answer: dict[str, object]) -> tuple[str, str]:
    """What an API answer says, and its message."""
    if answer.get("type") == "error":
        return f"error:{answer['code']}", str(answer["message"])
    if "state" in answer:
        return f"status:{answer['state']}", ""
    if "cancelled" in answer:
        return f"cancel:{str(answer['cancelled']).lower()}", ""
    return "unexpected answer", json.dumps(answer)[:300]


def quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(
        statistics.quantiles(ordered, n=100, method="inclusive")[int(q * 100) - 1]
        if len(ordered) > 1
        else ordered[0],
        4,
    )

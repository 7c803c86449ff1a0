"""Hostile input through the live stack: thousands of generated attacks, and what they do.

    python -m bench.hostile [--inputs 10000] [--seed 1] [--concurrency 64] [--out FILE]

A real stack (`bench.stack`: an embedded nats-server, `python -m dispatcher` and two
simulated workers, each its own process) runs with the small `[dispatcher.input]` limits
of `bench.hostile_inputs`. The probes it draws (random bytes, truncated and deeply
nested JSON and msgpack, wrong types, bodies over every limit and over the broker's
largest message, invalid UTF-8, bad images, forged and missing headers, odd subject
tokens, ids reused across tenants, floods of status and cancel calls for unknown ids,
and valid requests among them) go out `--concurrency` at a time, each message checked
against the outcome the contract promises for it. At the end:

- every message the broker stored was answered as promised: its error event (code and
  message), or for those without a usable `Fq-Reply` exactly one count each in
  `fairq_invalid_messages_total{reply="none"}`; every valid one finished `done`;
- every message the broker refused failed at the publisher with the promised error;
- the dispatcher is alive, answers the depth API, and the requests stream is empty;
  the streams fairq relies on still exist (a forged `Fq-Reply` aimed at the JetStream
  API did nothing);
- the dispatcher's RSS after the run, against after a first tenth of the probes (the
  baseline, once every code path has been touched), stays within `--max-rss-growth`.

Exit status 0 when all of that holds; the figures go to `--out` (JSON) and stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import nats.errors
from nats.aio.msg import Msg

from bench.hostile_inputs import TENANTS, Probe, Send, generate, suite_options
from bench.machine import command_line, machine_facts
from bench.procstat import memory_kb
from bench.stack import Stack, StackSpec, benchmark_config
from broker_config import wire
from broker_config.config import Config, Tenant
from broker_config.subjects import HDR_CONTENT_TYPE, HDR_MSG_ID, HDR_REPLY, is_request_id

RESULTS = Path(__file__).resolve().parent / "results" / "hostile"
# Bounds, so that a stalled dispatcher fails the run instead of hanging it.
PUBLISH_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 30.0
# The forged reply subjects a leak would reach (bench.hostile_inputs.BAD_REPLIES).
WATCHED_REPLIES = ("fq.req.chat.globex", "$JS.API.STREAM.DELETE.>", "a.*", "a.>")
BASELINE_FRACTION = 0.1
# The flood after the probes: its tenant's backlog waits on an endpoint without workers.
FLOOD_ENDPOINT = "embed"
FLOOD_TENANT = "initech"
VICTIM = "globex"
VICTIM_CALLS = 20
# Above the dispatcher's cap of a tenant's calls in flight (MAX_API_CALLS_PER_TENANT).
FLOOD_IN_FLIGHT = 256
# The victim's status calls during the flood: a call that waited behind the flood's
# lookups would take seconds.
VICTIM_STATUS_MAX_S = 1.0


def hostile_config() -> Config:
    """The benchmark config (admission out of the way) with the suite's tenants listed,
    others refused, and the suite's input limits."""
    config = benchmark_config()
    tier = config.tiers[0].name
    return msgspec.structs.replace(
        config,
        tenants={name: Tenant(tier=tier, weight=1.0) for name in (*TENANTS, "warmup")},
        unlisted_tenants=msgspec.structs.replace(config.unlisted_tenants, policy="reject"),
        dispatcher=suite_options(config.dispatcher),
    )


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
        return _api_outcome(json.loads(msg.data))

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
                answers[_api_outcome(json.loads(reply.data))[0]] += 1
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
    return {"p50": _quantile(ordered, 0.5), "max": round(ordered[-1], 4) if ordered else None}


def _api_outcome(answer: dict[str, object]) -> tuple[str, str]:
    """What an API answer says, and its message."""
    if answer.get("type") == "error":
        return f"error:{answer['code']}", str(answer["message"])
    if "state" in answer:
        return f"status:{answer['state']}", ""
    if "cancelled" in answer:
        return f"cancel:{str(answer['cancelled']).lower()}", ""
    return "unexpected answer", json.dumps(answer)[:300]


def rss_mib(pid: int) -> float:
    return memory_kb(pid)["rss_kb"] / 1024


def metric(url: str, name: str, labels: str) -> float:
    """One sample of the dispatcher's /metrics."""
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.split()[-1])
    raise LookupError(f"{name}{{{labels}}} is not in {url}")


def metrics_url(log: Path) -> str:
    for line in log.read_text().splitlines():
        if line.startswith("METRICS_URL="):
            return line.split("=", 1)[1]
    raise LookupError(f"the dispatcher printed no METRICS_URL in {log}")


async def settled(stack: Stack, nc: nats.NATS) -> dict[str, object]:
    """The state after the run: the depth API's answer time and what the streams hold,
    once the requests stream is empty or `SETTLE_TIMEOUT_S` passed."""
    subjects = stack.spec.config.subjects
    js = nc.jetstream()
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        stack.check_alive()
        state = (await js.stream_info(subjects.requests_stream)).state
        if not state.messages or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    started = time.monotonic()
    depth = await nc.request(subjects.depth, b"{}", timeout=PUBLISH_TIMEOUT_S)
    answered_s = time.monotonic() - started
    await js.stream_info(subjects.parked_stream)  # raises if a forged reply deleted it
    return {
        "requests_left_in_stream": state.messages,
        "depth_api_answer_s": round(answered_s, 4),
        "depth_api_queues": len(json.loads(depth.data)["queues"]),
    }


async def run(
    inputs: int,
    seed: int,
    concurrency: int,
    log_dir: Path,
    *,
    flood_backlog: int = 0,
    flood_calls: int = 0,
) -> dict[str, object]:
    probes = generate(inputs, seed)
    spec = StackSpec(
        mode="fairq",
        workers=2,
        time_scale=0.02,
        config=hostile_config(),
        dispatcher_args=("--metrics-port", "0"),
    )
    report = Report()
    async with Stack(spec, log_dir) as stack:
        pid = stack.pids()["dispatcher"]
        url = metrics_url(log_dir / "dispatcher.log")
        rss_start = rss_mib(pid)
        nc = await nats.connect(stack.url, connect_timeout=5)
        try:
            runner = Runner(nc, stack.url, report)
            await runner.start()
            split = max(1, int(len(probes) * BASELINE_FRACTION))
            started = time.monotonic()

            async def watch() -> None:
                while True:
                    await asyncio.sleep(1.0)
                    stack.check_alive()

            watchdog = asyncio.create_task(watch())
            try:
                await runner.run(probes[:split], concurrency)
                rss_baseline = rss_mib(pid)
                await runner.run(probes[split:], concurrency)
            finally:
                watchdog.cancel()
            elapsed = time.monotonic() - started
            after = await settled(stack, nc)
            rss_end = rss_mib(pid)
            counted = metric(url, "fairq_invalid_messages_total", 'reply="none"')
            flooded = await flood(nc, flood_backlog, flood_calls) if flood_calls else None
            stack.check_alive()
        finally:
            await nc.drain()
    latency = sorted(report.valid_latency_s)
    return {
        "inputs": len(probes),
        "messages": report.sends,
        "concurrency": concurrency,
        "seed": seed,
        "elapsed_s": round(elapsed, 1),
        "by_kind": dict(report.by_kind.most_common()),
        "outcomes": dict(report.got.most_common()),
        "mismatches": report.mismatches,
        "leaks": runner.leaks,
        "unanswered_sent": report.unanswered,
        "unanswered_counted": counted,
        "valid_done": report.got["done"],
        "valid_latency_s": {
            "p50": _quantile(latency, 0.5),
            "p99": _quantile(latency, 0.99),
            "max": latency[-1] if latency else None,
        },
        "dispatcher_rss_mib": {
            "start": round(rss_start, 1),
            "baseline": round(rss_baseline, 1),
            "end": round(rss_end, 1),
            "growth_pct": round(100 * (rss_end / rss_baseline - 1), 1),
        },
        "dispatcher_crashes": 0,  # a crash raises StackError and ends the run before this
        **after,
        "flood": flooded,
    }


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(
        statistics.quantiles(ordered, n=100, method="inclusive")[int(q * 100) - 1]
        if len(ordered) > 1
        else ordered[0],
        4,
    )


def failures(result: dict[str, object], max_rss_growth_pct: float) -> list[str]:
    """Why a run fails the suite; empty when it passes."""
    problems = (
        [f"{len(result['mismatches'])} messages were not answered as the contract promises"]
        if result["mismatches"]
        else []
    )
    problems += [str(leak) for leak in result["leaks"]]
    if result["unanswered_sent"] != result["unanswered_counted"]:
        problems.append(
            f"{result['unanswered_sent']} messages without a usable Fq-Reply, "
            f'but fairq_invalid_messages_total{{reply="none"}} is '
            f"{result['unanswered_counted']:g}"
        )
    if result["requests_left_in_stream"]:
        problems.append(f"{result['requests_left_in_stream']} requests left in the stream")
    flooded = result.get("flood")
    if flooded:
        if flooded["answers"].get("no answer"):
            problems.append(f"{flooded['answers']['no answer']} flood calls got no answer")
        slowest = flooded["victim_during"]["status_s"]["max"]
        if slowest > VICTIM_STATUS_MAX_S:
            problems.append(
                f"another tenant's status call took {slowest} s during the flood "
                f"(limit {VICTIM_STATUS_MAX_S} s)"
            )
    growth = result["dispatcher_rss_mib"]["growth_pct"]
    if growth > max_rss_growth_pct:
        problems.append(f"dispatcher RSS grew {growth}% (limit {max_rss_growth_pct}%)")
    return problems


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.hostile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--inputs", type=int, default=10_000, help="probes to send")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64, help="probes in flight")
    parser.add_argument("--max-rss-growth", type=float, default=10.0, metavar="PCT")
    parser.add_argument(
        "--flood-backlog",
        type=int,
        default=5000,
        metavar="N",
        help="after the probes: the flooding tenant's waiting requests",
    )
    parser.add_argument(
        "--flood-calls",
        type=int,
        default=1000,
        metavar="N",
        help="status and cancel calls for unknown ids (0: no flood)",
    )
    parser.add_argument("--out", type=Path, help="result JSON (default: bench/results/hostile)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    facts = machine_facts(command_line("bench.hostile", argv))
    with tempfile.TemporaryDirectory(prefix="fairq-hostile-") as log_dir:
        result = asyncio.run(
            run(
                args.inputs,
                args.seed,
                args.concurrency,
                Path(log_dir),
                flood_backlog=args.flood_backlog,
                flood_calls=args.flood_calls,
            )
        )
    problems = failures(result, args.max_rss_growth)
    out = args.out or RESULTS / f"hostile-{args.inputs}-seed{args.seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"machine": facts, "result": result, "problems": problems}, indent=2) + "\n"
    )
    summary = {k: v for k, v in result.items() if k != "mismatches"}
    print(json.dumps(summary, indent=2))
    for mismatch in result["mismatches"][:20]:
        print("MISMATCH", mismatch)
    for problem in problems:
        print("FAIL:", problem)
    print(f"results in {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

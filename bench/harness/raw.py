"""The raw JetStream path: what the broker alone does, with no dispatcher and no worker.
It is the baseline of the rate and tenant-scale scenarios (and of the archived intake
studies in `bench.archive`).

`raw_run` publishes from this process (through `bench.harness.firehose`, without
`Fq-Reply`) into a fresh, provisioned nats-server while a consumer job runs in a fresh
process (a spawned `ProcessPoolExecutor` job, so it shares neither heap nor GIL with the
publisher) and returns when that consumer has acked the last message. Two consumer jobs:

- `raw_consumer_job`: one durable pull consumer over every stored request (`RAW_CONSUMER`),
  batches of `FETCH_BATCH`, each message acked (`raw_fetch`);
- `shard_consumer_job`: fairq's consumer layout without fairq: one durable pull consumer
  per shard of the requests stream, each with one standing pull for all its messages,
  every reply to one wildcard inbox, each message acked at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, NamedTuple

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from bench.harness.consumers import pull_subscription
from bench.harness.firehose import fire
from bench.harness.measured import Arrival, Replay
from bench.harness.procstat import CpuMeter, run_timed
from bench.harness.stack import ENDPOINT, FIRE_IN_FLIGHT, connected, provisioned
from broker_config import jetstream
from broker_config.config import BrokerSettings, DispatcherOptions
from broker_config.streams import ConsumerLimits, ConsumerSpec, ensure_consumer

SETTINGS = BrokerSettings()
RAW_CONSUMER = "bench~raw"
FETCH_BATCH = DispatcherOptions().intake_batch
FETCH_TIMEOUT_S = 0.5
# Bound on one raw consumer's run, so a stuck run fails with a message instead of hanging.
RAW_TIMEOUT_S = 60.0
# Bound on the shard consumers' run (also their pulls' expiry).
SHARDS_TIMEOUT_S = 120.0
# Bound on waiting for the consumer to exist before publishing.
CONSUMER_READY_S = 30.0
LOAD_GENERATOR = "load generator"


def spawn_pool() -> ProcessPoolExecutor:
    """Fresh interpreters for the consumer jobs: spawned, one job each."""
    return ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1
    )


class RawError(RuntimeError):
    """A raw consumer that did not get every message in time."""


class RawRun(NamedTuple):
    replay: Replay  # the publisher's records: every request `published` (or not)
    cpu_s: dict[str, float]  # nats-server, the load generator and the consumer
    finished_at: float  # unix time when the consumer's last ack reached the server


async def raw_run(
    arrivals: Sequence[Arrival],
    pool: ProcessPoolExecutor,
    consumer_job: Callable[..., tuple[float, float]],
    job_args: tuple[Any, ...],
    last_consumer: str,
    timeout_s: float,
) -> RawRun:
    """`arrivals` published (no Fq-Reply) from this process while `consumer_job(url,
    *job_args)` consumes them in a fresh process of `pool` and returns (unix time of its
    last ack, its CPU seconds). Publishing starts once `last_consumer` exists."""
    async with provisioned(SETTINGS) as (server, nc):
        consumer = asyncio.get_running_loop().run_in_executor(
            pool, consumer_job, server.url, *job_args
        )
        js = nc.jetstream()
        await _until_consumer(js, SETTINGS.subjects.requests_stream, last_consumer, consumer)
        assert server.pid is not None
        meter = CpuMeter({"nats-server": server.pid, LOAD_GENERATOR: "self"})
        meter.start()
        result = await fire(
            server.url,
            arrivals,
            endpoint=ENDPOINT,
            settings=SETTINGS,
            in_flight=FIRE_IN_FLIGHT,
            timeout_s=timeout_s,
        )
        finished_at, consumer_cpu_s = await consumer
        cpu = meter.stop() | {"consumer": consumer_cpu_s}
    return RawRun(result, cpu, finished_at)


async def _until_consumer(js: Any, stream: str, name: str, consumer: asyncio.Future[Any]) -> None:
    """Publishing starts once the consumer exists (or fails if its process failed)."""
    async with asyncio.timeout(CONSUMER_READY_S):
        while True:
            if consumer.done():
                consumer.result()  # raises what the consumer process raised
                raise RuntimeError("the raw consumer ended before anything was published")
            with contextlib.suppress(NotFoundError):
                await js.consumer_info(stream, name)
                return
            await asyncio.sleep(0.02)


# -- one shared consumer -------------------------------------------------------------------


class Fetched(NamedTuple):
    elapsed_s: float  # to fetch (and ack) every expected message, from the first fetch
    watch_s: float | None  # until the first message on the watched subject was fetched
    finished_at: float  # unix time when the last message was fetched (and its ack sent)


async def raw_fetch(url: str, expected: int, ack: bool, watch: str | None = None) -> Fetched:
    """One pull consumer fetches `expected` messages (and acks each): see `Fetched`."""
    limits = ConsumerLimits(max_ack_pending=expected)
    spec = ConsumerSpec(RAW_CONSUMER, SETTINGS.subjects.all_stored, limits)
    async with connected(url) as nc:
        subscription = await pull_subscription(
            nc.jetstream(), SETTINGS.subjects.requests_stream, spec
        )
        received = 0
        watch_s = None
        start = time.perf_counter()
        while received < expected:
            if time.perf_counter() - start > RAW_TIMEOUT_S:
                raise RawError(
                    f"raw consumer: {received} of {expected} fetched after {RAW_TIMEOUT_S}s"
                )
            try:
                messages = await subscription.fetch(FETCH_BATCH, timeout=FETCH_TIMEOUT_S)
            except nats.errors.TimeoutError:
                continue
            if ack:
                for msg in messages:
                    await msg.ack()
            if watch_s is None and any(msg.subject == watch for msg in messages):
                watch_s = time.perf_counter() - start
            received += len(messages)
        if ack:
            await nc.flush()  # the acks have reached the server
        elapsed, finished_at = time.perf_counter() - start, time.time()
        await subscription.unsubscribe()
        return Fetched(elapsed, watch_s, finished_at)


# Spawned-process entry points: plain functions returning plain data.


def raw_fetch_job(url: str, expected: int, ack: bool, watch: str | None = None) -> Fetched:
    return asyncio.run(raw_fetch(url, expected, ack, watch))


def raw_consumer_job(url: str, expected: int) -> tuple[float, float]:
    """In a fresh process: when the last ack was sent, and the CPU seconds it took."""
    fetched, cpu_s = run_timed(raw_fetch, url, expected, True)
    return fetched.finished_at, cpu_s


# -- a consumer per shard ------------------------------------------------------------------


def raw_consumer_name(n: int) -> str:
    return f"{RAW_CONSUMER}~{n}"


def shard_consumer_job(url: str, messages: int) -> tuple[float, float]:
    """In a fresh process: when the last ack was sent, and the CPU seconds it took."""
    return run_timed(_consume_shards, url, messages)


async def _consume_shards(url: str, messages: int) -> float:
    """Every shard's consumer with a standing pull for all `messages`, each message acked
    at once. Unix time when the last ack reached the server."""
    subjects = SETTINGS.subjects
    async with connected(url) as nc:
        js = nc.jetstream()
        remaining = messages
        consumed = asyncio.Event()

        async def on_message(msg: Msg) -> None:
            nonlocal remaining
            if jetstream.status_of(msg)[0] is not None:
                return  # the pull's end (a status message), not a request
            await msg.ack()
            remaining -= 1
            if not remaining:
                consumed.set()

        inbox = nc.new_inbox()
        await nc.subscribe(f"{inbox}.*", cb=on_message)
        pull = jetstream.pull_request(messages, SHARDS_TIMEOUT_S)
        for shard in range(SETTINGS.intake_shards):
            name = raw_consumer_name(shard)
            limits = ConsumerLimits(max_ack_pending=messages)
            spec = ConsumerSpec(name, subjects.shard_filter(shard), limits)
            await ensure_consumer(js, subjects.requests_stream, spec)
            await nc.publish(
                jetstream.pull_subject(subjects.requests_stream, name),
                pull,
                reply=f"{inbox}.{shard}",
            )
        async with asyncio.timeout(SHARDS_TIMEOUT_S):
            await consumed.wait()
        await nc.flush()  # the acks have reached the server
        return time.time()

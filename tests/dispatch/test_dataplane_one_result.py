"""What a worker process that is lost mid-request does to the request: paused (SIGSTOP)
long enough to be thought lost, or killed -9 and restarted. Either way the request has
exactly one result (issue 12):

- one that streamed no token yet runs again elsewhere; if the paused worker resumes, the
  run that finishes first stores the result (create-only), the dispatcher stops the
  other, and every final event a subscriber gets is that one result;
- one that streamed ends with a retryable `internal` error (a stream cannot take back
  text), which is its result even if the paused worker resumes and finishes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import pytest

from broker_config.config import (
    EXAMPLE_CONFIG,
    EXAMPLE_ENGINE,
    BrokerSettings,
    DispatcherOptions,
    WorkerOptions,
    load_config,
)
from broker_config.kv_writer import KeyValueWriter
from broker_config.streams import provision
from broker_config.subjects import HDR_CONTENT_TYPE, Subjects
from broker_config.wire import EVENT, DoneEvent, Encoding, ErrorCode, ErrorEvent, TokenEvent
from broker_config.wire_internal import BATCH, COMPLETIONS, STORED_RESULT
from costmodel.engine_model import load_engine_params
from dispatcher.dispatch.stored_results import Results
from tests.local_stack import LocalStack, StackOptions
from tests.wire_support import eventually
from workers.service import WorkerService
from workers.sim_engine import SimEngine

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
S = Subjects()
WAIT_S = 30.0
TOKENS = 300  # about 7.5 s on the first worker (time scale 1), 15 s on the second
# The simulated engine draws an output length from its seed and the request's key: 300 here.
REQUEST_ID = "twice-220"
# A prompt that takes 4 s to prefill at time scale 1: a worker stopped as it receives it
# cannot have reported a token.
LONG_PREFILL_TOKENS = 32_000
# Silence for 1 s takes a worker's requests back; no probes, so only silence decides.
OPTIONS = DispatcherOptions(
    settle_s=0.2,
    tick_s=0.05,
    grace_s=0.0,
    worker_timeout_s=1.0,
    probe_stall_s=3600.0,
    probe_idle_s=3600.0,
)
# Silence never decides: only the restarted worker's first heartbeat does.
NEVER_SILENT = msgspec.structs.replace(OPTIONS, worker_timeout_s=3600.0)


@contextlib.asynccontextmanager
async def worker_process(nats_url: str, worker_id: str) -> AsyncIterator[int]:
    """`python -m workers` (sim engine, time scale 1, 0.2 s heartbeats): its pid."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workers",
        "--nats",
        nats_url,
        "--endpoint",
        "chat",
        "--worker-id",
        worker_id,
        "--time-scale",
        "1",
        "--heartbeat-interval",
        "0.2",
        "--config",
        str(EXAMPLE_CONFIG),
        "--engine-config",
        str(EXAMPLE_ENGINE),
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield process.pid
    finally:
        if process.returncode is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        await process.wait()


class Observed:
    """What a client sees on its reply inbox, and the workers' completions."""

    def __init__(self, client: nats.NATS) -> None:
        self.client = client
        self.inbox = client.new_inbox()
        self.events: list = []
        self.completions: list = []

    async def __aenter__(self) -> Observed:
        async def on_event(msg) -> None:
            self.events.append(EVENT.decode(msg.data))

        async def on_completions(msg) -> None:
            self.completions.extend(COMPLETIONS.decode(msg.data).items)

        await self.client.subscribe(self.inbox, cb=on_event)
        await self.client.subscribe(S.completions("chat"), cb=on_completions)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.client.drain()

    async def publish(self, request_id: str, **body: object) -> None:
        await self.client.jetstream().publish(
            S.request("chat", "acme"),
            json.dumps({"prompt": "hello", **body}).encode(),
            headers={"Nats-Msg-Id": request_id, "Fq-Reply": self.inbox},
        )

    def finals(self, request_id: str) -> list:
        return [e for e in self.events if e.id == request_id and not isinstance(e, TokenEvent)]

    def tokens(self, request_id: str) -> int:
        return sum(1 for e in self.events if e.id == request_id and isinstance(e, TokenEvent))

    def completed_by(self, request_id: str) -> dict:
        return {c.worker_id: c for c in self.completions if c.id == request_id}

    async def stored(self, request_id: str):
        bucket = await self.client.jetstream().key_value(S.results_bucket)
        return STORED_RESULT.decode(
            (await bucket.get(S.result_key("acme", request_id))).value
        ).event


async def serving(pool, worker_id: str, started_after: float = 0.0) -> None:
    async def healthy():
        worker = pool.get(worker_id)
        return worker is not None and worker.healthy and worker.started_at > started_after

    await eventually(healthy, timeout=WAIT_S, what=f"{worker_id} serving")


async def stop_on_receipt(
    client: nats.NATS, worker_id: str, pid: int, request_id: str, signum: int
) -> asyncio.Event:
    """Send `signum` to the worker process the moment its batch with `request_id` is
    published (set once it is sent)."""
    sent = asyncio.Event()

    async def on_batch(msg) -> None:
        encoding = Encoding.from_content_type((msg.headers or {}).get(HDR_CONTENT_TYPE))
        if not sent.is_set() and any(
            item.id == request_id for item in BATCH.decode(msg.data, encoding).items
        ):
            os.kill(pid, signum)
            sent.set()

    await client.subscribe(S.work("chat", worker_id), cb=on_batch)
    return sent


async def test_an_unstreamed_request_of_a_paused_worker_runs_again_and_keeps_one_result(nats_url):
    key = ("acme", REQUEST_ID)
    async with (
        Observed(await nats.connect(nats_url)) as seen,
        LocalStack(
            load_config(), StackOptions(workers=0, dispatcher=OPTIONS), nats_url=nats_url
        ) as stack,
        worker_process(nats_url, "chat-first") as first_pid,
    ):
        pool, held = stack.dispatcher.pool, stack.dispatcher.held
        await serving(pool, "chat-first")
        stopped = await stop_on_receipt(
            seen.client, "chat-first", first_pid, REQUEST_ID, signal.SIGSTOP
        )
        await seen.publish(REQUEST_ID, max_tokens=TOKENS, input_tokens=LONG_PREFILL_TOKENS)
        await asyncio.wait_for(stopped.wait(), WAIT_S)
        # The second worker: half the first one's speed, so the first finishes first.
        params = load_engine_params(EXAMPLE_ENGINE)
        async with (
            KeyValueWriter(stack.nc, S.results_bucket) as results,
            SimEngine(params, time_scale=2.0) as engine,
            WorkerService(
                stack.nc,
                engine,
                endpoint="chat",
                worker_id="chat-second",
                subjects=S,
                results=results,
                settings=WorkerOptions(heartbeat_interval_s=0.2),
            ) as second,
        ):

            async def running_again():
                return (
                    held.get(key) is not None
                    and held.get(key).worker == "chat-second"
                    and second.in_flight
                )

            await eventually(running_again, timeout=WAIT_S, what="the request running again")
            assert stack.counted(stack.metrics.redispatched) == 1
            os.kill(first_pid, signal.SIGCONT)

            async def both_ended():
                return set(seen.completed_by(REQUEST_ID)) == {"chat-first", "chat-second"}

            await eventually(both_ended, timeout=WAIT_S, what="both runs ending")
            assert engine.active_requests == 0
        stored = await seen.stored(REQUEST_ID)
    by_worker = seen.completed_by(REQUEST_ID)
    # The first run finished and stored the result; the second was stopped early.
    assert by_worker["chat-first"].code is None and by_worker["chat-first"].stored
    assert by_worker["chat-second"].code is ErrorCode.INTERNAL
    assert by_worker["chat-second"].usage.output_tokens < TOKENS
    assert isinstance(stored, DoneEvent) and stored.usage.output_tokens == TOKENS
    # Both runs answered the reply subject with the one result: identical events.
    assert seen.finals(REQUEST_ID) == [stored, stored]
    assert stack.counted(stack.metrics.failed_by_lost_worker) == 0


async def test_a_streamed_request_of_a_paused_worker_ends_with_a_retryable_error(nats_url):
    async with (
        Observed(await nats.connect(nats_url)) as seen,
        LocalStack(
            load_config(), StackOptions(workers=0, dispatcher=OPTIONS), nats_url=nats_url
        ) as stack,
        worker_process(nats_url, "chat-first") as first_pid,
    ):
        await serving(stack.dispatcher.pool, "chat-first")
        await seen.publish(REQUEST_ID, max_tokens=TOKENS)
        scheduler = stack.dispatcher.scheduler

        async def streaming():
            request = scheduler.running_request("acme", REQUEST_ID)
            # Tokens seen by the client and reported by a heartbeat.
            return (
                seen.tokens(REQUEST_ID) >= 20 and request is not None and request.output_charged > 0
            )

        await eventually(streaming, timeout=WAIT_S, what="the request streaming")
        os.kill(first_pid, signal.SIGSTOP)

        async def ended():
            return seen.finals(REQUEST_ID)

        (end,) = await eventually(ended, timeout=WAIT_S, what="the dispatcher ending it")
        assert isinstance(end, ErrorEvent) and end.code is ErrorCode.INTERNAL
        assert end.retry_after_s == OPTIONS.lost_worker_retry_after_s
        assert scheduler.running_request("acme", REQUEST_ID) is None
        assert scheduler.queued_count("chat") == 0  # ended, not run again
        # The worker resumes and finishes its run: the result stays the error.
        os.kill(first_pid, signal.SIGCONT)

        async def finished_there():
            return "chat-first" in seen.completed_by(REQUEST_ID)

        await eventually(finished_there, timeout=WAIT_S, what="the resumed run finishing")
        stored = await seen.stored(REQUEST_ID)
    assert stored == end
    # The resumed run published the stored result, not its own: identical events.
    assert seen.finals(REQUEST_ID) == [end, end]
    assert stack.counted(stack.metrics.failed_by_lost_worker) == 1
    assert stack.counted(stack.metrics.redispatched) == 0


async def test_a_restarted_worker_s_streamed_request_fails_and_its_unstreamed_one_runs_again(
    nats_url,
):
    waiting = "waiting-1"
    async with (
        Observed(await nats.connect(nats_url)) as seen,
        LocalStack(
            load_config(), StackOptions(workers=0, dispatcher=NEVER_SILENT), nats_url=nats_url
        ) as stack,
    ):
        pool, scheduler = stack.dispatcher.pool, stack.dispatcher.scheduler
        async with worker_process(nats_url, "chat-first") as first_pid:
            await serving(pool, "chat-first")
            first_run = pool.get("chat-first").started_at
            await seen.publish(REQUEST_ID, max_tokens=TOKENS)

            async def streaming():
                request = scheduler.running_request("acme", REQUEST_ID)
                return request is not None and request.output_charged > 0

            await eventually(streaming, timeout=WAIT_S, what="the request streaming")
            killed = await stop_on_receipt(
                seen.client, "chat-first", first_pid, waiting, signal.SIGKILL
            )
            await seen.publish(waiting, max_tokens=4, input_tokens=LONG_PREFILL_TOKENS)
            await asyncio.wait_for(killed.wait(), WAIT_S)
        # The supervisor's part: the same worker id in a new process.
        async with worker_process(nats_url, "chat-first"):
            await serving(pool, "chat-first", started_after=first_run)

            async def both_final():
                return seen.finals(REQUEST_ID) and seen.finals(waiting)

            await eventually(both_final, timeout=WAIT_S, what="both requests ending")
            stored = {rid: await seen.stored(rid) for rid in (REQUEST_ID, waiting)}
    (streamed_end,) = seen.finals(REQUEST_ID)
    assert isinstance(streamed_end, ErrorEvent) and streamed_end.code is ErrorCode.INTERNAL
    assert streamed_end.retry_after_s == NEVER_SILENT.lost_worker_retry_after_s
    (waiting_end,) = seen.finals(waiting)
    assert isinstance(waiting_end, DoneEvent)
    assert stored == {REQUEST_ID: streamed_end, waiting: waiting_end}
    # One run completed it: the new process's (the old one died during its prefill).
    assert [c.worker_id for c in seen.completions if c.id == waiting] == ["chat-first"]
    assert stack.counted(stack.metrics.failed_by_lost_worker) == 1
    assert stack.counted(stack.metrics.redispatched) == 1
    assert stack.counted(stack.metrics.replacements) == 1


async def test_the_dispatcher_never_overwrites_a_stored_result(nats_url):
    """What the dispatcher ends itself (a cancel, a rejection, a streamed request of a
    lost worker) does not replace a result a worker stored first: the first stands,
    and is what the client is sent."""
    nc = await nats.connect(nats_url)
    try:
        await provision(nc.jetstream(), BrokerSettings())
        first = ErrorEvent(id="r-1", code=ErrorCode.INTERNAL, message="stored first")
        later = ErrorEvent(id="r-1", code=ErrorCode.CANCELLED, message="too late")
        async with Results(nc, S) as results:
            assert await results.store("acme", "chat", first, 1.0) == first
            assert await results.store("acme", "chat", later, 2.0) == first
            assert (await results.get(("acme", "r-1"))).event == first
            # Another tenant's request of the same id is another result.
            assert await results.store("globex", "chat", later, 3.0) == later
    finally:
        await nc.drain()

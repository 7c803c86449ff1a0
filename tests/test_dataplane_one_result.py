"""A worker process paused (SIGSTOP) long enough to be thought lost, whose request then
runs again elsewhere, and which resumes: the request still has exactly one result. The
run that finishes first stores it (create-only); the dispatcher stops the other run; every
final event a subscriber gets is that one result (issue 12)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

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
from broker_config.subjects import Subjects
from broker_config.wire import (
    COMPLETIONS,
    EVENT,
    STORED_RESULT,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    TokenEvent,
)
from costmodel.engine_model import load_engine_params
from dispatcher.results import Results
from tests.local_stack import LocalStack, StackOptions
from tests.wire_support import eventually
from workers.service import WorkerService
from workers.sim_engine import SimEngine

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
S = Subjects()
WAIT_S = 30.0
TOKENS = 300  # about 7.5 s on the first worker (time scale 1), 15 s on the second
# The simulated engine draws an output length from its seed and the request's key: 300 here.
REQUEST_ID = "twice-220"
# Silence for 1 s takes a worker's requests back; no probes, so only silence decides.
OPTIONS = DispatcherOptions(settle_s=0.2, tick_s=0.05, grace_s=0.0, worker_timeout_s=1.0,
                            probe_stall_s=3600.0, probe_idle_s=3600.0)


@contextlib.asynccontextmanager
async def worker_process(nats_url: str, worker_id: str) -> AsyncIterator[int]:
    """`python -m workers` (sim engine, time scale 1, 0.2 s heartbeats): its pid."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workers", "--nats", nats_url, "--endpoint", "chat",
        "--worker-id", worker_id, "--time-scale", "1", "--heartbeat-interval", "0.2",
        "--config", str(EXAMPLE_CONFIG), "--engine-config", str(EXAMPLE_ENGINE), cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)}, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        yield process.pid
    finally:
        if process.returncode is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        await process.wait()


async def test_a_paused_worker_that_resumes_cannot_give_a_request_a_second_result(nats_url):
    client = await nats.connect(nats_url)
    events = []
    completions = []

    async def on_event(msg) -> None:
        events.append(EVENT.decode(msg.data))

    async def on_completions(msg) -> None:
        completions.extend(COMPLETIONS.decode(msg.data).items)

    inbox = client.new_inbox()
    await client.subscribe(inbox, cb=on_event)
    await client.subscribe(S.completions("chat"), cb=on_completions)
    key = ("acme", REQUEST_ID)
    try:
        async with LocalStack(load_config(), StackOptions(workers=0, dispatcher=OPTIONS),
                              nats_url=nats_url) as stack, \
                worker_process(nats_url, "chat-first") as first_pid:
            pool, held = stack.dispatcher.pool, stack.dispatcher.held

            async def first_serving():
                worker = pool.get("chat-first") if "chat-first" in {
                    w.worker_id for w in pool} else None
                return worker is not None and worker.healthy

            await eventually(first_serving, timeout=WAIT_S, what="the worker process serving")
            await client.jetstream().publish(
                S.request("chat", "acme"),
                json.dumps({"prompt": "hello", "max_tokens": TOKENS}).encode(),
                headers={"Nats-Msg-Id": REQUEST_ID, "Fq-Reply": inbox})

            async def streaming():
                return len(events) >= 20

            await eventually(streaming, timeout=WAIT_S, what="the first run streaming")
            os.kill(first_pid, signal.SIGSTOP)
            # The second worker: half the first one's speed, so the first finishes first.
            params = load_engine_params(EXAMPLE_ENGINE)
            async with KeyValueWriter(stack.nc, S.results_bucket) as results, \
                    SimEngine(params, time_scale=2.0) as engine, \
                    WorkerService(stack.nc, engine, endpoint="chat", worker_id="chat-second",
                                  subjects=S, results=results,
                                  settings=WorkerOptions(heartbeat_interval_s=0.2)) as second:

                async def running_again():
                    return held.get(key) is not None and held.get(key).worker == "chat-second" \
                        and second.in_flight

                await eventually(running_again, timeout=WAIT_S, what="the request running again")
                os.kill(first_pid, signal.SIGCONT)

                async def both_ended():
                    return {c.worker_id for c in completions if c.id == REQUEST_ID} == {
                        "chat-first", "chat-second"}

                await eventually(both_ended, timeout=WAIT_S, what="both runs ending")
                assert engine.active_requests == 0
            stored = STORED_RESULT.decode(
                (await (await client.jetstream().key_value(S.results_bucket)).get(
                    S.result_key(*key))).value).event
    finally:
        await client.drain()
    by_worker = {c.worker_id: c for c in completions if c.id == REQUEST_ID}
    # The first run finished and stored the result; the second was stopped early.
    assert by_worker["chat-first"].code is None and by_worker["chat-first"].stored
    assert by_worker["chat-second"].code is ErrorCode.INTERNAL
    assert by_worker["chat-second"].usage.output_tokens < TOKENS
    assert isinstance(stored, DoneEvent) and stored.usage.output_tokens == TOKENS
    # Both runs answered the reply subject with the one result: identical events.
    assert [e for e in events if not isinstance(e, TokenEvent)] == [stored, stored]


async def test_the_dispatcher_never_overwrites_a_stored_result(nats_url):
    """What the dispatcher ends itself (a cancel, a rejection, a streamed request of an
    evicted worker) does not replace a result a worker stored first: the first stands,
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

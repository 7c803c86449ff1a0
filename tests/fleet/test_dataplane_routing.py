"""Routing through a real nats-server: sessions stay on their worker, and a worker that
leaves moves only its own sessions. Which worker ran a request is read off the batches
the dispatcher publishes, as any observer of the work subjects can."""

from __future__ import annotations

import asyncio
import time

import pytest

from broker_config import wire, wire_internal
from broker_config.config import load_config
from tests.dispatch.test_dataplane_e2e import collect, stack_options, submit
from tests.local_stack import LocalStack

pytestmark = pytest.mark.integration

SESSIONS = [f"conversation-{i}" for i in range(24)]


class BatchLog:
    """Which worker each request (by id) was sent to."""

    def __init__(self) -> None:
        self.worker_of: dict[str, str] = {}

    async def on_batch(self, msg) -> None:
        batch = wire_internal.BATCH.decode(
            msg.data, wire.Encoding.from_content_type((msg.headers or {}).get("Content-Type"))
        )
        for item in batch.items:
            self.worker_of[item.id] = batch.worker_id


async def turn(stack: LocalStack, log: BatchLog, n: int) -> dict[str, str]:
    """One request per session, one after the other (nothing else in flight, so the
    load bound never moves a session); the worker each session's request ran on."""
    owners = {}
    for session in SESSIONS:
        rid = f"{session}-turn{n}"
        _, sub = await submit(
            stack.nc,
            "chat",
            "acme",
            {"prompt": f"turn {n}", "max_tokens": 2, "session": session},
            rid=rid,
        )
        events = await collect(sub, timeout=20.0)
        assert events[-1]["type"] == "done", events[-1]
        owners[session] = log.worker_of[rid]
    return owners


async def test_sessions_stay_on_their_worker_and_a_leaving_worker_moves_only_its_own(
    nats_url: str,
) -> None:
    async with LocalStack(
        load_config(), stack_options(workers=3, time_scale=0.005), nats_url=nats_url
    ) as stack:
        log = BatchLog()
        await stack.nc.subscribe(stack.config.subjects.batches("chat"), cb=log.on_batch)
        first = await turn(stack, log, 1)
        assert len(set(first.values())) == 3, first  # 24 sessions land on every worker
        assert await turn(stack, log, 2) == first  # affinity: each stays where it was

        leaving = stack.workers[0]
        await leaving.__aexit__(None, None, None)  # drains; its last heartbeat says so
        pool = stack.dispatcher.pool
        deadline = time.monotonic() + 10
        while pool.get(leaving.worker_id).healthy:
            assert time.monotonic() < deadline, "the dispatcher never saw the worker leave"
            await asyncio.sleep(0.05)

        third = await turn(stack, log, 3)
        moved = {s for s in SESSIONS if third[s] != first[s]}
        assert moved == {s for s in SESSIONS if first[s] == leaving.worker_id}, (first, third)
        assert leaving.worker_id not in third.values()

"""Health probes against a real nats-server: an engine that hangs while its worker keeps
beating is found by probes, its worker evicted, and its requests run elsewhere or, if
they had streamed, end with a retryable error (issue 12)."""

from __future__ import annotations

import json

import nats
import pytest

from broker_config.config import DispatcherOptions, WorkerOptions, load_config
from broker_config.subjects import Subjects
from tests.local_stack import LocalStack, StackOptions
from tests.wire_support import eventually

pytestmark = pytest.mark.integration

S = Subjects()
WAIT_S = 20.0
# Probe quickly: a worker holding work that completes nothing for 0.5 s is probed; two
# probes unanswered for 0.5 s each evict it. No idle probes during a test.
PROBING = DispatcherOptions(
    settle_s=0.2,
    tick_s=0.05,
    grace_s=0.0,
    probe_stall_s=0.5,
    probe_timeout_s=0.5,
    probe_failures=2,
    probe_idle_s=3600.0,
)
WORKERS = WorkerOptions(heartbeat_interval_s=0.2, drain_timeout_s=0.5)


@pytest.fixture
async def client(nats_url):
    nc = await nats.connect(nats_url)
    yield nc
    await nc.drain()


def stack_options(workers: int) -> StackOptions:
    return StackOptions(
        workers=workers, endpoints=("chat",), dispatcher=PROBING, workers_settings=WORKERS
    )


async def publish(js, rid: str, reply: str, max_tokens: int) -> None:
    await js.publish(
        S.request("chat", "acme"),
        json.dumps({"prompt": "hello", "max_tokens": max_tokens}).encode(),
        headers={"Nats-Msg-Id": rid, "Fq-Reply": reply},
    )


def finals(events: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for event in events:
        if event["type"] != "token":
            out.setdefault(event["id"], []).append(event)
    return out


async def collect(client, inbox: str) -> list[dict]:
    """Every event published to `inbox`.*, decoded, as it arrives."""
    events: list[dict] = []

    async def record(msg) -> None:
        events.append(json.loads(msg.data))

    await client.subscribe(f"{inbox}.>", cb=record)
    return events


async def test_a_hung_engine_is_found_by_probes_and_its_work_runs_elsewhere(nats_url, client):
    inbox = client.new_inbox()
    events = await collect(client, inbox)
    async with LocalStack(load_config(), stack_options(2), nats_url=nats_url) as stack:
        hung = stack.engines[0]
        hung.faults.hang = True  # its worker keeps beating: only a probe can tell
        js = client.jetstream()
        ids = [f"h{i}" for i in range(8)]
        for rid in ids:
            await publish(js, rid, f"{inbox}.{rid}", max_tokens=4)

        async def all_final():
            return set(finals(events)) == set(ids)

        await eventually(all_final, timeout=WAIT_S, what="every request's final event")
        pool = stack.dispatcher.pool
        assert pool.get("chat-w1").evicted and not pool.get("chat-w1").healthy
        # The evicted run knows it: it fails /healthz and /readyz, and takes no work.
        assert stack.workers[0].evicted.is_set()
        assert not stack.workers[0].live() and not stack.workers[0].ready()
        assert stack.workers[1].live() and stack.workers[1].ready()
        assert pool.get("chat-w2").healthy and not pool.get("chat-w2").evicted
        assert stack.counted(stack.metrics.evictions) == 1
        redispatched = stack.counted(stack.metrics.redispatched)
        assert redispatched >= 1  # what the hung worker held ran on the other
        assert stack.counted(stack.metrics.probe_failures) >= 2
        hung.faults.hang = False
    # Exactly one final event each, all done: none had streamed on the hung engine.
    for rid, ends in finals(events).items():
        assert [e["type"] for e in ends] == ["done"], (rid, ends)


async def test_a_request_that_streamed_before_its_worker_hung_ends_with_a_retryable_error(
    nats_url, client
):
    inbox = client.new_inbox()
    events = await collect(client, inbox)
    async with LocalStack(load_config(), stack_options(1), nats_url=nats_url) as stack:
        js = client.jetstream()
        await publish(js, "long", f"{inbox}.long", max_tokens=1000)
        scheduler = stack.dispatcher.scheduler

        async def streaming():
            request = scheduler.running_request("acme", "long")
            # A token seen by the client and reported by a heartbeat.
            return (
                request is not None
                and request.output_charged > 0
                and any(e["type"] == "token" for e in events)
            )

        await eventually(streaming, timeout=WAIT_S, what="the request streaming")
        stack.engines[0].faults.hang = True

        async def ended():
            return finals(events).get("long")

        (end,) = await eventually(ended, timeout=WAIT_S, what="the request's final event")
        assert (end["type"], end["code"]) == ("error", "internal")
        assert end["retry_after_s"] == PROBING.lost_worker_retry_after_s
        assert stack.dispatcher.pool.get("chat-w1").evicted
        assert stack.counted(stack.metrics.failed_by_lost_worker) == 1
        assert scheduler.running_request("acme", "long") is None
        assert scheduler.queued_count("chat") == 0  # ended, not run again
        stack.engines[0].faults.hang = False
    assert len(finals(events)["long"]) == 1

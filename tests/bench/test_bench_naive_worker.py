"""bench.harness.naive_worker: the naive baseline's worker, on a real nats-server. It must be the
baseline the issue describes: one shared queue served oldest first, whoever sent the
request, with no more in flight than the engine's capacity, and every request acked only
once its final event is stored."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import nats
import pytest

from bench.harness.consumers import endpoint_consumer
from bench.harness.naive_worker import FeederSettings, SharedQueueFeeder, main
from broker_config.config import EXAMPLE_CONFIG, BrokerSettings
from broker_config.streams import provision
from broker_config.subjects import SubjectError
from broker_config.wire import EVENT, DoneEvent, Encoding
from broker_config.wire_internal import BATCH, COMPLETIONS
from costmodel.engine_model import EngineParams
from workers.service import WorkerService
from workers.sim_engine import SimEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SETTINGS = BrokerSettings(storage="memory")
S = SETTINGS.subjects
ENDPOINT, WORKER = "chat", "w1"
SLOTS = 2
# Published in this order: A's backlog first, then B's requests behind it.
ORDER = [("A", "a0"), ("A", "a1"), ("A", "a2"), ("B", "b0"), ("A", "a3"), ("B", "b1")]
REPO = Path(__file__).resolve().parents[2]


async def test_the_shared_queue_runs_requests_in_arrival_order_within_capacity(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url, connect_timeout=5)
    js = nc.jetstream()
    provisioned = await provision(js, SETTINGS)
    dispatched: list[str] = []
    in_flight = peak = 0
    finals: dict[str, DoneEvent] = {}
    all_done = asyncio.Event()

    async def on_batch(msg: nats.aio.msg.Msg) -> None:
        nonlocal in_flight, peak
        items = BATCH.decode(msg.data, Encoding.MSGPACK).items
        dispatched.extend(item.id for item in items)
        in_flight += len(items)
        peak = max(peak, in_flight)

    async def on_completion(msg: nats.aio.msg.Msg) -> None:
        nonlocal in_flight
        items = COMPLETIONS.decode(msg.data).items
        assert all(done.stored for done in items)
        in_flight -= len(items)

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        event = EVENT.decode(msg.data)
        if isinstance(event, DoneEvent):
            finals[event.id] = event
            if len(finals) == len(ORDER):
                all_done.set()

    await nc.subscribe(S.work(ENDPOINT, WORKER), cb=on_batch)
    await nc.subscribe(S.completion(ENDPOINT, WORKER), cb=on_completion)
    await nc.subscribe("_INBOX.naive.>", cb=on_event)
    # Queued before any worker pulls, so the order is the stream's alone.
    for tenant, request_id in ORDER:
        await js.publish(
            S.request(ENDPOINT, tenant),
            b'{"prompt":"hello","max_tokens":8,"input_tokens":50}',
            headers={"Nats-Msg-Id": request_id, "Fq-Reply": f"_INBOX.naive.{request_id}"},
        )
    async with (
        SimEngine(EngineParams(), time_scale=0.05) as engine,
        WorkerService(
            nc, engine, endpoint=ENDPOINT, worker_id=WORKER, subjects=S, results=provisioned.results
        ) as service,
        SharedQueueFeeder(nc, service, SLOTS, FeederSettings(max_tokens_cap=4)),
    ):
        async with asyncio.timeout(20):
            await all_done.wait()
            while (await js.stream_info(S.requests_stream)).state.messages:
                await asyncio.sleep(0.05)  # acked once the completion says stored
    await nc.drain()
    assert dispatched == [request_id for _, request_id in ORDER]
    assert peak <= SLOTS
    # The endpoint's cap applies to max_tokens, as the dispatcher applies it.
    assert all(1 <= done.usage.output_tokens <= 4 for done in finals.values())


def test_the_shared_consumer_reads_one_endpoint_for_every_tenant() -> None:
    spec = endpoint_consumer(S, ENDPOINT)
    assert (spec.durable, spec.filter_subject) == ("fq~req~chat", "fq.q.*.chat.*")
    with pytest.raises(SubjectError, match="endpoint"):
        endpoint_consumer(S, "chat.*")


def test_main_needs_the_config_for_the_endpoint_cap(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--endpoint", ENDPOINT, "--worker-id", WORKER])
    assert exited.value.code == 2
    assert (
        "python -m bench.harness.naive_worker: error: --config is required"
        in capsys.readouterr().err
    )


async def test_main_serves_the_shared_queue_until_sigterm(nats_url: str) -> None:
    """The command the benchmark stack runs: answers a queued request, acks it once the
    final event is stored, and exits 0 on SIGTERM."""
    nc = await nats.connect(nats_url, connect_timeout=5)
    js = nc.jetstream()
    await provision(js, SETTINGS)
    finals: asyncio.Queue[DoneEvent] = asyncio.Queue()

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        event = EVENT.decode(msg.data)
        if isinstance(event, DoneEvent):
            finals.put_nowait(event)

    await nc.subscribe("_INBOX.main.>", cb=on_event)
    await js.publish(
        S.request(ENDPOINT, "A"),
        b'{"prompt":"hello","max_tokens":4}',
        headers={"Nats-Msg-Id": "m0", "Fq-Reply": "_INBOX.main.m0"},
    )
    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.harness.naive_worker",
        "--nats",
        nats_url,
        "--endpoint",
        ENDPOINT,
        "--worker-id",
        WORKER,
        "--config",
        str(EXAMPLE_CONFIG),
        "--time-scale",
        "0.01",
        "--log-level",
        "WARNING",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(30):
            done = await finals.get()
            while (await js.stream_info(S.requests_stream)).state.messages:
                await asyncio.sleep(0.05)  # acked once the completion says stored
            worker.send_signal(signal.SIGTERM)
            output, _ = await worker.communicate()
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
    await nc.drain()
    assert done.id == "m0" and done.usage.output_tokens >= 1
    assert worker.returncode == 0, output.decode(errors="replace")

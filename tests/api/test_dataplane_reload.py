"""Reloading the config file at run time, end to end: real nats-server, the dispatcher
(dispatcher.service.Dispatcher), a simulated worker; reloads asked for on
`<prefix>.admin.reload` (producers/admin.py) or by SIGHUP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import pytest

from broker_config import wire_internal
from broker_config.config import DispatcherOptions, WorkerOptions, load_config
from broker_config.subjects import Subjects
from dispatcher.api.reload import install_reload_signal
from producers.admin import reload_dispatchers
from tests.dispatch.test_dataplane_e2e import load_engine_config_one_slot, submit
from tests.local_stack import LocalStack, StackOptions
from tests.wire_support import api, eventually

pytestmark = pytest.mark.integration

CONFIG = """
[endpoints.chat]
cost = "request"
latency_target_s = 1e6  # no throttling: these tests count what is served
max_tokens_cap = 64
newcomer_reserve = 0.0

[[tiers]]
name = "enterprise"
weight = 4.0

[[tiers]]
name = "free"
weight = 1.0
{tenants}
[unlisted_tenants]
policy = "reject"
"""
# Each request: 12 output tokens at 2.5 ms (time_scale 0.1): about 35 ms alone.
BODY = {"prompt": "hello", "max_tokens": 12}
RELOAD_WAIT_S = 1.0  # how long the replies of every dispatcher are gathered


def write_config(path: Path, tenants: dict[str, str], extra: str = "") -> None:
    lines = "".join(f'[tenants.{name}]\ntier = "{tier}"\n' for name, tier in tenants.items())
    path.write_text(CONFIG.format(tenants=lines) + extra)


def options(engine=None) -> StackOptions:
    return StackOptions(
        workers=1,
        endpoints=("chat",),
        time_scale=0.1,
        engine=engine,
        workers_settings=WorkerOptions(heartbeat_interval_s=0.2),
        dispatcher=DispatcherOptions(settle_s=0.5, tick_s=0.05, worker_timeout_s=3.0, grace_s=5.0),
    )


def with_config_file(stack: LocalStack, path: Path) -> LocalStack:
    """LocalStack builds its Dispatcher without `config_path`: give its reloader the file,
    as `Dispatcher(..., config_path=path)` does at start. The stack's own [dispatcher]
    and [workers] tables replace the file's: a reload must keep such overrides."""
    stack.dispatcher.reloader.path = path
    stack.dispatcher.reloader.start()
    return stack


@dataclass
class Tracked:
    """One request's events as they arrived (monotonic times)."""

    tenant: str
    id: str
    first_at: float | None = None
    final: dict | None = None
    final_at: float | None = None
    finals: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)


async def track(nc, tenant: str, count: int) -> list[Tracked]:
    tracked = []
    for _ in range(count):
        rid, sub = await submit(nc, "chat", tenant, BODY)
        one = Tracked(tenant, rid)
        one.task = asyncio.create_task(_follow(one, sub))
        tracked.append(one)
    return tracked


async def _follow(one: Tracked, sub) -> None:
    """Events until the final one, then a little longer: a second final would be seen."""
    while True:
        try:
            msg = await sub.next_msg(timeout=30.0 if one.final is None else 0.5)
        except nats.errors.TimeoutError:
            return
        event = json.loads(msg.data)
        now = time.monotonic()
        one.first_at = one.first_at or now
        if event["type"] in ("done", "error"):
            one.final, one.final_at = one.final or event, one.final_at or now
            one.finals += 1


async def finished(requests: list[Tracked]) -> None:
    await asyncio.gather(*(r.task for r in requests))


async def reload_all(nc) -> list[dict]:
    replies = await reload_dispatchers(nc, Subjects("fq"), RELOAD_WAIT_S)
    return [msgspec.structs.asdict(r) for r in replies]


@pytest.fixture
async def client(nats_url):
    nc = await nats.connect(nats_url)
    yield nc
    await nc.drain()


async def test_a_tenant_moved_up_a_tier_under_load_is_served_by_it_within_a_second(
    nats_url, client, tmp_path
):
    path = tmp_path / "fairq.toml"
    write_config(path, {"ent": "enterprise", "mover": "free", "other": "free"})
    async with LocalStack(
        load_config(path), options(load_engine_config_one_slot()), nats_url=nats_url
    ) as stack:
        with_config_file(stack, path)
        ent = await track(client, "ent", 80)
        mover = await track(client, "mover", 8)
        other = await track(client, "other", 8)
        # Enterprise's backlog holds the free tier back entirely: nothing of it runs.
        await eventually(
            lambda: asyncio.sleep(0, sum(r.final is not None for r in ent) >= 10),
            what="enterprise requests completing",
        )
        assert all(r.first_at is None for r in mover + other)
        write_config(path, {"ent": "enterprise", "mover": "enterprise", "other": "free"})
        reloaded_at = time.monotonic()
        replies = await reload_all(client)
        assert [(r["ok"], r["added"], r["removed"], r["changed"], r["error"]) for r in replies] == [
            (True, [], [], ["mover"], None)
        ]
        depth = await api(client, "fq.api.depth", {})
        assert {q["tenant"]: q["tier"] for q in depth["queues"]}["mover"] == "enterprise"
        await finished(ent + mover + other)
    first_served = min(r.first_at for r in mover)
    assert first_served - reloaded_at < 1.0
    # Still under load when served: enterprise had work left, the free tier waited.
    assert max(r.final_at for r in ent) > first_served
    assert min(r.first_at for r in other) > max(r.final_at for r in mover)
    assert all(r.final["type"] == "done" and r.finals == 1 for r in ent + mover + other)


async def test_a_tenant_added_to_the_file_is_served_after_sighup(nats_url, client, tmp_path):
    path = tmp_path / "fairq.toml"
    write_config(path, {"acme": "enterprise"})
    async with LocalStack(load_config(path), options(), nats_url=nats_url) as stack:
        (reply,) = await reload_all(client)
        assert not reply["ok"] and "started without a config file" in reply["error"]
        with_config_file(stack, path)
        (before,) = await track(client, "newco", 1)
        await finished([before])
        assert before.final["type"] == "error" and before.final["code"] == "unknown_tenant"
        write_config(path, {"acme": "enterprise", "newco": "free"})
        loop = asyncio.get_running_loop()
        install_reload_signal(loop, lambda: stack.dispatcher)
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            await eventually(
                lambda: asyncio.sleep(0, stack.dispatcher.scheduler.registry.tenant("newco")),
                what="the reload after SIGHUP",
            )
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
        after = await track(client, "newco", 3)
        await finished(after)
    assert [r.final["type"] for r in after] == ["done"] * 3


async def test_a_removed_tenants_queued_requests_end_with_a_clear_error(nats_url, client, tmp_path):
    path = tmp_path / "fairq.toml"
    write_config(path, {"ent": "enterprise", "gone": "free"})
    async with LocalStack(
        load_config(path), options(load_engine_config_one_slot()), nats_url=nats_url
    ) as stack:
        with_config_file(stack, path)
        ent = await track(client, "ent", 40)
        gone = await track(client, "gone", 5)
        await eventually(
            lambda: asyncio.sleep(0, stack.dispatcher.scheduler.tenant_queued("gone") == 5),
            what="gone queued",
        )
        write_config(path, {"ent": "enterprise"})
        replies = await reload_all(client)
        assert [(r["ok"], r["removed"]) for r in replies] == [(True, ["gone"])]
        await finished(ent + gone)
        # Later requests of the tenant are turned away at admission.
        (late,) = await track(client, "gone", 1)
        await finished([late])
    for r in gone:
        assert r.final["type"] == "error" and r.final["code"] == "unknown_tenant", r.final
        assert r.final["message"] == "tenant 'gone' was removed from the configuration"
        assert r.finals == 1
    assert late.final["code"] == "unknown_tenant"
    assert all(r.final["type"] == "done" for r in ent)


async def test_a_bad_file_leaves_the_old_config_in_force_and_the_reply_says_why(
    nats_url, client, tmp_path
):
    path = tmp_path / "fairq.toml"
    write_config(path, {"acme": "enterprise"})
    async with LocalStack(load_config(path), options(), nats_url=nats_url) as stack:
        with_config_file(stack, path)
        dispatcher = stack.dispatcher
        config = dispatcher.config
        path.write_text("[tenants.newco\ntier = 'free'\n")
        (reply,) = await reload_all(client)
        assert not reply["ok"] and "not valid TOML" in reply["error"], reply
        # Adds a tenant, and changes an endpoint: refused whole, naming the section.
        write_config(path, {"acme": "enterprise", "newco": "free"})
        path.write_text(path.read_text().replace("max_tokens_cap = 64", "max_tokens_cap = 8"))
        (reply,) = await reload_all(client)
        assert not reply["ok"] and "section(s) endpoints changed" in reply["error"], reply
        # A tier still named by a tenant cannot go.
        write_config(path, {"acme": "free"})
        path.write_text(path.read_text().replace('[[tiers]]\nname = "free"\nweight = 1.0', ""))
        (reply,) = await reload_all(client)
        assert not reply["ok"] and "tenants.acme.tier" in reply["error"], reply
        # A malformed request is answered, and the subscription keeps serving.
        answer = await client.request(
            "fq.admin.reload", b"[1, 2]", timeout=5.0, headers={"Fq-Admin-Op": "reload"}
        )
        refused = json.loads(answer.data)
        assert not refused["ok"] and "invalid reload request" in refused["error"]
        # Without its header nothing is reloaded: what a caller directs here as its reply
        # (a PubAck, an API answer) is not a reload request.
        answer = await client.request("fq.admin.reload", b"{}", timeout=5.0)
        refused = json.loads(answer.data)
        assert not refused["ok"] and "Fq-Admin-Op" in refused["error"]
        assert dispatcher.config is config
        (rejected,) = await track(client, "newco", 1)
        await finished([rejected])
        assert rejected.final["code"] == "unknown_tenant"
        write_config(path, {"acme": "enterprise", "newco": "free"})
        (reply,) = await reload_all(client)
        assert reply["ok"] and reply["added"] == ["newco"], reply
        (accepted,) = await track(client, "newco", 1)
        await finished([accepted])
        assert accepted.final["type"] == "done"
        # The stack's own [dispatcher] table, not the file's, is still in force.
        assert dispatcher.config.dispatcher == config.dispatcher != load_config(path).dispatcher


async def test_nothing_is_lost_or_run_twice_across_reloads_under_load(nats_url, client, tmp_path):
    path = tmp_path / "fairq.toml"
    plans = [
        {"a": "free", "b": "enterprise", "c": "free"},
        {"a": "enterprise", "b": "free", "c": "free"},
        {"a": "enterprise", "b": "enterprise", "c": "enterprise", "d": "free"},
        {"a": "free", "b": "free", "c": "enterprise", "d": "enterprise"},
    ]
    write_config(path, plans[0])
    engine = msgspec.structs.replace(load_engine_config_one_slot(), max_sequences=4)
    async with LocalStack(load_config(path), options(engine), nats_url=nats_url) as stack:
        with_config_file(stack, path)
        dispatched: list[str] = []

        async def observe(msg) -> None:
            batch = msgspec.msgpack.decode(msg.data, type=wire_internal.Batch)
            dispatched.extend(f"{i.tenant}/{i.id}" for i in batch.items if not i.probe)

        await client.subscribe("fq.int.work.chat.*", cb=observe)
        requests: list[Tracked] = []
        for plan in plans[1:] * 2:
            for tenant in "abc":
                requests += await track(client, tenant, 20)
            await asyncio.sleep(0.2)
            write_config(path, plan)
            replies = await reload_all(client)
            assert [r["ok"] for r in replies] == [True], replies
        await finished(requests)
    assert len(requests) == 360
    assert all(r.finals == 1 and r.final["type"] == "done" for r in requests), [
        r.final for r in requests if r.finals != 1 or r.final["type"] != "done"
    ][:3]
    assert sorted(dispatched) == sorted(f"{r.tenant}/{r.id}" for r in requests)

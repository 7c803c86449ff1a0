"""Strict tiers through real nats-server (issue 44): a higher tier whose backlog is larger
than the intake window keeps every slot but the newcomer reserve, although most of its
requests wait in the broker rather than in the dispatcher's queue."""

from __future__ import annotations

import asyncio
import json

import msgspec
import nats
import pytest

from broker_config.config import DispatcherOptions, parse_config
from broker_config.subjects import Subjects
from dispatcher.core.placement import Placement
from dispatcher.core.types import Selection
from tests.local_stack import LocalStack, StackOptions
from workers.sim_engine import SimEngine

pytestmark = pytest.mark.integration

CONFIG = """
[profiles.p]
name = "p"
alpha = 0.000125
beta = 0.025
capacity_mu_per_s = 30.0
[endpoints.chat]
profile = "p"
cost = "model_units"
latency_target_s = 600.0
newcomer_reserve = 0.08        # 1 of the worker's 12 sequences
[[tiers]]
name = "enterprise"
weight = 4.0
[[tiers]]
name = "free"
[tenants.acme]
tier = "enterprise"
[tenants.initech]
tier = "free"
"""
# The intake's per-tenant window: acme's backlog is forty times larger, and a batch that
# ends together frees three times what the dispatcher holds of acme's.
WINDOW = 2
ACME, INITECH = 80, 30
RESERVE = 1


async def publish(url: str, tenant: str, count: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    for n in range(count):
        await js.publish(
            Subjects().request("chat", tenant),
            json.dumps({"prompt": "hello", "max_tokens": 12}).encode(),
            headers={"Nats-Msg-Id": f"{tenant}-{n}"},
        )
    await nc.drain()


@pytest.mark.timeout(120)
async def test_a_backlog_beyond_the_intake_window_keeps_lower_tiers_to_the_reserve(
    nats_url: str,
) -> None:
    engine = msgspec.structs.replace(SimEngine().params, max_sequences=13)  # 12 + a probe's
    options = StackOptions(
        workers=1,
        engine=engine,
        time_scale=0.5,
        dispatcher=DispatcherOptions(tenant_window=WINDOW, tick_s=0.05, grace_s=0.0),
    )
    async with LocalStack(
        parse_config(CONFIG, source="tiers.toml"), options, nats_url=nats_url
    ) as stack:
        scheduler = stack.dispatcher.scheduler
        place = scheduler.place
        passes: list[tuple[int, int]] = []  # (acme not yet dispatched, initech running)
        dispatched = {"acme": 0, "initech": 0}

        def observed(endpoint: str, room: Placement, now: float, *args) -> Selection:
            selection = place(endpoint, room, now, *args)
            for request in selection.requests:
                dispatched[request.tenant] += 1
            initech = scheduler.flow(endpoint, "initech")
            passes.append((ACME - dispatched["acme"], initech.running if initech else 0))
            return selection

        scheduler.place = observed
        await publish(stack.nats_url, "acme", ACME)
        await publish(stack.nats_url, "initech", INITECH)
        async with asyncio.timeout(90):
            while dispatched != {"acme": ACME, "initech": INITECH}:
                await asyncio.sleep(0.05)
        while_acme_waited = [running for left, running in passes if left > 0]
        assert while_acme_waited, "acme's backlog never met initech's requests"
        assert max(while_acme_waited) <= RESERVE, passes
        # Once acme had nothing left, initech took every slot.
        assert max(running for _, running in passes) > RESERVE

"""The dispatcher's autoscaling decisions through a real nats-server: an endpoint with
no worker at all, scaled to zero, is asked for one by its first requests (even those
it turns away as `overloaded`: they cannot wait out the cold start), as a ScaleEvent
and on the gauges."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from broker_config import wire_internal
from broker_config.config import load_config
from costmodel.capacity import ScalingPolicy
from tests.dispatch.test_dataplane_e2e import collect, stack_options, submit
from tests.local_stack import LocalStack

pytestmark = pytest.mark.integration


async def test_an_endpoint_without_workers_is_asked_for_one_by_its_first_requests(
    nats_url: str,
) -> None:
    config = load_config()
    chat = config.endpoints["chat"]
    config = msgspec.structs.replace(
        config,
        endpoints={
            **config.endpoints,
            "chat": (
                msgspec.structs.replace(
                    chat,
                    autoscale=ScalingPolicy(
                        min_replicas=0, max_replicas=4, cold_start_s=60.0, rate_window_s=5.0
                    ),
                )
            ),
        },
    )
    async with LocalStack(config, stack_options(workers=0), nats_url=nats_url) as stack:
        events: asyncio.Queue[wire_internal.ScaleEvent] = asyncio.Queue()

        async def on_event(msg) -> None:
            await events.put(wire_internal.SCALE_EVENT.decode(msg.data))

        await stack.nc.subscribe(stack.config.subjects.scale("chat"), cb=on_event)
        first = await asyncio.wait_for(events.get(), 5.0)
        assert first.endpoint == "chat" and first.desired == 0 and first.serving == 0
        _, sub = await submit(stack.nc, "chat", "acme", {"prompt": "hi", "max_tokens": 8})
        final = (await collect(sub))[-1]
        # 60 s of cold start against a 30 s latency target: turned away, honestly ...
        assert final["type"] == "error" and final["code"] == "overloaded", final
        # ... and still counted: the dispatcher asks for a worker.
        async with asyncio.timeout(10.0):
            event = await events.get()
            while event.desired < 1:  # the events before the demand was counted
                event = await events.get()
        assert event.serving == 0 and event.utilisation is None and event.demand_mu_per_s > 0
        metrics = stack.metrics
        assert metrics.desired_replicas.labels("chat")._value.get() >= 1
        assert metrics.serving_replicas.labels("chat")._value.get() == 0

"""The drift reading through a real nats-server: three endpoints on the same simulated
engine, whose profiles predict its capacity right, four times too high and four times
too low. Kept busy, the right one reads near 1 and stays quiet; the other two read out
of the band and each gets a warning in the log that says how to fix it."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import msgspec
import pytest

from broker_config.config import parse_config
from costmodel.capacity import DriftPolicy
from tests.dispatch.test_dataplane_e2e import (
    FAST,
    collect,
    load_engine_config_one_slot,
    stack_options,
    submit,
)
from tests.local_stack import LocalStack

pytestmark = pytest.mark.integration

# One sequence at a time on the example engine takes exactly a request's model units
# in (simulated) seconds; at time_scale 0.2 a replica gets through 5 model units/s.
TIME_SCALE = 0.2
TRUE_CAPACITY = 1 / TIME_SCALE
PREDICTED = {"right": TRUE_CAPACITY, "over": 4 * TRUE_CAPACITY, "under": TRUE_CAPACITY / 4}


def drift_config():
    profiles = "".join(
        f"""
[profiles.{name}]
name = "{name}"
alpha = 0.000125
beta = 0.025
capacity_mu_per_s = {capacity}
[endpoints.{name}]
profile = "{name}"
cost = "model_units"
latency_target_s = 3600.0
max_tokens_cap = 64
"""
        for name, capacity in PREDICTED.items()
    )
    return parse_config(
        profiles
        + """
[[tiers]]
name = "standard"
[tenants.acme]
tier = "standard"
"""
    )


async def test_a_wrong_profile_reads_out_of_band_and_is_warned_about(nats_url, caplog):
    caplog.set_level(logging.WARNING, logger="dispatcher.fleet.drift")
    options = stack_options(
        endpoints=tuple(PREDICTED),
        time_scale=TIME_SCALE,
        engine=load_engine_config_one_slot(),
        dispatcher=msgspec.structs.replace(
            FAST, drift=DriftPolicy(window_s=6.0, min_full_s=3.0, warn_after_s=1.0)
        ),
    )
    async with LocalStack(drift_config(), options, nats_url=nats_url) as stack:
        # 1.6 model units each: 30 keep a replica busy for about 10 s.
        body = {"prompt": "hi", "max_tokens": 64}
        subs = [
            (await submit(stack.nc, name, "acme", body))[1] for _ in range(30) for name in PREDICTED
        ]
        gauge = stack.metrics.drift
        readings: dict[str, float] = {}
        deadline = time.monotonic() + 30.0
        while len(readings) < len(PREDICTED) or not warned(caplog, "over", "under"):
            assert time.monotonic() < deadline, (readings, caplog.text)
            await asyncio.sleep(0.2)
            for name in PREDICTED:
                value = gauge.labels(name)._value.get()
                if not math.isnan(value):
                    readings[name] = value
        assert 0.8 <= readings["right"] <= 1.25, readings
        assert readings["over"] < 0.8 and readings["under"] > 1.25, readings
        assert not warned(caplog, "right"), caplog.text
        for sub in subs:
            assert (await collect(sub, timeout=60.0))[-1]["type"] == "done"
    assert "fairq calibrate" in caplog.text


def warned(caplog, *endpoints: str) -> bool:
    return all(
        any(f"endpoint {name}:" in record.getMessage() for record in caplog.records)
        for name in endpoints
    )

"""The load of a chaos run (`bench.chaos.run`): Poisson arrivals from Zipf-weighted
tenants (`open_loop`), bursts before the dispatchers' faults (`burst`), or tenants that
keep every worker full (`closed_loop`); every request submitted until the broker
acknowledges it, each with its own reply subject that the observer (`Watch`) reads."""

from __future__ import annotations

import asyncio
import json
import random
import time

import nats.errors

from bench.chaos.settings import Settings
from bench.chaos.watch import Watch
from bench.harness.stack import ENDPOINT
from broker_config.subjects import HDR_MSG_ID, HDR_REPLY, Subjects
from dispatcher.core.pool import Key
from producers.loadgen import tenant_names, zipf_weights

SUBMIT_TRY_S = 2.0
SUBMIT_TIMEOUT_S = 60.0
SUBJECTS = Subjects()  # the benchmark config's prefix


# -- load --------------------------------------------------------------------------------


def _body(rng: random.Random, settings: Settings) -> bytes:
    low, high = settings.prompt_tokens
    return json.dumps(
        {
            "prompt": "chaos",
            "input_tokens": rng.randint(low, high),
            "max_tokens": settings.max_tokens,
        }
    ).encode()


async def _submit(js, watch: Watch, key: Key, n: int, body: bytes) -> None:
    """Until the broker acknowledges it, as a client does while a cluster elects a new
    stream leader: the same message id, so a copy it stored already is not stored twice."""
    tenant, request_id = key
    headers = {HDR_MSG_ID: request_id, HDR_REPLY: watch.reply_for(key, n)}
    deadline = time.monotonic() + SUBMIT_TIMEOUT_S
    while True:
        try:
            await js.publish(
                SUBJECTS.request(ENDPOINT, tenant), body, headers=headers, timeout=SUBMIT_TRY_S
            )
            return
        except (nats.errors.Error, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def open_loop(js, watch: Watch, settings: Settings, rng: random.Random) -> list[Key]:
    """Poisson arrivals at `rate_per_s`, tenants by Zipf shares; every request submitted."""
    tenants = tenant_names(settings.tenants)
    weights = zipf_weights(settings.tenants, 1.1)
    keys, tasks = [], []
    start = time.monotonic()
    due = 0.0
    for n in range(settings.requests):
        due += rng.expovariate(settings.rate_per_s)
        await asyncio.sleep(max(0.0, start + due - time.monotonic()))
        key = (rng.choices(tenants, weights)[0], f"c{n}")
        keys.append(key)
        tasks.append(asyncio.create_task(_submit(js, watch, key, n, _body(rng, settings))))
    await asyncio.gather(*tasks)
    return keys


async def burst(js, watch: Watch, settings: Settings, rng: random.Random, keys: list[Key]) -> None:
    """`burst_before_fault` requests at once, from tenants by Zipf shares, added to
    `keys` (numbered after the open loop's)."""
    tenants = tenant_names(settings.tenants)
    weights = zipf_weights(settings.tenants, 1.1)
    sent = []
    for _ in range(settings.burst_before_fault):
        n = settings.requests + len(keys)
        keys.append((rng.choices(tenants, weights)[0], f"b{n}"))
        sent.append(_submit(js, watch, keys[-1], n, _body(rng, settings)))
    await asyncio.gather(*sent)


async def closed_loop(
    js, watch: Watch, settings: Settings, rng: random.Random, per_tenant: int
) -> list[Key]:
    """Each tenant keeps `per_tenant` requests in flight until `saturate_s` has passed."""
    keys: list[Key] = []
    counter = iter(range(10**9))
    stop_at = time.monotonic() + settings.saturate_s

    async def tenant(name: str) -> None:
        while time.monotonic() < stop_at:
            n = next(counter)
            key = (name, f"s{n}")
            keys.append(key)
            await _submit(js, watch, key, n, _body(rng, settings))
            given_up = time.monotonic() + settings.finish_timeout_s
            while key not in watch.finals and time.monotonic() < given_up:
                await asyncio.sleep(0.05)  # a request never answered counts as lost

    await asyncio.gather(
        *(tenant(name) for name in tenant_names(settings.tenants) for _ in range(per_tenant))
    )
    return keys

"""Real vLLM engines of their own, none shared with other tests: a worker kept full and
probed, and two engines with prefix caching behind affinity routing.

Apart from test_vllm_dataplane.py's module engine on purpose: an idle vLLM engine's
scheduler process polls a core without sleeping (vLLM's CPU backend reserves one for
it), and on a 2-core machine that starves the test's own event loop (dispatcher and
worker) into answering probes seconds late.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS

from bench.scenarios import affinity_vllm
from broker_config.config import DispatcherOptions
from dispatcher.observe.metrics import DispatcherMetrics
from dispatcher.service import Dispatcher
from tests.dispatch.test_dataplane_e2e import collect, submit
from tests.workers.test_vllm_dataplane import (  # noqa: F401
    CONFIG,
    KV_CACHE_BYTES,
    OPTIONS,
    WAIT_S,
    client,
    serving,
)
from tests.workers.test_vllm_engine import model_dir, vllm_env  # noqa: F401
from workers.vllm_engine import VLLMEngine, VLLMEngineConfig

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]
NO_RESERVE = CONFIG.replace(
    "max_tokens_cap = 8000", "max_tokens_cap = 8000\nnewcomer_reserve = 0.0"
)
assert NO_RESERVE != CONFIG


async def test_a_vllm_worker_under_full_load_answers_probes_and_is_never_evicted(
    nats_url: str,
    client: NATS,  # noqa: F811
    model_dir: Path,  # noqa: F811
) -> None:
    """Its own engine of four sequences (three advertised, one kept for probes), kept
    full through the dispatcher by long requests, and probed as often as the dispatcher
    can (stall 0.05 s: a probe whenever one heartbeat reports no new token and the last
    probe was answered). The dispatcher's default probe timeout and failure count apply:
    every probe is answered in time, and the worker is never evicted.

    No newcomer reserve: the two tenants alternate, each exactly at its share, and
    neither may take a reserved slot (it is kept for a tenant below its share, for the
    newcomer window), so the worker would run two of three."""
    config = VLLMEngineConfig(
        model=str(model_dir),
        max_num_seqs=4,
        max_model_len=8192,
        kv_cache_bytes=KV_CACHE_BYTES,
        ignore_eos=True,
    )
    defaults = DispatcherOptions()
    options = msgspec.structs.replace(
        OPTIONS,
        probe_stall_s=0.05,
        probe_idle_s=0.05,
        probe_timeout_s=defaults.probe_timeout_s,
        probe_failures=defaults.probe_failures,
    )
    metrics = DispatcherMetrics(["chat"])
    running: list[int] = []  # requests on the worker, sampled every 50 ms

    async def sample(dispatcher: Dispatcher) -> None:
        while True:
            # The dispatcher may not have read the worker's first heartbeat yet.
            if (worker := dispatcher.pool.get("vllm-1")) is not None:
                running.append(len(worker.assigned))
            await asyncio.sleep(0.05)

    async with (
        VLLMEngine(config) as engine,
        serving(nats_url, engine, options, metrics, NO_RESERVE) as dispatcher,
    ):
        submitted = await asyncio.gather(
            *(
                submit(
                    client,
                    "chat",
                    tenant,
                    {"prompt": f"def g{i}():", "max_tokens": 1000},
                    rid=f"{tenant}-{i}",
                )
                for i in range(3)
                for tenant in ("acme", "globex")
            )
        )
        sampler = asyncio.create_task(sample(dispatcher))
        try:
            streams = await asyncio.gather(
                *(collect(sub, timeout=4 * WAIT_S) for _, sub in submitted)
            )
        finally:
            sampler.cancel()
        if sampler.done() and not sampler.cancelled():
            sampler.result()  # a sampler that died says why
        worker = dispatcher.pool.get("vllm-1")
        assert worker.healthy and not worker.evicted

    def count(metric) -> float:
        return metrics.child(metric, "chat")._value.get()

    assert all(events[-1]["type"] == "done" for events in streams), [
        events[-1] for events in streams if events[-1]["type"] != "done"
    ]
    # Full (three of three) for most of the run: six requests, three at a time.
    assert len(running) >= 20 and running.count(3) >= len(running) / 3, running
    assert count(metrics.probes) >= 10, count(metrics.probes)
    assert count(metrics.probe_failures) == 0 and count(metrics.evictions) == 0


async def test_session_affinity_finds_more_of_the_prompts_cached_than_least_loaded(
    nats_url: str,
    model_dir: Path,  # noqa: F811
) -> None:
    """`bench.scenarios.affinity_vllm` at a small size: two vLLM engines with prefix caching, six
    conversations of three turns, routed by session and then to the least loaded
    worker. Turns of a conversation that stay on one engine find their history in its
    cache."""
    results = await affinity_vllm.compare(nats_url, model_dir, sessions=6, turns=3)
    routed, spread = results["affinity"], results["least-loaded"]
    assert routed["requests"] == spread["requests"] == 18
    assert len(routed["requests_per_worker"]) == 2  # both engines served
    assert routed["cached_token_ratio"] > spread["cached_token_ratio"], results

"""What each limiter store costs admission: the in-process one, the embedded default
(decisions in memory, monthly usage in NATS KV) and Redis.

    python -m bench.micro.limiter_stores [--tenants 1000] [--requests 20000] [--repeats 3]
                                         [--out bench/results/limiter_stores.json]

Each request of `--tenants` tenants (taken in turn) is checked as the dispatcher checks
it: requests and tokens per minute on its endpoint, its monthly quota there and its
monthly quota across endpoints (`limit_checks`), then settled as a completion would be
(a refund of unused output). Reported per store: the wall time of `apply`, p50 and
p99, and requests admitted per second, with one request in flight as in the
dispatcher's admission loop; for the KV store also the first `apply` of each tenant (it
reads the stored counters) and one flush that writes every tenant's two counters.
Starts its own nats-server and redis-server on free loopback ports.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import nats
import numpy as np

from bench.harness.cli import write_json
from bench.harness.machine import command_line, machine_facts, table
from broker_config.config import BrokerSettings, Limits
from broker_config.server import EmbeddedNatsServer, EmbeddedRedisServer
from dispatcher.admission.kv_store import KvLimiterStore
from dispatcher.admission.redis_store import (
    AsyncLimiterStore,
    MemoryLimiterAsync,
    RedisLimiterStore,
)
from dispatcher.core.limits import charged, limit_checks, settlement

LIMITS = Limits(rpm=1e6, tpm=1e9, monthly_quota_tokens=10**12)
TOTAL_QUOTA = 10**12
NOW = 1_700_000_000.0


async def run_store(store: AsyncLimiterStore, tenants: int, requests: int) -> dict:
    first_seen: list[float] = []
    steady: list[float] = []
    started = time.perf_counter()
    for n in range(requests):
        tenant = f"t{n % tenants}"
        checks = limit_checks(tenant, "chat", LIMITS, 600, NOW, TOTAL_QUOTA)
        began = time.perf_counter()
        decision = await store.apply(checks, NOW)
        (first_seen if n < tenants else steady).append(time.perf_counter() - began)
        assert decision.admitted, decision
        await store.settle(settlement(charged(checks), 450), NOW)
    elapsed = time.perf_counter() - started
    result = {
        "requests_per_s": requests / elapsed,
        "apply_p50_ms": 1e3 * float(np.percentile(steady, 50)),
        "apply_p99_ms": 1e3 * float(np.percentile(steady, 99)),
        "first_apply_p50_ms": 1e3 * float(np.percentile(first_seen, 50)),
    }
    if isinstance(store, KvLimiterStore):
        began, cpu = time.perf_counter(), time.process_time()
        await store.flush()
        result["flush_all_ms"] = 1e3 * (time.perf_counter() - began)
        result["flush_all_cpu_ms"] = 1e3 * (time.process_time() - cpu)
    return result


async def main_async(args: argparse.Namespace) -> dict:
    results: dict[str, list[dict]] = {"in-process": [], "nats-kv": [], "redis": []}
    for repeat in range(args.repeats):
        async with EmbeddedNatsServer() as nats_server:
            with EmbeddedRedisServer() as redis_server:
                nc = await nats.connect(nats_server.url)
                try:
                    stores: dict[str, AsyncLimiterStore] = {
                        "in-process": MemoryLimiterAsync(),
                        # Flushed once, at the end, to time one whole flush.
                        "nats-kv": await KvLimiterStore.open(nc, BrokerSettings(), flush_s=3600.0),
                        "redis": RedisLimiterStore.from_url(redis_server.url),
                    }
                    for name, store in stores.items():
                        results[name].append(await run_store(store, args.tenants, args.requests))
                        await store.aclose()
                finally:
                    await nc.close()
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    return results


def median(runs: list[dict], key: str) -> float:
    return float(np.median([run[key] for run in runs]))


def report(results: dict[str, list[dict]]) -> list[str]:
    rows = []
    for name, runs in results.items():
        flush = (
            f"{median(runs, 'flush_all_ms'):.0f} ({median(runs, 'flush_all_cpu_ms'):.0f})"
            if "flush_all_ms" in runs[0]
            else "-"
        )
        rows.append(
            [
                name,
                f"{median(runs, 'requests_per_s'):,.0f}",
                f"{median(runs, 'apply_p50_ms'):.3f}",
                f"{median(runs, 'apply_p99_ms'):.3f}",
                f"{median(runs, 'first_apply_p50_ms'):.3f}",
                flush,
            ]
        )
    return table(
        [
            "store",
            "requests/s (apply + settle)",
            "apply p50 ms",
            "apply p99 ms",
            "first apply of a tenant p50 ms",
            "one flush of all counters ms (of it CPU in this process)",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.limiter_stores", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/limiter_stores.json"))
    args = parser.parse_args()
    if not 1 <= args.tenants <= args.requests:
        parser.error("--tenants must be between 1 and --requests")
    facts = machine_facts(command_line("bench.micro.limiter_stores"))
    results = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, {"machine": facts, "results": results}, 2)
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()

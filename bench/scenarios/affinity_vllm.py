"""Session affinity against least-loaded routing on real vLLM: two CPU engines with
prefix caching, the dispatcher, and multi-turn chats.

    python -m bench.scenarios.affinity_vllm [--sessions 12] [--turns 5] [--workers 2]
                                            [--kv-cache-mib 64] [--out-dir bench/results/affinity]

Two vLLM workers (--workers; the tiny local model, `workers.tiny_model`; prefix caching
on) serve one endpoint through an embedded nats-server and the real dispatcher. Conversations
share one of two system prompts and grow turn by turn (each turn sends the whole
conversation so far: system prompt, earlier messages and answers, a new message); the
conversations run side by side, each turn sent a random 0-1 s after the previous one
was answered (seeded), so no two runs place them in lockstep. The same
chats run twice, with `affinity` on and off (least utilised worker), each under a prefix
of its own so neither run finds the other's cache. Reported per run: the share of
prompt tokens vLLM found cached (`usage.cached_input_tokens`, from its
`num_cached_tokens`), p50/p95 time to first token, output tokens per second, and each
worker's share of the requests. The engines share 2 CPU cores here, so time to first
token mostly measures their contention.

On two workers the 2x cached-token goal of issue 11 is out of reach by construction:
least-loaded routing sends a turn to the worker of the conversation's previous turn
about half the time, and there it finds everything affinity would (docs/benchmarks.md
works the expected ratio out: 1.35x for this workload).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from bench.harness.cli import write_json
from bench.harness.machine import ran_on, table
from bench.harness.stack import connected
from broker_config import wire, wire_internal
from broker_config.config import Config, DispatcherOptions, WorkerOptions, parse_config
from broker_config.server import EmbeddedNatsServer
from dispatcher.service import Dispatcher
from workers.service import WorkerService
from workers.tiny_model import build_tiny_model
from workers.vllm_engine import VLLMEngine, VLLMEngineConfig

CONFIG = """
[profiles.tiny]
name = "tiny"
alpha = 0.00005
beta = 0.002
capacity_mu_per_s = 4.0

[endpoints.chat]
profile = "tiny"
cost = "model_units"
latency_target_s = 600.0
max_tokens_cap = 256

[[tiers]]
name = "standard"

[unlisted_tenants]
policy = "admit"
tier = "standard"
"""
OPTIONS = DispatcherOptions(
    settle_s=0.2,
    tick_s=0.05,
    worker_timeout_s=30.0,
    grace_s=5.0,
    probe_stall_s=3600.0,
    probe_idle_s=3600.0,
)
# Short beside the conversations they start: what a worker that served a
# conversation holds, and another does not, is its history.
SYSTEM_PROMPTS = [
    f"You are a careful assistant for a team of {role} engineers. " * 2
    for role in ("storage", "network")
]
ANSWER_TOKENS = 16
KV_CACHE_MIB = 64
REPLY_S = 120.0
SUBJECTS = parse_config(CONFIG).subjects


def engine_config(model: Path, kv_cache_mib: int) -> VLLMEngineConfig:
    # vLLM refuses a cache smaller than one sequence of max_model_len; the tiny model's
    # cache holds 1,024 tokens per MiB.
    return VLLMEngineConfig(
        model=str(model),
        max_num_seqs=4,
        max_model_len=min(4096, kv_cache_mib * 1024),
        kv_cache_bytes=kv_cache_mib << 20,
        ignore_eos=True,
    )


@contextlib.asynccontextmanager
async def serving(nats_url: str, engines: list[VLLMEngine], affinity: bool) -> AsyncIterator[NATS]:
    """A dispatcher (affinity on or off) and a worker per engine; yields a client."""
    config: Config = parse_config(CONFIG)
    config = msgspec.structs.replace(
        config,
        dispatcher=OPTIONS,
        endpoints={"chat": msgspec.structs.replace(config.endpoints["chat"], affinity=affinity)},
    )
    async with contextlib.AsyncExitStack() as stack:
        nc = await stack.enter_async_context(connected(nats_url, name="fairq-affinity-vllm"))
        dispatcher = await stack.enter_async_context(Dispatcher(nc, config))
        results = await nc.jetstream().key_value(dispatcher.subjects.results_bucket)
        for n, engine in enumerate(engines, 1):
            await stack.enter_async_context(
                WorkerService(
                    nc,
                    engine,
                    endpoint="chat",
                    worker_id=f"vllm-{n}",
                    subjects=dispatcher.subjects,
                    results=results,
                    profile=dispatcher.scheduler.endpoints["chat"].profile,
                    settings=WorkerOptions(heartbeat_interval_s=0.2, drain_timeout_s=10.0),
                )
            )
        deadline = time.monotonic() + 60
        while sum(w.healthy for w in dispatcher.pool) < len(engines):
            if time.monotonic() > deadline:
                raise RuntimeError("the workers never reported healthy")
            await asyncio.sleep(0.05)
        yield nc


async def ask(nc: NATS, tenant: str, rid: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request's final event."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.jetstream().publish(
            SUBJECTS.request("chat", tenant),
            json.dumps(body).encode(),
            headers={"Nats-Msg-Id": rid, "Fq-Reply": inbox},
        )
        async with asyncio.timeout(REPLY_S):
            while True:
                event = json.loads((await sub.next_msg(timeout=REPLY_S)).data)
                if event["type"] in ("done", "error"):
                    return event
    finally:
        await sub.unsubscribe()


async def chats(nc: NATS, run: str, sessions: int, turns: int) -> dict[str, Any]:
    """Every conversation's turns; per request its usage, TTFT and worker."""
    workers: dict[str, str] = {}

    async def on_batch(msg) -> None:
        batch = wire_internal.BATCH.decode(
            msg.data, wire.Encoding.from_content_type((msg.headers or {}).get("Content-Type"))
        )
        workers.update((item.id, batch.worker_id) for item in batch.items)

    watch = await nc.subscribe(SUBJECTS.batches("chat"), cb=on_batch)
    rng = random.Random(f"{sessions}:{turns}")  # the same pauses for every routing
    pauses = [[rng.uniform(0.0, 1.0) for _ in range(turns)] for _ in range(sessions)]
    done: list[dict[str, Any]] = []

    async def conversation(s: int) -> None:
        history = f"# {run}\n{SYSTEM_PROMPTS[s % 2]}\n"
        for turn in range(turns):
            await asyncio.sleep(pauses[s][turn])  # the user reads, then writes
            history += f"User: question {turn} about part {s}: " + "details " * 60 + "\n"
            rid = f"{run}-{s}-{turn}-{uuid.uuid4().hex[:6]}"
            event = await ask(
                nc,
                f"team{s % 3}",
                rid,
                {"prompt": history, "session": f"{run}-{s}", "max_tokens": ANSWER_TOKENS},
            )
            if event["type"] != "done":
                raise RuntimeError(f"turn {turn} of conversation {s} failed: {event}")
            history += f"Assistant: {event['text']}\n"
            done.append(event | {"worker": workers.get(rid)})

    started = time.monotonic()
    await asyncio.gather(*(conversation(s) for s in range(sessions)))
    elapsed = time.monotonic() - started
    await watch.unsubscribe()
    prompt = sum(e["usage"]["input_tokens"] for e in done)
    cached = sum(e["usage"].get("cached_input_tokens", 0) for e in done)
    ttft = sorted(e["timings"]["ttft_s"] for e in done)
    per_worker = Counter(e["worker"] for e in done)
    return {
        "requests": len(done),
        "cached_token_ratio": cached / prompt,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
        "output_tokens_per_s": sum(e["usage"]["output_tokens"] for e in done) / elapsed,
        "max_over_mean_requests": max(per_worker.values()) / (len(done) / len(per_worker)),
        "requests_per_worker": dict(per_worker),
    }


async def compare(
    nats_url: str,
    model: Path,
    sessions: int,
    turns: int,
    kv_cache_mib: int = KV_CACHE_MIB,
    workers: int = 2,
) -> dict[str, Any]:
    """Both routings on the same engines, affinity first."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(VLLMEngine(engine_config(model, kv_cache_mib)))
            for _ in range(workers)
        ]
        results = {}
        for name, affinity in (("affinity", True), ("least-loaded", False)):
            async with serving(nats_url, engines, affinity) as nc:
                results[name] = await chats(nc, name, sessions, turns)
        return results


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [
        [
            name,
            str(r["requests"]),
            f"{r['cached_token_ratio']:.1%}",
            f"{r['ttft_p50_s']:.2f} s",
            f"{r['ttft_p95_s']:.2f} s",
            f"{r['output_tokens_per_s']:.1f}",
            f"{r['max_over_mean_requests']:.2f}",
        ]
        for name, r in results.items()
    ]
    return "\n".join(
        [
            ran_on(
                f"python -m bench.scenarios.affinity_vllm --sessions {args.sessions} "
                f"--turns {args.turns} --workers {args.workers} "
                f"--kv-cache-mib {args.kv_cache_mib}"
            ),
            "",
            *table(
                [
                    "routing",
                    "requests",
                    "cached prompt tokens",
                    "p50 TTFT",
                    "p95 TTFT",
                    "output tok/s",
                    "busiest worker / mean",
                ],
                rows,
            ),
        ]
    )


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fairq-affinity-") as scratch:
        model = build_tiny_model(Path(scratch) / "model")
        async with EmbeddedNatsServer() as server:
            return await compare(
                server.url, model, args.sessions, args.turns, args.kv_cache_mib, args.workers
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scenarios.affinity_vllm", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument(
        "--kv-cache-mib",
        type=int,
        default=KV_CACHE_MIB,
        help="each engine's KV cache (smaller: cache pressure)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results/affinity"))
    args = parser.parse_args(argv)
    # A local model: nothing is fetched, and vLLM reports nothing home.
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS"):
        os.environ.setdefault(name, "1")
    if min(args.sessions, args.turns, args.workers, args.kv_cache_mib) < 1:
        print(
            "affinity_vllm: --sessions, --turns, --workers and --kv-cache-mib must be >= 1",
            file=sys.stderr,
        )
        return 2
    results = asyncio.run(_main(args))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(args.out_dir / "vllm.json", results, 2)
    print(report(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

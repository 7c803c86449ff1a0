"""What the OpenAI-compatible front costs: the same requests through it (OpenAI's Python
package over HTTP) and over NATS with fairq's SDK, side by side on one stack.

    python -m bench.scenarios.front [--requests 2000] [--concurrency 32] [--max-tokens 16]

The stack (`bench.harness.stack`): an embedded nats-server, `python -m dispatcher` and two
simulated workers with an instant engine (time scale 0), so what is measured is the
path, not generation. The front runs as its own process (`python -m producers.openai_front`),
as a deployment runs it. Each path gets a warm-up, then the measured requests at the
given concurrency, non-streamed (latency to the whole answer) and streamed (latency to
the first token); the paths alternate, twice each, and each figure is the better of
its two rounds. Writes bench/results/front/front.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai

from bench.harness.cli import write_json
from bench.harness.machine import command_line, machine_facts, table
from bench.harness.paths import REPO, RESULTS_DIR
from bench.harness.procstat import cpu_seconds
from bench.harness.stack import Stack, StackSpec
from dispatcher.sim.fairness import percentile
from producers.client import Client

RESULTS = RESULTS_DIR / "front"
TENANT = "bench"
WARMUP = 50
START_TIMEOUT_S = 30.0

Call = Callable[[int], Awaitable[float]]


async def measure(call: Call, requests: int, concurrency: int, front_pid: int) -> dict[str, float]:
    """Requests/s, latency percentiles (ms) of `requests` calls, `concurrency` at once, and
    the CPU milliseconds per request of the front's process and of this one (the client)."""
    latencies: list[float] = []
    slots = asyncio.Semaphore(concurrency)

    async def one(n: int) -> None:
        async with slots:
            latencies.append(await call(n))

    started, front_cpu, own_cpu = time.perf_counter(), cpu_seconds(front_pid), time.process_time()
    await asyncio.gather(*(one(n) for n in range(requests)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "requests_per_s": requests / elapsed,
        **{f"p{q}_ms": percentile(latencies, q) * 1000 for q in (50, 90, 99)},
        "front_cpu_ms": (cpu_seconds(front_pid) - front_cpu) * 1000 / requests,
        "client_cpu_ms": (time.process_time() - own_cpu) * 1000 / requests,
    }


def sdk_calls(fq: Client, max_tokens: int) -> dict[str, Call]:
    async def complete(n: int) -> float:
        started = time.perf_counter()
        await fq.run("chat", TENANT, prompt=f"request {n}", max_tokens=max_tokens)
        return time.perf_counter() - started

    async def first_token(n: int) -> float:
        started = time.perf_counter()
        submitted = await fq.submit("chat", TENANT, prompt=f"request {n}", max_tokens=max_tokens)
        elapsed = None
        async with contextlib.aclosing(fq.stream(submitted)) as events:
            async for _ in events:
                elapsed = elapsed or time.perf_counter() - started
        assert elapsed is not None
        return elapsed

    return {"complete": complete, "first_token": first_token}


def http_calls(client: openai.AsyncOpenAI, max_tokens: int) -> dict[str, Call]:
    async def complete(n: int) -> float:
        started = time.perf_counter()
        await client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": f"request {n}"}],
            max_tokens=max_tokens,
        )
        return time.perf_counter() - started

    async def first_token(n: int) -> float:
        started = time.perf_counter()
        stream = await client.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": f"request {n}"}],
            max_tokens=max_tokens,
            stream=True,
        )
        elapsed = None
        async for chunk in stream:
            if elapsed is None and chunk.choices and chunk.choices[0].delta.content:
                elapsed = time.perf_counter() - started
        assert elapsed is not None
        return elapsed

    return {"complete": complete, "first_token": first_token}


async def start_front(stack: Stack) -> tuple[asyncio.subprocess.Process, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "producers.openai_front",
        "--config",
        str(stack.config_path),
        "--nats",
        stack.url,
        "--port",
        "0",
        "--dev-key-for",
        TENANT,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdout is not None
    async with asyncio.timeout(START_TIMEOUT_S):
        base = (await process.stdout.readline()).decode().strip()
        key = (await process.stdout.readline()).decode().strip()
    return process, base.removeprefix("OPENAI_BASE_URL="), key.removeprefix("OPENAI_API_KEY=")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = StackSpec(mode="fairq", workers=2, time_scale=0.0)
    async with Stack(spec, args.out_dir / "logs") as stack:
        front, base_url, key = await start_front(stack)
        try:
            async with Client.connect(stack.url) as fq:
                http = openai.AsyncOpenAI(
                    base_url=base_url, api_key=key, max_retries=0, timeout=60.0
                )
                paths = {
                    "nats (SDK)": sdk_calls(fq, args.max_tokens),
                    "http (front)": http_calls(http, args.max_tokens),
                }
                results: dict[str, dict[str, list[dict[str, float]]]] = {
                    path: {kind: [] for kind in calls} for path, calls in paths.items()
                }
                for calls in paths.values():
                    for call in calls.values():
                        await measure(call, WARMUP, args.concurrency, front.pid)
                for _ in range(2):
                    for path, calls in paths.items():
                        for kind, call in calls.items():
                            results[path][kind].append(
                                await measure(call, args.requests, args.concurrency, front.pid)
                            )
                await http.close()
        finally:
            front.terminate()
            await front.wait()
    best = {
        path: {
            kind: max(rounds, key=lambda r: r["requests_per_s"]) for kind, rounds in kinds.items()
        }
        for path, kinds in results.items()
    }
    return {
        "settings": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "stack": spec.describe(),
        },
        "machine": machine_facts(command_line("bench.scenarios.front")),
        "best": best,
        "rounds": results,
    }


def report(summary: dict[str, Any]) -> list[str]:
    rows = []
    for path, kinds in summary["best"].items():
        for kind, figures in kinds.items():
            rows.append(
                [
                    path,
                    kind,
                    f"{figures['requests_per_s']:.0f}",
                    *(f"{figures[f'p{q}_ms']:.1f}" for q in (50, 90, 99)),
                    f"{figures['front_cpu_ms']:.2f}",
                    f"{figures['client_cpu_ms']:.2f}",
                ]
            )
    return table(
        [
            "path",
            "answer",
            "requests/s",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "front CPU ms/request",
            "client CPU ms/request",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scenarios.front", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        parser.error("--requests, --concurrency and --max-tokens must be >= 1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(run(args))
    write_json(args.out_dir / "front.json", summary, 2)
    print("\n".join(report(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

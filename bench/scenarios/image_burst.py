"""Does a burst of large images disturb a worker's text streams? Runs of the same text
load on one worker: without images (the baseline), then with another tenant's burst of
large images in the middle, twice: once on a simulated engine whose vision encoder
costs nothing (what the worker's own handling of images costs the streams), once with
the engine's vision encoding (`image_s` of configs/engine.toml, 50 ms per image, paid
in the engine's step as a GPU pays it). For each, the worker's event-loop lag and the
gaps between the text requests' token events, during the burst's window.

    python -m bench.scenarios.image_burst [--duration 25] [--burst-at 5] [--images 96]
                                          [--image-size 3000x2000] [--streams 8]

Parts: an embedded nats-server and `python -m dispatcher` as processes (a stack of
`bench.harness.stack` without workers); the worker (the real WorkerService on the
simulated engine at time scale 1, its image pool of `[workers.images]`) runs in this
process beside a probe that sleeps 5 ms at a time and records how late it wakes (the
event-loop lag); the same probe runs in a process that does nothing else, for the lag
the machine adds by itself. Each client runs in a process of its own, so that neither's
work counts as the worker's, and sending large bodies does not delay the reading of the
text streams. The text tenant keeps `--streams` streaming requests in flight; the image
tenant sends `--images` requests at once, each with a JPEG photo of `--image-size`,
which the worker decodes and scales to 1024 pixels. A run whose image requests do not
all succeed fails. Writes
bench/results/image_burst/image_burst.json (the clients' samples and the dispatcher's
log go to its logs/) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats

from bench.harness.cli import bench_parser, write_json
from bench.harness.machine import command_line, machine_facts, table
from bench.harness.paths import REPO, RESULTS_DIR
from bench.harness.stack import Stack, StackSpec
from broker_config.config import EXAMPLE_CONFIG, EXAMPLE_ENGINE, Config, load_config
from broker_config.kv_writer import KeyValueWriter
from broker_config.wire import TokenEvent
from costmodel.engine_model import load_engine_params
from dispatcher.sim.fairness import percentile
from producers.client import Client
from workers.service import WorkerService
from workers.sim_engine import SimEngine

RESULTS = RESULTS_DIR / "image_burst"
TEXT_TENANT, IMAGE_TENANT = "acme", "globex"
PROBE_S = 0.005
CLIENT_START_S = 5.0  # from starting the clients to their clock's start
START_TIMEOUT_S = 60.0


# -- the clients' process ------------------------------------------------------------------


def photo_jpeg(width: int, height: int, seed: int) -> str:
    """A JPEG with the detail of a photo (smooth shapes and fine noise), base64."""
    from PIL import Image, ImageFilter

    # Noise at 1/16 of the size, blurred: about 600 KB for 3000x2000, so that a request
    # fits in nats-server's default largest message (1 MiB).
    noise = Image.frombytes("L", (width // 16, height // 16), os.urandom(width * height // 256))
    base = Image.merge(
        "RGB",
        [
            Image.radial_gradient("L").resize((width, height)),
            Image.linear_gradient("L").resize((width, height)),
            noise.resize((width, height)).filter(ImageFilter.BLUR),
        ],
    )
    buffer = io.BytesIO()
    base.rotate(seed % 360).save(buffer, "JPEG", quality=80)
    return base64.b64encode(buffer.getvalue()).decode()


async def text_stream(client: Client, gaps: list[tuple[float, float]], until: float) -> None:
    """One text request after another; each gap between token events, with its time."""
    while time.time() < until:
        submitted = await client.submit(
            "chat", TEXT_TENANT, prompt="tell me a story", max_tokens=64
        )
        last = None
        async for event in client.stream(submitted, timeout_s=60.0):
            now = time.time()
            if isinstance(event, TokenEvent):
                if last is not None:
                    gaps.append((now, now - last))
                last = now


async def image_burst(client: Client, count: int, images: list[str]) -> dict[str, Any]:
    async def one(n: int) -> str:
        await client.run(
            "chat",
            IMAGE_TENANT,
            prompt="describe this",
            images=[images[n % len(images)]],
            max_tokens=8,
            timeout_s=300.0,
        )
        return "done"

    started = time.time()
    outcomes = await asyncio.gather(*(one(n) for n in range(count)), return_exceptions=True)
    return {
        "started": started,
        "ended": time.time(),
        "done": sum(outcome == "done" for outcome in outcomes),
        "failed": [repr(o) for o in outcomes if o != "done"][:5],
    }


async def text_client(args: argparse.Namespace) -> None:
    gaps: list[tuple[float, float]] = []
    async with Client.connect(args.nats) as client:
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        until = args.start_at + args.duration
        await asyncio.gather(*(text_stream(client, gaps, until) for _ in range(args.streams)))
    Path(args.out).write_text(json.dumps({"gaps": gaps}))


async def idle_probe(args: argparse.Namespace) -> None:
    """The same probe in a process that does nothing else: the lag the machine itself
    adds (two shared cores), the floor for the worker's."""
    lags: list[tuple[float, float]] = []
    probing = asyncio.create_task(probe(lags))
    await asyncio.sleep(max(0.0, args.start_at + args.duration - time.time()))
    probing.cancel()
    Path(args.out).write_text(json.dumps({"lags": lags}))


async def image_client(args: argparse.Namespace) -> None:
    images = [photo_jpeg(*args.image_size, seed) for seed in range(4)]
    async with Client.connect(args.nats) as client:
        await asyncio.sleep(max(0.0, args.start_at + args.burst_at - time.time()))
        burst = await image_burst(client, args.images, images)
    Path(args.out).write_text(json.dumps({"burst": burst, "image_bytes": len(images[0])}))


# -- the worker's process (this one) -------------------------------------------------------


async def probe(lags: list[tuple[float, float]]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(PROBE_S)
        lags.append((time.time(), loop.time() - asked - PROBE_S))


async def one_run(
    args: argparse.Namespace, name: str, burst: bool, vision: bool, out_dir: Path
) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    # The worker's event loop alone on one core, its image pool and the rest on the
    # others, as on a GPU host with cores to spare; --shared-cores: all together.
    worker_cpus, other_cpus = (
        ({cpus[0]}, set(cpus[1:])) if args.pin and len(cpus) > 1 else (set(cpus),) * 2
    )
    os.sched_setaffinity(0, other_cpus)  # inherited by nats-server and the dispatcher
    # The dispatcher alone: the worker runs here, beside the probe.
    spec = StackSpec(mode="fairq", workers=0, config=load_config(EXAMPLE_CONFIG))
    log_dir = out_dir / "logs" / re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    async with (
        Stack(spec, log_dir) as stack,
        stack.connect() as nc,
        in_process_worker(nc, spec.config, vision) as worker,
    ):
        # Started here, the fork server and its processes keep the other cores.
        await worker.image_pool.prepare([photo_jpeg(64, 64, 0)], "warm-up")
        os.sched_setaffinity(0, worker_cpus)  # this thread: the worker's event loop
        lags: list[tuple[float, float]] = []
        probing = asyncio.create_task(probe(lags))
        # Both clients start the clock together, once the images are made.
        start_at = time.time() + CLIENT_START_S
        roles = ["text", "probe", "images"] if burst else ["text", "probe"]
        outs = {role: out_dir / "logs" / f"{role}-{name}.json" for role in roles}
        cpus_of = {role: worker_cpus if role == "probe" else other_cpus for role in roles}
        await run_clients(args, stack.url, outs, cpus_of, start_at)
        probing.cancel()
        restarts = worker.image_pool.restarts
    seen = json.loads(outs["images"].read_text()) if burst else {"burst": None, "image_bytes": None}
    if burst and seen["burst"]["done"] != args.images:
        raise RuntimeError(f"image requests failed: {seen['burst']['failed']}")
    start, end = (
        (seen["burst"]["started"], seen["burst"]["ended"])
        if burst
        else (start_at + args.burst_at, start_at + args.burst_at + args.baseline_window)
    )
    return {
        "run": name,
        "window_s": round(end - start, 2),
        "image_requests_done": seen["burst"]["done"] if burst else None,
        "image_failures": seen["burst"]["failed"] if burst else None,
        "image_base64_bytes": seen["image_bytes"],
        "pool_restarts": restarts,
        **figures(lags, outs, start, end),
    }


@contextlib.asynccontextmanager
async def in_process_worker(
    nc: nats.NATS, config: Config, vision: bool
) -> AsyncIterator[WorkerService]:
    """The real WorkerService on the simulated engine at time scale 1, in this process
    (`vision` False: an engine whose vision encoder costs nothing)."""
    params = load_engine_params(EXAMPLE_ENGINE)
    if not vision:
        params = msgspec.structs.replace(params, image_s=0.0)
    async with (
        KeyValueWriter(nc, config.subjects.results_bucket) as results,
        SimEngine(params, time_scale=1.0) as engine,
        WorkerService(
            nc,
            engine,
            endpoint="chat",
            worker_id="chat-w1",
            subjects=config.subjects,
            results=results,
            profile=config.profiles["llama-7b-sim"],
            settings=config.workers,
        ) as worker,
    ):
        yield worker


async def run_clients(
    args: argparse.Namespace,
    url: str,
    outs: dict[str, Path],
    cpus_of: dict[str, set[int]],
    start_at: float,
) -> None:
    """Each client role in a process of its own, on its cores, until all have ended."""
    processes = [
        await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "bench.scenarios.image_burst", "--role", role),
            *("--nats", url, "--out", str(out), "--start-at", repr(start_at)),
            *args.passed,
            cwd=REPO,
            preexec_fn=functools.partial(os.sched_setaffinity, 0, cpus_of[role]),
        )
        for role, out in outs.items()
    ]
    for role, process in zip(outs, processes, strict=True):
        if await process.wait() != 0:
            raise RuntimeError(f"the {role} client failed ({process.returncode})")


def figures(
    lags: list[tuple[float, float]], outs: dict[str, Path], start: float, end: float
) -> dict[str, Any]:
    """The worker's event-loop lag, the idle probe's, and the text streams' token gaps
    within [start, end]."""
    gaps = json.loads(outs["text"].read_text())["gaps"]
    lag_ms = sorted(1000 * lag for at, lag in lags if start <= at <= end)
    idle_ms = sorted(
        1000 * lag
        for at, lag in json.loads(outs["probe"].read_text())["lags"]
        if start <= at <= end
    )
    gap_ms = sorted(1000 * gap for at, gap in gaps if start <= at <= end)
    return {
        "lag_samples": len(lag_ms),
        "lag_p50_ms": round(percentile(lag_ms, 50), 2),
        "lag_p99_ms": round(percentile(lag_ms, 99), 2),
        "lag_max_ms": round(lag_ms[-1], 2),
        "idle_lag_p99_ms": round(percentile(idle_ms, 99), 2),
        "token_gaps": len(gap_ms),
        "gap_p50_ms": round(percentile(gap_ms, 50), 1),
        "gap_p99_ms": round(percentile(gap_ms, 99), 1),
        "gap_max_ms": round(gap_ms[-1], 1),
    }


def size(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    return int(width), int(height)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("bench.scenarios.image_burst", __doc__)
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of text load")
    parser.add_argument(
        "--burst-at", type=float, default=5.0, help="seconds into the run the image burst starts"
    )
    parser.add_argument(
        "--baseline-window",
        type=float,
        default=10.0,
        help="seconds the baseline's window lasts (the burst's own otherwise)",
    )
    parser.add_argument("--images", type=int, default=96, help="image requests in the burst")
    parser.add_argument("--image-size", type=size, default=(3000, 2000), metavar="WxH")
    parser.add_argument("--streams", type=int, default=8, help="text requests in flight")
    parser.add_argument(
        "--shared-cores",
        dest="pin",
        action="store_false",
        help="run every process on every core (default: the worker alone "
        "on the first core, the rest on the others)",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--role",
        choices=("main", "text", "probe", "images"),
        default="main",
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # What the clients' process is started with: the load's settings as given here.
    args.passed = [
        "--duration",
        str(args.duration),
        "--burst-at",
        str(args.burst_at),
        "--baseline-window",
        str(args.baseline_window),
        "--images",
        str(args.images),
        "--image-size",
        "x".join(map(str, args.image_size)),
        "--streams",
        str(args.streams),
    ]
    return args


async def main_role(args: argparse.Namespace) -> None:
    (args.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    command = command_line("bench.scenarios.image_burst")
    runs = [
        await one_run(args, name, burst, vision, args.out_dir)
        for name, burst, vision in (
            ("baseline", False, True),
            ("burst", True, False),
            ("burst, vision encoding in the engine", True, True),
        )
    ]
    report = {
        "machine": machine_facts(command),
        "settings": args.passed,
        "worker_alone_on_a_core": args.pin,
        "runs": runs,
    }
    write_json(args.out_dir / "image_burst.json", report, 2)
    columns = [
        "run",
        "window_s",
        "image_requests_done",
        "lag_p50_ms",
        "lag_p99_ms",
        "lag_max_ms",
        "idle_lag_p99_ms",
        "gap_p50_ms",
        "gap_p99_ms",
        "gap_max_ms",
        "pool_restarts",
    ]
    print("\n".join(table(columns, [[str(run[c]) for c in columns] for run in runs])))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    role = {"main": main_role, "text": text_client, "probe": idle_probe, "images": image_client}[
        args.role
    ]
    asyncio.run(role(args))


if __name__ == "__main__":
    main()

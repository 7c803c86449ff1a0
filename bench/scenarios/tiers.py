"""Strict tiers under load, end to end through `fairq up` (issue 44's two runs).

    python -m bench.scenarios.tiers                      # starts `fairq up` itself
    python -m bench.scenarios.tiers --nats-url URL       # against a running one
    python -m bench.scenarios.tiers --run mixed --quick  # a shorter variant

- **mixed**: acme (enterprise) sends 250 requests, globex (standard) 25 and initech
  (free) 25, all `max_tokens=1024`, at once.
- **newcomer**: acme sends 1,000 requests of 400 tokens; three seconds later initech
  sends 60 requests of 300 tokens over 6 s.

Reported per run: the most lower-tier requests running while an enterprise request
surely waited (the goal: at most the newcomer reserve, 4 slots on `fairq up`'s two chat
workers). Running counts are the dispatcher's own, sampled every 0.1 s as `fairq top`
sees them; an enterprise request surely waited at a sample if the broker had acked it
and its done event says it was dispatched (or refused) later, even counted from when
its publish began (its timings count from its broker timestamp, which the client knows
only to within its publish). Also each tier's p95 queue wait, and every answer by
outcome, with the enterprise requests admission refused after they waited in the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness.machine import command_line, machine_facts
from bench.harness.paths import REPO
from bench.harness.up import fairq_up
from producers.client import Client
from producers.demo import BATCH_PROMPT, Answer, ask
from producers.errors import FairqError

RESULTS = REPO / "bench" / "results" / "tiers"
TIER = {"acme": "enterprise", "globex": "standard", "initech": "free"}
SAMPLE_S = 0.1


@dataclass(frozen=True, slots=True)
class Wave:
    tenant: str
    count: int
    max_tokens: int
    after_s: float = 0.0  # from the run's start
    over_s: float = 0.0  # sent evenly over this long (0: at once)


RUNS = {
    "mixed": [Wave("acme", 250, 1024), Wave("globex", 25, 1024), Wave("initech", 25, 1024)],
    "newcomer": [Wave("acme", 1000, 400), Wave("initech", 60, 300, after_s=3.0, over_s=6.0)],
}
QUICK = {
    "mixed": [Wave("acme", 160, 256), Wave("globex", 25, 256), Wave("initech", 25, 256)],
    "newcomer": [Wave("acme", 300, 128), Wave("initech", 40, 96, after_s=2.0, over_s=4.0)],
}


async def send(client: Client, wave: Wave, run_id: str) -> list[Answer]:
    await asyncio.sleep(wave.after_s)
    gap = wave.over_s / wave.count
    tasks = []
    for n in range(wave.count):
        request_id = f"tiers-{run_id}-{wave.tenant}-{n}"
        tasks.append(
            asyncio.create_task(
                ask(client, "chat", wave.tenant, wave.max_tokens, request_id, BATCH_PROMPT)
            )
        )
        if gap:
            await asyncio.sleep(gap)
        elif n % 50 == 49:
            await asyncio.sleep(0)  # let replies be read while publishing
    return list(await asyncio.gather(*tasks))


def surely_waiting(top: Sequence[Answer], moment: float) -> bool:
    """Whether an enterprise request was surely waiting at `moment`: the broker had
    acknowledged it, and even counted from when its publish began it had not been
    dispatched (nor refused) yet."""
    return any(
        a.sent_at is not None and a.sent_at <= moment < (a.started_at or a.ended_at or float("inf"))
        for a in top
    )


def lower_running_while_top_waited(
    answers: Sequence[Answer], samples: Sequence[tuple[float, int]]
) -> int:
    """The most lower-tier requests running (the dispatcher's count, sampled) while an
    enterprise request surely waited."""
    top = [a for a in answers if TIER[a.tenant] == "enterprise"]
    return max((lower for at, lower in samples if surely_waiting(top, at)), default=0)


def p95_wait_by_tier(answers: Sequence[Answer]) -> dict[str, float | None]:
    waits: dict[str, list[float]] = {tier: [] for tier in TIER.values()}
    for a in answers:
        if a.started_at is not None:
            waits[TIER[a.tenant]].append(a.started_at - a.submitted_at)
    return {
        tier: (sorted(w)[min(len(w) - 1, int(0.95 * len(w)))] if w else None)
        for tier, w in waits.items()
    }


async def sample_depth(client: Client, samples: list[tuple[float, int]]) -> None:
    """Every `SAMPLE_S`, as `fairq top` sees it: (when, lower-tier requests running)."""
    while True:
        with contextlib.suppress(FairqError):
            asked = time.time()
            rows = (await client.depth()).queues
            lower = sum(r.running for r in rows if r.endpoint == "chat" and r.tier != "enterprise")
            samples.append((asked, lower))
        await asyncio.sleep(SAMPLE_S)


async def run_one(url: str, name: str, waves: list[Wave]) -> dict:
    run_id = f"{name}-{time.time():.0f}"
    started = time.monotonic()
    samples: list[tuple[float, int]] = []
    async with Client.connect(url) as client:
        sampler = asyncio.create_task(sample_depth(client, samples))
        results = await asyncio.gather(*(send(client, wave, run_id) for wave in waves))
        sampler.cancel()
    answers = [a for result in results for a in result]
    outcomes = Counter(f"{a.tenant} {a.outcome}" for a in answers)
    return {
        "run": name,
        "waves": [dataclasses.asdict(w) for w in waves],
        "seconds": round(time.monotonic() - started, 1),
        "depth_samples": len(samples),
        "lower_tier_running_while_enterprise_waited": lower_running_while_top_waited(
            answers, samples
        ),
        "p95_queue_wait_s": p95_wait_by_tier(answers),
        "outcomes": dict(sorted(outcomes.items())),
        # Admission's throttle after the request waited in the broker (issue 37's part).
        "enterprise_refused_after_waiting_in_broker": sum(
            1
            for a in answers
            if TIER[a.tenant] == "enterprise" and "waiting in the broker" in a.message
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scenarios.tiers", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--nats-url", help="a running `fairq up` (default: start one)")
    parser.add_argument("--run", choices=[*RUNS, "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="smaller runs (about a minute)")
    parser.add_argument("--label", default="", help="a name for the result file (e.g. before)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    runs = QUICK if args.quick else RUNS
    names = list(runs) if args.run == "both" else [args.run]
    summary = {"machine": machine_facts(command_line("bench.scenarios.tiers", argv)), "runs": []}
    with contextlib.ExitStack() as stack:
        if args.nats_url is None:
            up = stack.enter_context(fairq_up(Path(tempfile.mkdtemp(prefix="tiers-"))))
        url = args.nats_url or up.values["NATS_URL"]
        for name in names:
            result = asyncio.run(run_one(url, name, runs[name]))
            print(json.dumps(result), flush=True)
            summary["runs"].append(result)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    suffix = ("-" + args.label if args.label else "") + ("-quick" if args.quick else "")
    (args.out_dir / f"tiers{suffix}.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

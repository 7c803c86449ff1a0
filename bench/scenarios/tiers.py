"""Strict tiers under load, end to end through `fairq up` (issue 44's two runs).

    python -m bench.scenarios.tiers                      # starts `fairq up` itself
    python -m bench.scenarios.tiers --nats-url URL       # against a running one
    python -m bench.scenarios.tiers --run mixed --quick  # a shorter variant

- **mixed**: acme (enterprise) sends 250 requests, globex (standard) 25 and initech
  (free) 25, all `max_tokens=1024`, at once.
- **newcomer**: acme sends 1,000 requests of 400 tokens; three seconds later initech
  sends 60 requests of 300 tokens over 6 s.

Each request's dispatch and end come from its done event (`timings`, from its submit).
Reported per run: the most lower-tier requests running at any moment an enterprise
request that had been sent was not yet dispatched (the goal: at most the newcomer
reserve, 4 slots on `fairq up`'s two chat workers), each tier's p95 queue wait, and
every answer by outcome (the goal: no enterprise request refused).
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

RESULTS = REPO / "bench" / "results" / "tiers"
TIER = {"acme": "enterprise", "globex": "standard", "initech": "free"}
START_S = 60.0


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


def lower_running_while_top_waited(answers: Sequence[Answer]) -> int:
    """The most lower-tier requests running at a moment when an enterprise request sent
    before it had not been dispatched yet (checked at every lower-tier dispatch)."""
    top = [a for a in answers if TIER[a.tenant] == "enterprise"]
    lower = [a for a in answers if TIER[a.tenant] != "enterprise" and a.started_at is not None]
    most = 0
    for moment in sorted(a.started_at for a in lower):
        waiting = any(
            a.submitted_at <= moment < (a.started_at or a.ended_at or float("inf")) for a in top
        )
        if waiting:
            running = sum(1 for a in lower if a.started_at <= moment < a.ended_at)
            most = max(most, running)
    return most


def p95_wait_by_tier(answers: Sequence[Answer]) -> dict[str, float | None]:
    waits: dict[str, list[float]] = {tier: [] for tier in TIER.values()}
    for a in answers:
        if a.started_at is not None:
            waits[TIER[a.tenant]].append(a.started_at - a.submitted_at)
    return {
        tier: (sorted(w)[min(len(w) - 1, int(0.95 * len(w)))] if w else None)
        for tier, w in waits.items()
    }


async def run_one(url: str, name: str, waves: list[Wave]) -> dict:
    run_id = f"{name}-{time.time():.0f}"
    started = time.monotonic()
    async with Client.connect(url) as client:
        results = await asyncio.gather(*(send(client, wave, run_id) for wave in waves))
    answers = [a for result in results for a in result]
    outcomes = Counter(f"{a.tenant} {a.outcome}" for a in answers)
    return {
        "run": name,
        "waves": [dataclasses.asdict(w) for w in waves],
        "seconds": round(time.monotonic() - started, 1),
        "lower_tier_running_while_enterprise_waited": lower_running_while_top_waited(answers),
        "p95_queue_wait_s": p95_wait_by_tier(answers),
        "outcomes": dict(sorted(outcomes.items())),
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
        url = args.nats_url or stack.enter_context(
            fairq_up(Path(tempfile.mkdtemp(prefix="tiers-")))
        )
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

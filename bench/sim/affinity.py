"""Session affinity against least-loaded routing, in the simulator, on one workload.

    python -m bench.sim.affinity [--replicas 16] [--sessions 2400] [--turns 8] [--seed 1]
                                 [--session-rate 0.25] [--out-dir bench/results/affinity]
                                 [--smoke]

The workload (`bench.sim.affinity_workload`): multi-turn chats whose prompts share a system
prompt and grow turn by turn. Both runs replay the same turns through the same config
(configs/example.toml, admission out of the way) and engine (configs/engine.toml, a
7B-class model per replica, with a prefix cache of its KV size); only the routing
differs. Reported: the cached share of prompt tokens, p50/p95 time to first token,
output throughput, and the busiest replica's share of the work against the mean.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.harness.cli import write_json
from bench.harness.machine import ran_on, table
from bench.sim.affinity_workload import ChatWorkload, chat_turns
from broker_config.config import EXAMPLE_CONFIG, EXAMPLE_ENGINE, load_config
from costmodel.engine_model import load_engine_params
from dispatcher.core.limits import scheduling_only
from dispatcher.sim.fairness import RequestRecord
from dispatcher.sim.simulator import simulate

ROUTINGS = {"affinity": True, "least-loaded": False}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def figures(records: list[RequestRecord], summary: dict[str, Any]) -> dict[str, float]:
    served = [r for r in records if r.first_token is not None and r.finished is not None]
    ttft = [r.first_token - r.arrival for r in served]
    span = max(r.finished for r in served) - min(r.arrival for r in served)
    work: dict[str, int] = {}
    for r in served:
        work[r.worker] = work.get(r.worker, 0) + r.input_tokens + r.output_tokens
    return {
        "requests": len(records),
        "served": len(served),
        "cached_token_ratio": summary["simulation"]["cached_token_ratio"],
        "ttft_p50_s": percentile(ttft, 0.50),
        "ttft_p95_s": percentile(ttft, 0.95),
        "output_tokens_per_s": sum(r.output_tokens for r in served) / span,
        "max_over_mean_load": max(work.values()) / statistics.mean(work.values()),
    }


def run(workload: ChatWorkload, replicas: int, seed: int) -> dict[str, dict[str, float]]:
    trace = chat_turns(workload, seed)
    config = scheduling_only(load_config(EXAMPLE_CONFIG))
    engine = load_engine_params(EXAMPLE_ENGINE)
    results = {}
    for name, affinity in ROUTINGS.items():
        result = simulate(
            trace, config, engine, replicas=replicas, affinity=affinity, early_binding=True
        )
        results[name] = figures(result.records, result.summary)
    return results


def report(
    results: dict[str, dict[str, float]], args: argparse.Namespace, workload: ChatWorkload
) -> str:
    a, b = results["affinity"], results["least-loaded"]
    command = (
        f"python -m bench.sim.affinity --replicas {args.replicas} --sessions "
        f"{args.sessions} --turns {args.turns} --session-rate {args.session_rate} "
        f"--seed {args.seed}"
    )
    rows = [
        [
            name,
            f"{r['cached_token_ratio']:.1%}",
            f"{r['ttft_p50_s']:.2f} s",
            f"{r['ttft_p95_s']:.2f} s",
            f"{r['output_tokens_per_s']:,.0f}",
            f"{r['max_over_mean_load']:.2f}",
        ]
        for name, r in results.items()
    ]
    lines = [
        f"{ran_on(command)}; {a['requests']:,} requests, system prompt "
        f"{workload.system_tokens} tokens, {workload.system_prompts} of them.",
        "",
        *table(
            [
                "routing",
                "cached prompt tokens",
                "p50 TTFT",
                "p95 TTFT",
                "output tok/s",
                "busiest replica / mean",
            ],
            rows,
        ),
    ]
    lines += [
        "",
        f"Affinity / least-loaded: cached ratio "
        f"{a['cached_token_ratio'] / max(b['cached_token_ratio'], 1e-12):.2f}x, p95 TTFT "
        f"{a['ttft_p95_s'] / b['ttft_p95_s']:.2f}x, throughput "
        f"{a['output_tokens_per_s'] / b['output_tokens_per_s']:.3f}x.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim.affinity", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=2400)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--session-rate", type=float, default=0.25, help="sessions started per second per replica"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results/affinity"))
    parser.add_argument(
        "--smoke", action="store_true", help="a small run (4 replicas, 200 sessions) for CI"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.replicas, args.sessions = 4, 200
    if args.replicas < 1 or args.sessions < 1 or args.turns < 1 or not args.session_rate > 0:
        print(
            "affinity: --replicas, --sessions and --turns must be >= 1, --session-rate > 0",
            file=sys.stderr,
        )
        return 2
    # Sessions start over a span that keeps the fleet busy in proportion to its size.
    workload = ChatWorkload(
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=500,
        message_tokens=(100, 400),
        answer_tokens=(100, 400),
        duration_s=args.sessions / args.replicas / args.session_rate,
    )
    results = run(workload, args.replicas, args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "smoke.json" if args.smoke else "sim.json"
    write_json(args.out_dir / name, results, 2)
    print(report(results, args, workload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How work spreads over unequal replicas: three simulated workers, one twice the others.

    python -m bench.sim.spread [--requests 20000] [--load 0.7] [--seed 1] [--smoke]
                               [--out-dir bench/results/spread]

Replicas: two of configs/engine.toml (a 7B-class model on one GPU) and one with twice
its sequences, KV cache, prefill budget and prefill speed, and a full batch's decode
step as fast (the same model on a GPU twice the size). Traffic: steady Poisson arrivals,
prompts of 100-2,000 tokens and answers of 50-500 (uniform), at --load times the fleet's
throughput on that mix, in two runs: requests without an affinity key (least utilised
routing), and requests of 400 conversations (affinity with bounded load). The fleet's
throughput is measured first, by keeping one base replica full of the same mix. Reported
per replica: its share of the model units served against its share of the fleet's size;
the goal is every share within +-10% (relative) of its share of capacity.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from bench.harness.cli import write_json
from bench.harness.machine import ran_on, table
from broker_config.config import EXAMPLE_CONFIG, EXAMPLE_ENGINE, load_config
from costmodel.engine_model import EngineParams, load_engine_params
from dispatcher.core.limits import scheduling_only
from dispatcher.sim.simulator import simulate
from dispatcher.sim.trace import TraceRecord

CONVERSATIONS = 400
MEAN_OUTPUT_TOKENS = 275.0  # of the uniform 50-500


def fleet(base: EngineParams) -> list[EngineParams]:
    big = EngineParams(
        max_sequences=2 * base.max_sequences,
        max_batched_tokens=2 * base.max_batched_tokens,
        kv_cache_tokens=2 * base.kv_cache_tokens,
        prefill_tokens_per_s=2 * base.prefill_tokens_per_s,
        # Twice the sequences at the same step time: each sequence's step costs half.
        decode_step_base_s=base.decode_step_base_s,
        decode_step_per_seq_s=base.decode_step_per_seq_s / 2,
        image_s=base.image_s / 2,
    )
    return [base, base, big]


def traffic(requests: int, rate: float, seed: int, keyed: bool) -> list[TraceRecord]:
    rng = random.Random(seed)
    at, records = 0.0, []
    for n in range(requests):
        at += rng.expovariate(rate)
        output = rng.randint(50, 500)
        records.append(
            TraceRecord(
                f"t{n % 8}",
                at,
                rng.randint(100, 2000),
                output,
                max_tokens=output,
                session=f"c{rng.randrange(CONVERSATIONS)}" if keyed else None,
            )
        )
    return records


def saturated_tokens_per_s(config, base: EngineParams, seed: int) -> float:
    """Output tokens per second of one base replica kept full of this mix."""
    records = [
        TraceRecord(r.tenant, 0.0, r.input_tokens, r.output_tokens, max_tokens=r.max_tokens)
        for r in traffic(2_000, 1.0, seed, False)
    ]
    result = simulate(records, config, base)
    return sum(r.output_tokens for r in result.records) / result.summary["simulation"]["makespan_s"]


def shares(requests: int, load: float, seed: int, keyed: bool) -> dict[str, dict[str, float]]:
    base = load_engine_params(EXAMPLE_ENGINE)
    replicas = fleet(base)
    config = scheduling_only(load_config(EXAMPLE_CONFIG))
    profile = config.profiles[config.endpoints[next(iter(config.endpoints))].profile]
    size = sum(p.max_sequences for p in replicas)
    # Arrivals per second for `load` x the fleet's throughput (the big replica counted
    # as two base ones).
    fleet_tokens_per_s = saturated_tokens_per_s(config, base, seed) * size / base.max_sequences
    rate = load * fleet_tokens_per_s / MEAN_OUTPUT_TOKENS
    result = simulate(
        traffic(requests, rate, seed, keyed), config, fleet=replicas, early_binding=True
    )
    served: dict[str, float] = {}
    for r in result.records:
        if r.finished is not None:
            served[r.worker] = served.get(r.worker, 0.0) + profile.model_units(
                r.input_tokens, r.output_tokens
            )
    total = sum(served.values())
    endpoint = next(iter(config.endpoints))
    return {
        f"{endpoint}-{i}": {
            "capacity_share": p.max_sequences / size,
            "served_share": served.get(f"{endpoint}-{i}", 0.0) / total,
        }
        for i, p in enumerate(replicas)
    }


def report(runs: dict[str, dict[str, dict[str, float]]], args: argparse.Namespace) -> str:
    rows = [
        [
            name,
            replica,
            f"{figures['capacity_share']:.1%}",
            f"{figures['served_share']:.1%}",
            f"{figures['served_share'] / figures['capacity_share'] - 1:+.1%}",
        ]
        for name, replicas in runs.items()
        for replica, figures in replicas.items()
    ]
    return "\n".join(
        [
            ran_on(
                f"python -m bench.sim.spread --requests {args.requests} --load {args.load} "
                f"--seed {args.seed}"
            ),
            "",
            *table(
                [
                    "requests",
                    "replica",
                    "share of capacity",
                    "share of model units served",
                    "relative error",
                ],
                rows,
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim.spread", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results/spread"))
    parser.add_argument("--smoke", action="store_true", help="2,000 requests, for CI")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests = 2_000
    if args.requests < 1 or not 0 < args.load:
        print("spread: --requests must be >= 1 and --load > 0", file=sys.stderr)
        return 2
    runs = {
        name: shares(args.requests, args.load, args.seed, keyed)
        for name, keyed in (("no key", False), ("conversations", True))
    }
    write_json(args.out_dir / ("smoke.json" if args.smoke else "spread.json"), runs, 2)
    print(report(runs, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

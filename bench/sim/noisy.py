"""The noisy neighbour in the simulator, against what an equally busy engine allows.

    python -m bench.sim.noisy [--seeds 1,2,3]

Workload (`producers.loadgen.noisy_neighbour`): tenant A sends 10,000 requests at t=0;
B-E send Poisson 0.5 req/s each for 300 s; short chat turns; one replica; the example
config with admission out of the way. Four runs per seed, same requests:

- `alone`: B's requests only;
- `beside`: B-E next to a well-behaved A that sends the same 10,000 requests closed
  loop, keeping every sequence slot outside the newcomer reserve busy and never
  building a backlog (`dispatcher.sim.simulator.ClosedLoop`): the reference;
- `flood`: B-E next to A's flood, fairq;
- `fifo`: the same, the naive shared queue.

The headline is B's p95 TTFT next to the flood over its p95 next to the well-behaved A
(bound 1.2x); the ratio to B alone shows what sharing a full engine costs by itself.
Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from bench.harness.machine import command_line, machine_facts, table
from broker_config.config import Config, load_config
from dispatcher.core.limits import scheduling_only
from dispatcher.sim.simulator import ClosedLoop, SimResult, simulate
from producers.loadgen import noisy_neighbour

NOISY_DURATION_S = 300.0
RUNS = ("alone", "beside", "flood", "fifo")


def noisy_config(reserve: float = 0.03) -> Config:
    """The example config with admission out of the way and `reserve` on `chat`.

    The scenario is about scheduling order: with the example's 30 s latency target the
    throttle would reject most of A's 10,000 requests at once (and the free tier's rate
    limits would too), and B would then never compete with a backlog.
    """
    config = scheduling_only(load_config())
    chat = msgspec.structs.replace(config.endpoints["chat"], newcomer_reserve=reserve)
    return msgspec.structs.replace(config, endpoints={**config.endpoints, "chat": chat})


def reference_runs(seed: int) -> dict[str, SimResult]:
    """The four runs of one seed, by name (see the module docstring)."""
    config = noisy_config()
    trace = noisy_neighbour(
        seed, noisy_requests=10_000, small_tenants=4, small_rate=0.5, duration_s=NOISY_DURATION_S
    )
    flood = [r for r in trace if r.tenant == "A"]
    others = [r for r in trace if r.tenant != "A"]
    return {
        "alone": simulate([r for r in trace if r.tenant == "B"], config),
        "beside": simulate(others, config, closed_loop=[ClosedLoop(flood)]),
        "flood": simulate(trace, config),
        "fifo": simulate(trace, config, policy="fifo"),
    }


def p95_ttft(result: SimResult, tenant: str) -> float:
    value = result.summary["tenants"][tenant]["ttft_s"]["p95"]
    if value is None:
        raise ValueError(f"{tenant} has no time to first token in this run")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim.noisy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    args = parser.parse_args(argv)
    facts = machine_facts(command_line("bench.sim.noisy", argv))
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        p95 = {name: p95_ttft(run, "B") for name, run in reference_runs(seed).items()}
        rows.append(
            [
                str(seed),
                *(f"{p95[name]:.3f}" for name in RUNS),
                f"{p95['flood'] / p95['beside']:.2f}",
                f"{p95['flood'] / p95['alone']:.2f}",
                f"{p95['fifo'] / p95['beside']:,.0f}",
            ]
        )
    print(
        f"Command: `{facts['command']}`. Date {facts['date']}; {facts['cpu']}, "
        f"{facts['nproc']} cores, Python {facts['python']}.\n"
    )
    print(
        "\n".join(
            table(
                [
                    "seed",
                    "B alone p95 TTFT (s)",
                    "beside a well-behaved A (s)",
                    "beside the flood, fairq (s)",
                    "fifo (s)",
                    "fairq / well-behaved A",
                    "fairq / alone",
                    "fifo / well-behaved A",
                ],
                rows,
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The end-to-end scenarios that `python -m bench.all` runs and `python -m bench.report`
writes into docs/benchmarks.md. Adding one is one line in SCENARIOS.

A scenario is a module with:
- `TITLE`: the heading of its section in docs/benchmarks.md;
- `RESULTS`: its results folder, where it writes `summary.json` (with a `machine` block
  from `bench.machine.machine_facts` and a `plots` list of PNG names in that folder);
- `main(argv) -> int`: runs it; `--quick` runs the few-second variant;
- `render(summary) -> str`: the markdown tables of a summary.
"""

from __future__ import annotations

from types import ModuleType

from bench import (
    scenario_latency,
    scenario_noisy,
    scenario_rate,
    scenario_scale,
    scenario_trace,
)

# In running order: latency reads the sustained rate that rate measured.
SCENARIOS: dict[str, ModuleType] = {
    "noisy": scenario_noisy,
    "trace": scenario_trace,
    "rate": scenario_rate,
    "latency": scenario_latency,
    "scale": scenario_scale,
}

"""The end-to-end scenarios that `python -m bench.scenarios.all` runs and
`python -m bench.scenarios.report` writes into docs/benchmarks.md. Adding one is one line
in SCENARIOS.

A scenario is a module with:
- `TITLE`: the heading of its section in docs/benchmarks.md;
- `RESULTS`: its results folder, where it writes `summary.json` (with a `machine` block
  from `bench.harness.machine.machine_facts` and a `plots` list of PNG names in that folder);
- `main(argv) -> int`: runs it; `--quick` runs the few-second variant;
- `render(summary) -> str`: the markdown tables of a summary.

Each brings up its stacks with the harness (`bench.harness.stack`) and writes its files
with `bench.harness.cli`.
"""

from __future__ import annotations

from types import ModuleType

from bench.scenarios import latency, noisy, rate, scale, trace

# In running order: latency reads the sustained rate that rate measured.
SCENARIOS: dict[str, ModuleType] = {
    "noisy": noisy,
    "trace": trace,
    "rate": rate,
    "latency": latency,
    "scale": scale,
}

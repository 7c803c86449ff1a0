"""A benchmark's command line and output: its parser, its run, a line on stderr per run,
and its result files. End-to-end scenarios (the protocol is `bench.scenarios.registry`'s)
use all of it:

    def main(argv=None) -> int:
        parser = scenario_parser("bench.scenarios.noisy", __doc__, RESULTS)
        args = parser.parse_args(argv)
        command = command_line("bench.scenarios.noisy", argv)
        return run_scenario(args.out_dir, run_all(settings, args.out_dir, command), render)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

from bench.harness.measured import Measured

Summary = dict[str, Any]


def bench_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help shows the benchmark's whole docstring, as it is laid out."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def scenario_parser(
    module: str, doc: str | None, results: Path, quick: str = "the few-second smoke variant"
) -> argparse.ArgumentParser:
    """A scenario's parser with the options every scenario has: `--quick` (what it runs
    said by `quick`) and `--out-dir`."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}", description=(doc or "").split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out-dir", type=Path, default=results)
    return parser


def run_scenario(
    out_dir: Path, work: Coroutine[Any, Any, Summary], render: Callable[[Summary], str]
) -> int:
    """Run a scenario's `run_all` (writing into `out_dir`) and print its tables."""
    out_dir.mkdir(parents=True, exist_ok=True)
    print(render(asyncio.run(work)))
    return 0


def note_run(name: str, started: float, detail: str) -> None:
    """One line on stderr when a run has ended: `name: 12.3 s, detail`."""
    print(f"{name}: {time.monotonic() - started:.1f} s, {detail}", file=sys.stderr)


def write_json(path: Path, data: Any, indent: int = 1) -> None:
    """`data` as JSON at `path` (its folder made if need be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str) + "\n")


def write_records(path: Path, measured: Iterable[Measured]) -> None:
    """Every request of a run, compact (the per-request records beside a summary)."""
    path.write_text(json.dumps([m.to_dict() for m in measured], separators=(",", ":")) + "\n")


def write_summary(out_dir: Path, summary: Summary) -> Summary:
    """`<out_dir>/summary.json`, what `bench.scenarios.report` reads."""
    write_json(out_dir / "summary.json", summary)
    return summary

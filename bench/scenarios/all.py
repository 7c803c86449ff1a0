"""Run every end-to-end scenario, then regenerate their tables in docs/benchmarks.md.

    python -m bench.scenarios.all [--quick] [--only noisy trace] [--no-report]

The scenarios are `bench.scenarios.registry.SCENARIOS`, run one after the other in that
order, each on its own fresh stacks.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.scenarios import report
from bench.scenarios.registry import SCENARIOS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scenarios.all", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="each scenario's quick variant")
    parser.add_argument(
        "--only", nargs="+", choices=sorted(SCENARIOS), help="scenarios to run (default: all)"
    )
    parser.add_argument(
        "--no-report", action="store_true", help="leave docs/benchmarks.md as it is"
    )
    args = parser.parse_args(argv)
    names = args.only or list(SCENARIOS)
    for name in names:
        started = time.monotonic()
        code = SCENARIOS[name].main(["--quick"] if args.quick else [])
        print(
            f"bench.scenarios.all: {name} finished in {time.monotonic() - started:.0f} s",
            file=sys.stderr,
        )
        if code:
            return code
    return 0 if args.no_report else report.main(["--only", *names])


if __name__ == "__main__":
    sys.exit(main())

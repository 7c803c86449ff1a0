"""Where the benchmarks read and write: the repository, bench/results and docs/."""

from __future__ import annotations

from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO = BENCH_DIR.parent
# Each benchmark's results folder is RESULTS_DIR / <its name>.
RESULTS_DIR = BENCH_DIR / "results"
DOCS_DIR = REPO / "docs"

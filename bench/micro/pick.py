"""Cost of one scheduling pick with many backlogged tenants.

    python -m bench.micro.pick [--tenants 100 1000 10000] [--picks 200000]

Every tenant is backlogged (a refill keeps its queue non-empty), so each pick runs the
whole path: tier ladder -> DRR ring -> tenant queue -> fit check -> dispatch bookkeeping
-> completion. Reported per pick: `next_batch` alone, and the full cycle including
admission and completion. The baseline in the same run is the FIFO policy.
"""

from __future__ import annotations

import argparse
import gc
import platform
import time

from costmodel.units import Capacity, Usage
from dispatcher.core.limits import MemoryLimiterStore
from dispatcher.core.scheduler import Scheduler
from dispatcher.core.types import Request
from tests.core_support import make_config

BATCH = 64


def run(policy: str, tenants: int, picks: int) -> tuple[float, float]:
    names = {f"t{i}": ("gold", 1.0 + i % 3) for i in range(tenants)}
    scheduler = Scheduler(make_config(cost="model_units", tenants=names), policy=policy)
    store = MemoryLimiterStore()
    serial = 0
    for name in names:
        for _ in range(4):
            serial += 1
            scheduler.admit(Request(str(serial), name, "ep", 0.0, 20, 10), 0.0, store)
    free = Capacity(BATCH, 10**9, 1e12)
    in_batch = 0.0
    gc.disable()
    start = time.perf_counter()
    done = 0
    while done < picks:
        t0 = time.perf_counter()
        batch = scheduler.next_batch("ep", free, 0.0)
        in_batch += time.perf_counter() - t0
        for request in batch.requests:
            scheduler.complete(request.tenant, request.id, Usage(20, 10, 0.0), 0.0)
            serial += 1
            scheduler.enqueue(Request(str(serial), request.tenant, "ep", 0.0, 20, 10), 0.0)
        done += len(batch.requests)
    elapsed = time.perf_counter() - start
    gc.enable()
    return in_batch / done * 1e6, elapsed / done * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.pick", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tenants", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--picks", type=int, default=200_000)
    args = parser.parse_args()
    print(
        f"# pick cost, {platform.python_implementation()} {platform.python_version()}, "
        f"{platform.machine()}, batches of {BATCH}, {args.picks} picks per row"
    )
    print("| policy | tenants | next_batch us/pick | full cycle us/pick |")
    print("|---|---|---|---|")
    for tenants in args.tenants:
        for policy in ("fairq", "fifo"):
            pick, cycle = run(policy, tenants, args.picks)
            print(f"| {policy} | {tenants} | {pick:.2f} | {cycle:.2f} |")


if __name__ == "__main__":
    main()

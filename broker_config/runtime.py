"""Process-wide tuning and waiting shared by fairq's long-running services."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable


def freeze_startup_heap() -> None:
    """Leave what startup made (modules, config, connections) out of garbage collection.

    A full collection scans every tracked object; with the 40,000 or so that imports and
    startup leave in the dispatcher, each paused its event loop 10-20 ms under load (a
    p99 latency spike every time). Call when the service is up; called again (a new
    dispatcher tenure in the process), it first unfreezes what the last call froze, so
    that the objects of the service that ended can be collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


async def first_of(*waits: Awaitable[object]) -> None:
    """Wait until the first of `waits` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

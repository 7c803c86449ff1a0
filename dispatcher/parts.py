"""What the dispatcher's rooms share, in one frozen object that `dispatcher/service.py`
builds once per dispatcher: each component takes `parts` plus only what is its own.

The configuration is not a field: a reload swaps the scheduler's (`Scheduler.reconfigure`),
and `config` reads it from there, so no component keeps one a reload left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from broker_config.config import Config, DispatcherOptions
from broker_config.subjects import Subjects
from dispatcher.admission.redis_store import AsyncLimiterStore
from dispatcher.core.pool import WorkerPool
from dispatcher.core.scheduler import Scheduler
from dispatcher.dispatch.held import HeldRequests
from dispatcher.dispatch.stored_results import Results
from dispatcher.observe.metrics import DispatcherMetrics


@dataclass(frozen=True, slots=True)
class Parts:
    nc: NATS  # the dispatcher's connection
    subjects: Subjects
    scheduler: Scheduler
    pool: WorkerPool
    held: HeldRequests  # the JetStream messages of the requests taken in, not finished
    results: Results  # final events: stored, looked up, published
    metrics: DispatcherMetrics
    limiter: AsyncLimiterStore
    wake: asyncio.Event  # set when a dispatch pass is due (something changed)
    # (endpoint, tenant) -> its unfinished requests in the streams, as last listed.
    backlog: Callable[[], dict[tuple[str, str], int]]

    @property
    def config(self) -> Config:
        """The running configuration (see the module doc)."""
        return self.scheduler.config

    @property
    def options(self) -> DispatcherOptions:
        return self.scheduler.config.dispatcher

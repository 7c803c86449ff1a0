"""A dispatcher process's tenures: one `Dispatcher` after another on one connection.

A dispatcher that loses its lease (it was paused past it, or its renewals failed for a
TTL while a cluster elected a new leader) drains at once; one whose broker failed it
(at start or in one of its tasks) is left; either way the next one stands by until it
holds the lease again. `python -m dispatcher` and `fairq up` run their dispatcher this
way, so neither stops for a broker's hiccup. What the workers were last heard from is
kept across tenures, for the next one to settle on (dispatcher/service.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from broker_config.config import Config
from broker_config.runtime import first_of
from dispatcher.ha.lease import Lease
from dispatcher.service import Dispatcher, State

log = logging.getLogger("fairq.dispatcher")

# After the broker failed a dispatcher, the next one starts after this long.
RESTART_AFTER_S = 1.0


class Tenures:
    """`run(stop)` until `stop` is set: a stop while a dispatcher stands by (or starts)
    ends it at once, one while it runs drains it. `on_running` is called as each one
    has taken the lease and started, and `serving` is set from then until its drain;
    `current` is the one serving or standing by."""

    def __init__(
        self,
        nc: NATS,
        config: Config,
        *,
        lease: Lease | None,
        on_running: Callable[[Dispatcher], None] = lambda _: None,
        **dispatcher_options: Any,
    ) -> None:
        self._nc = nc
        self._lease = lease
        self._on_running = on_running
        self._options = dispatcher_options  # Dispatcher's keyword arguments
        self._heard: dict[str, float] = {}
        self.serving = asyncio.Event()
        self.current = Dispatcher(nc, config, lease=lease, heard=self._heard, **dispatcher_options)

    def _next(self) -> Dispatcher:
        """The next tenure's, with the config as running (reloads included) and the file
        as last read: the file is not read again (it may be mid-edit)."""
        previous = self.current
        dispatcher = Dispatcher(
            self._nc, previous.config, lease=self._lease, heard=self._heard, **self._options
        )
        dispatcher.reloader.file_config = previous.reloader.file_config
        return dispatcher

    async def run(self, stop: asyncio.Event) -> None:
        while True:
            try:
                await self._tenure(self.current, stop)
            except* nats.errors.Error as failed:
                log.error(
                    "the broker failed the dispatcher (%r); starting again in %.0f s",
                    failed.exceptions,
                    RESTART_AFTER_S,
                    exc_info=failed,
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), RESTART_AFTER_S)
            if stop.is_set():
                return
            self.current = self._next()

    async def _tenure(self, dispatcher: Dispatcher, stop: asyncio.Event) -> None:
        held = asyncio.create_task(self._hold(dispatcher, stop))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([held, stopped], return_when=asyncio.FIRST_COMPLETED)
            if not held.done() and dispatcher.state in (State.STARTING, State.STANDBY):
                held.cancel()  # nothing to drain
            with contextlib.suppress(asyncio.CancelledError):
                await held
        finally:
            stopped.cancel()

    async def _hold(self, dispatcher: Dispatcher, stop: asyncio.Event) -> None:
        async with dispatcher:
            self._on_running(dispatcher)
            self.serving.set()
            try:
                await first_of(stop.wait(), dispatcher.lease_lost())
            finally:
                self.serving.clear()
            log.info("draining" if stop.is_set() else "draining: the lease is lost")

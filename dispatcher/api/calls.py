"""Status and cancel calls side by side: nats-py handles a subscription's messages one at a
time, and these calls may wait on the broker (a lookup in the streams), so each runs in
a task of its own; one tenant's slow lookup must hold up no other call.

At most MAX_API_CALLS run at once, and MAX_API_CALLS_PER_TENANT of one tenant: its calls
beyond that are answered `rate_limited` at once, so that its flood cannot take the
others' room.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg

from dispatcher.api.request_reply import Api

MAX_API_CALLS = 1024
MAX_API_CALLS_PER_TENANT = 64
API_RETRY_AFTER_S = 1.0

Handler = Callable[[Msg], Awaitable[None]]


class ApiCalls:
    def __init__(self, api: Api) -> None:
        self.api = api
        self._calls: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_API_CALLS)
        self._calls_of: Counter[str] = Counter()  # tenant -> its calls in flight

    def side_by_side(self, handler: Handler) -> Handler:
        """A subscription callback that runs `handler` (which must not raise) in a task
        per message."""

        async def spawn(msg: Msg) -> None:
            tenant = msg.subject.rsplit(".", 1)[-1]  # checked by the handler
            if self._calls_of[tenant] >= MAX_API_CALLS_PER_TENANT:
                await self._refuse(msg)
                return
            await self._slots.acquire()
            self._calls_of[tenant] += 1
            task = asyncio.create_task(handler(msg))
            self._calls.add(task)
            task.add_done_callback(lambda done: self._done(done, tenant))

        return spawn

    async def close(self) -> None:
        """After unsubscribing: the calls still waiting on a lookup end unanswered (their
        callers time out and ask again, another dispatcher answers)."""
        calls = list(self._calls)
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    async def _refuse(self, msg: Msg) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self.api.refuse(
                msg,
                f"more than {MAX_API_CALLS_PER_TENANT} status and "
                "cancel calls of this tenant in flight; retry",
                API_RETRY_AFTER_S,
            )

    def _done(self, task: asyncio.Task[None], tenant: str) -> None:
        self._calls.discard(task)
        self._slots.release()
        self._calls_of[tenant] -= 1
        if not self._calls_of[tenant]:
            del self._calls_of[tenant]

"""Helpers shared by the tests that talk to a live system over NATS."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def api(nc, subject: str, body: dict, timeout: float = 5.0) -> dict:
    """A request/reply API call (status, cancel, depth), JSON both ways."""
    reply = await nc.request(subject, json.dumps(body).encode(), timeout=timeout)
    return json.loads(reply.data)


async def eventually(check: Callable[[], Awaitable[T]], timeout: float = 10.0,
                     what: str = "condition") -> T:
    """Poll `check` until it returns something true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout}s"
        await asyncio.sleep(0.05)

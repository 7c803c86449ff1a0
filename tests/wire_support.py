"""Helpers shared by the tests of the wire: what a client sends, and talking to a live
system over NATS."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from PIL import Image

T = TypeVar("T")


def image_b64(fmt: str = "PNG", size: tuple[int, int] = (2, 2)) -> str:
    """A small real image in a Pillow format, base64 as a request's `images` carry it
    (the dispatcher refuses what is not a PNG, JPEG, GIF or WebP image)."""
    buffer = io.BytesIO()
    Image.new("RGB", size, "teal").save(buffer, fmt)
    return base64.b64encode(buffer.getvalue()).decode()


async def api(nc, subject: str, body: dict, timeout: float = 5.0) -> dict:
    """A request/reply API call (status, cancel, depth), JSON both ways."""
    reply = await nc.request(subject, json.dumps(body).encode(), timeout=timeout)
    return json.loads(reply.data)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll a plain `condition` until it holds; fail naming `what` after `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail(f"not within {timeout_s}s: {what}")


async def eventually(
    check: Callable[[], Awaitable[T]], timeout: float = 10.0, what: str = "condition"
) -> T:
    """Poll `check` until it returns something true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout}s"
        await asyncio.sleep(0.05)

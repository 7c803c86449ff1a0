"""The front served over HTTP by hypercorn, as an async context manager.

hypercorn rather than uvicorn: its keep-alive timeout also runs from a connection's
start until its first request is complete, so a client that connects and sends nothing,
or sends its headers a byte at a time, is closed (`[front] idle_timeout_s`); uvicorn
waits on such a connection forever. The body's own timeout is the app's
(`request_read_timeout_s`).

Drain order on leaving: stop accepting connections and let open requests finish for up to
`DRAIN_S`, then close the listening socket. The SDK client is the caller's to close after.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig

from broker_config.config import FrontOptions
from producers.openai_front.app import Front

DRAIN_S = 5.0


class FrontServer:
    """Serves `front` on `options.host`:`port` (0: a free port, then `self.port`)."""

    def __init__(self, front: Front, options: FrontOptions, port: int | None = None) -> None:
        self._front = front
        self._options = options
        self._port = options.port if port is None else port
        self._socket: socket.socket | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        if self._socket is None:
            raise RuntimeError("the front is not serving")
        return int(self._socket.getsockname()[1])

    @property
    def base_url(self) -> str:
        return f"http://{self._options.host}:{self.port}/v1"

    async def __aenter__(self) -> FrontServer:
        family = socket.AF_INET6 if ":" in self._options.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Accepted connections inherit it: a streamed chunk leaves at once.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self._options.host, self._port))
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        self._socket = sock
        config = HypercornConfig()
        # hypercorn wraps and closes the descriptor it is given: a duplicate of ours.
        config.bind = [f"fd://{os.dup(sock.fileno())}"]
        config.keep_alive_timeout = self._options.idle_timeout_s
        config.graceful_timeout = DRAIN_S
        config.accesslog = None
        app: Any = self._front.app  # hypercorn's ASGI types are narrower than Starlette's
        self._task = asyncio.create_task(
            serve(app, config, shutdown_trigger=self._stop.wait), name="openai-front"
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._stop.set()
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._socket is not None:
            self._socket.close()
            self._socket = None

"""The front served over HTTP by hypercorn, as an async context manager.

hypercorn rather than uvicorn: its keep-alive timeout also runs from a connection's
start until its first request is complete, so a client that connects and sends nothing,
or sends its headers a byte at a time, is closed (`[front] idle_timeout_s`); uvicorn
waits on such a connection forever. The body's own timeout is the app's
(`request_read_timeout_s`).

hypercorn writes HTTP/1.1 status lines without a reason phrase ("HTTP/1.1 200"): legal,
but not what clients, proxies and `curl -i` expect to show, so the standard phrase is
added to each response as it is sent ("HTTP/1.1 200 OK").

Drain order on leaving: stop accepting connections and let open requests finish for up to
`DRAIN_S`, then close the listening socket. The SDK client is the caller's to close after.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from http import HTTPStatus
from typing import Any

import h11
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.protocol.h11 import H11Protocol

from broker_config.config import FrontOptions
from producers.openai_front.app import Front

DRAIN_S = 5.0


def _reason_phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:  # not a standard status (the front's 499): none, as before
        return b""


_send_h11_event = H11Protocol._send_h11_event


async def _send_with_reason_phrase(self: H11Protocol, event: Any) -> None:
    if isinstance(event, h11.Response | h11.InformationalResponse) and not event.reason:
        event = type(event)(
            headers=event.headers,
            status_code=event.status_code,
            http_version=event.http_version,
            reason=_reason_phrase(event.status_code),
        )
    await _send_h11_event(self, event)


# hypercorn has no setting for it, and builds each h11 response where it sends it.
H11Protocol._send_h11_event = _send_with_reason_phrase  # type: ignore[method-assign]


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

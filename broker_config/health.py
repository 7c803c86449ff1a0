"""The HTTP endpoints every fairq service can serve: `/healthz` (liveness: restart me if
this fails), `/readyz` (readiness: route work to me) and, with a registry, Prometheus's
`/metrics`, and any pages a service adds. A thread of its own answers them, so the checks
behind `/healthz`, and the pages, must look at what the service's event loop last did,
not ask it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

Check = Callable[[], bool]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        """Probes come every few seconds: no access log on stderr."""


class HealthServer:
    """`live` and `ready` are called per request, from the server's threads; both may
    be replaced while it serves (a service built after its server is started)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.live: Check = lambda: True
        self.ready: Check = lambda: False
        self._metrics = make_wsgi_app(registry) if registry is not None else None
        self._pages: dict[str, tuple[str, Callable[[], bytes]]] = {}
        self._server: _Server | None = None

    def add_page(self, path: str, content_type: str, body: Callable[[], bytes]) -> None:
        """Serve `body()` at `path`; called from the server's threads, per request."""
        self._pages[path] = (content_type, body)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start answering on `host:port`; the bound port (0 picks a free one)."""
        server = make_server(
            host, port, self._app, server_class=_Server, handler_class=_QuietHandler
        )
        threading.Thread(target=server.serve_forever, name="fairq-http", daemon=True).start()
        self._server = server
        return server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            ok = (self.live if path == "/healthz" else self.ready)()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "text/plain; charset=utf-8")],
            )
            return [b"ok\n" if ok else b"not ok\n"]
        page = self._pages.get(path)
        if page is not None:
            content_type, body = page
            start_response(
                "200 OK", [("Content-Type", content_type), ("Cache-Control", "no-store")]
            )
            return [body()]
        if self._metrics is not None and path in ("/metrics", "/"):
            return self._metrics(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found\n"]

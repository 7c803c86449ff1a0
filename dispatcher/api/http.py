"""The dispatcher's HTTP server, the only one it runs: Prometheus's `/metrics`, `/healthz`
(live) and `/readyz` (settled and running), and the live queue dashboard (`/dashboard`, a
page that polls `/dashboard.json` and `/dashboard/history.json`, whose figures
dispatcher/observe/dashboard.py keeps).

    http = HttpApi(metrics)
    port = http.serve(port)            # before any dispatcher exists (0: a free port)
    Dispatcher(nc, config, metrics=metrics, http=http)   # its checks answer the probes
    http.close()

A thread of its own answers (broker_config/health.py): the pages are the latest snapshot
the maintenance loop made; only a read of a snapshot gone stale (nobody watched) waits,
briefly, for the event loop to build a new one.
"""

from __future__ import annotations

from importlib import resources

from broker_config.health import Check, HealthServer
from dispatcher.observe.metrics import DispatcherMetrics

PAGE = resources.files("dispatcher.api").joinpath("dashboard.html").read_bytes()


class HttpApi:
    def __init__(self, metrics: DispatcherMetrics) -> None:
        self._server = HealthServer(metrics.registry)
        self._server.add_page("/dashboard", "text/html; charset=utf-8", lambda: PAGE)
        self._server.add_page("/dashboard.json", "application/json", metrics.watch.read)
        self._server.add_page("/dashboard/history.json", "application/json", metrics.watch.history)

    def check_with(self, live: Check, ready: Check) -> None:
        """Answer `/healthz` and `/readyz` with these: the dispatcher's that is current
        (each tenure's replaces the last one's, dispatcher/ha/tenures.py)."""
        self._server.live, self._server.ready = live, ready

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start answering on `host:port`; the bound port (0 picks a free one)."""
        return self._server.serve(port, host)

    def close(self) -> None:
        self._server.close()

"""The services' HTTP endpoints (broker_config/health.py) over a real loopback socket."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from broker_config.health import HealthServer


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_health_and_readiness_follow_their_checks_and_metrics_pass_through() -> None:
    registry = CollectorRegistry()
    Counter("fairq_test_things", "things", registry=registry).inc(3)
    server = HealthServer(registry)
    state = {"live": True, "ready": False}
    server.live, server.ready = (lambda: state["live"]), (lambda: state["ready"])
    port = server.serve(0)
    base = f"http://127.0.0.1:{port}"
    try:
        assert get(f"{base}/healthz") == (200, "ok\n")
        assert get(f"{base}/readyz") == (503, "not ok\n")
        state.update(live=False, ready=True)
        assert get(f"{base}/healthz")[0] == 503
        assert get(f"{base}/readyz")[0] == 200
        status, text = get(f"{base}/metrics")
        assert status == 200 and "fairq_test_things_total 3.0" in text
        assert get(f"{base}/nope")[0] == 404
    finally:
        server.close()


def test_without_a_registry_there_is_no_metrics_page() -> None:
    server = HealthServer()
    port = server.serve(0)
    try:
        assert get(f"http://127.0.0.1:{port}/metrics")[0] == 404
        assert get(f"http://127.0.0.1:{port}/readyz")[0] == 503  # not ready until told
    finally:
        server.close()

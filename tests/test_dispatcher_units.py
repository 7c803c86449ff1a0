"""The dispatcher's own bookkeeping, without a broker."""

from __future__ import annotations

import pytest

from dispatcher.core.types import Capacity, Request
from dispatcher.service import DispatcherOptions, WorkerState


def request(rid: str, input_tokens: int, max_tokens: int, units: float) -> Request:
    r = Request(rid, "acme", "chat", 0.0, input_tokens, max_tokens)
    r.model_units = units
    return r


def test_worker_ledger_keeps_its_totals_as_requests_come_and_go():
    worker = WorkerState("w1", "chat", 0.0, Capacity(8, 1000, 10.0), 0.0)
    a, b = request("a", 10, 20, 0.3), request("b", 5, 5, 0.1)
    worker.assign(a, 1.0)
    worker.assign(b, 1.0)
    assert worker.used() == Capacity(2, 40, pytest.approx(0.4))
    assert worker.free() == Capacity(6, 960, pytest.approx(9.6))
    worker.release(("acme", "a"))
    worker.release(("acme", "a"))  # twice (a completion after a requeue): no effect
    assert worker.used() == Capacity(1, 10, pytest.approx(0.1))
    worker.release(("acme", "b"))
    assert worker.used() == Capacity(0, 0, 0.0)


def test_options_refuse_a_window_larger_than_what_may_be_held():
    with pytest.raises(ValueError, match="tenant_window"):
        DispatcherOptions(tenant_window=2000, max_ack_pending=1000)
    with pytest.raises(ValueError, match="tenant_window"):
        DispatcherOptions(tenant_window=1)

"""The dashboard's figures, pure: rates from a tenant's first second, the oldest wait of
what is queued, shares of service against shares of weight and Jain's index, the
history the dispatcher keeps, and snapshots built on the event loop when a read finds
them stale. The page and the dispatcher around them: tests/api/test_dashboard*.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest

from dispatcher.core.scheduler import DepthRow
from dispatcher.core.view import FlowRow
from dispatcher.observe.dashboard import FRESH_S, RATE_WINDOW_S, QueueWatch, Watched
from dispatcher.observe.fairness import Service, jain, ratios, shares
from dispatcher.observe.history import HISTORY_S, STEP_S, HistoryView
from tests.observe.dashboard_support import Count, Queues, snapshot, watched

TIERS = {"acme": "enterprise", **dict.fromkeys(["initech", "a", "b", "c", "late"], "free")}
ORDER = ["enterprise", "standard", "free"]
WEIGHTS = {"acme": 4.0, "a": 1.0, "b": 1.0, "c": 2.0, "late": 1.0}


def queues(served: dict[str, float]) -> Queues:
    flows = [FlowRow("chat", tenant, WEIGHTS[tenant], cost) for tenant, cost in served.items()]
    return Queues(TIERS, ORDER, flows, {"chat": "model_units"})


def queued(*tenants: str, running: int = 0) -> list[DepthRow]:
    return [DepthRow("chat", TIERS[t], t, 5, running, 3.0) for t in tenants]


def test_a_tenants_rates_count_from_its_first_sample() -> None:
    """initech's burst began between two samples: the 55 admitted in that second count
    (its history used to start at its first sample, so it showed 0.5/s)."""
    watch = watched(["chat"])
    counts = {("chat", "acme"): Count(admitted=3)}
    watch.refresh(Watched([], counts, queues({})), 100.0)
    counts[("chat", "initech")] = Count(admitted=55)
    watch.refresh(Watched([], counts, queues({})), 101.0)
    enterprise, free = snapshot(watch).endpoints[0].tiers
    assert (enterprise.tenants[0].admitted_per_s, free.tenants[0].admitted_per_s) == (0.0, 55.0)
    counts[("chat", "initech")] = Count(admitted=60, rejected=4)
    watch.refresh(Watched([], counts, queues({})), 102.0)
    _, free = snapshot(watch).endpoints[0].tiers
    assert (free.tenants[0].admitted_per_s, free.tenants[0].rejected_per_s) == (30.0, 2.0)


def test_the_oldest_wait_of_what_is_queued_per_tenant_tier_and_endpoint() -> None:
    """The p95 queue wait counts dispatched requests only: 126 requests queued for 15 s
    showed 27 ms. The oldest wait shows them."""
    watch = watched(["chat"])
    watch.waited("chat", "acme", 0.027, 1.0)
    rows = [
        DepthRow("chat", "enterprise", "acme", 126, 4, 15.0),
        DepthRow("chat", "free", "a", 2, 0, 40.0),
        DepthRow("chat", "free", "b", 0, 3, 0.0),  # nothing queued: no wait to show
    ]
    watch.refresh(Watched(rows, {}, queues({})), 2.0)
    chat = snapshot(watch).endpoints[0]
    enterprise, free = chat.tiers
    assert (enterprise.tenants[0].oldest_wait_s, enterprise.tenants[0].p95_queue_wait_s) == (
        15.0,
        0.027,
    )
    assert [(t.name, t.oldest_wait_s) for t in free.tenants] == [("b", None), ("a", 40.0)]
    assert (enterprise.figures.oldest_wait_s, free.figures.oldest_wait_s) == (15.0, 40.0)
    assert chat.figures.oldest_wait_s == 40.0


def serve(watch: QueueWatch, rows: list[DepthRow], per_s: dict[str, float], start: float):
    """Refresh once a second for a window, each tenant served `per_s` a second."""
    served = dict.fromkeys(per_s, 0.0)
    for t in range(int(RATE_WINDOW_S) + 1):
        watch.refresh(Watched(rows, {}, queues(served)), start + t)
        served = {tenant: cost + per_s[tenant] for tenant, cost in served.items()}
    return served


def test_shares_of_service_next_to_shares_of_weight_and_jains_index() -> None:
    watch = watched(["chat"])
    rows = queued("acme", "a", "b", "c")
    # Served as the weights say: a and b 1 each, c (weight 2) 2 a second.
    serve(watch, rows, {"acme": 8.0, "a": 1.0, "b": 1.0, "c": 2.0}, 0.0)
    chat = snapshot(watch).endpoints[0]
    assert chat.cost_unit == "model_units"
    enterprise, free = chat.tiers
    shown = {t.name: (t.service_share, t.weight_share, t.served_per_s) for t in free.tenants}
    assert shown == {"a": (0.25, 0.25, 1.0), "b": (0.25, 0.25, 1.0), "c": (0.5, 0.5, 2.0)}
    assert (enterprise.tenants[0].service_share, enterprise.tenants[0].weight_share) == (1, 1)
    assert (free.figures.fairness, enterprise.figures.fairness) == (1.0, 1.0)
    assert (free.figures.served_per_s, chat.figures.served_per_s) == (4.0, 12.0)
    assert free.tenants[0].fairness is None  # a tier's and an endpoint's figure only
    # Now c gets no more than a and b: 1/3 each against weight shares 1/4, 1/4, 1/2.
    watch = watched(["chat"])
    serve(watch, rows, {"acme": 8.0, "a": 1.0, "b": 1.0, "c": 1.0}, 0.0)
    enterprise, free = snapshot(watch).endpoints[0].tiers
    c = next(t for t in free.tenants if t.name == "c")
    assert (c.service_share, c.weight_share) == (pytest.approx(1 / 3), 0.5)
    # Ratios 4/3, 4/3, 2/3: (10/3)^2 / (3 * 36/9).
    assert free.figures.fairness == pytest.approx(100 / 108)
    # The endpoint pools every tier's ratios: acme's 1 with the free tier's.
    assert snapshot(watch).endpoints[0].figures.fairness == pytest.approx(
        jain([1.0, 4 / 3, 4 / 3, 2 / 3])
    )


def test_only_tenants_backlogged_all_window_make_the_fairness_figure() -> None:
    """`late` came halfway through the window: its small share is not unfairness."""
    watch = watched(["chat"])
    served = dict.fromkeys(["a", "b", "late"], 0.0)
    for t in range(int(RATE_WINDOW_S) + 1):
        rows = queued("a", "b", *(["late"] if t >= RATE_WINDOW_S / 2 else []))
        watch.refresh(Watched(rows, {}, queues(served)), float(t))
        served = {"a": served["a"] + 1, "b": served["b"] + 1, "late": served["late"]}
        if t >= RATE_WINDOW_S / 2:
            served["late"] += 0.5
    (free,) = snapshot(watch).endpoints[0].tiers
    late = next(t for t in free.tenants if t.name == "late")
    assert late.weight_share == pytest.approx(1 / 3)  # present: part of the weights
    assert late.service_share is not None and late.service_share < 0.2
    assert free.figures.fairness == 1.0  # a and b, served alike all along


def test_a_tier_a_higher_one_starves_has_no_fairness_figure() -> None:
    watch = watched(["chat"])
    serve(watch, queued("acme", "a", "b"), {"acme": 8.0, "a": 0.0, "b": 0.0}, 0.0)
    enterprise, free = snapshot(watch).endpoints[0].tiers
    assert (enterprise.figures.fairness, free.figures.fairness) == (1.0, None)
    assert {t.service_share for t in free.tenants} == {None}


def test_a_refund_or_a_flow_made_again_never_counts_as_service() -> None:
    watch = watched(["chat"])
    rows = queued("a")
    watch.refresh(Watched(rows, {}, queues({"a": 10.0})), 0.0)
    watch.refresh(Watched(rows, {}, queues({"a": 14.0})), 1.0)
    watch.refresh(Watched(rows, {}, queues({"a": 13.0})), 2.0)  # 1 refunded on a requeue
    (free,) = snapshot(watch).endpoints[0].tiers
    assert free.tenants[0].served_per_s == 2.0  # the 4 served over the 2 s


def test_shares_and_jain() -> None:
    tenants = {
        "a": Service(1.0, 3.0, present=True, backlogged=True),
        "b": Service(1.0, 1.0, present=True, backlogged=True),
        "gone": Service(2.0, 0.0, present=False, backlogged=False),  # neither here nor served
    }
    assert shares(tenants) == {"a": (0.75, 0.5), "b": (0.25, 0.5)}
    assert ratios(tenants.values()) == [1.5, 0.5]
    assert jain([1.5, 0.5]) == 0.8
    assert jain([1.0, 0.0, 0.0, 0.0]) == 0.25  # one takes everything: 1/n
    assert jain([]) is None


def history(watch: QueueWatch) -> HistoryView:
    return msgspec.json.decode(watch.history(), type=HistoryView)


def test_the_history_keeps_queues_and_waits_per_step_and_no_more() -> None:
    watch = QueueWatch(["chat", "embed"])  # nobody watching: the history is kept anyway
    rows = [
        DepthRow("chat", "enterprise", "acme", 4, 2, 7.0),
        DepthRow("chat", "free", "a", 3, 1, 9.0),
    ]
    for n in range(1, 21):
        watch.waited("chat", "acme", n / 10, 0.5)
    watch.refresh(Watched(rows, {}, queues({})), 1.0)
    watch.refresh(Watched([], {}, queues({})), 2.0)  # within the step: no point
    watch.refresh(Watched([], {}, queues({})), 1.0 + STEP_S)
    view = history(watch)
    assert (view.step_s, view.span_s, view.at) == (STEP_S, HISTORY_S, [1.0, 1.0 + STEP_S])
    chat, embed = view.endpoints
    assert (chat.queued, chat.running, embed.queued, embed.running) == (
        [7, 0],
        [3, 0],
        [0, 0],
        [0, 0],
    )
    tiers = {tier.name: tier for tier in chat.tiers}
    assert list(tiers) == ORDER
    assert tiers["enterprise"].oldest_wait_s == [7.0, 0.0]
    assert tiers["free"].oldest_wait_s == [9.0, 0.0]
    # The waits of the requests dispatched in each step; none in the second.
    assert tiers["enterprise"].p95_queue_wait_s == [1.9, None]
    assert tiers["free"].p95_queue_wait_s == [None, None]
    for n in range(2, 2 * round(HISTORY_S / STEP_S)):
        watch.refresh(Watched(rows, {}, queues({})), 1.0 + n * STEP_S)
    assert len(history(watch).at) == round(HISTORY_S / STEP_S)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop in a thread of its own, as the dispatcher's is to the HTTP threads."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def test_a_stale_read_has_the_followed_loop_build_it_afresh(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody read it before, and no refresh ran: the first read still shows the queues
    now, not the zero snapshot made at start."""
    watch = QueueWatch(["chat"])
    built_on: list[threading.Thread] = []

    def source(now: float) -> Watched:
        built_on.append(threading.current_thread())
        return Watched(queued("a"), {("chat", "a"): Count(admitted=6)}, queues({}))

    stop = watch.follow(loop, source)
    first = snapshot(watch)
    assert abs(first.at - time.time()) < FRESH_S
    assert first.endpoints[0].figures.queued == 5
    assert built_on and built_on[0] is not threading.current_thread()  # on the loop's
    # Followed from zero counts: the 6 admitted since `follow` are in the rate.
    assert first.endpoints[0].figures.admitted_per_s > 6 / FRESH_S
    assert snapshot(watch).at == first.at  # fresh enough: served as it is
    stop()
    built = len(built_on)
    later = time.monotonic() + FRESH_S + 1  # it has aged, but nobody follows: stays
    monkeypatch.setattr("dispatcher.observe.dashboard.time.monotonic", lambda: later)
    assert snapshot(watch).at == first.at and len(built_on) == built

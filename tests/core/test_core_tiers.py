"""Strict tiers wherever work waits (issue 44): a lower tier starts work outside the
newcomer reserve only when no higher tier has work queued here, on its way from the
broker, or set aside because it did not fit; and the reserve lets in a bounded number of
lower-tier requests meanwhile."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.units import Capacity, Usage
from dispatcher.core.limits import MemoryLimiterStore
from dispatcher.core.placement import Placement
from dispatcher.core.scheduler import Scheduler
from dispatcher.core.types import Request
from tests.core_support import make_config, req

TENANTS = {"acme": ("gold", 4.0), "globex": ("silver", 2.0), "initech": ("bronze", 1.0)}
RANK = {"acme": 0, "globex": 1, "initech": 2}
WORKER = Capacity(64, 64 * 2048, 1e12)
RESERVE = 0.03  # 2 of 64 sequences, as in configs/example.toml


class OneWorker:
    """One worker's ledger: what runs on it, and the passes that fill it."""

    def __init__(self, scheduler: Scheduler, total: Capacity = WORKER) -> None:
        self.scheduler = scheduler
        self.total = total
        self.running: list[Request] = []
        self.now = 0.0

    def free(self) -> Capacity:
        used = Capacity(
            len(self.running),
            sum(r.input_tokens + r.max_tokens for r in self.running),
            sum(r.model_units for r in self.running),
        )
        return self.total.minus(used)

    def fill(self, on_the_way: list[str] | None = None) -> list[Request]:
        """One dispatch pass; `on_the_way`: tenants with requests still in the broker."""
        in_reserve = sum(r.in_reserve for r in self.running)
        room = Placement.single(self.free(), self.total, in_reserve)
        placed = self.scheduler.place("ep", room, self.now, on_the_way or []).requests
        self.running += placed
        return placed

    def complete(self, request: Request) -> None:
        self.running.remove(request)
        self.now += 0.01
        self.scheduler.complete(
            request.tenant, request.id, Usage(request.input_tokens, 1, 0.0), self.now
        )

    def lower_tier_running(self) -> int:
        return sum(1 for r in self.running if r.tenant != "acme")


def scheduler_with(queued: dict[str, int], max_tokens: int = 1024) -> Scheduler:
    scheduler = Scheduler(make_config(tenants=TENANTS, reserve=RESERVE, tokens=WORKER.tokens))
    store = MemoryLimiterStore()
    for tenant, count in queued.items():
        for n in range(count):
            request = req(tenant, n, input_tokens=100, max_tokens=max_tokens)
            assert scheduler.admit(request, 0.0, store).admitted
    return scheduler


def test_a_backlogged_top_tier_keeps_every_slot_but_the_reserve() -> None:
    """Issue 44's first run in miniature: acme (enterprise) 250, globex and initech 25
    each. Lower tiers used to count as below their share across tiers, so each slot that
    freed went to them (globex reached 20 running, acme fell from 117 to 106)."""
    worker = OneWorker(scheduler_with({"acme": 250, "globex": 25, "initech": 25}))
    worker.fill()
    assert worker.lower_tier_running() == 2  # the reserve: 3% of 64
    flow = worker.scheduler.flow("ep", "acme")
    while len(flow.queue):
        oldest = next(r for r in worker.running if r.tenant == "acme")
        worker.complete(oldest)
        placed = worker.fill()
        assert [r.tenant for r in placed] == ["acme"]
        assert worker.lower_tier_running() <= 2
    # acme's queue is empty: the lower tiers take what frees from now on.
    worker.complete(next(r for r in worker.running if r.tenant == "acme"))
    assert [r.tenant for r in worker.fill()] == ["globex"]


def test_a_top_tier_on_its_way_from_the_broker_keeps_the_room() -> None:
    """acme's queue here is empty but more of its requests are on their way (beyond its
    intake window): lower tiers get the reserve only, the rest stays free for acme."""
    worker = OneWorker(scheduler_with({"globex": 25, "initech": 25}))
    placed = worker.fill(["acme"])
    assert len(placed) == 2 and all(r.in_reserve for r in placed)
    assert worker.free().sequences == 62
    assert len(worker.fill([])) == 48  # all the rest, once acme has nothing on its way


def test_a_top_tier_head_that_does_not_fit_is_not_overtaken() -> None:
    """acme's head needs more KV room than is free; globex's small requests fit. They
    used to go ahead for as long as small requests kept coming."""
    scheduler = Scheduler(make_config(tenants=TENANTS, reserve=RESERVE, tokens=WORKER.tokens))
    store = MemoryLimiterStore()
    total = Capacity(64, 64_000, 1e12)
    worker = OneWorker(scheduler, total)
    for n in range(40):
        assert scheduler.admit(req("acme", f"small{n}", max_tokens=1000), 0.0, store).admitted
    worker.fill()  # 40 of acme's, 40,400 tokens of 64,000
    assert scheduler.admit(req("acme", "big", max_tokens=30_000), 0.0, store).admitted
    for n in range(50):
        assert scheduler.admit(req("globex", n, max_tokens=100), 0.0, store).admitted
    placed = worker.fill()
    assert len(placed) == 2 and all(r.in_reserve for r in placed)  # the reserve only
    for request in [r for r in worker.running if r.tenant == "acme"][:10]:
        worker.complete(request)
    assert [r.id for r in worker.fill()][0] == "big"


@settings(max_examples=80, deadline=None)
@given(
    window=st.integers(1, 12),
    sizes=st.dictionaries(
        st.sampled_from(sorted(TENANTS)),
        st.lists(st.integers(1, 3000), min_size=1, max_size=40),
        min_size=2,
    ),
    sequences=st.integers(2, 24),
    reserve=st.sampled_from([0.0, 0.1, 0.3]),
    completions=st.lists(st.integers(0, 1000), min_size=1, max_size=60),
)
def test_tiers_are_strict_at_any_intake_window_and_head_size(
    window, sizes, sequences, reserve, completions
) -> None:
    """Each tenant's requests reach the scheduler `window` at a time (the intake), the
    rest wait in the broker and are reported on their way. After every pass: a request
    of tier r placed outside the reserve means no tier above r had work left queued or
    on its way; and lower-tier requests in the reserve never exceed its sequences."""
    total = Capacity(sequences, sequences * 2000, 1e12)
    scheduler = Scheduler(make_config(tenants=TENANTS, reserve=reserve, tokens=total.tokens))
    reserved = scheduler.endpoints["ep"].reserve(total).sequences
    store = MemoryLimiterStore()
    broker = {
        tenant: deque(
            req(tenant, n, max_tokens=min(size, total.tokens - 10)) for n, size in enumerate(heads)
        )
        for tenant, heads in sizes.items()
    }
    worker = OneWorker(scheduler, total)
    for pick in [0, *completions]:
        if worker.running:
            worker.complete(worker.running[pick % len(worker.running)])
        for tenant, waiting in broker.items():  # the intake tops each window up
            flow = scheduler.flow("ep", tenant)
            while waiting and (flow is None or len(flow.queue) < window):
                assert scheduler.admit(waiting.popleft(), worker.now, store).admitted
                flow = scheduler.flow("ep", tenant)
        placed = worker.fill([t for t, waiting in broker.items() if waiting])
        waiting_ranks = [
            RANK[t]
            for t in TENANTS
            if broker.get(t) or ((f := scheduler.flow("ep", t)) is not None and len(f.queue))
        ]
        for request in placed:
            if not request.in_reserve:
                assert all(RANK[request.tenant] <= rank for rank in waiting_ranks), (
                    request.tenant,
                    waiting_ranks,
                )
        assert sum(r.in_reserve for r in worker.running) <= reserved

"""The worker pool: what the dispatcher knows of each worker, and the decisions it takes
from that alone. Synchronous and clock-free like the rest of the core (every call takes
`now`); the network dispatcher feeds it heartbeats and completions, the simulator its
replicas, so both place work the same way.

Per worker, a ledger of what was sent to it and has not completed (`assigned`), so
capacity is never double-booked between heartbeats, and its totals in sequences, KV
tokens and model units. Decisions:

- **choice**: `placement` is the room of one dispatch pass over an endpoint's healthy
  workers, with their consistent-hash ring (`dispatcher/core/placement.py` picks the
  worker of each request);
- **liveness**: a worker silent for `timeout_s` (`silent`) or restarted (a heartbeat
  with a new `started_at`) loses its work; so does a worker whose last heartbeat says it
  drained (unhealthy, nothing in flight, no capacity);
- **lost requests**: a request sent to a worker that `missing_beats` heartbeats in a row
  do not list (and that was sent more than `heartbeat_lag_s` before them) never arrived:
  core NATS is at most once;
- **probes**: heartbeats only say the worker's event loop runs, not that its engine
  does. A worker that holds work and neither completed anything nor generated a token
  for a while, or sat idle for longer, is sent a black-box probe (`probes_due`); a
  probe unanswered in time, or answered with an error, is a failure, and `evict_after`
  failures in a row evict the worker: out of rotation with its work, its reports
  ignored until it restarts.

Requests a worker runs that the dispatcher did not send it (found in its heartbeat after
a dispatcher restart) are *adopted*: the pool tracks them by key, without capacity (the
worker's heartbeat counts them), until they complete or the worker loses them.

Every decision that takes work away from a worker returns it as `Lost`, for the caller
to take back (`dispatcher/dispatch/reports.py`: requeued if it streamed nothing yet, else ended).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from costmodel.units import NO_CAPACITY, Capacity
from dispatcher.core.placement import DEFAULT_LOAD_BOUND, Placement, Ring, fleet_sizes
from dispatcher.core.types import Request

Key = tuple[str, str]  # (tenant, request id): ids are unique per tenant only

# A request sent to a worker this recently may not be in its heartbeat yet.
HEARTBEAT_LAG_S = 1.0
# Heartbeats in a row that must miss a request before it counts as lost.
MISSING_BEATS = 2
# A worker silent this many timeouts, holding nothing, is forgotten.
FORGET_AFTER_TIMEOUTS = 12


@dataclass(slots=True)
class Lost:
    """Work a worker no longer has."""

    requests: list[Request] = field(default_factory=list)
    adopted: list[Key] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requests or self.adopted)

    def add(self, other: Lost) -> Lost:
        self.requests += other.requests
        self.adopted += other.adopted
        return self


@dataclass(slots=True)
class Worker:
    """One worker as the pool knows it."""

    worker_id: str
    endpoint: str
    started_at: float
    capacity: Capacity
    last_seen: float
    healthy: bool = True
    # What was sent to it and has not completed: key -> (request, sent at).
    assigned: dict[Key, tuple[Request, float]] = field(default_factory=dict)
    # Keys its last heartbeat listed as in flight.
    reported: frozenset[Key] = frozenset()
    # Requests it runs that were not sent by this dispatcher (see the module docstring).
    adopted: set[Key] = field(default_factory=set)
    # Keys missing from consecutive heartbeats, and how many.
    missing: dict[Key, int] = field(default_factory=dict)
    # Totals over `assigned`, kept as it changes: read on every dispatch pass.
    assigned_tokens: int = 0
    assigned_units: float = 0.0
    assigned_in_reserve: int = 0  # those placed in its newcomer reserve
    # When it last showed its engine works: work started on it idle, a completion, an
    # answered probe. Probes are due from here.
    progress_at: float = 0.0
    probe_id: str | None = None  # the probe it has not answered yet
    probe_sent_at: float = 0.0
    probe_failures: int = 0  # in a row
    evicted: bool = False
    # Output tokens of its in-flight requests at its last heartbeat: more is progress.
    reported_output: int = 0
    # Model units per second it completes, as it says (0: unknown): its routing size.
    mu_per_s: float = 0.0
    # The most sequences this run has offered: its size when sizes are counted in
    # sequences. A draining worker offers only what it uses; its size, and so its
    # points on the ring, must not shrink with it (that would move other workers' keys).
    sequences: int = 0

    def used(self) -> Capacity:
        return Capacity(len(self.assigned), self.assigned_tokens, self.assigned_units)

    def free(self) -> Capacity:
        return self.capacity.minus(self.used())

    @property
    def load(self) -> float:
        """Model units in flight over its model-unit capacity."""
        return self.assigned_units / max(self.capacity.model_units, 1e-9)

    def _assign(self, request: Request, now: float) -> None:
        if not self.assigned:
            self.progress_at = now  # the stall clock starts with its first request
        self.assigned[(request.tenant, request.id)] = (request, now)
        self.assigned_tokens += request.input_tokens + request.max_tokens
        self.assigned_units += request.model_units
        self.assigned_in_reserve += request.in_reserve

    def _release(self, key: Key) -> Request | None:
        entry = self.assigned.pop(key, None)
        self.missing.pop(key, None)
        if entry is None:
            return None
        request = entry[0]
        self.assigned_tokens -= request.input_tokens + request.max_tokens
        self.assigned_in_reserve -= request.in_reserve
        # Float sums drift: back to exactly zero when nothing is assigned.
        self.assigned_units = self.assigned_units - request.model_units if self.assigned else 0.0
        return request

    def _lose_all(self, sent_before: float = math.inf) -> Lost:
        """Everything it holds, except requests sent at or after `sent_before`."""
        gone = [key for key, (_, sent_at) in self.assigned.items() if sent_at < sent_before]
        lost = Lost([self._release(key) for key in gone], sorted(self.adopted))
        self.adopted.clear()
        # Adopted keys' counts too: one adopted or sent here again starts from zero.
        for key in [k for k in self.missing if k not in self.assigned]:
            del self.missing[key]
        return lost


class WorkerPool:
    def __init__(
        self,
        *,
        timeout_s: float,
        heartbeat_lag_s: float = HEARTBEAT_LAG_S,
        missing_beats: int = MISSING_BEATS,
        evict_after: int = 2,
    ) -> None:
        if timeout_s <= 0 or heartbeat_lag_s < 0 or missing_beats < 1 or evict_after < 1:
            raise ValueError(
                "timeout_s must be > 0, heartbeat_lag_s >= 0, missing_beats >= 1, evict_after >= 1"
            )
        self.timeout_s = timeout_s
        self.evict_after = evict_after
        self.heartbeat_lag_s = heartbeat_lag_s
        self.missing_beats = missing_beats
        self.workers: dict[str, Worker] = {}
        # Which worker last reported running a key: for requests it runs that the
        # dispatcher did not send (after a dispatcher restart).
        self._reported_by: dict[Key, str] = {}
        # Per endpoint, the consistent-hash ring over its healthy workers.
        self._rings: dict[str, Ring] = {}

    def __iter__(self) -> Iterator[Worker]:
        return iter(self.workers.values())

    def get(self, worker_id: str) -> Worker | None:
        return self.workers.get(worker_id)

    # -- reports ------------------------------------------------------------------------

    def add(
        self, worker_id: str, endpoint: str, capacity: Capacity, now: float, started_at: float = 0.0
    ) -> Worker:
        """A worker the caller knows without heartbeats (the simulator's replicas)."""
        worker = Worker(
            worker_id,
            endpoint,
            started_at,
            capacity,
            now,
            progress_at=now,
            sequences=capacity.sequences,
        )
        self.workers[worker_id] = worker
        return worker

    def heartbeat(
        self,
        worker_id: str,
        endpoint: str,
        started_at: float,
        capacity: Capacity,
        in_flight: Collection[Key],
        healthy: bool,
        now: float,
        output_tokens: int = 0,
        mu_per_s: float = 0.0,
    ) -> Lost:
        """Take a heartbeat; returns the work the worker no longer has (it restarted,
        drained away, or a request never reached it). `output_tokens`: what its in-flight
        requests have generated so far; more than last time is progress (a long answer
        still streaming needs no probe)."""
        worker = self.workers.get(worker_id)
        lost = Lost()
        if worker is None:
            worker = self.add(worker_id, endpoint, capacity, now, started_at)
        elif worker.started_at != started_at:
            # A restart: what it was sent before the new run started is gone; what was
            # sent since may have reached the new run, and is left to the missing-
            # heartbeat check (taking it back now could run it twice). The same object
            # carries on, so a caller still holding it (a dispatch pass, across its
            # awaits) records what it sends in the ledger the pool checks.
            lost.add(worker._lose_all(sent_before=started_at))
            worker.endpoint, worker.started_at = endpoint, started_at
            worker.evicted, worker.probe_id, worker.probe_failures = False, None, 0
            worker.progress_at, worker.sequences = now, 0
        elif worker.evicted:
            worker.last_seen = now  # out of rotation until it restarts
            return lost
        self._forget_reports(worker)
        if output_tokens > worker.reported_output:
            worker.progress_at = now
        worker.reported_output = output_tokens
        worker.capacity, worker.last_seen, worker.healthy = capacity, now, healthy
        worker.sequences = max(worker.sequences, capacity.sequences)
        worker.mu_per_s = mu_per_s
        worker.reported = frozenset(in_flight)
        for key in worker.reported:
            self._reported_by[key] = worker_id
        if not healthy and not in_flight and capacity == NO_CAPACITY:
            # Its last heartbeat: the drain is over and it runs nothing; whatever it was
            # sent and did not complete is abandoned.
            return lost.add(worker._lose_all())
        return lost.add(self._find_lost(worker, now))

    def sent_again(self, now: float) -> None:
        """The dispatcher's connection to the broker came back: batches it sent before may
        have waited in its client's buffer until now, so heartbeats that do not list them
        count only from now (else a delayed batch looks lost, runs again elsewhere, and
        also where it arrives)."""
        for worker in self.workers.values():
            worker.assigned = {
                key: (request, max(sent_at, now))
                for key, (request, sent_at) in worker.assigned.items()
            }
            worker.missing.clear()

    def _find_lost(self, worker: Worker, now: float) -> Lost:
        lost = Lost()
        for key, (_, sent_at) in list(worker.assigned.items()):
            if key in worker.reported or now - sent_at < self.heartbeat_lag_s:
                worker.missing.pop(key, None)
            elif self._missed(worker, key):
                lost.requests.append(worker._release(key))
        for key in list(worker.adopted):
            if key in worker.reported:
                worker.missing.pop(key, None)
            elif self._missed(worker, key):
                worker.adopted.discard(key)
                lost.adopted.append(key)
        return lost

    def _missed(self, worker: Worker, key: Key) -> bool:
        """Count one more heartbeat without `key`; True once it is lost."""
        count = worker.missing[key] = worker.missing.get(key, 0) + 1
        if count < self.missing_beats:
            return False
        del worker.missing[key]
        return True

    def silent(self, now: float) -> list[tuple[Worker, Lost]]:
        """Workers silent for `timeout_s` leave rotation; each with the work it held.

        Also a worker that said it is unhealthy and then went quiet (its drain ended) may
        still hold requests sent just before its last heartbeat: those come back too.
        """
        found = []
        for worker in list(self.workers.values()):
            quiet_s = now - worker.last_seen
            if quiet_s > self.timeout_s and (worker.healthy or worker.assigned or worker.adopted):
                worker.healthy = False
                self._forget_reports(worker)
                worker.reported = frozenset()
                found.append((worker, worker._lose_all()))
            elif quiet_s > FORGET_AFTER_TIMEOUTS * self.timeout_s and not worker.healthy:
                # Gone for good (replaced workers often come back under new ids): the
                # pool must not grow with every worker that ever existed.
                del self.workers[worker.worker_id]
        return found

    # -- probes -------------------------------------------------------------------------

    def probes_due(self, now: float, stall_s: float, idle_s: float) -> list[Worker]:
        """Healthy workers to probe now, one probe at a time each: holding work and
        showing no progress for `stall_s`, or idle for `idle_s`."""
        due = []
        for worker in self.workers.values():
            if not worker.healthy or worker.probe_id is not None:
                continue
            busy = worker.assigned or worker.adopted
            if now - worker.progress_at >= (stall_s if busy else idle_s):
                due.append(worker)
        return due

    def probe_sent(self, worker: Worker, probe_id: str, now: float) -> None:
        worker.probe_id, worker.probe_sent_at = probe_id, now

    def probe_answered(self, worker_id: str, probe_id: str, ok: bool, now: float) -> Lost | None:
        """The worker answered `probe_id`; the work it loses if that failure evicts it
        (None otherwise, and for an answer to a probe no longer awaited)."""
        worker = self.workers.get(worker_id)
        if worker is None or worker.probe_id != probe_id:
            return None
        worker.probe_id = None
        if ok:
            worker.probe_failures, worker.progress_at = 0, now
            return None
        return self._probe_failed(worker)

    def probes_overdue(self, now: float, timeout_s: float) -> list[tuple[Worker, Lost | None]]:
        """Probes unanswered for `timeout_s` fail; each such worker, with the work it
        loses if it is evicted."""
        failed = []
        for worker in list(self.workers.values()):
            if worker.probe_id is not None and now - worker.probe_sent_at >= timeout_s:
                worker.probe_id = None
                failed.append((worker, self._probe_failed(worker)))
        return failed

    def _probe_failed(self, worker: Worker) -> Lost | None:
        worker.probe_failures += 1  # still due: the next probe goes at once
        if worker.probe_failures < self.evict_after or not worker.healthy:
            return None
        worker.evicted, worker.healthy = True, False
        self._forget_reports(worker)
        worker.reported = frozenset()
        return worker._lose_all()

    def _forget_reports(self, worker: Worker) -> None:
        for key in worker.reported:
            if self._reported_by.get(key) == worker.worker_id:
                del self._reported_by[key]

    # -- the ledger ---------------------------------------------------------------------

    def assign(self, worker: Worker, request: Request, now: float) -> None:
        worker._assign(request, now)

    def adopt(self, worker_id: str, key: Key) -> None:
        """`key` runs on `worker_id` (its heartbeat says so) without having been sent."""
        self.workers[worker_id].adopted.add(key)

    def complete(self, worker_id: str, key: Key, now: float) -> Request | None:
        """A request finished on its worker; the request, if it was sent there."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return None
        worker.progress_at = now
        if self._reported_by.get(key) == worker_id:
            del self._reported_by[key]
        worker.adopted.discard(key)
        return worker._release(key)

    def running_on(self, key: Key) -> str | None:
        """The worker whose last heartbeat lists `key` as in flight, if any."""
        return self._reported_by.get(key)

    # -- choice -------------------------------------------------------------------------

    def placement(
        self,
        endpoint: str,
        load_bound: float = DEFAULT_LOAD_BOUND,
        can_take: Callable[[Worker], bool] | None = None,
        affinity: bool = True,
    ) -> Placement | None:
        """A dispatch pass's room over the endpoint's healthy workers (those `can_take`
        refuses, and full ones, count in the fleet's load with no room); None when no
        worker has a free sequence. Without `affinity`, no ring: least utilised only."""
        fleet = [w for w in self.workers.values() if w.healthy and w.endpoint == endpoint]
        offers = [(w, w.free() if can_take is None or can_take(w) else NO_CAPACITY) for w in fleet]
        if not any(free.sequences > 0 for _, free in offers):
            return None
        sizes = fleet_sizes((w.worker_id, w.sequences, w.mu_per_s) for w in fleet)
        return Placement.of_fleet(
            (
                (w.worker_id, free, w.capacity, w.assigned_units, w.assigned_in_reserve)
                for w, free in offers
            ),
            sizes,
            self._ring(endpoint, sizes) if affinity else None,
            load_bound,
        )

    def _ring(self, endpoint: str, sizes: dict[str, float]) -> Ring:
        ring = self._rings.get(endpoint)
        if ring is None or ring.weights != sizes:
            ring = self._rings[endpoint] = Ring(sizes)
        return ring

    def healthy_count(self, endpoint: str) -> int:
        return sum(1 for w in self.workers.values() if w.endpoint == endpoint and w.healthy)

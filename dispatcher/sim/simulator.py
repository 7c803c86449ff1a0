"""A discrete-event simulator: the real scheduling core, a trace, a virtual clock.

Pure (no I/O, no wall clock, no randomness): the same trace, config and engine always
give the same result. The loop mirrors what the network dispatcher does with workers:

- events are trace arrivals, engine step ends, replicas becoming ready and autoscaler
  ticks, in time order (at equal times: step ends, arrivals, then the rest), all events
  of one instant before any dispatch;
- an arrival goes through `Scheduler.admit` with an in-process limiter store; a
  rejection is recorded with its outcome;
- the replicas are the workers of a `WorkerPool`, whose ledger holds what was sent to
  each and not finished (`Worker.free()`: sequences, KV tokens as input + max_tokens,
  model units); as in the dispatcher, one pass per endpoint places the next requests
  in fair order on its replicas (`WorkerPool.placement`, `Scheduler.place`);
- a replica mid-step offers no room, so work binds to a replica at the latest moment,
  unless `early_binding` is set: then every replica offers its room at every instant
  and work sent mid-step waits for its next step, as a real worker's engine does.
  Routing needs early binding: with late binding under load only the replica whose
  step just ended is offered, so a session could never wait for its own;
- the batch goes into the replica's `BatchingEngineModel`, which then runs one step;
  the step's tokens (`Scheduler.progress`), first tokens and finishes happen when the
  step ends; a finished request leaves the ledger and is settled with
  `Scheduler.complete` and its real usage.

Each endpoint has `replicas` engines of one `EngineParams` (or one per entry of `fleet`);
the throttle is told their capacity (the profile's `capacity_mu_per_s` each). With
`autoscale` (`sim_fleet.FleetScaling`) the count follows the autoscaler, new replicas
serving after the cold start; the summary's `gpu_seconds` is what they cost. Each
replica has a prefix cache (`costmodel.prefix_cache`): a request's cached leading
blocks (`TraceRecord.context_blocks`) skip prefill; requests route on their session,
else their shared prefix (`affinity`). The scheduler sees only `max_tokens`; the
engine generates `min(output_tokens, max_tokens)` tokens. A request that can never fit
a replica's KV cache is rejected as `invalid`.

`ClosedLoop` clients (`sim_clients`) add well-behaved load. The summary's
`idle_while_waiting` is the share of sequence-slot time left empty while a queued
request would have fit (what the newcomer reserve or FIFO's head-of-line blocking cost).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker_config.config import Config
from costmodel.capacity import ScalingPolicy
from costmodel.engine_model import BatchingEngineModel, EngineParams
from costmodel.prefix_cache import BLOCK_TOKENS, PrefixCache
from costmodel.units import Capacity
from dispatcher.core.endpoint import sequences_outside_reserve
from dispatcher.core.limits import MemoryLimiterStore
from dispatcher.core.placement import affinity_key
from dispatcher.core.policies import Policy
from dispatcher.core.pool import WorkerPool
from dispatcher.core.scheduler import Scheduler
from dispatcher.core.types import Outcome, Request
from dispatcher.sim.clients import Client, ClosedLoop
from dispatcher.sim.entries import Entry
from dispatcher.sim.fairness import (
    DEFAULT_METRICS,
    MetricOptions,
    RequestRecord,
    summarize,
)
from dispatcher.sim.replicas import FleetScaling, Replica
from dispatcher.sim.trace import TraceRecord

# Event kinds, in the order they are handled at one instant.
_STEP_END = 0
_ARRIVAL = 1
_WAKE = 2  # nothing to handle: a closed-loop client starts
_READY = 3  # a replica's cold start is over
_SCALE = 4  # the autoscaler decides


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    summary: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The RESULT.json shape: {"records": [...], "summary": {...}}."""
        return {"records": [r.to_dict() for r in self.records], "summary": self.summary}


class Simulation:
    """One run; `simulate` is the usual entry point."""

    def __init__(
        self,
        trace: Sequence[TraceRecord],
        config: Config,
        engine: EngineParams | None = None,
        *,
        replicas: int = 1,
        policy: Policy = "fairq",
        closed_loop: Sequence[ClosedLoop] = (),
        fleet: Sequence[EngineParams] = (),
        affinity: bool = True,
        early_binding: bool = False,
        autoscale: ScalingPolicy | None = None,
        scale_tick_s: float = 1.0,
    ) -> None:
        if replicas < 1 and autoscale is None:
            raise ValueError(f"replicas must be >= 1, got {replicas!r}")
        if autoscale is not None and fleet:
            raise ValueError("an autoscaled fleet is `replicas` of one engine, not `fleet`")
        self.config = config
        self.params = engine or EngineParams()
        # Each endpoint's replicas at the start: `fleet` if given, else `replicas` of
        # `engine`; the autoscaler starts more of `engine` and retires them.
        self.fleet = list(fleet) or [self.params] * replicas
        self.affinity = affinity
        self.early_binding = early_binding
        self.scheduler = Scheduler(config, policy=policy)
        self.scaling = (
            None
            if autoscale is None
            else FleetScaling(
                autoscale,
                {
                    name: self.scheduler.registry.profile(name).capacity_mu_per_s
                    for name in config.endpoints
                },
                scale_tick_s,
            )
        )
        self._reports_tokens = any(
            e.selector.charges_output_as_generated for e in self.scheduler.endpoints.values()
        )
        self.store = MemoryLimiterStore()
        self.default_endpoint = next(iter(config.endpoints))
        # Replicas never go silent: the simulator drives no heartbeats.
        self.pool = WorkerPool(timeout_s=math.inf)
        # In creation order: the order of their step ends at one instant.
        self.replicas: list[Replica] = []
        self._replica_of: dict[str, Replica] = {}
        for name in config.endpoints:
            for params in self.fleet:
                self._add_replica(name, params, 0.0)
            self._update_capacity(name)
        self.entries = [self._entry(i, record) for i, record in enumerate(trace)]
        self._events: list[tuple[float, int, int]] = [
            (e.request.arrival, _ARRIVAL, i) for i, e in enumerate(self.entries)
        ]
        if autoscale is not None:
            self._events.append((0.0, _SCALE, 0))
        self._clients: list[Client] = []
        for spec in closed_loop:
            self._add_client(spec)
        heapq.heapify(self._events)
        self.now = 0.0
        # Sequence-slot seconds run, and those left empty while queued work would fit.
        self.slot_s = self.idle_slot_s = 0.0

    def _add_client(self, spec: ClosedLoop) -> None:
        first = len(self.entries)
        self.entries += [self._entry(first + i, record) for i, record in enumerate(spec.records)]
        endpoint = (spec.records[0].endpoint if spec.records else None) or self.default_endpoint
        if endpoint not in self.config.endpoints:
            raise ValueError(f"closed-loop client on unknown endpoint {endpoint!r}")
        waiting = list(range(len(self.entries) - 1, first - 1, -1))
        slots = sum(
            self._slots_outside_reserve(endpoint, params) for params in self.fleet or [self.params]
        )
        self._clients.append(Client(endpoint, spec.start_s, slots, waiting))
        self._events.append((spec.start_s, _WAKE, 0))  # in case nothing else happens then

    def _slots_outside_reserve(self, endpoint: str, params: EngineParams) -> int:
        """Sequence slots of one replica of `endpoint` outside the newcomer reserve."""
        return max(
            1,
            sequences_outside_reserve(
                params.max_sequences, self.scheduler.endpoints[endpoint].reserve_fraction
            ),
        )

    def _top_up(self) -> None:
        """Each closed-loop client fills the free slots outside the reserve."""
        for client in self._clients:
            if self.now < client.start_s:
                continue
            queues = self.scheduler.endpoints[client.endpoint]
            # A rejected request takes no slot: the client sends on at once.
            while (
                client.waiting
                and (queues.running + self.scheduler.queued_count(client.endpoint)) < client.slots
            ):
                entry = self.entries[client.waiting.pop()]
                entry.request.arrival = self.now
                self._arrive(entry)

    def _entry(self, index: int, record: TraceRecord) -> Entry:
        endpoint = record.endpoint or self.default_endpoint
        spec = self.config.endpoints.get(endpoint)
        asked = record.max_tokens or (spec.max_tokens_cap if spec else record.output_tokens)
        # The scheduler caps max_tokens too; capping here as well gives the engine's
        # output length without waiting for admission (an unknown endpoint never runs).
        max_tokens = min(asked, spec.max_tokens_cap) if spec else asked
        request = Request(
            str(index),
            record.tenant,
            endpoint,
            record.arrival_s,
            record.input_tokens,
            max_tokens,
            priority=record.priority,
            deadline=record.deadline_s,
            session=record.session,
            payload=index,
        )
        if self.affinity and spec is not None:
            # The trace has no text: a shared prefix of a block or more stands for the
            # prompt's leading block.
            request.affinity = affinity_key(record.session, "") or (
                f"p:{record.prefix_id}"
                if record.prefix_id is not None
                and record.prefix_tokens >= spec.affinity_block_tokens
                else None
            )
        return Entry(request, min(record.output_tokens, max_tokens), record)

    def _add_replica(
        self, endpoint: str, params: EngineParams, now: float, ready: bool = True
    ) -> Replica:
        total = Capacity(
            params.max_sequences,
            params.kv_cache_tokens,
            self.config.endpoints[endpoint].batch.model_units,
        )
        number = sum(1 for r in self.replicas if r.worker.endpoint == endpoint)
        worker = self.pool.add(f"{endpoint}-{number}", endpoint, total, now)
        worker.healthy = ready
        replica = Replica(
            worker,
            BatchingEngineModel(params),
            PrefixCache(max(1, params.kv_cache_tokens // BLOCK_TOKENS)),
            now,
            ready,
        )
        self.replicas.append(replica)
        self._replica_of[worker.worker_id] = replica
        return replica

    def _update_capacity(self, endpoint: str) -> None:
        """For the throttle: serving replicas x the profile, or a cold start."""
        serving = sum(
            1 for r in self.replicas if r.worker.endpoint == endpoint and r.ready and r.alive
        )
        self.scheduler.set_capacity(
            endpoint,
            serving * self.scheduler.registry.profile(endpoint).capacity_mu_per_s,
            startup_wait_s=self.scaling.policy.cold_start_s
            if self.scaling and not serving
            else 0.0,
        )

    def _scale(self) -> None:
        scaling = self.scaling
        assert scaling is not None
        for name, queues in self.scheduler.endpoints.items():
            alive = [r for r in self.replicas if r.worker.endpoint == name and r.alive]
            resize = scaling.decide(name, alive, queues, self.now)
            for _ in range(resize.start):
                replica = self._add_replica(name, self.params, self.now, ready=False)
                heapq.heappush(
                    self._events,
                    (self.now + scaling.policy.cold_start_s, _READY, len(self.replicas) - 1),
                )
            for replica in resize.stop:
                replica.drain(self.now)
            self._update_capacity(name)
        busy = self.scheduler.queued_count() or any(not r.idle for r in self.replicas)
        if self._events or busy:
            heapq.heappush(self._events, (self.now + scaling.tick_s, _SCALE, 0))

    def _ready(self, replica: Replica) -> None:
        if replica.retired_at is None:
            replica.ready = replica.worker.healthy = True
            self._update_capacity(replica.worker.endpoint)

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> list[RequestRecord]:
        events = self._events
        while events:
            self.now = events[0][0]
            while events and events[0][0] == self.now:
                _, kind, index = heapq.heappop(events)
                if kind == _STEP_END:
                    self._end_step(self.replicas[index])
                elif kind == _ARRIVAL:
                    self._arrive(self.entries[index])
                elif kind == _READY:
                    self._ready(self.replicas[index])
                elif kind == _SCALE:
                    self._scale()
            for request in self.scheduler.expire(self.now):
                self._expired(request)
            self._top_up()
            # Endpoint by endpoint, like the dispatcher's pass: they share no queue.
            for name in self.scheduler.endpoints:
                self._dispatch(name)
            for index, replica in enumerate(self.replicas):
                if replica.step is None:
                    self._start_step(index, replica)
        if any(client.waiting for client in self._clients):
            raise RuntimeError("simulation ended with closed-loop requests never sent")
        if self.scheduler.queued_count():
            raise RuntimeError(
                f"simulation ended with {self.scheduler.queued_count()} requests queued "
                "and every replica idle: the scheduler withheld admissible work"
            )
        return [e.to_record() for e in self.entries]

    def _arrive(self, entry: Entry) -> None:
        request = entry.request
        if (
            request.endpoint in self.config.endpoints
            and request.input_tokens + request.max_tokens
            > max(p.kv_cache_tokens for p in self.fleet or [self.params])
        ):
            entry.outcome = Outcome.INVALID
        else:
            entry.outcome = self.scheduler.admit(request, self.now, self.store).outcome

    def _expired(self, request: Request) -> None:
        self.entries[request.payload].outcome = Outcome.DEADLINE_EXCEEDED

    def _dispatch(self, endpoint: str) -> None:
        """Work for the endpoint's replicas not in the middle of a step."""
        room = self.pool.placement(
            endpoint,
            self.scheduler.endpoints[endpoint].spec.affinity_load_bound,
            can_take=None
            if self.early_binding
            else lambda worker: self._replica_of[worker.worker_id].step is None,
        )
        if room is None:
            return
        selection = self.scheduler.place(endpoint, room, self.now)
        for request in selection.expired:
            self._expired(request)
        for slot in room.placed():
            replica = self._replica_of[slot.worker_id]
            for request in slot.requests:
                entry = self.entries[request.payload]
                cacheable, computed = entry.record.context_blocks(BLOCK_TOKENS)
                entry.cached_tokens = replica.cache.match(cacheable) * BLOCK_TOKENS
                replica.cache.insert(computed)
                entry.worker = slot.worker_id
                # The engine runs in dispatch order, except that requests of tenants below
                # their fair share go first (as the worker asks vLLM to).
                replica.engine.add(
                    request.payload,
                    request.input_tokens,
                    entry.output_tokens,
                    priority=int(request.expedited),
                    cached_tokens=entry.cached_tokens,
                )
                self.pool.assign(replica.worker, request, self.now)

    def _start_step(self, index: int, replica: Replica) -> None:
        if replica.engine.idle:
            return
        replica.step = step = replica.engine.step()
        heapq.heappush(self._events, (self.now + step.duration_s, _STEP_END, index))
        worker = replica.worker
        self.slot_s += step.duration_s * worker.capacity.sequences
        self.idle_slot_s += step.duration_s * self.scheduler.endpoints[
            worker.endpoint
        ].waiting_that_fits(worker.free())

    def _end_step(self, replica: Replica) -> None:
        step = replica.step
        assert step is not None
        replica.step = None
        # The engine's sequence ids are the trace indexes (`Request.payload`).
        for seq in step.first_tokens:
            self.entries[seq].first_token = self.now
        emitting = len(step.first_tokens) + len(step.tokens)
        worker = replica.worker
        self.scheduler.observe_occupancy(worker.endpoint, emitting, worker.capacity, worker.free())
        if self._reports_tokens:  # every step's token, as a worker's heartbeat would
            self.scheduler.progress(
                (
                    ((r.tenant, r.id), r.output_charged + 1)
                    for r in (self.entries[s].request for s in (*step.first_tokens, *step.tokens))
                ),
                occupancy=emitting,
            )
        for seq in step.finished:
            entry = self.entries[seq]
            entry.finished = self.now
            request = entry.request
            self.pool.complete(replica.worker.worker_id, (request.tenant, request.id), self.now)
            entry.engine_s = step.engine_s[seq]
            completed = self.scheduler.complete(
                request.tenant,
                request.id,
                entry.usage(self.scheduler.endpoints[request.endpoint]),
                self.now,
            )
            if completed is not None:
                self.store.settle(completed.settlement, self.now)
        replica.retire_if_drained(self.now)


def simulate(
    trace: Sequence[TraceRecord],
    config: Config,
    engine: EngineParams | None = None,
    *,
    replicas: int = 1,
    policy: Policy = "fairq",
    closed_loop: Sequence[ClosedLoop] = (),
    metrics: MetricOptions = DEFAULT_METRICS,
    fleet: Sequence[EngineParams] = (),
    affinity: bool = True,
    early_binding: bool = False,
    autoscale: ScalingPolicy | None = None,
) -> SimResult:
    """Run `trace` (and the `closed_loop` clients) through the scheduler and `replicas`
    engines per endpoint (or the `fleet`'s); `affinity` False routes every request to
    the least loaded replica; `early_binding`: see the module docstring; `autoscale`
    resizes each endpoint's fleet from `replicas` on (summary: `gpu_seconds`)."""
    simulation = Simulation(
        trace,
        config,
        engine,
        replicas=replicas,
        policy=policy,
        closed_loop=closed_loop,
        fleet=fleet,
        affinity=affinity,
        early_binding=early_binding,
        autoscale=autoscale,
    )
    records = simulation.run()
    registry = simulation.scheduler.registry
    # Each known tenant's configured weight, for the weighted fairness figures.
    weights = {
        tenant: known.weight
        for tenant in {r.tenant for r in records}
        if (known := registry.tenant(tenant)) is not None
    }
    summary = summarize(records, metrics, weights)
    summary["simulation"] = {
        "policy": policy,
        "replicas": len(simulation.fleet),
        "affinity": affinity,
        "cached_token_ratio": sum(r.cached_tokens for r in records)
        / max(1, sum(r.input_tokens for r in records if r.dispatched is not None)),
        "requests": len(records),
        "makespan_s": max((r.finished for r in records if r.finished is not None), default=0.0),
        "engine_steps": sum(r.engine.steps for r in simulation.replicas),
        "gpu_seconds": sum(r.gpu_seconds(simulation.now) for r in simulation.replicas),
        "scaling": simulation.scaling.decisions if simulation.scaling else [],
        "idle_while_waiting": simulation.idle_slot_s / max(simulation.slot_s, 1e-12),
    }
    return SimResult(records, summary)

"""What a chaos run sees, and what it concludes.

`Watch` listens, as an observer on the same NATS server, to everything that tells
whether a worker's failure cost a request anything: the batches the dispatcher sends
(which request went to which worker, and the probes), the workers' completions and
heartbeats (a new `started_at` is a new process), the evictions, and every event on the
requests' reply subjects. `verdict()` turns that and the injected faults into the
report's figures, `render()` into its markdown digest.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bench.harness.machine import table
from broker_config import wire, wire_internal
from broker_config.subjects import HDR_CONTENT_TYPE, Subjects
from dispatcher.core.pool import Key

# A token event on a reply subject, recognised without decoding it (most events are).
_TOKEN_PREFIX = b'{"type":"token"'


# Faults that make the dispatcher take a worker's work back (a slowed worker keeps it).
LOSES_THE_WORKER = frozenset({"kill", "stop", "hang"})


@dataclass(slots=True)
class Fault:
    """One injected fault: `kind` on the worker process `worker_id` (pid, run) at `at`."""

    kind: str
    worker_id: str
    pid: int
    started_at: float  # the run it hit (heartbeats' started_at)
    at: float
    held: set[Key] = field(default_factory=set)  # its unfinished requests at `at`


@dataclass(slots=True)
class _Dispatch:
    at: float
    worker_id: str


class Watch:
    """Records, from subscriptions on `nc`, what the run's parts say to each other."""

    def __init__(self, nc: NATS, subjects: Subjects, endpoint: str, inbox: str) -> None:
        self.nc = nc
        self.subjects = subjects
        self.endpoint = endpoint
        self.inbox = inbox
        self.dispatches: dict[Key, list[_Dispatch]] = defaultdict(list)
        self.completions: dict[Key, list[tuple[float, wire_internal.Completion]]] = defaultdict(
            list
        )
        self.finals: dict[Key, list[wire.FinalEvent]] = defaultdict(list)
        self.final_at: dict[Key, float] = {}
        self.runs: dict[str, list[tuple[float, float]]] = defaultdict(list)  # (seen, started)
        self.evictions: list[tuple[float, wire_internal.Evict]] = []
        # Per healthy heartbeat: the larger of its sequence and KV token shares in use.
        self.fullness: list[float] = []
        self.probes_sent = 0
        self.probes_answered = 0
        self.probe_sent_at: dict[str, float] = {}
        self.probe_answer_s: list[float] = []  # from the probe's batch to its answer
        self.unreadable = 0
        self.replies: dict[str, Key] = {}
        self.submitted_at: dict[Key, float] = {}
        # The lease's epochs (bench.chaos.ha): each one's first batch, and batches sent
        # under an epoch older than one already seen (the workers refuse them).
        self.epoch_first_batch: dict[int, float] = {}
        self.stale_batches = 0

    async def start(self) -> None:
        s, ep = self.subjects, self.endpoint
        for subject, handler in (
            (s.batches(ep), self._on_batch),
            (s.completions(ep), self._on_completions),
            (s.heartbeats(ep), self._on_heartbeat),
            (s.evictions(ep), self._on_evict),
            (f"{self.inbox}.>", self._on_event),
        ):
            await self.nc.subscribe(
                subject, cb=handler, pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30
            )
        await self.nc.flush()

    def reply_for(self, key: Key, n: int) -> str:
        reply = f"{self.inbox}.{n}"
        self.replies[reply] = key
        self.submitted_at.setdefault(key, time.time())
        return reply

    # -- handlers ------------------------------------------------------------------------

    async def _on_batch(self, msg: Msg) -> None:
        batch = self._decode(msg, wire_internal.BATCH.decode)
        if batch is None:
            return
        if self.epoch_first_batch and batch.epoch < max(self.epoch_first_batch):
            self.stale_batches += 1
        self.epoch_first_batch.setdefault(batch.epoch, batch.sent_at)
        for item in batch.items:  # timed by the dispatcher's clock: this one may lag
            if item.probe:
                self.probes_sent += 1
                self.probe_sent_at[item.id] = batch.sent_at
            else:
                self.dispatches[(item.tenant, item.id)].append(
                    _Dispatch(batch.sent_at, batch.worker_id)
                )

    async def _on_completions(self, msg: Msg) -> None:
        completions = self._decode(msg, wire_internal.COMPLETIONS.decode)
        if completions is None:
            return
        for done in completions.items:
            if done.probe:
                self.probes_answered += 1
                sent = self.probe_sent_at.pop(done.id, None)
                if sent is not None:
                    self.probe_answer_s.append(done.finished_at - sent)
            else:
                self.completions[(done.tenant, done.id)].append((done.finished_at, done))

    async def _on_heartbeat(self, msg: Msg) -> None:
        beat = self._decode(msg, wire_internal.HEARTBEAT.decode)
        if beat is None:
            return
        runs = self.runs[beat.worker_id]
        if not runs or runs[-1][1] != beat.started_at:
            runs.append((time.time(), beat.started_at))
        if beat.healthy and beat.capacity.sequences and beat.capacity.tokens:
            self.fullness.append(
                max(
                    beat.used.sequences / beat.capacity.sequences,
                    beat.used.tokens / beat.capacity.tokens,
                )
            )

    async def _on_evict(self, msg: Msg) -> None:
        evict = self._decode(msg, wire_internal.EVICT.decode)
        if evict is not None:
            self.evictions.append((time.time(), evict))

    async def _on_event(self, msg: Msg) -> None:
        if msg.data.startswith(_TOKEN_PREFIX):
            return
        key = self.replies.get(msg.subject)
        event = self._decode(msg, wire.EVENT.decode)
        if key is None or event is None or isinstance(event, wire.TokenEvent):
            return
        self.finals[key].append(event)
        self.final_at.setdefault(key, time.time())

    def _decode(self, msg: Msg, decode: Any) -> Any:
        try:
            return decode(
                msg.data,
                wire.Encoding.from_content_type(wire.header(msg.headers, HDR_CONTENT_TYPE)),
            )
        except (msgspec.DecodeError, wire.WireError):
            self.unreadable += 1
            return None

    # -- reading -------------------------------------------------------------------------

    def current_run(self, worker_id: str) -> float | None:
        runs = self.runs.get(worker_id)
        return runs[-1][1] if runs else None

    def held_by(self, worker_id: str, at: float) -> set[Key]:
        """Requests whose latest dispatch before `at` went to `worker_id`, unfinished then."""
        held = set()
        for key, dispatches in self.dispatches.items():
            before = [d for d in dispatches if d.at <= at]
            ended = self.final_at.get(key)
            if (
                not before
                or before[-1].worker_id != worker_id
                or (ended is not None and ended <= at)
            ):
                continue
            if not any(
                t <= at and c.worker_id == worker_id for t, c in self.completions.get(key, ())
            ):
                held.add(key)
        return held

    def waiting(self, at: float) -> set[Key]:
        """Requests submitted before `at`, neither dispatched nor ended by then."""
        return {
            key
            for key, sent in self.submitted_at.items()
            if sent <= at and not self._dispatched_by(key, at) and not self._ended_by(key, at)
        }

    def running(self, at: float) -> set[Key]:
        """Requests dispatched before `at`, not completed nor ended by then."""
        return {
            key
            for key in self.dispatches
            if self._dispatched_by(key, at)
            and not self._ended_by(key, at)
            and not any(t <= at for t, _ in self.completions.get(key, ()))
        }

    def _dispatched_by(self, key: Key, at: float) -> bool:
        return any(d.at <= at for d in self.dispatches.get(key, ()))

    def _ended_by(self, key: Key, at: float) -> bool:
        ended = self.final_at.get(key)
        return ended is not None and ended <= at


def verdict(
    watch: Watch,
    faults: list[Fault],
    submitted: list[Key],
    stored: dict[Key, wire_internal.StoredResult],
) -> dict[str, Any]:
    """The run's figures: delivery (lost, two results, repeats, run twice), and per fault
    the times to detection, re-dispatch and a replacement serving."""
    lost = [k for k in submitted if k not in stored and k not in watch.finals]
    two_results = [k for k in submitted if _results_of(watch, stored, k) > 1]
    repeated = sum(
        1
        for k in submitted
        if len(watch.finals.get(k, ())) > 1 and _results_of(watch, stored, k) == 1
    )
    ran_twice = [
        k
        for k in submitted
        if sum(1 for _, c in watch.completions.get(k, ()) if c.code is None) > 1
    ]
    finals = {key: _final(watch, stored, key) for key in submitted}
    outcomes = Counter(_outcome(event) for event in finals.values())
    # `internal` ends a request whose worker was lost after it streamed: only requests
    # sent to a worker that was killed, stopped or hung may end so.
    lost_workers = {f.worker_id for f in faults if f.kind in LOSES_THE_WORKER}
    internal_elsewhere = [
        k
        for k in submitted
        if _outcome(finals[k]) == wire.ErrorCode.INTERNAL.value
        and not any(d.worker_id in lost_workers for d in watch.dispatches.get(k, ()))
    ]
    totals = sorted(e.timings.total_s for e in finals.values() if isinstance(e, wire.DoneEvent))
    answers = sorted(watch.probe_answer_s)
    expected = {(f.worker_id, f.started_at) for f in faults if f.kind in ("hang", "stop")}
    healthy_evictions = [
        e.worker_id for _, e in watch.evictions if (e.worker_id, e.started_at) not in expected
    ]
    return {
        "submitted": len(submitted),
        "lost": len(lost),
        "lost_ids": [list(k) for k in lost[:20]],
        "two_different_results": len(two_results),
        "two_results_ids": [list(k) for k in two_results[:20]],
        "final_repeated_identical": repeated,
        "ran_twice_to_completion": len(ran_twice),
        "ran_twice_ids": [list(k) for k in ran_twice[:20]],
        "outcomes": dict(outcomes),
        "error_messages": dict(
            Counter(
                e.message for e in finals.values() if isinstance(e, wire.ErrorEvent)
            ).most_common(5)
        ),
        "internal_elsewhere": len(internal_elsewhere),
        "internal_elsewhere_ids": [list(k) for k in internal_elsewhere[:20]],
        "done_total_s": {f"p{q}": _quantile(totals, q / 100) for q in (50, 95, 99)},
        "redispatched": sum(1 for k in submitted if len(watch.dispatches.get(k, ())) > 1),
        "worker_fullness_mean": (
            sum(watch.fullness) / len(watch.fullness) if watch.fullness else None
        ),
        "evictions": len(watch.evictions),
        "healthy_evictions": len(healthy_evictions),
        "healthy_evicted": healthy_evictions,
        "probes_sent": watch.probes_sent,
        "probes_answered": watch.probes_answered,
        "probe_answer_s": {
            "p50": _quantile(answers, 0.5),
            "p99": _quantile(answers, 0.99),
            "max": answers[-1] if answers else None,
        },
        "unreadable_messages": watch.unreadable,
        "faults": [_fault_figures(watch, fault) for fault in faults],
    }


def _results_of(watch: Watch, stored: dict[Key, wire_internal.StoredResult], key: Key) -> int:
    """How many different final events the request has, stored or delivered."""
    events = list(watch.finals.get(key, ()))
    if key in stored:
        events.append(stored[key].event)
    return len({msgspec.json.encode(e) for e in events})


def _final(
    watch: Watch, stored: dict[Key, wire_internal.StoredResult], key: Key
) -> wire.FinalEvent | None:
    result = stored.get(key)
    return result.event if result is not None else (watch.finals.get(key) or [None])[0]


def _quantile(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def _outcome(event: wire.FinalEvent | None) -> str:
    if event is None:
        return "none"
    if isinstance(event, wire.DoneEvent):
        return "done"
    return event.code.value


def _fault_figures(watch: Watch, fault: Fault) -> dict[str, Any]:
    """Seconds from the fault to: detection (the worker evicted, or the first of its
    requests sent elsewhere or ended), all its requests re-dispatched or ended, and a
    new process of the worker heartbeating."""
    moved: list[float] = []
    finished_there = 0
    for key in fault.held:
        # Sent again (also to the worker's replacement, which has the same id)...
        later = [d.at for d in watch.dispatches.get(key, ()) if d.at > fault.at]
        ended = watch.final_at.get(key)
        if later:
            moved.append(min(later) - fault.at)
        elif any(
            c.worker_id == fault.worker_id and c.code is None
            for _, c in watch.completions.get(key, ())
        ):
            finished_there += 1  # ... or not: it finished where it was (a slow worker)
        elif ended is not None:
            moved.append(ended - fault.at)  # ended by the dispatcher: it had streamed
        else:
            moved.append(float("inf"))
    evicted = [
        t - fault.at
        for t, e in watch.evictions
        if e.worker_id == fault.worker_id and e.started_at == fault.started_at
    ]
    replaced = [
        seen - fault.at
        for seen, started in watch.runs.get(fault.worker_id, ())
        if started > fault.started_at
    ]
    first_signs = evicted[:1] + ([min(moved)] if moved else [])
    return {
        "kind": fault.kind,
        "worker": fault.worker_id,
        "at_s": fault.at,
        "held": len(fault.held),
        "finished_where_they_were": finished_there,
        "evicted_s": evicted[0] if evicted else None,
        "detected_s": min(first_signs) if first_signs else None,
        "redispatched_s": max(moved) if moved else None,
        "replacement_serving_s": replaced[0] if replaced else None,
    }


def render(summary: dict[str, Any]) -> str:
    f = summary["figures"]
    lines = [
        f"### Chaos: {summary['name']} ({summary['machine']['date']})",
        "",
        f"`{summary['machine']['command']}`",
        "",
        *_totals(f),
    ]
    if f["faults"]:
        lines += ["", *_worker_faults(f["faults"])]
    if f.get("ha_faults"):
        lines += [
            "",
            *_ha_faults(f["ha_faults"]),
            "",
            f"batches sent under an old epoch (refused by the workers): {f['stale_batches']}",
        ]
    lines += ["", f"failed goals: {', '.join(summary['failed']) or 'none'}"]
    return "\n".join(lines)


def _totals(f: dict[str, Any]) -> list[str]:
    return table(
        [
            "submitted",
            "lost",
            "two different results",
            "final repeated (identical)",
            "ran twice to completion",
            "evictions (of healthy)",
            "probes sent / answered (answer p50 / max s)",
            "outcomes",
            "done: p50 / p95 / p99 s",
            "re-dispatched",
            "worker fullness",
        ],
        [
            [
                str(f["submitted"]),
                str(f["lost"]),
                str(f["two_different_results"]),
                str(f["final_repeated_identical"]),
                str(f["ran_twice_to_completion"]),
                f"{f['evictions']} ({f['healthy_evictions']})",
                f"{f['probes_sent']} / {f['probes_answered']} ("
                f"{_seconds(f['probe_answer_s']['p50'], 2)} / "
                f"{_seconds(f['probe_answer_s']['max'], 2)})",
                ", ".join(f"{k} {v}" for k, v in sorted(f["outcomes"].items())),
                " / ".join(_seconds(v) for v in f["done_total_s"].values()),
                str(f["redispatched"]),
                _share(f["worker_fullness_mean"]),
            ]
        ],
    )


def _worker_faults(faults: list[dict[str, Any]]) -> list[str]:
    return table(
        [
            "fault",
            "worker",
            "requests held",
            "finished there",
            "detected s",
            "all re-dispatched s",
            "replacement serving s",
        ],
        [
            [
                x["kind"],
                x["worker"],
                str(x["held"]),
                str(x["finished_where_they_were"]),
                _seconds(x["detected_s"]),
                _seconds(x["redispatched_s"]),
                _seconds(x["replacement_serving_s"]),
            ]
            for x in faults
        ],
    )


def _ha_faults(faults: list[dict[str, Any]]) -> list[str]:
    return table(
        [
            "fault",
            "target",
            "epoch",
            "new holder's first batch s",
            "first new request dispatched s",
            "waiting (all dispatched s)",
            "running (sent again)",
        ],
        [
            [
                x["kind"],
                x["target"],
                str(x["epoch"]),
                _seconds(x["new_holder_s"]),
                _seconds(x["new_request_dispatched_s"]),
                f"{x['waiting']} ({_seconds(x['waiting_dispatched_s'])})",
                f"{x['running']} ({x['running_sent_again']})",
            ]
            for x in faults
        ],
    )


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _seconds(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"

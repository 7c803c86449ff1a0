"""Where each request goes: the room of one dispatch pass over an endpoint's workers.

The scheduler decides the order (tier -> DRR -> priority) and offers each next request
to a `Placement`, which picks the worker; so routing chooses among workers and never
reorders tenants. One pass over one worker (`Placement.single`) is `next_batch`'s
classic batch fill.

Among the workers the request fits (sequences, KV tokens, model units, and the newcomer
reserve unless its tenant is below its share; while a higher tier has work waiting, a
lower tier's request may use only the reserve, and holds one of its sequences until it
completes, `Request.in_reserve`: so lower tiers run at most the reserve meanwhile):

- **affinity**: a request with an affinity key (its `session`, else a hash of its
  prompt's leading block; `affinity_key`) walks the endpoint's consistent-hash `Ring`
  (points in proportion to each worker's size, so keys are shared out as capacity is)
  from the key's point and takes the first worker within the load bound: a worker's
  model-unit load, before this request, below `load_bound` x its share of the fleet's
  size x the fleet's load including this request. So a worker ends at most one request
  above c x its share (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded
  Loads", 2018); a key stays on its worker while that has room and spills along the
  ring when it does not; a worker joining or leaving moves only the keys it takes or held
  (unless it changes the fleet's smallest size: see `Ring`).
- **no key**, or no worker within the bound: the least utilised worker (model units in
  flight over its size), the one with more free sequences on a tie.

A worker's size (`fleet_sizes`) is the model units per second it completes, from its
calibration profile, when every worker of the fleet says so and they differ, else its
sequences (the most its current run has offered: `WorkerPool` keeps that).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from costmodel.units import CHARS_PER_TOKEN, NO_CAPACITY, Capacity
from dispatcher.core.types import Request

# What `Placement.place` says of a request.
PLACED = 0
HELD = 1  # fits, in room it may not use: the newcomer reserve, or kept for a higher tier
MISFIT = 2  # fits a whole batch, not the room left
BLOCKED = 3  # larger than any whole batch, and no idle worker to run it alone

DEFAULT_LOAD_BOUND = 1.25
DEFAULT_AFFINITY_BLOCK_TOKENS = 128
# Points per worker on the ring: enough that keys spread evenly over a few workers.
VNODES = 64
# A worker far larger than the smallest gets at most this many times its points.
MAX_VNODES_FACTOR = 16.0


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (Python's `hash` is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def affinity_key(
    session: str | None, leading_text: str, block_tokens: int = DEFAULT_AFFINITY_BLOCK_TOKENS
) -> str | None:
    """The key a request routes on: its session, else its prompt's first block (whose
    KV cache a replica that served it may still hold); None for a prompt shorter than
    one block, which has no prefix worth keeping on one worker."""
    if session is not None:
        return "s:" + session
    block_chars = block_tokens * CHARS_PER_TOKEN
    if len(leading_text) < block_chars:
        return None
    return "p:" + hashlib.blake2b(leading_text[:block_chars].encode(), digest_size=12).hexdigest()


class Ring:
    """A consistent-hash ring over worker ids, weighted by size: the smallest members get
    `VNODES` points each, a larger one as many more as it is larger (at most
    `MAX_VNODES_FACTOR` times), so keys land on members in proportion to their size.

    A member's points are `<id>#<n>` for its first n, so a member joining or leaving
    moves only its own keys, as long as it does not change the smallest size (every
    other member's count of points is relative to it)."""

    def __init__(self, members: Iterable[str] | Mapping[str, float], vnodes: int = VNODES) -> None:
        weights = dict(members) if isinstance(members, Mapping) else dict.fromkeys(members, 1.0)
        if not all(0 < weight < math.inf for weight in weights.values()):
            raise ValueError(f"ring weights must be finite and > 0, got {weights!r}")
        smallest = min(weights.values(), default=1.0)
        self.weights = weights
        self.members = frozenset(weights)
        points = sorted(
            (stable_hash(f"{member}#{i}"), member)
            for member, weight in weights.items()
            for i in range(round(vnodes * min(weight / smallest, MAX_VNODES_FACTOR)))
        )
        self._hashes = [h for h, _ in points]
        self._owners = [m for _, m in points]

    def walk(self, key: str) -> Iterator[str]:
        """Every member once, clockwise from the key's point."""
        if not self._owners:
            return
        start = bisect.bisect(self._hashes, stable_hash(key))
        seen: set[str] = set()
        count = len(self._owners)
        for i in range(count):
            owner = self._owners[(start + i) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.members):
                    return


def fleet_sizes(workers: Iterable[tuple[str, int, float]]) -> dict[str, float]:
    """Each of (worker id, sequences, model units per second)'s size: its speed when the
    fleet's speeds differ and all are known (finite, > 0), else its sequences. Equal
    speeds say nothing of size: workers of an endpoint share its profile unless
    calibrated one by one."""
    workers = list(workers)
    speeds = {mu_per_s for *_, mu_per_s in workers}
    by_speed = len(speeds) > 1 and all(0 < speed < math.inf for speed in speeds)
    return {
        worker_id: mu_per_s if by_speed else max(sequences, 1)
        for worker_id, sequences, mu_per_s in workers
    }


class Slot:
    """One worker's room in a pass, and what the pass placed on it."""

    __slots__ = (
        "worker_id",
        "sequences",
        "tokens",
        "units",
        "total",
        "reserve",
        "whole_reserve",
        "reserve_in_use",
        "idle",
        "load",
        "size",
        "requests",
    )

    def __init__(
        self,
        worker_id: str,
        free: Capacity,
        total: Capacity,
        load: float = 0.0,
        size: float = 1.0,
        reserve_in_use: int = 0,
    ) -> None:
        self.worker_id = worker_id
        self.sequences, self.tokens, self.units = free.sequences, free.tokens, free.model_units
        self.total = total
        self.reserve = self.whole_reserve = NO_CAPACITY  # what is left of it, and all of it
        self.reserve_in_use = reserve_in_use  # its sequences taken by running requests
        self.idle = free == total
        self.load = load  # model units in flight
        self.size = size
        self.requests: list[Request] = []

    def fits(self, tokens: int, units: float, reserve: Capacity) -> bool:
        return (
            self.sequences > reserve.sequences
            and tokens <= self.tokens - reserve.tokens
            and units <= self.units - reserve.model_units
        )

    def set_reserve(self, whole: Capacity) -> None:
        """The reserve of `whole` less the sequences running requests took, each with
        its share of the reserve's tokens and model units."""
        self.whole_reserve = whole
        left = whole.sequences - self.reserve_in_use
        self.reserve = (
            NO_CAPACITY
            if left <= 0
            else Capacity(
                left,
                whole.tokens * left // whole.sequences,
                whole.model_units * left / whole.sequences,
            )
        )


class Placement:
    def __init__(
        self,
        slots: Sequence[Slot],
        ring: Ring | None = None,
        load_bound: float = DEFAULT_LOAD_BOUND,
    ) -> None:
        if load_bound <= 1:
            raise ValueError(f"load_bound must be > 1, got {load_bound!r}")
        self.slots = list(slots)
        self.ring = ring
        self.load_bound = load_bound
        self._by_id = {slot.worker_id: slot for slot in self.slots}
        self._size = sum(slot.size for slot in self.slots)
        self._load = sum(slot.load for slot in self.slots)

    @classmethod
    def single(cls, free: Capacity, total: Capacity, reserve_in_use: int = 0) -> Placement:
        return cls([Slot("", free, total, reserve_in_use=reserve_in_use)])

    @classmethod
    def of_fleet(
        cls,
        workers: Iterable[tuple[str, Capacity, Capacity, float, int]],
        sizes: Mapping[str, float],
        ring: Ring | None = None,
        load_bound: float = DEFAULT_LOAD_BOUND,
    ) -> Placement:
        """A pass over (worker id, free, total, model units in flight, reserve sequences
        in use) of every healthy worker of one endpoint, full ones included (they count
        in the fleet's load), with their `sizes` (`fleet_sizes`)."""
        return cls(
            [
                Slot(worker_id, free, total, load, sizes[worker_id], in_reserve)
                for worker_id, free, total, load, in_reserve in workers
            ],
            ring,
            load_bound,
        )

    def set_reserves(self, reserve_of: Callable[[Capacity], Capacity]) -> None:
        for slot in self.slots:
            slot.set_reserve(reserve_of(slot.total))

    def lift_reserves(self) -> None:
        for slot in self.slots:
            slot.reserve = slot.whole_reserve = NO_CAPACITY

    def has_room(self) -> bool:
        return any(slot.sequences > 0 for slot in self.slots)

    def place(self, request: Request, respect_reserve: bool, confined: bool = False) -> int:
        """Place `request` on a worker if it fits one; PLACED, HELD, MISFIT or BLOCKED.

        `respect_reserve`: its tenant is at or above its share, so it may not use the
        newcomer reserve. `confined`: a higher tier has work this room is kept for, so
        it may use only the reserve (and only if it may use the reserve at all)."""
        tokens = request.input_tokens + request.max_tokens
        units = request.model_units
        fitting = []
        for slot in self.slots:
            if not slot.fits(tokens, units, NO_CAPACITY):
                continue
            if confined:
                if not respect_reserve and slot.reserve.sequences > 0:
                    fitting.append(slot)
            elif not respect_reserve or slot.fits(tokens, units, slot.reserve):
                fitting.append(slot)
        if fitting:
            slot = self._choose(request, fitting)
            self._take(slot, request, tokens, units)
            request.in_reserve = confined
            if confined:
                slot.reserve_in_use += 1
                slot.set_reserve(slot.whole_reserve)
            return PLACED
        if any(slot.fits(tokens, units, NO_CAPACITY) for slot in self.slots):
            return HELD
        if any(slot.total.fits(Capacity(1, tokens, units)) for slot in self.slots):
            return MISFIT
        # Larger than any whole batch: it runs alone on an idle worker, not starved.
        for slot in self.slots:
            if slot.idle and not slot.requests:
                self._take(slot, request, tokens, units)
                slot.sequences = 0
                request.in_reserve = False
                return PLACED
        return BLOCKED

    def placed(self) -> list[Slot]:
        """The workers this pass placed requests on."""
        return [slot for slot in self.slots if slot.requests]

    def _choose(self, request: Request, fitting: list[Slot]) -> Slot:
        if len(fitting) == 1:
            return fitting[0]
        key = request.affinity
        if key is not None and self.ring is not None:
            fleet_load = self._load + request.model_units
            for worker_id in self.ring.walk(key):
                slot = self._by_id.get(worker_id)
                if (
                    slot is not None
                    and slot in fitting
                    and (
                        slot.load < self.load_bound * slot.size / self._size * fleet_load
                        or slot.load == 0
                    )
                ):
                    return slot
        return min(fitting, key=lambda s: (s.load / s.size, -s.sequences))

    def _take(self, slot: Slot, request: Request, tokens: int, units: float) -> None:
        slot.sequences -= 1
        slot.tokens -= tokens
        slot.units -= units
        slot.load += units
        self._load += units
        slot.requests.append(request)

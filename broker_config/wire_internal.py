"""The messages between fairq's own services (batches, aborts, evictions, heartbeats,
scale events, completions, stored results): internal, they may change between
versions. The public ones and the codecs are in wire.py."""

from __future__ import annotations

import msgspec

from broker_config.wire import Codec, Encoding, ErrorCode, FinalEvent, SubmitRequest
from costmodel.units import Capacity, Usage


class BatchItem(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One request as a worker receives it: the body as the client submitted it, and what
    the dispatcher decided about it.

    `max_tokens` is the body's, capped by the endpoint. `expedited` is the engine priority
    the dispatcher chose (its tenant ran below its fair share): the worker schedules it
    ahead in the engine. The body's own `priority` orders requests only inside their
    tenant's queue and never reaches the engine. Times are unix seconds. `probe` marks a
    black-box health check: the worker runs it through its engine ahead of everything,
    in a sequence slot it keeps free for probes, until the body's `deadline`, and
    answers with a Completion (`probe` set) instead of events or a stored result.
    """

    id: str
    tenant: str
    endpoint: str
    request: SubmitRequest
    max_tokens: int
    expedited: bool = False
    reply: str | None = None
    encoding: Encoding = Encoding.JSON
    enqueued_at: float
    dispatched_at: float
    probe: bool = False


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    endpoint: str
    items: list[BatchItem]
    sent_at: float
    # The sending dispatcher's lease epoch (broker_config/lease_key.py); workers refuse an
    # older one than they have seen. 0: a dispatcher run without a lease.
    epoch: int = 0


class Abort(msgspec.Struct, frozen=True, kw_only=True):
    """Stop these requests of one tenant wherever they run; each gets an error event
    with `code`. Ids are unique per tenant only, hence the tenant."""

    endpoint: str
    tenant: str
    ids: list[str]
    code: ErrorCode = ErrorCode.CANCELLED
    epoch: int = 0  # as in Batch


class Evict(msgspec.Struct, frozen=True, kw_only=True):
    """To one run (`started_at`) of a worker: it failed its health probes and is out of
    rotation. It abandons its requests without final events or completions (the
    dispatcher has run them elsewhere or ended them), takes no more batches and exits,
    so its supervisor starts a fresh run. A run with another `started_at` ignores it."""

    endpoint: str
    worker_id: str
    started_at: float
    epoch: int = 0  # as in Batch


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's state: total capacity, what is in use (model-unit load), and its ids.

    `started_at` changes when the worker restarts, so the dispatcher can tell a restart
    (in-flight work lost) from a late heartbeat.
    """

    worker_id: str
    endpoint: str
    capacity: Capacity
    used: Capacity
    # `Subjects.result_key(tenant, id)` of every request on the worker.
    in_flight: list[str]
    healthy: bool
    started_at: float
    sent_at: float
    seq: int
    # Output tokens each `in_flight` request has generated so far, in the same order
    # (tenants are charged for output as it is served); empty if the worker does not say.
    output_tokens: list[int] = []
    # Model units per second it completes (its calibration profile's): its size when
    # work is spread over unequal workers; 0 if unknown.
    capacity_mu_per_s: float = 0.0


class ScaleEvent(msgspec.Struct, frozen=True, kw_only=True):
    """The dispatcher's autoscaling decision for one endpoint (costmodel/capacity.py), for
    whatever starts and stops its workers (`fairq up --autoscale`)."""

    endpoint: str
    desired: int
    serving: int  # healthy workers now
    demand_mu_per_s: float
    utilisation: float | None  # demand over the serving workers' capacity; None if none
    sent_at: float


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A request finished on a worker. `code` None means done, else the error it ended with.

    `stored` says the final event is in the results bucket, which is what allows the
    dispatcher to ack the request in JetStream.
    """

    id: str
    tenant: str
    endpoint: str
    worker_id: str
    usage: Usage
    code: ErrorCode | None = None
    stored: bool
    finished_at: float
    # Unix time of the first token event, if there was one (for TTFT metrics).
    first_token_at: float | None = None
    # The answer to a health probe (`BatchItem.probe`): nothing stored, no events.
    probe: bool = False


class Completions(msgspec.Struct, frozen=True):
    """The completions a worker reports in one message: those of the requests that
    finished in the same turn of its event loop (one, unless many finish at once)."""

    items: list[Completion]


class StoredResult(msgspec.Struct, frozen=True, kw_only=True):
    """Value in the results bucket under `Subjects.result_key(tenant, id)`."""

    tenant: str
    endpoint: str
    event: FinalEvent
    stored_at: float


BATCH = Codec(Batch)
ABORT = Codec(Abort)
EVICT = Codec(Evict)
HEARTBEAT = Codec(Heartbeat)
SCALE_EVENT = Codec(ScaleEvent)
COMPLETIONS = Codec(Completions)
STORED_RESULT = Codec(StoredResult)

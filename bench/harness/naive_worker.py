"""The naive baseline: workers that pull from one shared JetStream work queue, oldest first.

    python -m bench.harness.naive_worker --nats URL --endpoint chat --worker-id w1 \\
        --config C.toml [every other flag of `python -m workers`]

This is what a team builds without fairq: no dispatcher, every worker of an endpoint
pulls from one durable pull consumer over `fq.req.<endpoint>.*` on the same requests
stream (same subjects, same wire contract), so requests run in stream (arrival) order
whichever tenant sent them. Each worker is the real `WorkerService` on the same engine;
`SharedQueueFeeder` stands where the dispatcher would be, for one worker:

- it keeps at most the engine's capacity in sequences in flight (the same capacity the
  dispatcher fills), fetching exactly as many messages as there are free slots;
- it turns each message into a `BatchItem` (the endpoint's `max_tokens_cap` applied, as
  the dispatcher does; `enqueued_at` is the time JetStream stored the message, so the
  done event's `queued_s` is the time spent in the shared queue) and hands it to the
  service as a batch on the worker's work subject, so events stream to `Fq-Reply` and
  the final event is stored exactly as in fairq;
- it acks the message when the worker's completion says the final event is stored
  (naks it otherwise, so it runs again).

No dispatcher may run beside these workers: on a work-queue stream the shared consumer
and the dispatcher's cannot coexist. The broker must already be provisioned. A request
that breaks the wire contract is dropped (logged and terminated): the baseline keeps
no error path of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import Self

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from bench.harness.consumers import endpoint_consumer, pull_subscription
from broker_config import jetstream, wire, wire_internal
from broker_config.config import ConfigError, load_config
from broker_config.streams import ConsumerLimits
from broker_config.subjects import HDR_CONTENT_TYPE
from workers.__main__ import (
    Options,
    UsageError,
    WorkerFailure,
    build_parser,
    parse_options,
    serving,
    stop_on_signals,
)
from workers.service import WorkerService

log = logging.getLogger("bench.harness.naive_worker")

# A fetch waits this long for messages; also how soon the feeder notices it should stop.
FETCH_POLL_S = 0.5
# Messages are acked only when their request finishes: this must outlast any request.
ACK_WAIT_S = 300.0
# On exit, how long requests still running may take to complete (and be acked).
EXIT_GRACE_S = 30.0


@dataclass(frozen=True, slots=True)
class FeederSettings:
    max_tokens_cap: int
    ack_wait_s: float = ACK_WAIT_S
    exit_grace_s: float = EXIT_GRACE_S


class SharedQueueFeeder:
    """Feeds one running WorkerService from the endpoint's shared pull consumer, FIFO.

    An async context manager: entering binds the shared consumer (creating it if it is
    missing) and starts pulling; leaving stops pulling, waits up to `exit_grace_s` for the
    requests in flight to complete, and naks what is left so another worker runs it.
    """

    def __init__(
        self, nc: NATS, service: WorkerService, slots: int, settings: FeederSettings
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots!r}")
        self._nc = nc
        self._service = service
        self._subjects = service.subjects
        self._slots = slots
        self._settings = settings
        # result key -> the message to ack when that request's completion arrives.
        self._held: dict[str, Msg] = {}
        self._freed = asyncio.Event()
        self._pulling = True
        self._task: asyncio.Task[None] | None = None
        self._pull: JetStreamContext.PullSubscription | None = None
        self._completions: Subscription | None = None

    async def __aenter__(self) -> Self:
        service = self._service
        spec = endpoint_consumer(
            self._subjects, service.endpoint, ConsumerLimits(ack_wait_s=self._settings.ack_wait_s)
        )
        pull = await pull_subscription(self._nc.jetstream(), self._subjects.requests_stream, spec)
        self._completions = await self._nc.subscribe(
            self._subjects.completion(service.endpoint, service.worker_id), cb=self._on_completions
        )
        self._pull = pull
        self._task = asyncio.create_task(self._pull_loop(pull), name="shared-queue-feeder")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._pulling = False
        self._freed.set()
        if self._task is not None:
            await self._task  # ends within one fetch poll
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.exit_grace_s
        while self._held and loop.time() < deadline:
            self._freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), deadline - loop.time())
        for msg in self._held.values():
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()
        self._held.clear()
        for subscription in (self._pull, self._completions):
            if subscription is not None:
                with contextlib.suppress(nats.errors.Error):
                    await subscription.unsubscribe()

    async def _pull_loop(self, pull: JetStreamContext.PullSubscription) -> None:
        while self._pulling:
            free = self._slots - len(self._held)
            if free <= 0:
                self._freed.clear()
                await self._freed.wait()
                continue
            try:
                messages = await pull.fetch(free, timeout=FETCH_POLL_S)
            except (TimeoutError, nats.errors.TimeoutError):
                continue  # nats-py raises either when nothing arrives within the poll
            except nats.errors.ConnectionClosedError:
                return
            await self._hand_over(messages)

    async def _hand_over(self, messages: list[Msg]) -> None:
        service = self._service
        now = time.time()
        items = []
        for msg in messages:
            try:
                submission = wire.parse_submission(
                    msg.subject, msg.data, msg.headers, self._subjects
                )
            except wire.WireError as exc:
                log.warning("dropping an invalid request on %s: %s", msg.subject, exc)
                await msg.term()
                continue
            request = submission.request
            key = self._subjects.result_key(submission.tenant, submission.id)
            self._held[key] = msg
            items.append(
                wire_internal.BatchItem(
                    id=submission.id,
                    tenant=submission.tenant,
                    endpoint=submission.endpoint,
                    request=request,
                    max_tokens=min(
                        request.max_tokens or self._settings.max_tokens_cap,
                        self._settings.max_tokens_cap,
                    ),
                    reply=submission.reply,
                    encoding=submission.encoding,
                    enqueued_at=jetstream.delivery_of(msg.reply)[0],  # when the stream stored it
                    dispatched_at=now,
                )
            )
        if not items:
            return
        batch = wire_internal.Batch(
            worker_id=service.worker_id, endpoint=service.endpoint, items=items, sent_at=now
        )
        await self._nc.publish(
            self._subjects.work(service.endpoint, service.worker_id),
            wire.encode(batch, wire.Encoding.MSGPACK),
            headers={HDR_CONTENT_TYPE: wire.Encoding.MSGPACK.content_type},
        )

    async def _on_completions(self, msg: Msg) -> None:
        completions = wire_internal.COMPLETIONS.decode(
            msg.data, wire.Encoding.from_content_type(wire.header(msg.headers, HDR_CONTENT_TYPE))
        )
        for done in completions.items:
            held = self._held.pop(self._subjects.result_key(done.tenant, done.id), None)
            if held is None:
                continue
            if done.stored:
                await held.ack()
            else:
                await held.nak()  # the final event is not stored: run it again
        self._freed.set()


def feeder_settings(args: argparse.Namespace, options: Options) -> FeederSettings:
    """The feeder's settings from the worker's command line; UsageError if unusable."""
    if args.config is None:
        raise UsageError("--config is required: the endpoint's max_tokens_cap comes from it")
    try:
        endpoint = load_config(args.config).endpoints[options.endpoint]
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    return FeederSettings(max_tokens_cap=endpoint.max_tokens_cap)


async def run(options: Options, settings: FeederSettings) -> None:
    """A worker fed from the shared queue until SIGTERM/SIGINT; then the feeder stops
    and hands back what it holds, then the worker drains. Raises WorkerFailure."""
    stop = stop_on_signals()
    # The feeder is sized once the engine has started: vLLM's capacity is known only then.
    async with (
        serving(options, stop) as (nc, service),
        SharedQueueFeeder(nc, service, options.engine.capacity.sequences, settings),
    ):
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(prog="python -m bench.harness.naive_worker")
    args = parser.parse_args(argv)
    try:
        options = parse_options(args)
        settings = feeder_settings(args, options)
    except UsageError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(run(options, settings))
    except WorkerFailure as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

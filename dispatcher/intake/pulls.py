"""Standing pull requests on durable consumers, every reply through one inbox.

    async with StandingPulls(nc, on_message=..., on_expired=...) as pulls:
        pulls.add(Pull(consumer, stream))
        await pulls.send(pull, credits)       # one outstanding pull per consumer

Every consumer gets at most one pull request (`$JS.API.CONSUMER.MSG.NEXT`) at a time,
whose replies go to `<inbox>.<consumer>` under one wildcard subscription: the server
pushes a message the moment it is stored. A pull ends by using up its credits, or by
its expiry (status 408, `on_expired` with the credits left unused), or by an error:
"consumer deleted" (or 404 / 503: no such consumer) marks the pull `gone`; any other
error (a 409 leadership change...) pauses it for `PULL_RETRY_S`. A pull lost to a
reconnect or a server restart, whose expiry never comes, is found by `forget_lost`.

Drain order on exit: drain the subscription (what is on its way is still delivered to
`on_message`; the server drops the outstanding pulls with their interest).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from broker_config import jetstream

log = logging.getLogger("fairq.intake")

# A pull whose expiry status is this much overdue was lost (a reconnect, a server restart).
PULL_LOST_MARGIN_S = 2.0
# After an error status, wait this long before pulling again.
PULL_RETRY_S = 1.0
# A pull to a consumer that does not exist (any more): no responders, not found.
CONSUMER_GONE = (jetstream.NO_RESPONDERS, jetstream.NOT_FOUND)


@dataclass(slots=True)
class Pull:
    """A durable consumer and its outstanding pull request: a shard's, or (`tenant`) one
    tenant's parked requests."""

    consumer: str
    stream: str
    filter_subject: str = ""
    tenant: str = ""
    requested: int = 0  # credits left on the outstanding pull
    pull_deadline: float = 0.0
    retry_at: float = 0.0
    gone: bool = False  # the consumer must be made (again)
    tenants: set[str] = field(default_factory=set)  # shard: tenants with stored requests


class StandingPulls:
    def __init__(
        self,
        nc: NATS,
        *,
        on_message: Callable[[Pull | None, Msg], Awaitable[None]],
        on_expired: Callable[[Pull, int], Awaitable[None]],
        expires_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc = nc
        self.on_message = on_message
        self.on_expired = on_expired
        self.expires_s = expires_s
        self.clock = clock
        self.by_consumer: dict[str, Pull] = {}
        self._inbox = ""
        self._subscription = None
        self._reconnects = 0

    async def __aenter__(self) -> StandingPulls:
        self._inbox = self.nc.new_inbox()
        self._reconnects = self.nc.stats["reconnects"]
        # Unbounded pending queue: the server bounds it (the consumers' max_ack_pending).
        self._subscription = await self.nc.subscribe(
            f"{self._inbox}.*", cb=self._on_reply, pending_msgs_limit=0, pending_bytes_limit=0
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # Drain, not unsubscribe: what is already on its way is still handed on.
        await self._subscription.drain()

    def add(self, pull: Pull) -> Pull:
        pull.gone = False
        self.by_consumer[pull.consumer] = pull
        return pull

    def remove(self, pull: Pull) -> None:
        if self.by_consumer.get(pull.consumer) is pull:
            del self.by_consumer[pull.consumer]

    def can_send(self, pull: Pull) -> bool:
        return not (pull.requested or pull.gone or self.clock() < pull.retry_at)

    async def send(self, pull: Pull, credits: int) -> None:
        """Ask `pull`'s consumer for up to `credits` messages (if it has no pull out)."""
        if credits <= 0 or not self.can_send(pull):
            return
        pull.requested = credits
        pull.pull_deadline = self.clock() + self.expires_s + PULL_LOST_MARGIN_S
        try:
            await self.nc.publish(
                jetstream.pull_subject(pull.stream, pull.consumer),
                jetstream.pull_request(credits, self.expires_s),
                reply=f"{self._inbox}.{pull.consumer}",
            )
        except nats.errors.Error as exc:
            pull.requested = 0
            pull.retry_at = self.clock() + PULL_RETRY_S
            log.warning("pull on %s not sent: %s", pull.consumer, exc)

    def forget_lost(self) -> None:
        """Forget the pulls the server forgot (a reconnect, or an expiry long overdue)."""
        now = self.clock()
        reconnects = self.nc.stats["reconnects"]
        reconnected, self._reconnects = reconnects != self._reconnects, reconnects
        for pull in self.by_consumer.values():
            if pull.requested and (reconnected or now > pull.pull_deadline):
                pull.requested = 0

    async def _on_reply(self, msg: Msg) -> None:
        if msg.reply:  # a message, on its own subject; the ack subject names the consumer
            pull = self.by_consumer.get(jetstream.consumer_of(msg.reply))
            if pull is not None:
                pull.requested = max(0, pull.requested - 1)
            await self.on_message(pull, msg)
            return
        pull = self.by_consumer.get(msg.subject.rsplit(".", 1)[1])  # a status, `<inbox>.<consumer>`
        if pull is None:
            return
        status, description = jetstream.status_of(msg)
        unused, pull.requested = pull.requested, 0
        if status == jetstream.REQUEST_TIMEOUT:
            await self.on_expired(pull, unused)
            return
        log.warning("pull on %s ended: %s %s", pull.consumer, status, description)
        if status in CONSUMER_GONE or "deleted" in description.lower():
            pull.gone = True  # what it delivered is redelivered through the new one
            self.remove(pull)
        pull.retry_at = self.clock() + PULL_RETRY_S

"""Listening for a request's events: the reply subscriptions a client holds, and each
event read from one, decoded and checked against the wire contract.

    replies = ReplySubscriptions(nc)
    subscription = await replies.listen(reply_subject)     # before the submit is published
    event = await next_event(subscription, request_id, timeout_s=5.0)
    await replies.release(subscription)

A duplicate submit's events went to the first submit's reply subject: `collect_final`
polls the status API for its final event instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from broker_config.subjects import HDR_CONTENT_TYPE
from broker_config.wire import EVENT, Encoding, Event, FinalEvent, StatusReply, WireError, header
from producers.errors import ConnectionFailed, FairqError, FairqTimeout, ProtocolError, describe
from producers.submission import Submitted

__all__ = ["ReplySubscriptions", "collect_final", "next_event", "not_listening"]

# Polling the status API for a duplicate submit's result: start fast, back off to this.
_POLL_FIRST_S = 0.1
_POLL_MAX_S = 2.0


class ReplySubscriptions:
    """The reply subscriptions of one connection not yet consumed; `len` counts them."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._held: set[Subscription] = set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, subscription: Subscription) -> bool:
        return subscription in self._held

    async def listen(self, subject: str) -> Subscription:
        try:
            subscription = await self._nc.subscribe(subject)
        except nats.errors.Error as exc:
            raise ConnectionFailed(f"cannot subscribe to {subject}: {describe(exc)}") from exc
        self._held.add(subscription)
        return subscription

    async def release(self, subscription: Subscription) -> None:
        if subscription not in self._held:
            return
        self._held.discard(subscription)
        # A closed or draining connection has dropped its subscriptions already.
        if not (self._nc.is_closed or self._nc.is_draining):
            await subscription.unsubscribe()

    async def release_all(self) -> None:
        for subscription in list(self._held):
            await self.release(subscription)


def not_listening(submitted: Submitted) -> FairqError:
    """Why a request's events cannot be streamed (no subscription is held for them)."""
    if submitted.reply_subject is None:
        return FairqError(
            f"request {submitted.id} was submitted without a reply subject: "
            "collect its result with status()"
        )
    return FairqError(
        f"the events of request {submitted.id} were already streamed or the client "
        "was closed: collect its result with status()"
    )


async def next_event(subscription: Subscription, request_id: str, timeout_s: float | None) -> Event:
    """The next event on a reply subscription (any request's: the caller filters by id)."""
    try:
        msg = await subscription.next_msg(timeout=timeout_s)
    except nats.errors.TimeoutError as exc:
        raise FairqTimeout(f"no event for request {request_id} within {timeout_s:g}s") from exc
    except nats.errors.Error as exc:
        raise ConnectionFailed(
            f"lost the events of request {request_id} "
            f"({describe(exc)}): collect its result with status()"
        ) from exc
    return _decode_event(msg)


async def collect_final(
    status: Callable[[str, str], Awaitable[StatusReply]],
    submitted: Submitted,
    timeout_s: float | None,
) -> FinalEvent:
    """Poll the status API (`status(tenant, id)`) until the request's final event is stored."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    delay = _POLL_FIRST_S
    while True:
        reply = await status(submitted.tenant, submitted.id)
        if reply.result is not None:
            return reply.result
        if deadline is not None and loop.time() + delay > deadline:
            raise FairqTimeout(
                f"request {submitted.id} (a duplicate submit) did not finish "
                f"within {timeout_s:g}s; last state {reply.state!r}"
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)


def _decode_event(msg: Msg) -> Event:
    try:
        encoding = Encoding.from_content_type(header(msg.headers, HDR_CONTENT_TYPE))
        return EVENT.decode(msg.data, encoding)
    except WireError as exc:
        raise ProtocolError(f"event on {msg.subject}: {exc.message}") from exc
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ProtocolError(f"malformed event on {msg.subject}: {exc}") from exc

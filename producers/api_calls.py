"""Calling the dispatcher's request/reply API (`<prefix>.api.status|cancel|depth.*`,
docs/protocol.md): one NATS request, its answer decoded, every failure a `FairqError`.

    subject = api_subject(subjects.status, "acme")
    reply = await call_api(nc, subject, StatusRequest(checked_id(id)), STATUS_REPLY, 5.0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from broker_config.subjects import SubjectError, check_request_id
from broker_config.wire import Codec, WireError, decode_api_reply, encode
from producers.errors import (
    ApiError,
    ConnectionFailed,
    FairqTimeout,
    InvalidRequest,
    NoDispatcher,
    describe,
)

__all__ = ["api_subject", "call_api", "checked_id"]

T = TypeVar("T")


def checked_id(request_id: str) -> str:
    """A request id as the API takes it (InvalidRequest otherwise)."""
    try:
        return check_request_id(request_id)
    except SubjectError as exc:
        raise InvalidRequest(str(exc)) from exc


def api_subject(build: Callable[[str], str], tenant: str) -> str:
    """A tenant's API subject, `build` being one of `Subjects`' (InvalidRequest: bad tenant)."""
    try:
        return build(tenant)
    except SubjectError as exc:
        raise InvalidRequest(str(exc)) from exc


async def call_api(
    nc: NATS, subject: str, payload: msgspec.Struct, codec: Codec[T], timeout_s: float
) -> T:
    """Send one API request and decode the dispatcher's reply with `codec`."""
    try:
        msg = await nc.request(subject, encode(payload), timeout=timeout_s)
    except nats.errors.NoRespondersError as exc:
        raise NoDispatcher(f"no dispatcher is running (nobody answers {subject})") from exc
    except nats.errors.TimeoutError as exc:
        raise FairqTimeout(
            f"no answer on {subject} within {timeout_s:g}s: the "
            "dispatcher is overloaded or unreachable"
        ) from exc
    except nats.errors.Error as exc:
        raise ConnectionFailed(f"cannot call {subject}: {describe(exc)}") from exc
    try:
        return decode_api_reply(msg.data, codec)
    except WireError as exc:
        raise ApiError(exc.code, f"{subject}: {exc.message}") from exc

"""The SDK's errors: every failure of `producers.client.Client` is a `FairqError`.

    try:
        done = await fq.run("chat", "acme", prompt="Hi")
    except BacklogFull:       # this tenant's queue is full: retry later
        ...
    except RequestFailed as exc:
        exc.event             # the ErrorEvent the request ended with
    except FairqError as exc:
        exc.code              # the contract's error code, where there is one

`code` is the wire contract's `ErrorCode` (docs/protocol.md) where the failure has one.
"""

from __future__ import annotations

import asyncio

from broker_config.wire import ErrorCode, ErrorEvent

__all__ = [
    "ApiError",
    "BacklogFull",
    "ConnectionFailed",
    "FairqError",
    "FairqTimeout",
    "InvalidRequest",
    "NoDispatcher",
    "ProtocolError",
    "PublishFailed",
    "RequestFailed",
    "describe",
]


class FairqError(Exception):
    """Base of every error the SDK raises. `code` is the contract's error code, if any."""

    code: ErrorCode | None = None


class InvalidRequest(FairqError, ValueError):
    """The request breaks the wire contract; caught locally, nothing was sent."""

    code = ErrorCode.INVALID_REQUEST


class ConnectionFailed(FairqError):
    """No connection to NATS, or the connection was lost or closed."""


class PublishFailed(FairqError):
    """The broker did not store the request."""


class BacklogFull(PublishFailed):
    """This tenant's backlog on this endpoint is full; other tenants are unaffected."""

    code = ErrorCode.OVERLOADED

    def __init__(self, endpoint: str, tenant: str) -> None:
        super().__init__(
            f"tenant {tenant!r} has too many unfinished requests on endpoint "
            f"{endpoint!r} (the broker's per-tenant queue cap): retry later"
        )
        self.endpoint = endpoint
        self.tenant = tenant


class FairqTimeout(FairqError, asyncio.TimeoutError):
    """Nothing arrived in time: a PubAck, an API answer, or a request's next event."""


class NoDispatcher(FairqError):
    """Nobody answers the API subjects: no dispatcher is running."""


class ApiError(FairqError):
    """The dispatcher refused an API call, or answered something that is not a reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ProtocolError(FairqError):
    """An event on a reply subject that does not follow the wire contract."""


class RequestFailed(FairqError):
    """The request ended with an error event (`event`)."""

    def __init__(self, event: ErrorEvent) -> None:
        hint = f" (retry after {event.retry_after_s:g}s)" if event.retry_after_s is not None else ""
        super().__init__(f"request {event.id} failed: {event.code}: {event.message}{hint}")
        self.event = event
        self.code = event.code


def describe(exc: BaseException) -> str:
    """A one-line description of a cause; some nats-py errors have an empty str()."""
    return str(exc) or type(exc).__name__

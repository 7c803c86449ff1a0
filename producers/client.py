"""The async fairq SDK: submit requests, stream their events, query and cancel them.

    async with Client.connect("nats://127.0.0.1:4222") as fq:
        submitted = await fq.submit("chat", "acme", prompt="Hello", max_tokens=16)
        async for event in fq.stream(submitted):
            ...                                   # TokenEvent..., then DoneEvent | ErrorEvent
        done = await fq.run("chat", "acme", prompt="Hi")   # or both in one call

Everything follows the public wire contract (docs/protocol.md): a submit is a JetStream
publish whose PubAck means "stored, will finish with exactly one final event"; events
arrive on the request's `Fq-Reply` subject, which the client subscribes to before it
publishes, so no event can be missed. Every failure is a `FairqError` with a clear message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Generator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import PubAck

from broker_config.connection import ConnectionOptionsError, credentials, server_urls
from broker_config.streams import is_backlog_full
from broker_config.subjects import (
    HDR_CONTENT_TYPE,
    HDR_MSG_ID,
    HDR_REPLY,
    SubjectError,
    Subjects,
    check_request_id,
    message_bytes,
)
from broker_config.wire import (
    CANCEL_REPLY,
    DEPTH_REPLY,
    EVENT,
    STATUS_REPLY,
    CancelReply,
    CancelRequest,
    ChatMessage,
    Codec,
    DepthReply,
    DepthRequest,
    DoneEvent,
    Encoding,
    ErrorCode,
    ErrorEvent,
    Event,
    FinalEvent,
    Sampling,
    StatusReply,
    StatusRequest,
    TokenEvent,
    WireError,
    decode_api_reply,
    decode_request,
    encode,
    header,
)

__all__ = [
    "ApiError",
    "BacklogFull",
    "Client",
    "Connecting",
    "ConnectionFailed",
    "FairqError",
    "FairqTimeout",
    "InvalidRequest",
    "NoDispatcher",
    "ProtocolError",
    "PublishFailed",
    "RequestFailed",
    "Submitted",
]

_log = logging.getLogger(__name__)
T = TypeVar("T")

# Polling the status API for a duplicate submit's result: start fast, back off to this.
_POLL_FIRST_S = 0.1
_POLL_MAX_S = 2.0


# -- errors --------------------------------------------------------------------------------


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


# -- submitted requests --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Submitted:
    """A request the broker stored (or had already stored: `duplicate`).

    `reply_subject` is where its events go (None: submitted without one). For a duplicate,
    the events went to the first submit's reply subject, so `Client.stream` collects the
    final event through the status API instead.
    """

    id: str
    reply_subject: str | None
    stream_seq: int
    duplicate: bool
    endpoint: str
    tenant: str
    encoding: Encoding
    _subscription: Subscription | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class _Prepared:
    subject: str
    body: bytes
    headers: dict[str, str]
    id: str


def _prepare_submit(
    subjects: Subjects,
    endpoint: str,
    tenant: str,
    fields: Mapping[str, Any],
    request_id: str,
    reply: str | None,
    encoding: Encoding,
) -> _Prepared:
    """Subject, body and headers of a submit, checked exactly as fairq will check them."""
    try:
        subject = subjects.request(endpoint, tenant)
        check_request_id(request_id)
    except SubjectError as exc:
        raise InvalidRequest(str(exc)) from exc
    deadline = fields.get("deadline")
    # JSON has no NaN/inf: the encoder would turn them into null, silently dropping it.
    if isinstance(deadline, float) and not math.isfinite(deadline):
        raise InvalidRequest(f"`deadline` must be a finite unix time in seconds, got {deadline}")
    headers = {HDR_MSG_ID: request_id, HDR_CONTENT_TYPE: encoding.content_type}
    if reply is not None:
        headers[HDR_REPLY] = reply
    body = {"id": request_id, **{k: v for k, v in fields.items() if v is not None}}
    try:
        draft = encode(body, encoding)
    except (TypeError, ValueError) as exc:  # msgspec.EncodeError is a ValueError
        raise InvalidRequest(f"cannot encode the request: {exc}") from exc
    try:
        request = decode_request(draft, headers)
    except WireError as exc:
        raise InvalidRequest(exc.message) from exc
    # The canonical body: validated, defaults omitted.
    return _Prepared(subject, encode(request, encoding), headers, request_id)


# -- the client ----------------------------------------------------------------------------


class Client:
    """The fairq SDK over one NATS connection.

    `Client(nc)` wraps a connection the caller owns (closing the client leaves it open);
    `Client.connect(url)` opens one that the client closes. Both are async context managers.

    `tenant_inboxes`: the broker has per-tenant users and this connection is that
    tenant's; the client then serves only that tenant, and reply subjects lie in its inbox
    (the connection's inbox prefix must be `Subjects.inbox_prefix(tenant)`, which
    `Client.connect` sets).
    """

    def __init__(
        self,
        nc: NATS,
        *,
        prefix: str = "fq",
        tenant_inboxes: str | None = None,
        publish_timeout_s: float = 5.0,
        api_timeout_s: float = 5.0,
    ) -> None:
        if tenant_inboxes is not None:
            _tenant_inbox(tenant_inboxes)
        self._nc = nc
        self._subjects = Subjects(prefix)
        self._tenant = tenant_inboxes
        self._publish_timeout_s = publish_timeout_s
        self._api_timeout_s = api_timeout_s
        self._js = nc.jetstream(timeout=publish_timeout_s)
        self._owns_connection = False
        # Reply subscriptions not yet consumed by stream(); removed on close().
        self._listening: set[Subscription] = set()

    @property
    def nc(self) -> NATS:
        """The connection, for operator calls beside the SDK's (producers.admin)."""
        return self._nc

    @staticmethod
    def connect(
        url: str,
        *,
        prefix: str = "fq",
        tenant_inboxes: str | None = None,
        user: str | None = None,
        password: str | None = None,
        creds: str | Path | None = None,
        nkey: str | Path | None = None,
        inbox_prefix: str | None = None,
        connect_timeout_s: float = 5.0,
        allow_reconnect: bool = True,
        publish_timeout_s: float = 5.0,
        api_timeout_s: float = 5.0,
    ) -> Connecting:
        """Open a connection; use as `async with Client.connect(url) as c` or `await`.

        Credentials, one kind at most: `user` and `password`, `creds` (a .creds file) or
        `nkey` (an nkey seed file, as `fairq auth` writes them); ConnectionFailed for
        conflicting ones or an unreadable file. A tenant's own broker user also needs
        `tenant_inboxes=<tenant>`.
        `allow_reconnect=False` fails at once when the server is unreachable (the CLI's
        choice); otherwise nats-py keeps retrying the server, also on the first connect.
        `inbox_prefix`: the connection's own (a front user's, `auth.front_inbox_prefix`);
        a tenant client's is its tenant's.
        """
        Subjects(prefix)  # a bad prefix fails here, before a connection is opened
        inbox = _tenant_inbox(tenant_inboxes) if tenant_inboxes is not None else inbox_prefix
        try:
            secrets = credentials(user=user, password=password, creds=creds, nkey=nkey)
        except ConnectionOptionsError as exc:
            raise ConnectionFailed(f"cannot connect to NATS at {url}: {exc}") from None

        async def open_client() -> Client:
            errors = _ErrorLog()
            options: dict[str, Any] = {"inbox_prefix": inbox} if inbox else {}
            if not allow_reconnect:
                # nats-py tries a server at least twice before giving up; make it quick.
                options |= {"max_reconnect_attempts": 1, "reconnect_time_wait": 0}
            try:
                nc = await nats.connect(
                    server_urls(url),
                    **secrets,
                    connect_timeout=connect_timeout_s,
                    allow_reconnect=allow_reconnect,
                    error_cb=errors.record,
                    **options,
                )
            except (TimeoutError, OSError, nats.errors.Error) as exc:
                # "no servers available" hides why: the last attempt's error says it.
                cause = errors.last if isinstance(exc, nats.errors.NoServersError) else None
                raise ConnectionFailed(
                    f"cannot connect to NATS at {url}: {_describe(cause or exc)}"
                ) from exc
            client = Client(
                nc,
                prefix=prefix,
                tenant_inboxes=tenant_inboxes,
                publish_timeout_s=publish_timeout_s,
                api_timeout_s=api_timeout_s,
            )
            client._owns_connection = True
            return client

        return Connecting(open_client)

    @property
    def connection(self) -> NATS:
        return self._nc

    @property
    def subjects(self) -> Subjects:
        return self._subjects

    @property
    def listening(self) -> int:
        """Requests whose events this client holds a subscription for (not yet streamed)."""
        return len(self._listening)

    async def close(self) -> None:
        """Drop every reply subscription; close the connection if this client opened it."""
        for subscription in list(self._listening):
            await self._release(subscription)
        if self._owns_connection and not self._nc.is_closed:
            await self._nc.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- submit ---------------------------------------------------------------------------

    async def submit(
        self,
        endpoint: str,
        tenant: str,
        *,
        prompt: str | None = None,
        messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
        max_tokens: int | None = None,
        priority: int = 0,
        deadline: float | None = None,
        session: str | None = None,
        input_tokens: int | None = None,
        images: Sequence[str] | None = None,
        metadata: Mapping[str, str] | None = None,
        sampling: Sampling | Mapping[str, Any] | None = None,
        id: str | None = None,
        reply: bool | str = True,
        encoding: Encoding = Encoding.JSON,
    ) -> Submitted:
        """Validate, publish to JetStream and return once the broker stored the request.

        `reply`: True listens on a fresh inbox, a string on that subject, False sends no
        `Fq-Reply` (collect the result later with `status`). Raises InvalidRequest (nothing
        sent), BacklogFull, PublishFailed, FairqTimeout (no PubAck: the request may be
        stored; the id is the idempotency key, so submitting again with it never runs the
        request twice) or ConnectionFailed.
        """
        self._check_tenant(tenant)
        request_id = uuid.uuid4().hex if id is None else id
        reply_subject = self._reply_subject(reply, tenant)
        fields = {
            "prompt": prompt,
            "messages": messages,
            "max_tokens": max_tokens,
            "priority": priority,
            "deadline": deadline,
            "session": session,
            "input_tokens": input_tokens,
            "images": images,
            "metadata": metadata,
            "sampling": sampling,
        }
        prepared = _prepare_submit(
            self._subjects, endpoint, tenant, fields, request_id, reply_subject, encoding
        )
        # Subscribe first: a fast worker may answer before the PubAck is back.
        subscription = await self._listen(reply_subject) if reply_subject is not None else None
        try:
            ack = await self._publish(prepared, endpoint, tenant)
        except BaseException:
            if subscription is not None:
                await self._release(subscription)
            raise
        duplicate = bool(ack.duplicate)
        if duplicate and subscription is not None:
            # The stored request answers the first submit's reply subject, not this one.
            await self._release(subscription)
            subscription = None
        return Submitted(
            request_id, reply_subject, ack.seq, duplicate, endpoint, tenant, encoding, subscription
        )

    def _check_tenant(self, tenant: str) -> None:
        if self._tenant is not None and tenant != self._tenant:
            raise InvalidRequest(
                f"this client is connected as tenant {self._tenant!r} "
                f"(tenant_inboxes) and cannot act for tenant {tenant!r}"
            )

    def _reply_subject(self, reply: bool | str, tenant: str) -> str | None:
        if reply is False:
            return None
        subject = self._nc.new_inbox() if reply is True else reply
        try:
            return self._subjects.check_reply(
                subject, tenant, tenant_inboxes=self._tenant is not None
            )
        except SubjectError as exc:
            raise InvalidRequest(str(exc)) from exc

    async def _publish(self, prepared: _Prepared, endpoint: str, tenant: str) -> PubAck:
        size = message_bytes(prepared.body, prepared.headers)
        if size > self._nc.max_payload:
            # The server would drop the connection, not answer: refused here instead.
            raise InvalidRequest(
                f"request {prepared.id} is {size} bytes with its headers, over the broker's "
                f"largest message ({self._nc.max_payload} bytes, its max_payload)"
            )
        try:
            return await self._js.publish(
                prepared.subject, prepared.body, headers=dict(prepared.headers)
            )
        except nats.js.errors.APIError as exc:
            if is_backlog_full(exc):
                raise BacklogFull(endpoint, tenant) from exc
            raise PublishFailed(
                f"the broker refused request {prepared.id} on "
                f"{prepared.subject}: {exc.description} (code {exc.code}, "
                f"err_code {exc.err_code})"
            ) from exc
        except nats.js.errors.NoStreamResponseError as exc:
            raise PublishFailed(
                f"no JetStream stream stores {prepared.subject}: is the broker provisioned "
                f"(stream {self._subjects.requests_stream})?"
            ) from exc
        except nats.errors.TimeoutError as exc:
            raise FairqTimeout(
                f"no PubAck for request {prepared.id} within {self._publish_timeout_s:g}s: it "
                "may or may not be stored; submit again with the same id (it runs at most "
                "once) or ask status()"
            ) from exc
        except nats.errors.Error as exc:
            raise ConnectionFailed(
                f"cannot publish request {prepared.id}: {_describe(exc)}"
            ) from exc

    # -- events ---------------------------------------------------------------------------

    async def stream(
        self, submitted: Submitted, *, timeout_s: float | None = None
    ) -> AsyncGenerator[Event, None]:
        """The request's events: TokenEvent..., then one DoneEvent or ErrorEvent, then stop.

        The iterator ends at the first final event (a redelivery may publish another) and
        removes the subscription; leaving early removes it too when the generator is
        closed (`contextlib.aclosing`, or `Client.close`). Events for other ids on a shared
        reply subject are skipped. `timeout_s` bounds the wait for each event (FairqTimeout).
        A duplicate submit yields only the final event, collected with the status API.
        """
        if submitted.duplicate:
            yield await self._collect(submitted, timeout_s)
            return
        subscription = submitted._subscription
        if subscription is None or subscription not in self._listening:
            raise FairqError(self._why_not_listening(submitted))
        try:
            while True:
                event = await self._next_event(subscription, submitted, timeout_s)
                if event.id != submitted.id:
                    continue
                yield event
                if not isinstance(event, TokenEvent):
                    return
        finally:
            await self._release(subscription)

    @staticmethod
    def _why_not_listening(submitted: Submitted) -> str:
        if submitted.reply_subject is None:
            return (
                f"request {submitted.id} was submitted without a reply subject: "
                "collect its result with status()"
            )
        return (
            f"the events of request {submitted.id} were already streamed or the client "
            "was closed: collect its result with status()"
        )

    async def _next_event(
        self, subscription: Subscription, submitted: Submitted, timeout_s: float | None
    ) -> Event:
        try:
            msg = await subscription.next_msg(timeout=timeout_s)
        except nats.errors.TimeoutError as exc:
            raise FairqTimeout(
                f"no event for request {submitted.id} within {timeout_s:g}s"
            ) from exc
        except nats.errors.Error as exc:
            raise ConnectionFailed(
                f"lost the events of request {submitted.id} "
                f"({_describe(exc)}): collect its result with status()"
            ) from exc
        return _decode_event(msg)

    async def _collect(self, submitted: Submitted, timeout_s: float | None) -> FinalEvent:
        """Poll the status API until the request's final event is stored."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        delay = _POLL_FIRST_S
        while True:
            reply = await self.status(submitted.tenant, submitted.id)
            if reply.result is not None:
                return reply.result
            if deadline is not None and loop.time() + delay > deadline:
                raise FairqTimeout(
                    f"request {submitted.id} (a duplicate submit) did not finish "
                    f"within {timeout_s:g}s; last state {reply.state!r}"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    async def run(
        self, endpoint: str, tenant: str, *, timeout_s: float | None = None, **submit_kwargs: Any
    ) -> DoneEvent:
        """Submit and wait for the end: the DoneEvent, or RequestFailed with the error event.

        `timeout_s` bounds the wait for each event; other keywords go to `submit`.
        """
        submitted = await self.submit(endpoint, tenant, **submit_kwargs)
        async with contextlib.aclosing(self.stream(submitted, timeout_s=timeout_s)) as events:
            async for event in events:
                if isinstance(event, DoneEvent):
                    return event
                if isinstance(event, ErrorEvent):
                    raise RequestFailed(event)
        raise FairqError(f"the events of request {submitted.id} ended without a final event")

    async def stop_listening(self, submitted: Submitted) -> None:
        """Drop the subscription to a request's events when `stream` will not be read to
        the end (a stream never started keeps it until the client closes otherwise)."""
        subscription = submitted._subscription
        if subscription is not None and subscription in self._listening:
            await self._release(subscription)

    async def _listen(self, subject: str) -> Subscription:
        try:
            subscription = await self._nc.subscribe(subject)
        except nats.errors.Error as exc:
            raise ConnectionFailed(f"cannot subscribe to {subject}: {_describe(exc)}") from exc
        self._listening.add(subscription)
        return subscription

    async def _release(self, subscription: Subscription) -> None:
        if subscription not in self._listening:
            return
        self._listening.discard(subscription)
        # A closed or draining connection has dropped its subscriptions already.
        if not (self._nc.is_closed or self._nc.is_draining):
            await subscription.unsubscribe()

    # -- request/reply APIs ---------------------------------------------------------------

    async def status(self, tenant: str, id: str) -> StatusReply:
        """State of a request; `result` is its final event once finished."""
        self._check_tenant(tenant)
        request_id = _checked_id(id)
        return await self._api(
            self._subject(self._subjects.status, tenant), StatusRequest(request_id), STATUS_REPLY
        )

    async def cancel(self, tenant: str, id: str) -> CancelReply:
        """Cancel a request; `cancelled` is False when it is unknown or already finished."""
        self._check_tenant(tenant)
        request_id = _checked_id(id)
        return await self._api(
            self._subject(self._subjects.cancel, tenant), CancelRequest(request_id), CANCEL_REPLY
        )

    async def depth(self) -> DepthReply:
        """Queued and running requests per endpoint, tier and tenant (service users only)."""
        if self._tenant is not None:
            raise InvalidRequest(
                f"{self._subjects.depth} shows every tenant and is for service "
                f"users only; this client is tenant {self._tenant!r}'s"
            )
        return await self._api(self._subjects.depth, DepthRequest(), DEPTH_REPLY)

    @staticmethod
    def _subject(build: Callable[[str], str], tenant: str) -> str:
        try:
            return build(tenant)
        except SubjectError as exc:
            raise InvalidRequest(str(exc)) from exc

    async def _api(self, subject: str, payload: msgspec.Struct, codec: Codec[T]) -> T:
        try:
            msg = await self._nc.request(subject, encode(payload), timeout=self._api_timeout_s)
        except nats.errors.NoRespondersError as exc:
            raise NoDispatcher(f"no dispatcher is running (nobody answers {subject})") from exc
        except nats.errors.TimeoutError as exc:
            raise FairqTimeout(
                f"no answer on {subject} within {self._api_timeout_s:g}s: the "
                "dispatcher is overloaded or unreachable"
            ) from exc
        except nats.errors.Error as exc:
            raise ConnectionFailed(f"cannot call {subject}: {_describe(exc)}") from exc
        try:
            return decode_api_reply(msg.data, codec)
        except WireError as exc:
            raise ApiError(exc.code, f"{subject}: {exc.message}") from exc


class Connecting:
    """What `Client.connect` returns: awaitable, or an async context manager."""

    def __init__(self, open_client: Callable[[], Awaitable[Client]]) -> None:
        self._open = open_client
        self._client: Client | None = None

    def __await__(self) -> Generator[Any, None, Client]:
        return self._open().__await__()

    async def __aenter__(self) -> Client:
        self._client = await self._open()
        return self._client

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._client is not None:
            await self._client.close()


def _tenant_inbox(tenant: str) -> str:
    try:
        return Subjects.inbox_prefix(tenant)
    except SubjectError as exc:
        raise InvalidRequest(str(exc)) from exc


def _checked_id(request_id: str) -> str:
    try:
        return check_request_id(request_id)
    except SubjectError as exc:
        raise InvalidRequest(str(exc)) from exc


def _decode_event(msg: Msg) -> Event:
    try:
        encoding = Encoding.from_content_type(header(msg.headers, HDR_CONTENT_TYPE))
        return EVENT.decode(msg.data, encoding)
    except WireError as exc:
        raise ProtocolError(f"event on {msg.subject}: {exc.message}") from exc
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ProtocolError(f"malformed event on {msg.subject}: {exc}") from exc


def _describe(exc: BaseException) -> str:
    """A one-line description; some nats-py errors have an empty str()."""
    return str(exc) or type(exc).__name__


class _ErrorLog:
    """nats-py's error callback: logs each error and remembers the last one.

    Connection-level failures are raised to the caller or followed by a reconnect, so they
    are only debug noise; anything else (permission violations, slow consumers) is not.
    """

    _ROUTINE = (OSError, TimeoutError, nats.errors.NoServersError, nats.errors.StaleConnectionError)

    def __init__(self) -> None:
        self.last: Exception | None = None

    async def record(self, exc: Exception) -> None:
        self.last = exc
        level = logging.DEBUG if isinstance(exc, self._ROUTINE) else logging.WARNING
        _log.log(level, "nats: %s", _describe(exc))

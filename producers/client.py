"""The async fairq SDK: submit requests, stream their events, query and cancel them.

    async with Client.connect("nats://127.0.0.1:4222") as fq:
        submitted = await fq.submit("chat", "acme", prompt="Hello", max_tokens=16)
        async for event in fq.stream(submitted):
            ...                                   # TokenEvent..., then DoneEvent | ErrorEvent
        done = await fq.run("chat", "acme", prompt="Hi")   # or both in one call

Everything follows the public wire contract (docs/protocol.md): a submit is a JetStream
publish whose PubAck means "stored, will finish with exactly one final event"; events
arrive on the request's `Fq-Reply` subject, which the client subscribes to before it
publishes, so no event can be missed. Every failure is a `FairqError` (producers.errors)
with a clear message.

`Client` ties together the SDK's parts: producers.connection opens the connection,
producers.submission prepares and checks a submit, producers.replies holds the reply
subscriptions and reads their events, producers.api_calls calls the dispatcher's API.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import PubAck

from broker_config.streams import is_backlog_full
from broker_config.subjects import SubjectError, Subjects, message_bytes
from broker_config.wire import (
    CANCEL_REPLY,
    DEPTH_REPLY,
    STATUS_REPLY,
    CancelReply,
    CancelRequest,
    ChatMessage,
    DepthReply,
    DepthRequest,
    DoneEvent,
    Encoding,
    ErrorEvent,
    Event,
    Sampling,
    StatusReply,
    StatusRequest,
    TokenEvent,
)
from producers.api_calls import api_subject, call_api, checked_id
from producers.connection import nats_options, open_connection, tenant_inbox
from producers.errors import (
    BacklogFull,
    ConnectionFailed,
    FairqError,
    FairqTimeout,
    InvalidRequest,
    PublishFailed,
    RequestFailed,
    describe,
)
from producers.replies import ReplySubscriptions, collect_final, next_event, not_listening
from producers.submission import Prepared, Submitted, prepare_submit

__all__ = ["Client", "Connecting"]


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
            tenant_inbox(tenant_inboxes)
        self._nc = nc
        self._subjects = Subjects(prefix)
        self._tenant = tenant_inboxes
        self._publish_timeout_s = publish_timeout_s
        self._api_timeout_s = api_timeout_s
        self._js = nc.jetstream(timeout=publish_timeout_s)
        self._owns_connection = False
        # Reply subscriptions not yet consumed by stream(); removed on close().
        self._replies = ReplySubscriptions(nc)

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
        inbox = tenant_inbox(tenant_inboxes) if tenant_inboxes is not None else inbox_prefix
        options = nats_options(
            url,
            user=user,
            password=password,
            creds=creds,
            nkey=nkey,
            inbox_prefix=inbox,
            connect_timeout_s=connect_timeout_s,
            allow_reconnect=allow_reconnect,
        )

        async def open_client() -> Client:
            client = Client(
                await open_connection(url, options),
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
        return len(self._replies)

    async def close(self) -> None:
        """Drop every reply subscription; close the connection if this client opened it."""
        await self._replies.release_all()
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
        prepared = prepare_submit(
            self._subjects, endpoint, tenant, fields, request_id, reply_subject, encoding
        )
        # Subscribe first: a fast worker may answer before the PubAck is back.
        subscription = None
        if reply_subject is not None:
            subscription = await self._replies.listen(reply_subject)
        try:
            ack = await self._publish(prepared, endpoint, tenant)
        except BaseException:
            if subscription is not None:
                await self._replies.release(subscription)
            raise
        duplicate = bool(ack.duplicate)
        if duplicate and subscription is not None:
            # The stored request answers the first submit's reply subject, not this one.
            await self._replies.release(subscription)
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

    async def _publish(self, prepared: Prepared, endpoint: str, tenant: str) -> PubAck:
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
                f"cannot publish request {prepared.id}: {describe(exc)}"
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
            yield await collect_final(self.status, submitted, timeout_s)
            return
        subscription = submitted._subscription
        if subscription is None or subscription not in self._replies:
            raise not_listening(submitted)
        try:
            while True:
                event = await next_event(subscription, submitted.id, timeout_s)
                if event.id != submitted.id:
                    continue
                yield event
                if not isinstance(event, TokenEvent):
                    return
        finally:
            await self._replies.release(subscription)

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
        if submitted._subscription is not None:
            await self._replies.release(submitted._subscription)

    # -- request/reply APIs ---------------------------------------------------------------

    async def status(self, tenant: str, id: str) -> StatusReply:
        """State of a request; `result` is its final event once finished."""
        self._check_tenant(tenant)
        request_id = checked_id(id)
        subject = api_subject(self._subjects.status, tenant)
        return await call_api(
            self._nc, subject, StatusRequest(request_id), STATUS_REPLY, self._api_timeout_s
        )

    async def cancel(self, tenant: str, id: str) -> CancelReply:
        """Cancel a request; `cancelled` is False when it is unknown or already finished."""
        self._check_tenant(tenant)
        request_id = checked_id(id)
        subject = api_subject(self._subjects.cancel, tenant)
        return await call_api(
            self._nc, subject, CancelRequest(request_id), CANCEL_REPLY, self._api_timeout_s
        )

    async def depth(self) -> DepthReply:
        """Queued and running requests per endpoint, tier and tenant (service users only)."""
        if self._tenant is not None:
            raise InvalidRequest(
                f"{self._subjects.depth} shows every tenant and is for service "
                f"users only; this client is tenant {self._tenant!r}'s"
            )
        return await call_api(
            self._nc, self._subjects.depth, DepthRequest(), DEPTH_REPLY, self._api_timeout_s
        )


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

"""The front's HTTP side: a Starlette app whose requests go through the fairq SDK.

Every request is published to its tenant's subject exactly as any client's is, so
admission, fairness and limits apply unchanged. A streamed answer starts (status 200)
only with the request's first event, so an error before any output gets its own status;
an error after output arrives as an `error` object in the stream. A client that leaves
before its answer is complete cancels its request: the cancel runs in a task of its own,
since the handler that notices may itself be being cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from broker_config.config import Config, Endpoint, EndpointKind
from broker_config.subjects import Subjects
from broker_config.wire import DoneEvent, ErrorCode, ErrorEvent, Event, TokenEvent, TokenLogprob
from producers.client import Client
from producers.errors import BacklogFull, FairqError, FairqTimeout, InvalidRequest
from producers.openai_front import openai_wire as ow
from producers.openai_front.errors import FrontError, error_for, event_error, submit_error
from producers.openai_front.keys import KeyRing
from producers.submission import Submitted

log = logging.getLogger("fairq.front")

T = TypeVar("T")
# How often a request waiting for its answer looks whether its client is still there.
DISCONNECT_POLL_S = 0.25
CANCEL_TIMEOUT_S = 5.0
# Embedding inputs submitted at once for one HTTP request.
EMBED_IN_FLIGHT = 64


class Front:
    """The routes, over one SDK client that the caller owns."""

    def __init__(self, client: Client, config: Config, keys: KeyRing) -> None:
        self.client = client
        self.config = config
        self.options = config.front
        self.keys = keys
        # Cancels of requests whose clients left, until they are done.
        self._cancels: set[asyncio.Task[None]] = set()
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                # `path`: a name with a slash is an unknown model too, not an unknown route.
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            ],
            exception_handlers={FrontError: _error_response, HTTPException: _http_error},
        )

    # -- routes --------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """For load balancers and probes (no key): 200 while the front can reach NATS."""
        nc = self.client.connection
        if nc.is_draining:  # is_connected too, but the front is stopping
            state = "draining"
        elif nc.is_connected:
            return JSONResponse({"status": "ok", "nats": "connected"})
        else:
            state = "closed" if nc.is_closed else "reconnecting"
        return JSONResponse({"status": "unavailable", "nats": state}, status_code=503)

    async def models(self, request: Request) -> Response:
        self._tenant(request)
        return JSONResponse(
            {"object": "list", "data": [_model(name) for name in sorted(self.config.endpoints)]}
        )

    async def model(self, request: Request) -> Response:
        self._tenant(request)
        name = request.path_params["model"]
        self._spec(name)
        return JSONResponse(_model(name))

    async def chat(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body: ow.ChatRequest = ow.decode_body(await self._body(request), ow.ChatRequest)
        fields = ow.chat_submit(body, self._endpoint(body.model, "generate").max_tokens_cap)
        return await self._generate(request, tenant, body, fields, "chatcmpl")

    async def completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body: ow.CompletionRequest = ow.decode_body(await self._body(request), ow.CompletionRequest)
        fields = ow.completion_submit(body, self._endpoint(body.model, "generate").max_tokens_cap)
        return await self._generate(request, tenant, body, fields, "cmpl")

    async def embeddings(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body: ow.EmbeddingRequest = ow.decode_body(await self._body(request), ow.EmbeddingRequest)
        inputs = ow.embedding_inputs(body)
        self._endpoint(body.model, "embed")
        fields = [
            {"prompt": text, "max_tokens": 1, **ow.fairq_fields(body.fairq)} for text in inputs
        ]
        submitted: list[Submitted] = []
        dones = await self._until_disconnect(
            request, self._embed_all(body, tenant, fields, submitted), submitted
        )
        return JSONResponse(ow.embedding_list(body.model, dones, body.encoding_format))

    # -- requests ------------------------------------------------------------------------

    def _tenant(self, request: Request) -> str:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        tenant = self.keys.tenant(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise FrontError(
                401,
                "missing or unknown API key (send Authorization: Bearer KEY)",
                type_="authentication_error",
                code="invalid_api_key",
            )
        return tenant

    async def _body(self, request: Request) -> bytes:
        """The body, refused (413) past the size limit and (408) past the read timeout."""
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.options.request_read_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise FrontError(
                408,
                f"the request body did not arrive within {self.options.request_read_timeout_s:g}s",
            ) from None
        return b"".join(chunks)

    def _spec(self, model: str) -> Endpoint:
        spec = self.config.endpoints.get(model)
        if spec is None:
            raise FrontError(
                404,
                f"the model {model!r} does not exist (GET /v1/models lists them)",
                param="model",
                code="model_not_found",
            )
        return spec

    def _endpoint(self, model: str, kind: EndpointKind) -> Endpoint:
        """The model's endpoint, which must be of this kind."""
        spec = self._spec(model)
        if spec.kind != kind:
            article, route = (
                ("an", "/v1/embeddings") if spec.kind == "embed" else ("a", "/v1/chat/completions")
            )
            raise FrontError(
                400,
                f"the model {model!r} is {article} {spec.kind} endpoint: use {route}",
                param="model",
                code="wrong_model_kind",
            )
        return spec

    async def _submit(self, body: Any, tenant: str, fields: dict[str, Any]) -> Submitted:
        """`fields` submitted to `body`'s model for `tenant`; a refusal names the
        parameter of `body` that it is about."""
        endpoint = body.model
        # With per-tenant broker users the dispatcher takes only replies in the tenant's
        # inbox; the front's user may listen there for the tenants it serves.
        reply: bool | str = (
            f"{Subjects.inbox_prefix(tenant)}.{uuid.uuid4().hex}"
            if self.config.dispatcher.tenant_inboxes
            else True
        )
        try:
            return await self.client.submit(endpoint, tenant, reply=reply, **fields)
        except InvalidRequest as exc:
            raise submit_error(exc, body.param_names()) from exc
        except BacklogFull as exc:
            raise error_for(ErrorCode.OVERLOADED, str(exc), 1.0) from exc
        except FairqTimeout as exc:  # also what a broker user refused this tenant sees
            raise FrontError(
                503,
                f"the broker did not take the request of tenant {tenant!r} on {endpoint!r}: {exc}",
                type_="server_error",
                retry_after_s=1.0,
            ) from exc
        except FairqError as exc:  # broker unreachable or refusing: not the client's fault
            raise FrontError(
                503, f"fairq is unavailable: {exc}", type_="server_error", retry_after_s=1.0
            ) from exc

    async def _generate(
        self, request: Request, tenant: str, body: Any, fields: dict[str, Any], prefix: str
    ) -> Response:
        submitted = await self._submit(body, tenant, fields)
        ids = ow.ResponseIds(prefix, submitted.id, body.model)
        chat = prefix == "chatcmpl"
        if not body.stream:
            done, logprobs = await self._until_disconnect(
                request, self._final(submitted, body), [submitted]
            )
            return JSONResponse(
                ow.chat_completion(ids, done, logprobs)
                if chat
                else ow.text_completion(ids, done, logprobs)
            )
        events = self.client.stream(submitted, timeout_s=self.options.event_timeout_s)
        first = await self._until_disconnect(request, self._next(events, submitted), [submitted])
        if isinstance(first, ErrorEvent):
            raise event_error(first, body.param_names())
        usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = ow.StreamChunks(ids, chat=chat, include_usage=usage)
        return _EventStream(
            self._sse(chunks, first, events, submitted), chunks, lambda: self._abandon([submitted])
        )

    async def _sse(
        self,
        chunks: ow.StreamChunks,
        first: Event,
        events: AsyncIterator[Event],
        submitted: Submitted,
    ) -> AsyncIterator[str]:
        """The stream's server-sent events. A failure of the front's own (the events
        stopped coming, NATS was lost) ends it with an `error` object, and the request is
        cancelled by `_EventStream`, since nobody will read the rest."""
        for chunk in chunks.start():
            yield _sse(chunk)
        event = first
        while True:
            for chunk in chunks.of(event):
                yield _sse(chunk)
            if chunks.finished:
                break
            try:
                event = await self._next(events, submitted)
            except FrontError as exc:
                yield _sse(exc.body())
                break
        yield "data: [DONE]\n\n"

    async def _next(self, events: AsyncIterator[Event], submitted: Submitted) -> Event:
        try:
            return await anext(events)
        except FairqTimeout as exc:
            raise error_for(ErrorCode.DEADLINE_EXCEEDED, str(exc)) from exc
        except StopAsyncIteration:
            raise FrontError(
                500,
                f"the events of request {submitted.id} ended without a final event",
                type_="server_error",
            ) from None
        except FairqError as exc:
            raise FrontError(503, str(exc), type_="server_error") from exc

    async def _final(
        self, submitted: Submitted, body: Any
    ) -> tuple[DoneEvent, list[TokenLogprob] | None]:
        """The request's done event and its tokens' logprobs (None if not asked for); its
        error event as a FrontError about a parameter of `body`. Tokens of a second run
        (from seq 0 again) are skipped."""
        events = self.client.stream(submitted, timeout_s=self.options.event_timeout_s)
        logprobs: list[TokenLogprob] | None = None
        next_seq = 0
        try:
            while True:
                event = await self._next(events, submitted)
                if isinstance(event, TokenEvent) and event.seq >= next_seq:
                    next_seq = event.seq + 1
                    if event.logprobs is not None:
                        logprobs = logprobs or []
                        logprobs.extend(event.logprobs)
                elif isinstance(event, DoneEvent):
                    return event, logprobs
                elif isinstance(event, ErrorEvent):
                    raise event_error(event, body.param_names())
        finally:
            await _close(events)

    async def _embed_all(
        self,
        body: ow.EmbeddingRequest,
        tenant: str,
        fields: list[dict[str, Any]],
        submitted: list[Submitted],
    ) -> list[DoneEvent]:
        """Every input's done event, in order; the requests are listed in `submitted` as
        they go out. If one fails, the others are cancelled and its error is raised."""
        slots = asyncio.Semaphore(EMBED_IN_FLIGHT)

        async def one(request: dict[str, Any]) -> DoneEvent:
            async with slots:
                submitted.append(await self._submit(body, tenant, request))
                done, _ = await self._final(submitted[-1], body)
                return done

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(request)) for request in fields]
        except BaseExceptionGroup as failed:
            self._abandon(submitted)
            first = next((e for e in failed.exceptions if isinstance(e, FrontError)), None)
            if first is None:
                raise
            raise first from None
        return [task.result() for task in tasks]

    async def _until_disconnect(
        self, request: Request, work: Awaitable[T], submitted: Sequence[Submitted]
    ) -> T:
        """`work`'s result; if the client leaves first, its requests are cancelled."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    break
            if task.done():
                return task.result()
        finally:
            if not task.done():  # the client left, or this handler was cancelled
                task.cancel()
                self._abandon(submitted)
        # Nobody reads this answer; 499 is what proxies log for it.
        raise FrontError(499, "the client closed the connection", type_="cancelled")

    def _abandon(self, submitted: Sequence[Submitted]) -> None:
        """Cancel requests nobody will read, in a task of their own."""
        task = asyncio.get_running_loop().create_task(self._cancel_all(list(submitted)))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel_all(self, submitted: list[Submitted]) -> None:
        for one in submitted:
            await self.client.stop_listening(one)
            try:
                async with asyncio.timeout(CANCEL_TIMEOUT_S):
                    await self.client.cancel(one.tenant, one.id)
            except (FairqError, TimeoutError) as exc:
                log.warning("cancelling request %s of %s failed: %s", one.id, one.tenant, exc)


class _EventStream(StreamingResponse):
    """A server-sent event stream whose request is abandoned unless it ran to its final
    event: also when it is cancelled before its first chunk went out."""

    def __init__(
        self, content: AsyncIterator[str], chunks: ow.StreamChunks, abandon: Callable[[], None]
    ) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._chunks = chunks
        self._abandon = abandon

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._chunks.finished:
                self._abandon()


async def _close(events: AsyncIterator[Event]) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


def _model(name: str) -> dict[str, Any]:
    """An endpoint as OpenAI's model object."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "fairq"}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _too_large(limit: int) -> FrontError:
    return FrontError(
        413, f"the request body is over the front's limit of {limit} bytes ([front] max_body_bytes)"
    )


async def _error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, FrontError)
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, wrong method) in OpenAI's error body."""
    assert isinstance(exc, HTTPException)
    return await _error_response(request, FrontError(exc.status_code, str(exc.detail)))

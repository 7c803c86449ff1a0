"""The front's HTTP side: a Starlette app whose requests go through the fairq SDK.

Every request is published to its tenant's subject exactly as any client's is, so
admission, fairness and limits apply unchanged. A streamed answer starts (status 200)
only with the request's first event, so an error before any output gets its own status;
an error after output arrives as an `error` object in the stream. A client that leaves
before its answer is complete cancels its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from broker_config.config import Config
from broker_config.subjects import Subjects
from broker_config.wire import DoneEvent, ErrorCode, ErrorEvent, Event
from producers.client import (
    BacklogFull,
    Client,
    FairqError,
    FairqTimeout,
    InvalidRequest,
    Submitted,
)
from producers.openai_front import openai_wire as ow
from producers.openai_front.keys import KeyRing

log = logging.getLogger("fairq.front")

T = TypeVar("T")
# How often a request waiting for its answer looks whether its client is still there.
DISCONNECT_POLL_S = 0.25
CANCEL_TIMEOUT_S = 5.0


class Front:
    """The routes, over one SDK client that the caller owns."""

    def __init__(self, client: Client, config: Config, keys: KeyRing) -> None:
        self.client = client
        self.config = config
        self.options = config.front
        self.keys = keys
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
        ], exception_handlers={ow.FrontError: _error_response})

    # -- routes --------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self._tenant(request)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "fairq"}
            for name in sorted(self.config.endpoints)]})

    async def chat(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body: ow.ChatRequest = ow.decode_body(await self._body(request), ow.ChatRequest)
        return await self._generate(request, tenant, body, ow.chat_submit(body), "chatcmpl")

    async def completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body: ow.CompletionRequest = ow.decode_body(await self._body(request),
                                                    ow.CompletionRequest)
        return await self._generate(request, tenant, body, ow.completion_submit(body), "cmpl")

    async def embeddings(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body: ow.EmbeddingRequest = ow.decode_body(await self._body(request),
                                                   ow.EmbeddingRequest)
        inputs = ow.embedding_inputs(body)
        endpoint = self._endpoint(body.model)
        extensions = ow.fairq_fields(body.fairq)
        submitted = [await self._submit(endpoint, tenant, {"prompt": text, "max_tokens": 1,
                                                           **extensions})
                     for text in inputs]
        dones = await self._until_disconnect(request, asyncio.gather(
            *(self._final(s) for s in submitted)), submitted)
        return JSONResponse(ow.embedding_list(body.model, dones, body.encoding_format))

    # -- requests ------------------------------------------------------------------------

    def _tenant(self, request: Request) -> str:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        tenant = self.keys.tenant(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise ow.FrontError(401, "missing or unknown API key (send Authorization: Bearer "
                                "KEY)", type_="authentication_error", code="invalid_api_key")
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
            raise ow.FrontError(408, "the request body did not arrive within "
                                f"{self.options.request_read_timeout_s:g}s") from None
        return b"".join(chunks)

    def _endpoint(self, model: str) -> str:
        if model not in self.config.endpoints:
            raise ow.FrontError(404, f"the model {model!r} does not exist (GET /v1/models "
                                "lists them)", param="model", code="model_not_found")
        return model

    async def _submit(self, endpoint: str, tenant: str, fields: dict[str, Any]) -> Submitted:
        # With per-tenant broker users the dispatcher takes only replies in the tenant's
        # inbox; the front's user may listen there for the tenants it serves.
        reply: bool | str = (f"{Subjects.inbox_prefix(tenant)}.{uuid.uuid4().hex}"
                             if self.config.dispatcher.tenant_inboxes else True)
        try:
            return await self.client.submit(endpoint, tenant, reply=reply, **fields)
        except InvalidRequest as exc:
            raise ow.FrontError(400, str(exc)) from exc
        except BacklogFull as exc:
            raise ow.error_for(ErrorCode.OVERLOADED, str(exc), 1.0) from exc
        except FairqTimeout as exc:  # also what a broker user refused this tenant sees
            raise ow.FrontError(503, f"the broker did not take the request of tenant "
                                f"{tenant!r} on {endpoint!r}: {exc}", type_="server_error",
                                retry_after_s=1.0) from exc
        except FairqError as exc:  # broker unreachable or refusing: not the client's fault
            raise ow.FrontError(503, f"fairq is unavailable: {exc}", type_="server_error",
                                retry_after_s=1.0) from exc

    async def _generate(self, request: Request, tenant: str, body: Any,
                        fields: dict[str, Any], prefix: str) -> Response:
        submitted = await self._submit(self._endpoint(body.model), tenant, fields)
        ids = ow.ResponseIds(prefix, submitted.id, body.model)
        chat = prefix == "chatcmpl"
        if not body.stream:
            done = await self._until_disconnect(request, self._final(submitted), [submitted])
            return JSONResponse(ow.chat_completion(ids, done) if chat
                                else ow.text_completion(ids, done))
        events = self.client.stream(submitted, timeout_s=self.options.event_timeout_s)
        first = await self._until_disconnect(request, self._next(events, submitted),
                                             [submitted], events)
        if isinstance(first, ErrorEvent):
            raise ow.error_for(first.code, first.message, first.retry_after_s)
        usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = ow.StreamChunks(ids, chat=chat, include_usage=usage)
        return StreamingResponse(self._sse(chunks, first, events, submitted),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _sse(self, chunks: ow.StreamChunks, first: Event,
                   events: AsyncIterator[Event], submitted: Submitted) -> AsyncIterator[str]:
        finished = False
        try:
            yield _sse(chunks.start())
            event: Event | None = first
            while event is not None:
                if isinstance(event, ErrorEvent):
                    finished = True
                    yield _sse(ow.error_for(event.code, event.message).body())
                    break
                for chunk in chunks.of(event):
                    yield _sse(chunk)
                if isinstance(event, DoneEvent):
                    finished = True
                    break
                event = await self._next(events, submitted)
            yield "data: [DONE]\n\n"
        finally:
            # Starlette cancels this generator when the client goes: the request goes too.
            await _close(events)
            if not finished:
                await self._cancel(submitted)

    async def _next(self, events: AsyncIterator[Event], submitted: Submitted) -> Event:
        try:
            return await anext(events)
        except FairqTimeout as exc:
            raise ow.error_for(ErrorCode.DEADLINE_EXCEEDED, str(exc)) from exc
        except StopAsyncIteration:
            raise ow.FrontError(500, f"the events of request {submitted.id} ended without a "
                                "final event", type_="server_error") from None
        except FairqError as exc:
            raise ow.FrontError(503, str(exc), type_="server_error") from exc

    async def _final(self, submitted: Submitted) -> DoneEvent:
        """The request's done event; its error event as a FrontError."""
        events = self.client.stream(submitted, timeout_s=self.options.event_timeout_s)
        try:
            while True:
                event = await self._next(events, submitted)
                if isinstance(event, DoneEvent):
                    return event
                if isinstance(event, ErrorEvent):
                    raise ow.error_for(event.code, event.message, event.retry_after_s)
        finally:
            await _close(events)

    async def _until_disconnect(self, request: Request, work: Awaitable[T],
                                submitted: list[Submitted],
                                events: AsyncIterator[Event] | None = None) -> T:
        """`work`'s result; if the client leaves first, its requests are cancelled."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    break
        except BaseException:
            task.cancel()
            raise
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if events is not None:
            await _close(events)
        for one in submitted:
            await self._cancel(one)
        # Nobody reads this answer; 499 is what proxies log for it.
        raise ow.FrontError(499, "the client closed the connection", type_="cancelled")

    async def _cancel(self, submitted: Submitted) -> None:
        try:
            async with asyncio.timeout(CANCEL_TIMEOUT_S):
                await asyncio.shield(self.client.cancel(submitted.tenant, submitted.id))
        except (FairqError, TimeoutError) as exc:
            log.warning("cancelling request %s of %s failed: %s", submitted.id,
                        submitted.tenant, exc)


async def _close(events: AsyncIterator[Event]) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _too_large(limit: int) -> ow.FrontError:
    return ow.FrontError(413, f"the request body is over the front's limit of {limit} bytes "
                         "([front] max_body_bytes)")


async def _error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ow.FrontError)
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

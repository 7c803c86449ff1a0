"""Every message fairq puts on the wire, as msgspec Structs, with codecs built once.

Public messages (firm, see docs/protocol.md): the submitted request, the events
(`token`, `done`, `error`), and the status/cancel/depth API bodies. Internal messages
(batches, aborts, heartbeats, completions, stored results) are in wire_internal.py and
may change between versions.

Public messages travel as JSON, or as msgpack when the request said
`Content-Type: application/msgpack`; internal ones use whichever encoding the service picks.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Generic, Literal, TypeVar

import msgspec

from broker_config.subjects import (
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_MSGPACK,
    HDR_CONTENT_TYPE,
    HDR_MSG_ID,
    HDR_REPLY,
    REQUEST_ID_PATTERN,
    SubjectError,
    Subjects,
    is_request_id,
)
from costmodel.units import Usage

INT32_MAX = 2**31 - 1
RequestId = Annotated[str, msgspec.Meta(pattern=f"^{REQUEST_ID_PATTERN}$")]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]


class ErrorCode(enum.StrEnum):
    """The `code` of an error event: exactly the contract's list."""

    INVALID_REQUEST = "invalid_request"
    UNKNOWN_ENDPOINT = "unknown_endpoint"
    UNKNOWN_TENANT = "unknown_tenant"
    RATE_LIMITED = "rate_limited"
    QUOTA_EXCEEDED = "quota_exceeded"
    OVERLOADED = "overloaded"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"


class Encoding(enum.Enum):
    """Body encoding of a request and of the events that answer it."""

    JSON = "json"
    MSGPACK = "msgpack"

    @property
    def content_type(self) -> str:
        return CONTENT_TYPE_MSGPACK if self is Encoding.MSGPACK else CONTENT_TYPE_JSON

    @classmethod
    def from_content_type(cls, value: str | None) -> Encoding:
        """The encoding a `Content-Type` header names; no header means JSON."""
        if value is None or not value.strip():
            return cls.JSON
        media_type = value.split(";", 1)[0].strip().lower()
        if media_type == CONTENT_TYPE_JSON:
            return cls.JSON
        if media_type == CONTENT_TYPE_MSGPACK:
            return cls.MSGPACK
        raise WireError(
            ErrorCode.INVALID_REQUEST,
            f"unsupported {HDR_CONTENT_TYPE} {value!r}: use {CONTENT_TYPE_JSON} "
            f"(the default) or {CONTENT_TYPE_MSGPACK}",
        )


class WireError(ValueError):
    """A message that breaks the contract, with the error code to answer it with.

    The context fields carry what could still be read from a bad request, so the
    caller can address its error event: the id, the reply subject and the encoding.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        request_id: str | None = None,
        reply: str | None = None,
        encoding: Encoding = Encoding.JSON,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.reply = reply
        self.encoding = encoding

    def to_event(self) -> ErrorEvent:
        return ErrorEvent(id=self.request_id or "", code=self.code, message=self.message)


# -- the submitted request -----------------------------------------------------------------


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    role: str
    content: str


Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
# Each stop string, and how many: OpenAI's API allows 4; engines take more.
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
MAX_STOP_STRINGS = 16
# Alternatives per token a request may ask logprobs for (vLLM's and OpenAI's maximum).
MAX_TOP_LOGPROBS = 20


class Sampling(
    msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True, kw_only=True
):
    """How to sample the output; every field optional, an absent one is the engine's
    default. Ranges are OpenAI's where it has the parameter.

    `logprobs`: how many alternatives to report beside each generated token's own log
    probability (0: the token's only). `n` is 1: events carry one sequence.
    """

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] | None = None  # 0: off
    min_p: Probability | None = None
    stop: Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)] = []
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1


class SubmitRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """The body of a submit. Tenant and endpoint come from the subject, never from here.

    After `decode_request`, `id` is always set and exactly one of `prompt` and `messages`.
    `max_tokens` None means the endpoint's own cap.
    """

    id: RequestId | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)] | None = None
    priority: Annotated[int, msgspec.Meta(ge=-INT32_MAX - 1, le=INT32_MAX)] = 0
    deadline: float | None = None
    session: str | None = None
    input_tokens: Count | None = None
    images: list[str] = []
    metadata: dict[str, str] = {}
    sampling: Sampling | None = None


# -- events --------------------------------------------------------------------------------


class Timings(msgspec.Struct, frozen=True):
    """Seconds: queued from submit to dispatch, ttft and total from submit.

    `ttft_s` is null when no token was produced.
    """

    queued_s: float
    ttft_s: float | None
    total_s: float


class TopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True):
    """One generated token, its log probability, and the most likely alternatives (as
    many as the request's `sampling.logprobs`)."""

    token: str
    logprob: float
    top: list[TopLogprob] = []


class TokenEvent(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="type", tag="token"):
    """`logprobs` (one entry per token in `text`) only when the request asked for them."""

    id: str
    seq: int
    text: str
    logprobs: list[TokenLogprob] | None = None


FinishReason = Literal["stop", "length"]


class DoneEvent(msgspec.Struct, frozen=True, tag_field="type", tag="done"):
    """`finish_reason`: "stop" (the model ended, or a stop string), "length" (`max_tokens`),
    null from an engine that does not say. `embedding`: the vector of an embedding
    endpoint, else null. Logprobs travel on the token events only: a long output's would
    make the done event, which is also stored, larger than a message may be."""

    id: str
    seq: int
    text: str
    usage: Usage
    timings: Timings
    metadata: dict[str, str] = {}
    finish_reason: FinishReason | None = None
    embedding: list[float] | None = None


class ErrorEvent(msgspec.Struct, frozen=True, tag_field="type", tag="error"):
    """`retry_after_s` is always present, null when there is no retry hint."""

    id: str
    code: ErrorCode
    message: str
    retry_after_s: float | None = None


Event = TokenEvent | DoneEvent | ErrorEvent
FinalEvent = DoneEvent | ErrorEvent


# -- request/reply APIs --------------------------------------------------------------------


class StatusRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    id: RequestId


RequestState = Literal["queued", "running", "done", "failed", "unknown"]


class StatusReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """`position` only while queued; `result` (the final event) only once finished."""

    id: str
    state: RequestState
    position: int | None = None
    result: FinalEvent | None = None


class CancelRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    id: RequestId


class CancelReply(msgspec.Struct, frozen=True):
    id: str
    cancelled: bool


class DepthRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """`{}`: the depth API takes no parameters (unknown fields are refused)."""


class DepthEntry(msgspec.Struct, frozen=True):
    """One queue: how many wait, how many run, how long the oldest has waited, and how
    many requests admission let in and turned away since the dispatcher started."""

    endpoint: str
    tier: str
    tenant: str
    queued: int
    running: int
    oldest_wait_s: float
    admitted: int = 0
    rejected: int = 0


class DepthReply(msgspec.Struct, frozen=True):
    queues: list[DepthEntry] = []


# -- codecs --------------------------------------------------------------------------------

T = TypeVar("T")

_JSON_ENCODER = msgspec.json.Encoder()
_MSGPACK_ENCODER = msgspec.msgpack.Encoder()


def encode(message: object, encoding: Encoding = Encoding.JSON) -> bytes:
    if encoding is Encoding.MSGPACK:
        return _MSGPACK_ENCODER.encode(message)
    return _JSON_ENCODER.encode(message)


class Codec(Generic[T]):
    """JSON and msgpack decoders for one message type, built once."""

    def __init__(self, type_: type[T]) -> None:
        self._json = msgspec.json.Decoder(type_)
        self._msgpack = msgspec.msgpack.Decoder(type_)

    def decode(self, data: bytes, encoding: Encoding = Encoding.JSON) -> T:
        """The message, or msgspec.DecodeError / msgspec.ValidationError."""
        decoder = self._msgpack if encoding is Encoding.MSGPACK else self._json
        return decoder.decode(data)

    def decode_or_invalid(self, data: bytes, encoding: Encoding = Encoding.JSON) -> T:
        """The message, or a WireError `invalid_request` with msgspec's explanation."""
        try:
            return self.decode(data, encoding)
        except msgspec.ValidationError as exc:  # a subclass of DecodeError: test it first
            raise WireError(
                ErrorCode.INVALID_REQUEST, f"invalid body: {exc}", encoding=encoding
            ) from exc
        except msgspec.DecodeError as exc:
            raise WireError(
                ErrorCode.INVALID_REQUEST,
                f"body is not valid {encoding.value}: {exc}",
                encoding=encoding,
            ) from exc


SUBMIT_REQUEST = Codec(SubmitRequest)
EVENT = Codec(Event)
STATUS_REQUEST = Codec(StatusRequest)
STATUS_REPLY = Codec(StatusReply)
CANCEL_REQUEST = Codec(CancelRequest)
CANCEL_REPLY = Codec(CancelReply)
DEPTH_REQUEST = Codec(DepthRequest)
DEPTH_REPLY = Codec(DepthReply)


class _TypeProbe(msgspec.Struct):
    type: str | None = None


_TYPE_PROBE = Codec(_TypeProbe)
_ERROR_EVENT = Codec(ErrorEvent)


def decode_api_reply(data: bytes, codec: Codec[T]) -> T:
    """An API reply; an error object in its place (a rejected API request) is raised.

    Raises WireError with the error's code, or `internal` for a reply that is neither.
    """
    try:
        if _TYPE_PROBE.decode(data).type == "error":
            error = _ERROR_EVENT.decode(data)
            raise WireError(error.code, error.message, request_id=error.id or None)
        return codec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(ErrorCode.INTERNAL, f"malformed API reply: {exc}") from exc


# -- submit validation ---------------------------------------------------------------------


def header(headers: Mapping[str, str] | None, name: str) -> str | None:
    """A header's value; exact name first, then case-insensitive (clients differ in case)."""
    if not headers:
        return None
    if name in headers:
        return headers[name]
    lowered = name.lower()
    return next((v for k, v in headers.items() if k.lower() == lowered), None)


def decode_request(body: bytes, headers: Mapping[str, str] | None) -> SubmitRequest:
    """Decode and validate a submitted body against everything the contract says.

    Returns the request with `id` filled in (from `Nats-Msg-Id` when the body has none).
    Raises WireError `invalid_request`, with as much context as could be read.
    """
    header_id = header(headers, HDR_MSG_ID)
    encoding = Encoding.JSON
    try:
        encoding = Encoding.from_content_type(header(headers, HDR_CONTENT_TYPE))
        request = SUBMIT_REQUEST.decode_or_invalid(body, encoding)
        return _check_request(request, header_id)
    except WireError as exc:
        # The header id is the client's key for the request (and JetStream's), so an
        # error is filed under it whenever it is usable.
        exc.request_id = _valid_id(header_id) or exc.request_id
        exc.encoding = encoding
        raise


def _valid_id(value: str | None) -> str | None:
    return value if value is not None and is_request_id(value) else None


def _check_request(request: SubmitRequest, header_id: str | None) -> SubmitRequest:
    def invalid(message: str) -> WireError:
        return WireError(ErrorCode.INVALID_REQUEST, message, request_id=request.id)

    if header_id is not None and not is_request_id(header_id):
        raise invalid(
            f"invalid {HDR_MSG_ID} header {header_id[:200]!r}: must match {REQUEST_ID_PATTERN}"
        )
    if header_id is not None and request.id is not None and request.id != header_id:
        raise invalid(
            f"body `id` {request.id!r} does not match the {HDR_MSG_ID} header {header_id!r}"
        )
    if header_id is None and request.id is None:
        raise invalid(f"missing request id: set the {HDR_MSG_ID} header")
    if (request.prompt is None) == (request.messages is None):
        both = "both" if request.prompt is not None else "neither"
        raise invalid(f"exactly one of `prompt` and `messages` is required, got {both}")
    if request.deadline is not None and not math.isfinite(request.deadline):
        raise invalid(f"`deadline` must be a finite unix time in seconds, got {request.deadline}")
    if request.id is None:
        request = msgspec.structs.replace(request, id=header_id)
    return request


@dataclass(frozen=True, slots=True)
class Submission:
    """A validated submit: where it came from, what it asks, where its events go."""

    endpoint: str
    tenant: str
    id: str
    request: SubmitRequest
    reply: str | None
    encoding: Encoding


def parse_submission(
    subject: str,
    body: bytes,
    headers: Mapping[str, str] | None,
    subjects: Subjects,
    *,
    tenant_inboxes: bool = False,
) -> Submission:
    """Subject, headers and body of a submitted message, all checked.

    `tenant_inboxes`: the broker runs with per-tenant users, so `Fq-Reply` must lie in
    the tenant's own inbox. Raises WireError `invalid_request`; its context fields say
    where an error event may still be sent (never to an unchecked reply subject).
    """
    known_id = _valid_id(header(headers, HDR_MSG_ID))
    reply = header(headers, HDR_REPLY)
    try:
        endpoint, tenant = subjects.parse_request(subject)
    except SubjectError as exc:
        error = WireError(ErrorCode.INVALID_REQUEST, str(exc), request_id=known_id)
        # Without per-tenant inboxes the reply's check needs no tenant: answer there.
        if reply is not None and not tenant_inboxes:
            with contextlib.suppress(SubjectError):
                error.reply = subjects.check_reply(reply, None)
        raise error from exc
    if reply is not None:
        try:
            subjects.check_reply(reply, tenant, tenant_inboxes=tenant_inboxes)
        except SubjectError as exc:
            raise WireError(ErrorCode.INVALID_REQUEST, str(exc), request_id=known_id) from exc
    try:
        request = decode_request(body, headers)
    except WireError as exc:
        exc.reply = reply
        raise
    encoding = Encoding.from_content_type(header(headers, HDR_CONTENT_TYPE))
    # decode_request always fills the id; `or ""` only narrows the type.
    return Submission(endpoint, tenant, request.id or "", request, reply, encoding)

"""Preparing a submit: its subject, body and headers, checked exactly as fairq will check
them, so a request that breaks the wire contract fails here (`InvalidRequest`) before
anything is sent; and `Submitted`, what `Client.submit` returns once the broker stored it.

    prepared = prepare_submit(Subjects(), "chat", "acme", {"prompt": "Hi"}, request_id,
                              reply="_INBOX.x", encoding=Encoding.JSON)
    await js.publish(prepared.subject, prepared.body, headers=prepared.headers)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nats.aio.subscription import Subscription

from broker_config.subjects import (
    HDR_CONTENT_TYPE,
    HDR_MSG_ID,
    HDR_REPLY,
    SubjectError,
    Subjects,
    check_request_id,
)
from broker_config.wire import Encoding, WireError, decode_request, encode
from producers.errors import InvalidRequest

__all__ = ["Prepared", "Submitted", "prepare_submit"]


@dataclass(frozen=True, slots=True)
class Submitted:
    """A request the broker stored (or had already stored: `duplicate`).

    `reply_subject` is where its events go (None: submitted without one). For a duplicate,
    the events went to the first submit's reply subject, so `Client.stream` collects the
    final event through the status API instead. `_subscription` is the client's own: its
    subscription to `reply_subject`, which `Client.stream` reads.
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
class Prepared:
    """A submit ready to publish: its canonical body (validated, defaults omitted)."""

    subject: str
    body: bytes
    headers: dict[str, str]
    id: str


def prepare_submit(
    subjects: Subjects,
    endpoint: str,
    tenant: str,
    fields: Mapping[str, Any],
    request_id: str,
    reply: str | None,
    encoding: Encoding,
) -> Prepared:
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
    return Prepared(subject, encode(request, encoding), headers, request_id)

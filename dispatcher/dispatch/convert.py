"""The one place where the scheduling core's types meet the wire's.

    Submission --to_request--> core Request --to_batch_item--> BatchItem
    BatchItems --encode_batches--> batch messages, each within the broker's largest message
    core Decision (a rejection) --to_error_event--> ErrorEvent (to the client)

Values that are the same on both sides have one definition and need no conversion:
`Capacity` (engine limits, heartbeats, batch room), `Usage` (a worker's completion, the
done event, the scheduler's charge correction), `ChatMessage`.
"""

from __future__ import annotations

from broker_config import wire, wire_internal
from broker_config.subjects import HDR_CONTENT_TYPE, message_bytes
from costmodel.units import approx_tokens
from dispatcher.core.placement import DEFAULT_AFFINITY_BLOCK_TOKENS, affinity_key
from dispatcher.core.types import Decision, Request


def prompt_text(body: wire.SubmitRequest) -> str:
    """The text a request's input tokens are counted from when the client gave no count."""
    if body.prompt is not None:
        return body.prompt
    return "".join(m.content for m in body.messages or ())


def to_request(
    submission: wire.Submission,
    received_at: float,
    max_tokens_cap: int,
    payload: object,
    affinity_block_tokens: int = DEFAULT_AFFINITY_BLOCK_TOKENS,
    counted_input: int | None = None,
) -> Request:
    """The core's view of a submitted request. `max_tokens_cap` stands in for an absent
    `max_tokens` (the scheduler then caps either to the endpoint's own limit).
    `counted_input`: the input's tokens as the dispatcher counted them with a tokenizer,
    over any count the client declared. Without one a declared count stands, but never
    below the rough count of the text (`approx_tokens`): a client cannot get a long
    prompt admitted as a short one (the engine's real count settles the rest)."""
    body = submission.request
    text = prompt_text(body)
    input_tokens = (
        counted_input
        if counted_input is not None
        else max(body.input_tokens or 0, approx_tokens(text))
    )
    # The leading block: a chat's system prompt and first message, or the prompt.
    leading = text if body.messages is None else "".join(m.content for m in body.messages[:2])
    return Request(
        submission.id,
        submission.tenant,
        submission.endpoint,
        received_at,
        input_tokens,
        body.max_tokens or max_tokens_cap,
        priority=body.priority,
        deadline=body.deadline,
        session=body.session,
        affinity=affinity_key(body.session, leading, affinity_block_tokens),
        other_units=float(len(body.images)),
        payload=payload,
    )


def to_batch_item(
    request: Request, submission: wire.Submission, now: float
) -> wire_internal.BatchItem:
    """What a worker receives for a dispatched request: the body as submitted plus the
    dispatcher's decisions (the capped `max_tokens`, the engine priority)."""
    return wire_internal.BatchItem(
        id=request.id,
        tenant=request.tenant,
        endpoint=request.endpoint,
        request=submission.request,
        max_tokens=request.max_tokens,
        expedited=request.expedited,
        reply=submission.reply,
        encoding=submission.encoding,
        enqueued_at=request.arrival,
        dispatched_at=now,
    )


# Batches travel as msgpack: internal, and cheaper to encode and decode than JSON.
BATCH_ENCODING = wire.Encoding.MSGPACK
BATCH_HEADERS = {HDR_CONTENT_TYPE: BATCH_ENCODING.content_type}
# What a batch's own fields may add around its items' bytes (a msgpack array header of
# up to 5 bytes, floats and ints whose encoded size varies).
BATCH_SLACK_BYTES = 64


def encode_batches(
    worker_id: str,
    endpoint: str,
    items: list[wire_internal.BatchItem],
    sent_at: float,
    max_payload: int,
    epoch: int = 0,
) -> list[bytes]:
    """The items as batch messages that the broker takes (each, with BATCH_HEADERS, at
    most its `max_payload`), in order: one message unless images make them large. An
    item too large for a message of its own stays alone in one (admission refuses such
    requests, `too_large_to_dispatch`)."""

    def encoded(chunk: list[wire_internal.BatchItem]) -> bytes:
        return wire.encode(
            wire_internal.Batch(
                worker_id=worker_id, endpoint=endpoint, items=chunk, sent_at=sent_at, epoch=epoch
            ),
            BATCH_ENCODING,
        )

    max_bytes = max_payload - message_bytes(b"", BATCH_HEADERS)
    whole = encoded(items)
    if len(whole) <= max_bytes:
        return [whole]
    room = max_bytes - len(encoded([])) - BATCH_SLACK_BYTES
    chunks: list[list[wire_internal.BatchItem]] = [[]]
    used = 0
    for item in items:
        size = len(wire.encode(item, BATCH_ENCODING))
        if chunks[-1] and used + size > room:
            chunks.append([])
            used = 0
        chunks[-1].append(item)
        used += size
    return [encoded(chunk) for chunk in chunks]


def too_large_to_dispatch(
    submission: wire.Submission, received_at: float, body_bytes: int, max_payload: int
) -> str | None:
    """Why the request cannot be sent to a worker: its batch item alone, in a message
    with BATCH_HEADERS, exceeds the broker's `max_payload`; None if it fits (only a
    body near the limit is encoded)."""
    if body_bytes + 4096 <= max_payload:  # far more room than the item's own fields take
        return None
    request = to_request(submission, received_at, 1, None)
    (alone,) = encode_batches(
        "w" * 64,
        request.endpoint,  # the longest worker id
        [to_batch_item(request, submission, received_at)],
        received_at,
        max_payload,
    )
    size = message_bytes(alone, BATCH_HEADERS) + BATCH_SLACK_BYTES
    if size <= max_payload:
        return None
    return (
        f"the request takes {size} bytes as sent to a worker, over the broker's "
        f"largest message (max_payload {max_payload})"
    )


def to_error_event(request_id: str, decision: Decision) -> wire.ErrorEvent:
    """The error event that tells a client its request was rejected or dropped."""
    return wire.ErrorEvent(
        request_id,
        wire.ErrorCode(decision.outcome.error_code),
        decision.message,
        decision.retry_after_s,
    )

"""The one conversion path between the core's types and the wire's
(dispatcher/dispatch/convert.py)."""

from __future__ import annotations

import msgspec
import pytest

from broker_config import wire, wire_internal
from broker_config.subjects import Subjects, message_bytes
from costmodel.units import Usage
from dispatcher.core.types import Decision, Outcome
from dispatcher.dispatch.convert import (
    BATCH_HEADERS,
    encode_batches,
    to_batch_item,
    to_error_event,
    to_request,
    too_large_to_dispatch,
)
from tests.wire_support import image_b64

S = Subjects()


def submission(
    body: dict,
    tenant: str = "acme",
    *,
    reply: str | None = "_INBOX.r",
    encoding: wire.Encoding = wire.Encoding.JSON,
) -> wire.Submission:
    headers = {"Nats-Msg-Id": "r1", "Content-Type": encoding.content_type}
    if reply:
        headers["Fq-Reply"] = reply
    return wire.parse_submission(f"fq.req.chat.{tenant}", wire.encode(body, encoding), headers, S)


FULL = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ],
    "max_tokens": 5000,
    "priority": 7,
    "deadline": 2e9,
    "session": "s-1",
    "images": [image_b64()],
    "metadata": {"k": "v"},
}


@pytest.mark.parametrize("encoding", list(wire.Encoding))
def test_a_submission_round_trips_to_the_worker(encoding: wire.Encoding) -> None:
    sub = submission(FULL, encoding=encoding)
    request = to_request(sub, received_at=100.0, max_tokens_cap=512, payload="held")
    assert (request.id, request.tenant, request.endpoint, request.arrival) == (
        "r1",
        "acme",
        "chat",
        100.0,
    )
    assert (request.priority, request.deadline, request.session) == (7, 2e9, "s-1")
    assert request.other_units == 1.0 and request.payload == "held"
    assert request.input_tokens == len("be briefhello there") // 4 + 1

    request.max_tokens = 512  # what the scheduler's cap leaves
    request.expedited = True
    item = to_batch_item(request, sub, now=101.5)
    decoded = wire_internal.BATCH.decode(
        wire.encode(
            wire_internal.Batch(worker_id="w", endpoint="chat", items=[item], sent_at=101.5),
            wire.Encoding.MSGPACK,
        ),
        wire.Encoding.MSGPACK,
    )
    (back,) = decoded.items
    assert back == item
    # The worker sees the body exactly as submitted, and the dispatcher's decisions.
    assert back.request == sub.request
    assert (back.id, back.tenant, back.endpoint) == ("r1", "acme", "chat")
    assert (back.max_tokens, back.expedited, back.reply, back.encoding) == (
        512,
        True,
        "_INBOX.r",
        encoding,
    )
    assert (back.enqueued_at, back.dispatched_at) == (100.0, 101.5)


def test_absent_max_tokens_and_counts_take_the_cap_and_the_rough_count() -> None:
    sub = submission({"prompt": "x" * 41, "input_tokens": None})
    request = to_request(sub, 0.0, max_tokens_cap=64, payload=None)
    assert (request.max_tokens, request.input_tokens, request.other_units) == (64, 11, 0.0)
    declared = to_request(submission({"prompt": "x", "input_tokens": 900}), 0.0, 64, None)
    assert declared.input_tokens == 900


def test_a_rejection_becomes_the_contracts_error_event() -> None:
    event = to_error_event("r1", Decision(Outcome.QUEUE_FULL, "tenant queue is full", 1.0))
    assert event == wire.ErrorEvent("r1", wire.ErrorCode.OVERLOADED, "tenant queue is full", 1.0)
    assert msgspec.json.decode(wire.encode(event)) == {
        "type": "error",
        "id": "r1",
        "code": "overloaded",
        "message": "tenant queue is full",
        "retry_after_s": 1.0,
    }


def test_usage_is_one_type_from_worker_to_client_and_scheduler() -> None:
    """The done event's usage is the contract's shape; units of other kinds travel only
    when there are some."""
    plain = Usage(3, 4, 0.5)
    assert msgspec.json.decode(msgspec.json.encode(plain)) == {
        "input_tokens": 3,
        "output_tokens": 4,
        "model_units": 0.5,
    }
    with_images = Usage(3, 4, 0.5, other_units=2.0)
    completion = wire_internal.Completion(
        id="r",
        tenant="acme",
        endpoint="chat",
        worker_id="w",
        usage=with_images,
        stored=True,
        finished_at=1.0,
    )
    assert (
        wire_internal.COMPLETIONS.decode(wire.encode(wire_internal.Completions([completion])))
        .items[0]
        .usage
        == with_images
    )


def batch_items(sizes: list[int]) -> list[wire_internal.BatchItem]:
    """Items whose image is `size` characters of base64 each."""
    items = []
    for n, size in enumerate(sizes):
        sub = wire.parse_submission(
            "fq.req.chat.acme",
            wire.encode({"prompt": "x", "images": ["A" * size]}, wire.Encoding.JSON),
            {"Nats-Msg-Id": f"r{n}"},
            S,
        )
        items.append(to_batch_item(to_request(sub, 1.0, 16, None), sub, 2.0))
    return items


def test_batches_are_split_to_fit_the_brokers_largest_message() -> None:
    items = batch_items([400_000, 400_000, 300_000, 10, 800_000])
    messages = encode_batches("w1", "chat", items, 3.0, 1 << 20)
    assert all(message_bytes(m, BATCH_HEADERS) <= 1 << 20 for m in messages)
    decoded = [msgspec.msgpack.decode(m, type=wire_internal.Batch) for m in messages]
    assert [[item.id for item in batch.items] for batch in decoded] == [
        ["r0", "r1"],
        ["r2", "r3"],
        ["r4"],
    ]
    assert all((b.worker_id, b.endpoint, b.sent_at) == ("w1", "chat", 3.0) for b in decoded)
    small = encode_batches("w1", "chat", items[3:4] * 3, 3.0, 1 << 20)
    assert len(small) == 1


def test_the_headers_count_against_the_largest_message() -> None:
    # Two items whose batch is 20 bytes under max_payload: over it with the header.
    (whole,) = encode_batches("w1", "chat", batch_items([1000, 1000]), 3.0, 1 << 30)
    limit = len(whole) + 20
    assert len(encode_batches("w1", "chat", batch_items([1000, 1000]), 3.0, limit)) == 2
    assert message_bytes(b"x", {"A": "b"}) == 1 + len(b"NATS/1.0\r\nA: b\r\n\r\n")
    assert message_bytes(b"xy") == 2


def test_a_request_too_large_for_a_batch_of_its_own_is_named() -> None:
    def check(size: int) -> str | None:
        body = wire.encode({"prompt": "x", "images": ["A" * size]}, wire.Encoding.JSON)
        sub = wire.parse_submission("fq.req.chat.acme", body, {"Nats-Msg-Id": "r"}, S)
        return too_large_to_dispatch(sub, 1.0, len(body), 1 << 20)

    assert check(900_000) is None
    assert check((1 << 20) - 200) is not None
    assert "over the broker's largest message (max_payload 1048576)" in check((1 << 20) - 60)

"""The wire contract without a server: subjects, request validation, event shapes."""

from __future__ import annotations

import base64
import json
import math
import random
import re
import struct
import time
import warnings
import zlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker_config.limits import InputLimits, over_limits
from broker_config.subjects import (
    HDR_CONTENT_TYPE,
    HDR_MSG_ID,
    HDR_REPLY,
    UNSHARDED,
    ApiKind,
    SubjectError,
    Subjects,
    shard_of,
)
from broker_config.wire import (
    CANCEL_REPLY,
    EVENT,
    STATUS_REPLY,
    CancelReply,
    ChatMessage,
    DepthEntry,
    DepthReply,
    DoneEvent,
    Encoding,
    ErrorCode,
    ErrorEvent,
    StatusReply,
    SubmitRequest,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
    WireError,
    decode_api_reply,
    decode_request,
    encode,
    parse_submission,
)
from broker_config.wire_internal import (
    ABORT,
    BATCH,
    COMPLETIONS,
    HEARTBEAT,
    STORED_RESULT,
    Abort,
    Batch,
    BatchItem,
    Completion,
    Completions,
    Heartbeat,
    StoredResult,
)
from costmodel.units import Capacity
from dispatcher.core.types import Outcome
from tests.wire_support import image_b64

S = Subjects()
JSON = {HDR_MSG_ID: "r-1"}
MSGPACK = {HDR_MSG_ID: "r-1", HDR_CONTENT_TYPE: "application/msgpack"}
# nats-py's KV key rule: result keys must satisfy it.
KV_KEY = re.compile(r"^[-/_=\.a-zA-Z0-9]+$")


# -- subjects --------------------------------------------------------------------------------


def test_request_subject_round_trip() -> None:
    assert S.request("chat", "acme") == "fq.req.chat.acme"
    assert S.parse_request("fq.req.chat.acme") == ("chat", "acme")
    assert S.parse_request("fq.req.emb-ed_2.Tenant_9-x") == ("emb-ed_2", "Tenant_9-x")
    custom = Subjects("stage")
    assert custom.parse_request(custom.request("chat", "acme")) == ("chat", "acme")


@pytest.mark.parametrize(
    "subject, fragment",
    [
        ("fq.req.chat", "not a request subject"),
        ("fq.req.chat.acme.extra", "not a request subject"),
        ("xx.req.chat.acme", "not a request subject"),
        ("fq.api.chat.acme", "not a request subject"),
        ("fq.req.chat.ac@me", "invalid tenant 'ac@me'"),
        ("fq.req..acme", "invalid endpoint ''"),
        ("fq.req.chat." + "t" * 65, "invalid tenant"),
    ],
)
def test_parse_request_rejects(subject: str, fragment: str) -> None:
    with pytest.raises(SubjectError, match=re.escape(fragment)):
        S.parse_request(subject)


@pytest.mark.parametrize(
    "endpoint, tenant",
    [("ch at", "a"), ("chat", "a.b"), ("chat", "*"), ("", "a"), ("chat", "x" * 65)],
)
def test_builders_reject_bad_tokens(endpoint: str, tenant: str) -> None:
    with pytest.raises(SubjectError, match="must match"):
        S.request(endpoint, tenant)


def test_prefix_is_validated() -> None:
    with pytest.raises(SubjectError, match="subject prefix"):
        Subjects("fq.x")


def test_filters_and_api_subjects() -> None:
    assert S.all_requests == "fq.req.*.*"
    assert S.tenant_requests("acme") == "fq.req.*.acme"
    assert S.status("acme") == "fq.api.status.acme"
    assert S.cancel("acme") == "fq.api.cancel.acme"
    assert S.depth == "fq.api.depth"
    assert S.api_filter(ApiKind.STATUS) == "fq.api.status.*"
    assert S.api_filter(ApiKind.DEPTH) == "fq.api.depth"
    assert S.parse_api("fq.api.status.acme") == (ApiKind.STATUS, "acme")
    assert S.parse_api("fq.api.cancel.acme") == (ApiKind.CANCEL, "acme")
    assert S.parse_api("fq.api.depth") == (ApiKind.DEPTH, None)
    for bad in ("fq.api.purge.acme", "fq.api.status", "fq.api.status.a.b"):
        with pytest.raises(SubjectError):
            S.parse_api(bad)


def test_internal_subjects_stay_under_int() -> None:
    internal = [
        S.work("chat", "w1"),
        S.abort("chat"),
        S.heartbeat("chat", "w1"),
        S.heartbeats("chat"),
        S.completion("chat", "w1"),
        S.completions("chat"),
    ]
    assert all(s.startswith("fq.int.") for s in internal)
    assert S.work("chat", "w1") == "fq.int.work.chat.w1"
    assert S.heartbeats("chat") == "fq.int.hb.chat.*"
    with pytest.raises(SubjectError, match="worker id"):
        S.work("chat", "w.1")


def test_names() -> None:
    assert S.requests_stream == "FQ_REQUESTS"
    assert S.results_bucket == "FQ_RESULTS"
    assert S.parked_stream == "FQ_PARKED"
    assert S.shard_consumer(3) == "fq~shard~3"
    assert S.shard_filter(3) == "fq.q.3.*.*"
    assert S.shard_key("fq.q.3.chat.acme") == "3"
    # Stored before the stream had shards: read as published (not "fq.req.*.*", which
    # the server would take for a consumer of every subject).
    assert S.shard_key("fq.req.chat.acme") == UNSHARDED
    assert S.shard_filter(UNSHARDED) == "fq.req.>"
    assert S.shard_consumer(UNSHARDED) == "fq~shard~unsharded"
    assert S.stored_request_transform(16) == (
        "fq.req.*.*",
        "fq.q.{{partition(16,2)}}.{{wildcard(1)}}.{{wildcard(2)}}",
    )
    assert S.parked("fq.q.3.chat.acme") == "fq.park.chat.acme"
    assert S.parked_consumer("acme") == "fq~parked~acme"
    assert S.parked_tenant_filter("acme") == "fq.park.*.acme"
    # Any subject token may be published to; one that is no tenant name gets a hashed,
    # valid consumer name, distinct from every real tenant's.
    odd = S.parked_consumer("bad$name")
    assert odd.startswith("fq~parked-hash~") and "$" not in odd
    assert odd != S.parked_consumer("bad_name")


def test_stored_and_parked_subjects_parse_like_published_ones() -> None:
    for subject in ("fq.req.chat.acme", "fq.q.7.chat.acme", "fq.park.chat.acme"):
        assert S.parse_request(subject) == ("chat", "acme")
        assert S.tenant_of(subject) == "acme"
    assert S.is_parked("fq.park.chat.acme") and not S.is_parked("fq.q.7.chat.acme")
    with pytest.raises(SubjectError):
        S.parse_request("fq.q.chat.acme")


def test_shard_of_spreads_tenants_over_every_shard() -> None:
    # That it matches the server's partition is checked against a real server
    # (tests/broker_config/test_broker_streams.py).
    assert {shard_of(f"t{i}", 16) for i in range(200)} == set(range(16))
    assert all(shard_of(f"t{i}", 1) == 0 for i in range(20))


@pytest.mark.parametrize("request_id", ["r1", "a.b", "..", ".lead", "trail.", "x" * 128, "a-b_c.d"])
def test_result_key_round_trip(request_id: str) -> None:
    key = S.result_key("acme", request_id)
    assert KV_KEY.fullmatch(key)
    tenant, _, rest = key.partition(".")
    assert tenant == "acme" and "." not in rest and rest  # exactly two non-empty tokens
    assert S.parse_result_key(key) == ("acme", request_id)


def test_result_key_rejects_bad_input() -> None:
    with pytest.raises(SubjectError, match="request id"):
        S.result_key("acme", "a/b")
    with pytest.raises(SubjectError, match="not a result key"):
        S.parse_result_key("acme")


@pytest.mark.parametrize("reply", ["_INBOX.abc.def", "my.events.r1", "_INBOX_acme.x"])
def test_check_reply_accepts_plain_subjects(reply: str) -> None:
    assert S.check_reply(reply, "acme") == reply


@pytest.mark.parametrize(
    "reply, fragment",
    [
        ("fq.req.chat.victim", "reserved"),
        ("fq.int.work.chat.w1", "reserved"),
        ("$JS.API.STREAM.DELETE.FQ_REQUESTS", "reserved"),
        ("$KV.FQ_RESULTS.acme.r1", "reserved"),
        ("a.*.b", "wildcards"),
        ("a.>", "wildcards"),
        ("a..b", "empty tokens"),
        ("a b", "whitespace"),
        ("", "1 to 256"),
        ("x" * 257, "1 to 256"),
    ],
)
def test_check_reply_rejects(reply: str, fragment: str) -> None:
    with pytest.raises(SubjectError, match=re.escape(fragment)):
        S.check_reply(reply, "acme")


def test_check_reply_with_tenant_inboxes() -> None:
    assert S.inbox_prefix("acme") == "_INBOX_acme"
    assert S.check_reply("_INBOX_acme.ev.1", "acme", tenant_inboxes=True) == "_INBOX_acme.ev.1"
    for reply in ("_INBOX_globex.ev", "_INBOX_acme", "_INBOX.x", "_INBOX_acmex.y"):
        with pytest.raises(SubjectError, match="must start with '_INBOX_acme.'"):
            S.check_reply(reply, "acme", tenant_inboxes=True)


# -- request decoding ------------------------------------------------------------------------


def test_decode_minimal_json_request_takes_id_from_header() -> None:
    request = decode_request(b'{"prompt":"hi","max_tokens":5}', JSON)
    assert request == SubmitRequest(id="r-1", prompt="hi", max_tokens=5)
    assert request.priority == 0 and request.metadata == {} and request.images == []


def test_decode_full_request_in_both_encodings() -> None:
    body = {
        "id": "r-1",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "priority": 2,
        "deadline": 1.7e9,
        "session": "s1",
        "input_tokens": 4,
        "images": ["aGk="],
        "metadata": {"k": "v"},
    }
    expected = SubmitRequest(
        id="r-1",
        messages=[ChatMessage("user", "hi")],
        max_tokens=3,
        priority=2,
        deadline=1.7e9,
        session="s1",
        input_tokens=4,
        images=["aGk="],
        metadata={"k": "v"},
    )
    assert decode_request(json.dumps(body).encode(), JSON) == expected
    assert decode_request(msgspec.msgpack.encode(body), MSGPACK) == expected


def test_body_id_without_header_is_accepted() -> None:
    assert decode_request(b'{"id":"b.1","prompt":"x"}', None).id == "b.1"


def test_header_names_are_matched_case_insensitively() -> None:
    headers = {"nats-msg-id": "r-1", "content-type": "application/msgpack"}
    assert decode_request(msgspec.msgpack.encode({"prompt": "x"}), headers).id == "r-1"


INVALID_REQUESTS = [
    # (body, headers, fragment of the message)
    (b'{"prompt": "x"', JSON, "body is not valid json: Input data was truncated"),
    (b"\xc1", MSGPACK, "body is not valid msgpack: MessagePack data is malformed"),
    (b'["prompt"]', JSON, "invalid body: Expected `object`, got `array`"),
    (b'{"prompt":"x","model":"gpt"}', JSON, "invalid body: Object contains unknown field `model`"),
    (b'{"prompt":"x","tenant":"other"}', JSON, "unknown field `tenant`"),
    (b'{"prompt":1}', JSON, "Expected `str | null`, got `int` - at `$.prompt`"),
    (b'{"prompt":"x","max_tokens":"10"}', JSON, "got `str` - at `$.max_tokens`"),
    (
        b'{"prompt":"x","max_tokens":0}',
        JSON,
        "invalid body: Expected `int` >= 1 - at `$.max_tokens`",
    ),
    (b'{"prompt":"x","max_tokens":1.5}', JSON, "got `float` - at `$.max_tokens`"),
    (b'{"prompt":"x","max_tokens":99999999999}', JSON, "<= 2147483647 - at `$.max_tokens`"),
    (b'{"prompt":"x","priority":true}', JSON, "Expected `int`, got `bool` - at `$.priority`"),
    (b'{"prompt":"x","deadline":"soon"}', JSON, "at `$.deadline`"),
    (b'{"prompt":"x","input_tokens":-1}', JSON, ">= 0 - at `$.input_tokens`"),
    (b'{"prompt":"x","images":"aGk="}', JSON, "Expected `array`, got `str` - at `$.images`"),
    (
        b'{"prompt":"x","metadata":{"k":1}}',
        JSON,
        "Expected `str`, got `int` - at `$.metadata[...]`",
    ),
    (b'{"prompt":"x","session":5}', JSON, "at `$.session`"),
    (
        b'{"messages":[{"role":"user"}]}',
        JSON,
        "missing required field `content` - at `$.messages[0]`",
    ),
    (b'{"messages":[{"role":"u","content":"c","name":"n"}]}', JSON, "unknown field `name`"),
    (b'{"messages":[]}', JSON, "length >= 1 - at `$.messages`"),
    (b'{"prompt":"x","messages":[{"role":"u","content":"c"}]}', JSON, "got both"),
    (b'{"max_tokens":3}', JSON, "exactly one of `prompt` and `messages` is required, got neither"),
    (
        b'{"id":"other","prompt":"x"}',
        JSON,
        "body `id` 'other' does not match the Nats-Msg-Id header 'r-1'",
    ),
    (b'{"id":"a b","prompt":"x"}', None, "at `$.id`"),
    (b'{"prompt":"x"}', None, "missing request id: set the Nats-Msg-Id header"),
    (b'{"prompt":"x"}', {HDR_MSG_ID: "bad id!"}, "invalid Nats-Msg-Id header 'bad id!'"),
    (b'{"prompt":"x"}', {HDR_MSG_ID: "x" * 129}, "invalid Nats-Msg-Id header"),
    (
        b'{"prompt":"x"}',
        {HDR_MSG_ID: "r", HDR_CONTENT_TYPE: "text/plain"},
        "unsupported Content-Type 'text/plain'",
    ),
    (
        msgspec.msgpack.encode({"prompt": "x", "deadline": math.inf}),
        MSGPACK,
        "`deadline` must be a finite unix time",
    ),
    (
        msgspec.msgpack.encode({"prompt": "x", "deadline": math.nan}),
        MSGPACK,
        "`deadline` must be a finite unix time",
    ),
]


@pytest.mark.parametrize("body, headers, fragment", INVALID_REQUESTS)
def test_invalid_requests_are_invalid_request(
    body: bytes, headers: dict[str, str] | None, fragment: str
) -> None:
    with pytest.raises(WireError) as info:
        decode_request(body, headers)
    assert info.value.code is ErrorCode.INVALID_REQUEST
    assert fragment in info.value.message


def test_wire_error_keeps_what_could_be_read() -> None:
    with pytest.raises(WireError) as info:
        decode_request(msgspec.msgpack.encode({"prompt": 1}), MSGPACK)
    assert info.value.request_id == "r-1"
    assert info.value.encoding is Encoding.MSGPACK
    event = info.value.to_event()
    assert (event.id, event.code) == ("r-1", ErrorCode.INVALID_REQUEST)
    with pytest.raises(WireError) as info:
        decode_request(b"{", {HDR_MSG_ID: "bad id!"})
    assert info.value.request_id is None  # an invalid id is never echoed back


def test_parse_submission() -> None:
    headers = {HDR_MSG_ID: "r-1", HDR_REPLY: "_INBOX.ev"}
    sub = parse_submission("fq.req.chat.acme", b'{"prompt":"x"}', headers, S)
    assert (sub.endpoint, sub.tenant, sub.id, sub.reply, sub.encoding) == (
        "chat",
        "acme",
        "r-1",
        "_INBOX.ev",
        Encoding.JSON,
    )
    assert sub.request.prompt == "x"


PNG = image_b64()
SMALL = InputLimits(
    max_body_bytes=400,
    max_prompt_chars=50,
    max_messages=2,
    max_images=1,
    max_image_chars=20,
    max_metadata_entries=2,
    max_metadata_chars=30,
    max_session_chars=10,
)


@pytest.mark.parametrize(
    "body, limit",
    [
        ({"prompt": "x" * 51}, "max_prompt_chars is 50, the request has 51"),
        (
            {"messages": [{"role": "user", "content": "x" * 30}] * 2},
            "max_prompt_chars is 50, the request has 60",
        ),
        ({"messages": [{"role": "user", "content": "x"}] * 3}, "max_messages is 2"),
        ({"prompt": "x", "images": [PNG, PNG]}, "max_images is 1, the request has 2"),
        ({"prompt": "x", "images": [PNG]}, f"max_image_chars is 20, the request has {len(PNG)}"),
        ({"prompt": "x", "metadata": {"a": "1", "b": "2", "c": "3"}}, "max_metadata_entries is 2"),
        (
            {"prompt": "x", "metadata": {"k": "v" * 30}},
            "max_metadata_chars is 30, the request has 31",
        ),
        ({"prompt": "x", "session": "s" * 11}, "max_session_chars is 10, the request has 11"),
        ({"prompt": "x" * 500}, "max_body_bytes is 400, the request has 5"),  # checked first
    ],
    ids=[
        "prompt",
        "messages-content",
        "messages",
        "images",
        "image",
        "metadata",
        "metadata-chars",
        "session",
        "body",
    ],
)
def test_a_request_over_a_limit_is_named_with_the_limit_and_what_it_had(
    body: dict, limit: str
) -> None:
    data = json.dumps(body).encode()
    request = decode_request(data, JSON)
    assert limit in over_limits(request, len(data), SMALL)
    # Within the defaults, the same request is fine.
    assert over_limits(request, len(data), InputLimits()) is None


def over_image_limits(images: list[str], limits: InputLimits = InputLimits()) -> str | None:
    data = json.dumps({"prompt": "x", "images": images}).encode()
    return over_limits(decode_request(data, JSON), len(data), limits)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int, *chunks: bytes) -> bytes:
    """A PNG whose header claims width x height, then `chunks`, with no pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + b"".join(chunks) + png_chunk(b"IDAT", b"")
    )


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_an_image_is_judged_by_its_pixels(fmt: str) -> None:
    image = image_b64(fmt, (4, 3))
    assert over_image_limits([image], InputLimits(max_image_pixels=12)) is None
    assert over_image_limits([PNG, image], InputLimits(max_image_pixels=11)) == (
        "max_image_pixels is 11, image 1 has 4x3 = 12 pixels"
    )


@pytest.mark.parametrize(
    "image",
    ["aGk", "not base64!", "é", PNG[:40] + "\n" + PNG[40:]],
    ids=["padding", "alphabet", "not-ascii", "newline"],
)
def test_an_image_that_is_not_base64_is_refused(image: str) -> None:
    assert over_image_limits([PNG, image]).startswith("image 1 is not valid base64: ")


@pytest.mark.parametrize(
    "data, problem",
    [
        (random.Random(15).randbytes(64), "is not a PNG, JPEG, GIF or WebP image"),
        (b"", "is not a PNG, JPEG, GIF or WebP image"),
        (base64.b64decode(image_b64("BMP")), "is not a PNG, JPEG, GIF or WebP image"),
        (base64.b64decode(PNG)[:20], "is not a readable PNG, JPEG, GIF or WebP image: no size"),
        (
            b"\xff\xd8\xff\xe0\x00\x10JFIF",
            "is not a readable PNG, JPEG, GIF or WebP image: no size",
        ),
    ],
    ids=["random-bytes", "empty", "bmp", "truncated-png", "jpeg-without-frame"],
)
def test_an_image_that_is_not_an_admitted_format_is_refused(data: bytes, problem: str) -> None:
    assert over_image_limits([b64(data)]).startswith(f"image 0 {problem}")


@pytest.mark.parametrize(
    "width, height, named",
    [
        (100_000, 100_000, "100000x100000 = 10000000000 pixels"),
        (10_000, 10_000, "10000x10000 = 100000000 pixels"),
    ],
)
def test_a_decompression_bomb_header_is_refused_without_a_warning(
    width: int, height: int, named: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        violation = over_image_limits([b64(png_header(width, height))])
    assert violation == f"max_image_pixels is {1 << 25}, image 0 has {named}"


def test_an_image_is_judged_without_inflating_what_its_header_holds() -> None:
    """PNG text chunks (zTXt) inflate to far more than they weigh: an image library's
    open would inflate every one of them (tens of MB) before the pixel check."""
    text = png_chunk(b"zTXt", b"k\0\0" + zlib.compress(b"x" * (1 << 20), 9))  # 1 MiB in 1 KB
    image = png_header(640, 480, *[text] * 60)
    started = time.perf_counter()
    assert over_image_limits([b64(image)]) is None
    assert time.perf_counter() - started < 0.1


def test_the_default_pixel_limit_admits_an_8k_frame() -> None:
    assert over_image_limits([b64(png_header(7680, 4320))]) is None


def test_counts_and_lengths_are_checked_before_any_image_is_decoded() -> None:
    data = json.dumps({"prompt": "x", "images": ["not base64!"], "session": "s" * 11}).encode()
    assert over_limits(decode_request(data, JSON), len(data), SMALL) == (
        "max_session_chars is 10, the request has 11"
    )


def test_parse_submission_errors_carry_safe_context() -> None:
    with pytest.raises(WireError, match="not a request subject") as info:
        parse_submission("fq.req.chat", b'{"prompt":"x"}', JSON, S)
    assert info.value.request_id == "r-1"
    # A body error still has the (checked) reply subject to answer on.
    with pytest.raises(WireError, match="unknown field") as info:
        parse_submission(
            "fq.req.chat.acme",
            b'{"prompt":"x","z":1}',
            {HDR_MSG_ID: "r-1", HDR_REPLY: "_INBOX.ev"},
            S,
        )
    assert info.value.reply == "_INBOX.ev"
    # A forbidden reply subject is never offered as a place to answer.
    with pytest.raises(WireError, match="reserved") as info:
        parse_submission(
            "fq.req.chat.acme",
            b'{"prompt":"x"}',
            {HDR_MSG_ID: "r-1", HDR_REPLY: "fq.req.chat.victim"},
            S,
        )
    assert info.value.reply is None
    with pytest.raises(WireError, match="_INBOX_acme"):
        parse_submission(
            "fq.req.chat.acme",
            b'{"prompt":"x"}',
            {HDR_MSG_ID: "r-1", HDR_REPLY: "_INBOX.ev"},
            S,
            tenant_inboxes=True,
        )
    # A subject whose tenant is no valid name is still answered on a checked reply...
    answerable = {HDR_MSG_ID: "r-1", HDR_REPLY: "_INBOX.ev"}
    with pytest.raises(WireError, match="invalid tenant") as info:
        parse_submission("fq.req.chat.bad$name", b'{"prompt":"x"}', answerable, S)
    assert info.value.reply == "_INBOX.ev"
    with pytest.raises(WireError, match="invalid tenant") as info:
        parse_submission(
            "fq.req.chat.bad$name",
            b'{"prompt":"x"}',
            {HDR_MSG_ID: "r-1", HDR_REPLY: "fq.api.depth"},
            S,
        )
    assert info.value.reply is None
    # ...but not with per-tenant inboxes, where the reply's owner cannot be checked.
    with pytest.raises(WireError, match="invalid tenant") as info:
        parse_submission(
            "fq.req.chat.bad$name", b'{"prompt":"x"}', answerable, S, tenant_inboxes=True
        )
    assert info.value.reply is None


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, Encoding.JSON),
        ("", Encoding.JSON),
        ("application/json", Encoding.JSON),
        ("application/json; charset=utf-8", Encoding.JSON),
        ("Application/MsgPack", Encoding.MSGPACK),
        (" application/msgpack ", Encoding.MSGPACK),
    ],
)
def test_encoding_from_content_type(value: str | None, expected: Encoding) -> None:
    assert Encoding.from_content_type(value) is expected
    assert Encoding.from_content_type(expected.content_type) is expected


@given(
    st.builds(
        SubmitRequest,
        id=st.from_regex(r"\A[A-Za-z0-9._-]{1,128}\Z"),
        prompt=st.text(max_size=50),
        max_tokens=st.none() | st.integers(1, 2**31 - 1),
        priority=st.integers(-(2**31), 2**31 - 1),
        deadline=st.none() | st.floats(allow_nan=False, allow_infinity=False),
        session=st.none() | st.text(max_size=10),
        metadata=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
    )
)
def test_any_valid_request_round_trips(submit: SubmitRequest) -> None:
    msgpack_headers = {HDR_MSG_ID: submit.id, HDR_CONTENT_TYPE: "application/msgpack"}
    for encoding, headers in ((Encoding.JSON, {}), (Encoding.MSGPACK, msgpack_headers)):
        assert decode_request(encode(submit, encoding), headers) == submit


# -- events and APIs -------------------------------------------------------------------------

DONE = DoneEvent(
    id="r-1",
    seq=3,
    text="hello world",
    usage=Usage(input_tokens=5, output_tokens=3, model_units=0.2),
    timings=Timings(queued_s=0.5, ttft_s=0.1, total_s=1.25),
    metadata={"job": "7"},
    finish_reason="length",
)
LOGPROBS = [TokenLogprob("hel", -0.5, [TopLogprob("hel", -0.5), TopLogprob("he", -1.5)])]
EVENTS = [
    (
        TokenEvent(id="r-1", seq=0, text="hel"),
        {"type": "token", "id": "r-1", "seq": 0, "text": "hel"},
    ),
    (
        TokenEvent(id="r-1", seq=0, text="hel", logprobs=LOGPROBS),
        {
            "type": "token",
            "id": "r-1",
            "seq": 0,
            "text": "hel",
            "logprobs": [
                {
                    "token": "hel",
                    "logprob": -0.5,
                    "top": [{"token": "hel", "logprob": -0.5}, {"token": "he", "logprob": -1.5}],
                }
            ],
        },
    ),
    (
        DONE,
        {
            "type": "done",
            "id": "r-1",
            "seq": 3,
            "text": "hello world",
            "usage": {"input_tokens": 5, "output_tokens": 3, "model_units": 0.2},
            "timings": {"queued_s": 0.5, "ttft_s": 0.1, "total_s": 1.25},
            "metadata": {"job": "7"},
            "finish_reason": "length",
            "embedding": None,
        },
    ),
    (
        DoneEvent(
            id="e-1",
            seq=0,
            text="",
            usage=Usage(2, 0, 0.0),
            timings=Timings(queued_s=0.0, ttft_s=None, total_s=0.1),
            finish_reason="stop",
            embedding=[0.6, -0.8],
        ),
        {
            "type": "done",
            "id": "e-1",
            "seq": 0,
            "text": "",
            "usage": {"input_tokens": 2, "output_tokens": 0, "model_units": 0.0},
            "timings": {"queued_s": 0.0, "ttft_s": None, "total_s": 0.1},
            "metadata": {},
            "finish_reason": "stop",
            "embedding": [0.6, -0.8],
        },
    ),
    (
        ErrorEvent(id="r-1", code=ErrorCode.RATE_LIMITED, message="slow down", retry_after_s=2.5),
        {
            "type": "error",
            "id": "r-1",
            "code": "rate_limited",
            "message": "slow down",
            "retry_after_s": 2.5,
        },
    ),
    (
        ErrorEvent(id="r-1", code=ErrorCode.CANCELLED, message="cancelled"),
        {
            "type": "error",
            "id": "r-1",
            "code": "cancelled",
            "message": "cancelled",
            "retry_after_s": None,
        },
    ),
]


@pytest.mark.parametrize("event, expected", EVENTS)
def test_events_have_the_contract_fields_in_both_encodings(event: object, expected: dict) -> None:
    assert json.loads(encode(event, Encoding.JSON)) == expected
    assert msgspec.msgpack.decode(encode(event, Encoding.MSGPACK)) == expected
    for encoding in Encoding:
        assert EVENT.decode(encode(event, encoding), encoding) == event
    # A client in another language produces the same bytes: decode from the plain dict.
    assert EVENT.decode(json.dumps(expected).encode()) == event


def test_done_event_without_tokens_has_null_ttft_and_empty_metadata() -> None:
    done = DoneEvent(
        id="r",
        seq=0,
        text="",
        usage=Usage(1, 0, 0.0),
        timings=Timings(queued_s=0.0, ttft_s=None, total_s=0.1),
    )
    encoded = json.loads(encode(done))
    assert encoded["timings"]["ttft_s"] is None and encoded["metadata"] == {}


def test_error_codes_are_exactly_the_contract_list() -> None:
    assert {c.value for c in ErrorCode} == {
        "invalid_request",
        "unknown_endpoint",
        "unknown_tenant",
        "rate_limited",
        "quota_exceeded",
        "overloaded",
        "deadline_exceeded",
        "cancelled",
        "internal",
        "unavailable",
    }
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'teapot'"):
        EVENT.decode(b'{"type":"error","id":"r","code":"teapot","message":"m"}')


def test_scheduler_outcomes_map_onto_error_codes() -> None:
    codes = {o.error_code for o in Outcome if o is not Outcome.ADMITTED}
    assert codes <= {c.value for c in ErrorCode}


def test_status_reply_omits_absent_position_and_result() -> None:
    unknown = StatusReply(id="r", state="unknown")
    assert json.loads(encode(unknown)) == {"id": "r", "state": "unknown"}
    queued = StatusReply(id="r", state="queued", position=4)
    assert json.loads(encode(queued)) == {"id": "r", "state": "queued", "position": 4}
    done = StatusReply(id="r-1", state="done", result=DONE)
    encoded = json.loads(encode(done))
    assert encoded["result"]["type"] == "done" and encoded["result"]["usage"]["output_tokens"] == 3
    assert STATUS_REPLY.decode(encode(done)) == done


def test_cancel_and_depth_replies() -> None:
    assert json.loads(encode(CancelReply(id="r", cancelled=True))) == {"id": "r", "cancelled": True}
    depth = DepthReply(
        queues=[
            DepthEntry(
                endpoint="chat",
                tier="gold",
                tenant="acme",
                queued=3,
                running=1,
                oldest_wait_s=0.25,
                admitted=9,
                rejected=2,
            )
        ]
    )
    assert json.loads(encode(depth)) == {
        "queues": [
            {
                "endpoint": "chat",
                "tier": "gold",
                "tenant": "acme",
                "queued": 3,
                "running": 1,
                "oldest_wait_s": 0.25,
                "admitted": 9,
                "rejected": 2,
            }
        ]
    }


def test_decode_api_reply_raises_error_objects() -> None:
    assert decode_api_reply(
        encode(CancelReply(id="r", cancelled=False)), CANCEL_REPLY
    ) == CancelReply("r", False)
    error = ErrorEvent(id="", code=ErrorCode.INVALID_REQUEST, message="bad body")
    with pytest.raises(WireError, match="bad body") as info:
        decode_api_reply(encode(error), STATUS_REPLY)
    assert info.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(WireError, match="malformed API reply") as info:
        decode_api_reply(b'{"state":"done"}', STATUS_REPLY)
    assert info.value.code is ErrorCode.INTERNAL


def test_internal_messages_round_trip() -> None:
    item = BatchItem(
        id="r-1",
        tenant="acme",
        endpoint="chat",
        request=SubmitRequest(id="r-1", prompt="hi", metadata={"k": "v"}),
        max_tokens=16,
        expedited=True,
        reply="_INBOX.x",
        encoding=Encoding.MSGPACK,
        enqueued_at=1.0,
        dispatched_at=2.0,
    )
    batch = Batch(worker_id="w1", endpoint="chat", items=[item], sent_at=2.0)
    beat = Heartbeat(
        worker_id="w1",
        endpoint="chat",
        capacity=Capacity(64, 4096, 100.0),
        used=Capacity(1, 20, 0.5),
        in_flight=["r-1"],
        healthy=True,
        started_at=0.5,
        sent_at=3.0,
        seq=7,
        output_tokens=[12],
    )
    done = Completion(
        id="r-1",
        tenant="acme",
        endpoint="chat",
        worker_id="w1",
        usage=DONE.usage,
        stored=True,
        finished_at=4.0,
    )
    stored = StoredResult(tenant="acme", endpoint="chat", event=DONE, stored_at=4.0)
    abort = Abort(endpoint="chat", tenant="acme", ids=["r-1"])
    for message, codec in (
        (batch, BATCH),
        (beat, HEARTBEAT),
        (Completions([done, done]), COMPLETIONS),
        (stored, STORED_RESULT),
        (abort, ABORT),
    ):
        for encoding in Encoding:
            assert codec.decode(encode(message, encoding), encoding) == message
    # A heartbeat from a worker that does not report output decodes with none.
    older = {k: v for k, v in msgspec.to_builtins(beat).items() if k != "output_tokens"}
    assert HEARTBEAT.decode(msgspec.json.encode(older), Encoding.JSON).output_tokens == []
    raw = msgspec.msgpack.decode(encode(batch, Encoding.MSGPACK))
    assert raw["items"][0]["encoding"] == "msgpack"

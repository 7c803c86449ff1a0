"""Hostile inputs for the live stack, generated with hypothesis; `bench.hostile` sends them.

A `Probe` is one attack: one message, or a few in order (an id reused across tenants, a
request published again after it finished, a flood of cancels). Each message carries the
outcome the contract promises for it (`Send.expect`), written down from the contract, not
computed by fairq's own parser:

- `done`: a valid request, interleaved with the garbage; it must finish;
- `error:<code>`: the broker stores it and the dispatcher sends this error event to its
  `Fq-Reply` (for `error:invalid_request`, `Send.detail` is a part of the message);
- `unanswered`: stored without a usable `Fq-Reply`; the dispatcher counts it in
  `fairq_invalid_messages_total{reply="none"}` (its error is kept for the status API);
- `refused:<exception>`: the broker, or the client library before it, refuses it and the
  publisher gets that exception; `duplicate`: the broker answers `"duplicate": true`;
- `closed`: the publish fails and the server closes the connection (a subject longer
  than its control line); such a probe gets a connection of its own;
- `status:unknown`, `cancel:false`: the API's answer for an id nobody submitted.

`generate(count, seed)` draws `count` probes with hypothesis (generation only: nothing is
shrunk, there is no example database), the same ones for the same seed.
"""

from __future__ import annotations

import base64
import io
import json
import random
from dataclasses import dataclass

import msgspec
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from PIL import Image

from broker_config.config import DispatcherOptions
from broker_config.limits import InputLimits

ENDPOINT = "chat"
TENANTS = ("acme", "globex", "initech")  # listed; any other tenant is refused
MSGPACK = "application/msgpack"
# Small limits, so that hypothesis reaches each of them with small inputs.
LIMITS = InputLimits(
    max_body_bytes=64 * 1024,
    max_prompt_chars=16 * 1024,
    max_messages=16,
    max_images=2,
    max_image_chars=4096,
    max_image_pixels=4096,
    max_metadata_entries=8,
    max_metadata_chars=512,
    max_session_chars=64,
)
# nats-server's default largest message and longest protocol line.
MAX_PAYLOAD = 1024 * 1024
MAX_CONTROL_LINE = 4096
# A republish must come after the broker's duplicate window (docs/protocol.md).
# (100 ms, forgotten on the server's purge timer: up to about 150 ms, more on a busy box).
AFTER_DUPLICATE_WINDOW_S = 0.4
FIELDS = (
    "id",
    "prompt",
    "messages",
    "max_tokens",
    "priority",
    "deadline",
    "session",
    "input_tokens",
    "images",
    "metadata",
)


def suite_options(options: DispatcherOptions = DispatcherOptions()) -> DispatcherOptions:
    return msgspec.structs.replace(options, input=LIMITS)


@dataclass(frozen=True, slots=True)
class Send:
    subject: str
    body: bytes
    expect: str
    detail: str = ""
    # Header id: the runner appends a number unique in the run, so that no two probes
    # collide by chance (JetStream deduplicates ids stream-wide); None: no header.
    msg_id: str | None = "h"
    same_id_as_previous: bool = False
    # "inbox": a subject of the runner's inbox; "none": no Fq-Reply; else sent as it is.
    reply: str = "inbox"
    headers: tuple[tuple[str, str], ...] = ()
    api: bool = False  # a core request to the API instead of a JetStream publish
    # The sends of a probe go in order, each after the previous one's final event (or
    # its publish, if it gets none) and `pause_s`.
    pause_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Probe:
    kind: str
    sends: tuple[Send, ...]


def request_subject(endpoint: str = ENDPOINT, tenant: str = "acme") -> str:
    return f"fq.req.{endpoint}.{tenant}"


def encode(body: object, content_type: str | None) -> bytes:
    return msgspec.msgpack.encode(body) if content_type == MSGPACK else json.dumps(body).encode()


def _typed(body: object, content_type: str | None) -> tuple[bytes, tuple[tuple[str, str], ...]]:
    return encode(body, content_type), (
        () if content_type is None else (("Content-Type", content_type),)
    )


# -- valid requests ------------------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8"), max_size=64)
_token = st.text("abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=16)
_encodings = st.sampled_from([None, MSGPACK])
_tenants = st.sampled_from(TENANTS)


@st.composite
def images(draw: st.DrawFn, *, max_pixels: int | None = None, min_pixels: int = 1) -> str:
    """A real image, base64: a format fairq admits, of a drawn size and colour."""
    width = draw(st.integers(1, 256))
    low = -(-min_pixels // width)
    high = max(low, 256) if max_pixels is None else max_pixels // width
    size = (width, draw(st.integers(max(1, low), max(1, high))))
    out = io.BytesIO()
    Image.new("RGB", size, draw(st.tuples(*[st.integers(0, 255)] * 3))).save(
        out, format=draw(st.sampled_from(["PNG", "JPEG", "GIF", "WEBP"]))
    )
    return base64.b64encode(out.getvalue()).decode()


@st.composite
def valid_bodies(draw: st.DrawFn) -> dict[str, object]:
    if draw(st.booleans()):
        body: dict[str, object] = {"prompt": draw(_text)}
    else:
        body = {
            "messages": draw(
                st.lists(
                    st.fixed_dictionaries(
                        {"role": st.sampled_from(["system", "user", "assistant"]), "content": _text}
                    ),
                    min_size=1,
                    max_size=3,
                )
            )
        }
    body["max_tokens"] = draw(st.integers(1, 6))
    optional = {
        "priority": st.integers(-3, 3),
        "session": _token,
        "images": st.lists(images(max_pixels=LIMITS.max_image_pixels), max_size=2),
        "metadata": st.dictionaries(_token, _token, max_size=3),
        "input_tokens": st.integers(0, 64),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True)):
        body[name] = draw(optional[name])
    return body


@st.composite
def valid(draw: st.DrawFn) -> Probe:
    body, headers = _typed(draw(valid_bodies()), draw(_encodings))
    return Probe(
        "valid", (Send(request_subject(tenant=draw(_tenants)), body, "done", headers=headers),)
    )


# -- bodies that break the contract --------------------------------------------------------


def _invalid(
    kind: str,
    body: bytes,
    detail: str = "",
    *,
    headers=(),
    tenant: str = "acme",
    reply: str = "inbox",
) -> Probe:
    expect = "error:invalid_request" if reply == "inbox" else "unanswered"
    return Probe(
        kind,
        (Send(request_subject(tenant=tenant), body, expect, detail, reply=reply, headers=headers),),
    )


@st.composite
def random_bytes(draw: st.DrawFn) -> Probe:
    # Without these words no body is a valid request, whatever else it holds.
    data = draw(
        st.binary(max_size=2048).filter(lambda b: b"prompt" not in b and b"messages" not in b)
    )
    content_type = draw(_encodings)
    return _invalid("random bytes", data, headers=_typed({}, content_type)[1])


@st.composite
def truncated(draw: st.DrawFn) -> Probe:
    content_type = draw(_encodings)
    body, headers = _typed(draw(valid_bodies()), content_type)
    return _invalid(
        "truncated " + ("msgpack" if content_type else "JSON"),
        body[: draw(st.integers(0, len(body) - 1))],
        headers=headers,
    )


@st.composite
def deeply_nested(draw: st.DrawFn) -> Probe:
    depth = draw(st.integers(1, 100_000))
    content_type = draw(_encodings)
    if content_type is None:
        inner = "[" * depth + "]" * depth
        body = draw(
            st.sampled_from(
                [
                    inner,
                    f'{{"prompt":{inner}}}',
                    f'{{"x":{inner}}}',
                    f'{{"prompt":"x","metadata":{{"a":{inner}}}}}',
                ]
            )
        )
        return _invalid("deeply nested JSON", body.encode())
    # msgpack: a fixarray of one element, `depth` times, around an empty array.
    inner_pack = b"\x91" * depth + b"\x90"
    body_pack = draw(
        st.sampled_from([inner_pack, b"\x81\xa6prompt" + inner_pack, b"\x81\xa1x" + inner_pack])
    )
    return _invalid("deeply nested msgpack", body_pack, headers=(("Content-Type", MSGPACK),))


WRONG_VALUES: dict[str, list[object]] = {
    "prompt": [5, None, True, ["x"], {"a": "b"}],
    "messages": [
        [],
        "hello",
        [{"role": "user"}],
        [{"role": 1, "content": "x"}],
        [{"role": "user", "content": "x", "extra": 1}],
    ],
    "max_tokens": [0, -1, 2**31, 1.5, "8", True],
    "priority": [2**40, 0.5, "high"],
    "deadline": ["soon", [1]],
    "session": [7, ["s"]],
    "input_tokens": [-1, 2**31, "3"],
    "images": ["x", [1], {"a": "b"}],
    "metadata": [[], {"a": 1}, {"a": {"b": "c"}}, "k=v"],
    "id": ["", "a b", "x" * 129, "é", 3],
}


@st.composite
def wrong_types(draw: st.DrawFn) -> Probe:
    body = {"prompt": "x", "max_tokens": 2}
    field = draw(st.sampled_from(sorted(WRONG_VALUES)))
    if field == "messages":
        del body["prompt"]
    body[field] = draw(st.sampled_from(WRONG_VALUES[field]))
    data, headers = _typed(body, draw(_encodings))
    return _invalid(f"wrong type: {field}", data, headers=headers)


@st.composite
def unknown_field(draw: st.DrawFn) -> Probe:
    name = draw(_text.filter(lambda n: n not in FIELDS))
    value = draw(st.one_of(_text, st.integers(-(2**63), 2**63 - 1)))  # msgpack's int range
    data, headers = _typed({"prompt": "x", name: value}, draw(_encodings))
    return _invalid("unknown field", data, headers=headers)


@st.composite
def over_a_limit(draw: st.DrawFn) -> Probe:
    """Valid in shape, over one of `LIMITS` (the error names the limit)."""
    over = draw(st.integers(1, 64))
    limit = draw(
        st.sampled_from(
            [
                "max_prompt_chars",
                "max_messages",
                "max_images",
                "max_image_chars",
                "max_metadata_entries",
                "max_metadata_chars",
                "max_session_chars",
                "max_body_bytes",
            ]
        )
    )
    value = getattr(LIMITS, limit) + over
    body: dict[str, object] = {"prompt": "x", "max_tokens": 2}
    if limit == "max_prompt_chars":
        body["prompt"] = "p" * value
    elif limit == "max_messages":
        body = {"messages": [{"role": "user", "content": "m"}] * value}
    elif limit == "max_images":
        body["images"] = ["aGk="] * value
    elif limit == "max_image_chars":
        body["images"] = ["A" * (value + (-value) % 4)]
    elif limit == "max_metadata_entries":
        body["metadata"] = {f"k{i}": "v" for i in range(value)}
    elif limit == "max_metadata_chars":
        body["metadata"] = {"k": "v" * value}
    elif limit == "max_session_chars":
        body["session"] = "s" * value
    else:  # JSON whitespace: counted in the body's bytes, by no other limit
        data = encode(body, None)
        return _invalid("over a limit", data[:-1] + b" " * value + data[-1:], limit)
    data, headers = _typed(body, draw(_encodings))
    return _invalid("over a limit", data, limit, headers=headers)


@st.composite
def oversized(draw: st.DrawFn) -> Probe:
    size = MAX_PAYLOAD + draw(st.integers(1, 4096))
    return Probe(
        "over the broker's largest message",
        (Send(request_subject(), b'{"prompt":"' + b"x" * size + b'"}', "refused:MaxPayloadError"),),
    )


@st.composite
def invalid_utf8(draw: st.DrawFn) -> Probe:
    bad = draw(st.binary(min_size=1, max_size=16).filter(_not_utf8))
    if draw(st.booleans()):
        return _invalid("invalid UTF-8", b'{"prompt":"' + bad.replace(b'"', b"") + b'"}')
    data = b"\x81\xa6prompt" + (b"\xd9" + bytes([len(bad)]) + bad)  # str 8 of those bytes
    return _invalid("invalid UTF-8", data, headers=(("Content-Type", MSGPACK),))


def _not_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except ValueError:
        return True
    return False


def _not_an_empty_object(data: bytes) -> bool:
    try:
        return json.loads(data) != {}
    except ValueError:
        return True


def _not_utf8(data: bytes) -> bool:
    try:
        data.replace(b'"', b"").decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


@st.composite
def bad_image(draw: st.DrawFn) -> Probe:
    case = draw(st.sampled_from(["not base64", "not an image", "too many pixels"]))
    if case == "not base64":
        image = draw(st.text("!@#$%^&*()ABCabc=+/ é", min_size=1, max_size=64).filter(_not_base64))
        detail = "not valid base64"
    elif case == "not an image":  # none of the formats' signatures starts with a zero
        image = base64.b64encode(b"\0" + draw(st.binary(max_size=512))).decode()
        detail = "is not a png, jpeg, gif or webp image"
    else:
        image = draw(images(min_pixels=LIMITS.max_image_pixels + 1))
        detail = "max_image_pixels"
    return _invalid(f"image: {case}", encode({"prompt": "x", "images": [image]}, None), detail)


# -- headers -------------------------------------------------------------------------------

BAD_REPLIES = (
    "fq.req.chat.globex",
    "fq.api.depth",
    "$JS.API.STREAM.DELETE.FQ_REQUESTS",
    "a..b",
    "a.*",
    "a.>",
    "x" * 300,
    "has space",
)


@st.composite
def forged_headers(draw: st.DrawFn) -> Probe:
    body = encode({"prompt": "x", "max_tokens": 2}, None)
    case = draw(
        st.sampled_from(
            [
                "no id",
                "bad id",
                "id mismatch",
                "content type",
                "bad reply",
                "no reply",
                "lower-case names",
            ]
        )
    )
    kind = f"headers: {case}"
    if case == "no id":
        return Probe(
            kind,
            (
                Send(
                    request_subject(),
                    body,
                    "error:invalid_request",
                    "missing request id",
                    msg_id=None,
                ),
            ),
        )
    if case == "bad id":
        prefix = draw(st.sampled_from(["a b", "é", "x" * 129, "a/b", "a:b"]))
        return Probe(
            kind,
            (Send(request_subject(), body, "error:invalid_request", "Nats-Msg-Id", msg_id=prefix),),
        )
    if case == "id mismatch":
        return Probe(
            kind,
            (
                Send(
                    request_subject(),
                    encode({"id": "other", "prompt": "x"}, None),
                    "error:invalid_request",
                    "does not match",
                ),
            ),
        )
    if case == "content type":
        value = draw(st.sampled_from(["text/plain", "application/xml", "msgpack", "\x7f"]))
        return _invalid(kind, body, "Content-Type", headers=(("Content-Type", value),))
    if case == "bad reply":
        return _invalid(kind, body, reply=draw(st.sampled_from(BAD_REPLIES)))
    if case == "no reply":
        return _invalid(kind, b"not json", reply="none")
    # Header names are matched case-insensitively by fairq: still a valid request.
    return Probe(
        kind,
        (Send(request_subject(), body, "done", headers=(("content-type", "application/json"),)),),
    )


# -- subjects ------------------------------------------------------------------------------

_odd_tokens = st.one_of(
    st.sampled_from(["*", ">", "%", "$x", "a@b", "ténant", "租户", "🙂"]),
    st.text("abcdefghijklmnopqrstuvwxyz", min_size=65, max_size=1000),
    st.text(
        st.characters(
            codec="utf-8", exclude_characters=".", exclude_categories=("Cc", "Cs", "Zs", "Zl", "Zp")
        ),
        min_size=1,
        max_size=32,
    ).filter(lambda t: not t.isascii()),
)


@st.composite
def odd_subject(draw: st.DrawFn) -> Probe:
    body = encode({"prompt": "x", "max_tokens": 2}, None)
    case = draw(
        st.sampled_from(
            [
                "odd tenant",
                "odd endpoint",
                "unknown endpoint",
                "unknown tenant",
                "empty token",
                "extra token",
                "whitespace",
                "over the control line",
            ]
        )
    )
    kind = f"subject: {case}"
    if case == "odd tenant":
        return Probe(
            kind,
            (
                Send(
                    request_subject(tenant=draw(_odd_tokens)),
                    body,
                    "error:invalid_request",
                    "invalid tenant",
                ),
            ),
        )
    if case == "odd endpoint":
        return Probe(
            kind,
            (
                Send(
                    request_subject(endpoint=draw(_odd_tokens)),
                    body,
                    "error:invalid_request",
                    "invalid endpoint",
                ),
            ),
        )
    if case == "unknown endpoint":
        endpoint = draw(_token.filter(lambda e: e not in ("chat", "embed")))
        return Probe(
            kind, (Send(request_subject(endpoint=endpoint), body, "error:unknown_endpoint"),)
        )
    if case == "unknown tenant":
        tenant = draw(_token.filter(lambda t: t not in TENANTS))
        return Probe(kind, (Send(request_subject(tenant=tenant), body, "error:unknown_tenant"),))
    if case == "empty token":
        subject = draw(st.sampled_from(["fq.req.chat.", "fq.req..acme", "fq.req.."]))
        return Probe(kind, (Send(subject, body, "refused:NoStreamResponseError"),))
    if case == "extra token":
        return Probe(
            kind,
            (Send(request_subject() + "." + draw(_token), body, "refused:NoStreamResponseError"),),
        )
    if case == "whitespace":
        space = draw(st.sampled_from([" ", "\t", "\r\n"]))
        return Probe(
            kind, (Send(request_subject(tenant=f"a{space}b"), body, "refused:BadSubjectError"),)
        )
    tenant = "t" * draw(st.integers(MAX_CONTROL_LINE, 2 * MAX_CONTROL_LINE))
    return Probe(kind, (Send(request_subject(tenant=tenant), body, "closed"),))


# -- ids -----------------------------------------------------------------------------------


@st.composite
def colliding_ids(draw: st.DrawFn) -> Probe:
    """The same id from two tenants: each is its own request (after the broker's window)."""
    first, second = draw(st.lists(_tenants, min_size=2, max_size=2, unique=True))
    body = encode(draw(valid_bodies()), None)
    return Probe(
        "id used by two tenants",
        (
            Send(request_subject(tenant=first), body, "done", msg_id="c"),
            Send(
                request_subject(tenant=second),
                body,
                "done",
                same_id_as_previous=True,
                pause_s=AFTER_DUPLICATE_WINDOW_S,
            ),
        ),
    )


@st.composite
def republished(draw: st.DrawFn) -> Probe:
    """An id published again after it finished gets the stored final event again."""
    body = encode(draw(valid_bodies()), None)
    return Probe(
        "id published again",
        (
            Send(request_subject(), body, "done"),
            Send(
                request_subject(),
                body,
                "done",
                same_id_as_previous=True,
                pause_s=AFTER_DUPLICATE_WINDOW_S,
            ),
        ),
    )


# -- the status, cancel and depth APIs -----------------------------------------------------

# The prefix keeps them apart from every id the runner submits.
_unknown_ids = st.from_regex(r"\A[A-Za-z0-9._-]{1,120}\Z").map(lambda i: f"unknown-{i}")


@st.composite
def api_calls(draw: st.DrawFn) -> Probe:
    kind = draw(st.sampled_from(["status", "cancel"]))
    tenant = draw(_tenants)
    case = draw(
        st.sampled_from(
            ["flood of unknown ids", "garbage", "odd tenant", "depth garbage", "extra token"]
        )
    )
    subject = f"fq.api.{kind}.{tenant}"
    if case == "flood of unknown ids":
        ids = draw(st.lists(_unknown_ids, min_size=1, max_size=20))
        expect = "status:unknown" if kind == "status" else "cancel:false"
        return Probe(
            f"api: {kind} {case}",
            tuple(Send(subject, json.dumps({"id": i}).encode(), expect, api=True) for i in ids),
        )
    if case == "garbage":
        body = draw(
            st.one_of(
                st.binary(max_size=256).filter(lambda b: b'"id"' not in b),
                st.sampled_from([b"{}", b'{"id":"a b"}', b'{"id":"x","x":1}']),
            )
        )
        return Probe(
            f"api: {kind} {case}", (Send(subject, body, "error:invalid_request", api=True),)
        )
    if case == "odd tenant":
        return Probe(
            f"api: {kind} {case}",
            (
                Send(
                    f"fq.api.{kind}.{draw(_odd_tokens)}",
                    b'{"id":"x"}',
                    "error:invalid_request",
                    "invalid tenant",
                    api=True,
                ),
            ),
        )
    if case == "depth garbage":
        body = draw(st.binary(min_size=1, max_size=256).filter(_not_an_empty_object))
        return Probe(
            f"api: {case}", (Send("fq.api.depth", body, "error:invalid_request", api=True),)
        )
    return Probe(
        f"api: {kind} {case}",
        (Send(subject + ".x", b'{"id":"x"}', "refused:NoRespondersError", api=True),),
    )


# Weights: how many of each hundred probes are of a kind (oversized bodies and control-line
# probes are costly to send, so they are rare).
KINDS = (
    (valid, 14),
    (random_bytes, 8),
    (truncated, 8),
    (deeply_nested, 5),
    (wrong_types, 10),
    (unknown_field, 4),
    (over_a_limit, 8),
    (oversized, 1),
    (invalid_utf8, 5),
    (bad_image, 3),
    (forged_headers, 9),
    (odd_subject, 9),
    (colliding_ids, 3),
    (republished, 3),
    (api_calls, 10),
)


def generate(count: int, seed_value: int) -> list[Probe]:
    """`count` probes in the mix of `KINDS`, drawn with hypothesis and shuffled, the same
    for the same seed. Each kind is drawn on its own: hypothesis leans towards the first
    choices of a `sampled_from`, which would skew the mix."""
    total = sum(weight for _, weight in KINDS)
    drawn: list[Probe] = []
    for index, (kind, weight) in enumerate(KINDS):
        wanted = max(1, round(count * weight / total))
        drawn += _draw(kind(), wanted, seed_value * len(KINDS) + index)
    random.Random(seed_value).shuffle(drawn)
    return drawn[:count]


def _draw(strategy: st.SearchStrategy[Probe], count: int, seed_value: int) -> list[Probe]:
    drawn: list[Probe] = []
    attempt = 0
    while len(drawn) < count:  # hypothesis stops early once it has nothing new to try

        @seed(seed_value + 1_000_003 * attempt)
        @settings(
            max_examples=count - len(drawn),
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(strategy)
        def draw(probe: Probe) -> None:
            drawn.append(probe)

        draw()
        attempt += 1
    return drawn

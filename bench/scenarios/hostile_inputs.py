"""Hostile inputs for the live stack, generated with hypothesis; `bench.scenarios.hostile`
sends them (`bench.scenarios.hostile_runner`).

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
import random

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from bench.scenarios.hostile_messages import (
    api_calls,
    colliding_ids,
    forged_headers,
    odd_subject,
    republished,
)
from bench.scenarios.hostile_probes import (
    FIELDS,
    LIMITS,
    MAX_PAYLOAD,
    MSGPACK,
    TENANTS,
    Probe,
    Send,
    encode,
    encodings,
    images,
    invalid,
    request_subject,
    suite_options,
    text,
    typed,
    valid,
    valid_bodies,
)

# What the suite and its tests take from here: the contract's parts are `hostile_probes`'s.
__all__ = ["KINDS", "LIMITS", "TENANTS", "Probe", "Send", "generate", "suite_options"]


# -- bodies that break the contract --------------------------------------------------------


@st.composite
def random_bytes(draw: st.DrawFn) -> Probe:
    # Without these words no body is a valid request, whatever else it holds.
    data = draw(
        st.binary(max_size=2048).filter(lambda b: b"prompt" not in b and b"messages" not in b)
    )
    content_type = draw(encodings)
    return invalid("random bytes", data, headers=typed({}, content_type)[1])


@st.composite
def truncated(draw: st.DrawFn) -> Probe:
    content_type = draw(encodings)
    body, headers = typed(draw(valid_bodies()), content_type)
    return invalid(
        "truncated " + ("msgpack" if content_type else "JSON"),
        body[: draw(st.integers(0, len(body) - 1))],
        headers=headers,
    )


@st.composite
def deeply_nested(draw: st.DrawFn) -> Probe:
    depth = draw(st.integers(1, 100_000))
    content_type = draw(encodings)
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
        return invalid("deeply nested JSON", body.encode())
    # msgpack: a fixarray of one element, `depth` times, around an empty array.
    inner_pack = b"\x91" * depth + b"\x90"
    body_pack = draw(
        st.sampled_from([inner_pack, b"\x81\xa6prompt" + inner_pack, b"\x81\xa1x" + inner_pack])
    )
    return invalid("deeply nested msgpack", body_pack, headers=(("Content-Type", MSGPACK),))


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
    data, headers = typed(body, draw(encodings))
    return invalid(f"wrong type: {field}", data, headers=headers)


@st.composite
def unknown_field(draw: st.DrawFn) -> Probe:
    name = draw(text.filter(lambda n: n not in FIELDS))
    value = draw(st.one_of(text, st.integers(-(2**63), 2**63 - 1)))  # msgpack's int range
    data, headers = typed({"prompt": "x", name: value}, draw(encodings))
    return invalid("unknown field", data, headers=headers)


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
        return invalid("over a limit", data[:-1] + b" " * value + data[-1:], limit)
    data, headers = typed(body, draw(encodings))
    return invalid("over a limit", data, limit, headers=headers)


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
        return invalid("invalid UTF-8", b'{"prompt":"' + bad.replace(b'"', b"") + b'"}')
    data = b"\x81\xa6prompt" + (b"\xd9" + bytes([len(bad)]) + bad)  # str 8 of those bytes
    return invalid("invalid UTF-8", data, headers=(("Content-Type", MSGPACK),))


def _not_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except ValueError:
        return True
    return False


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
    return invalid(f"image: {case}", encode({"prompt": "x", "images": [image]}, None), detail)


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

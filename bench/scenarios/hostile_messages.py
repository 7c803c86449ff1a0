"""Attacks beyond the body, for the hostile suite (`bench.scenarios.hostile_inputs`):
forged and missing headers, odd subject tokens, ids reused across tenants or published
again, and the status, cancel and depth APIs called with garbage or floods of unknown ids.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

from bench.scenarios.hostile_probes import (
    AFTER_DUPLICATE_WINDOW_S,
    MAX_CONTROL_LINE,
    TENANTS,
    Probe,
    Send,
    encode,
    invalid,
    not_an_empty_object,
    request_subject,
    tenants,
    token,
    valid_bodies,
)

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
        return invalid(kind, body, "Content-Type", headers=(("Content-Type", value),))
    if case == "bad reply":
        return invalid(kind, body, reply=draw(st.sampled_from(BAD_REPLIES)))
    if case == "no reply":
        return invalid(kind, b"not json", reply="none")
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
        endpoint = draw(token.filter(lambda e: e not in ("chat", "embed")))
        return Probe(
            kind, (Send(request_subject(endpoint=endpoint), body, "error:unknown_endpoint"),)
        )
    if case == "unknown tenant":
        tenant = draw(token.filter(lambda t: t not in TENANTS))
        return Probe(kind, (Send(request_subject(tenant=tenant), body, "error:unknown_tenant"),))
    if case == "empty token":
        subject = draw(st.sampled_from(["fq.req.chat.", "fq.req..acme", "fq.req.."]))
        return Probe(kind, (Send(subject, body, "refused:NoStreamResponseError"),))
    if case == "extra token":
        return Probe(
            kind,
            (Send(request_subject() + "." + draw(token), body, "refused:NoStreamResponseError"),),
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
    first, second = draw(st.lists(tenants, min_size=2, max_size=2, unique=True))
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
    tenant = draw(tenants)
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
        body = draw(st.binary(min_size=1, max_size=256).filter(not_an_empty_object))
        return Probe(
            f"api: {case}", (Send("fq.api.depth", body, "error:invalid_request", api=True),)
        )
    return Probe(
        f"api: {kind} {case}",
        (Send(subject + ".x", b'{"id":"x"}', "refused:NoRespondersError", api=True),),
    )

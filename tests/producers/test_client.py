"""The producer SDK and the `fairq submit|status|cancel|top` commands, on a real nats-server.

No dispatcher exists here: where one is needed, the test plays it with plain NATS (a pull
consumer reading the stored request and publishing its events, or a responder on an API
subject), which is exactly what a client in another language would see.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bench.harness.consumers import tenant_consumer
from broker_config.auth import build_users, render_auth_config
from broker_config.config import BrokerSettings
from broker_config.server import EmbeddedNatsServer
from broker_config.streams import ensure_consumer, provision
from broker_config.subjects import HDR_CONTENT_TYPE, HDR_MSG_ID, HDR_REPLY, Subjects, shard_of
from broker_config.wire import (
    DepthEntry,
    DepthReply,
    DoneEvent,
    Encoding,
    ErrorCode,
    ErrorEvent,
    Event,
    StatusReply,
    Timings,
    TokenEvent,
    Usage,
    encode,
    parse_submission,
)
from producers.client import Client
from producers.commands import DepthTrend, _without_credentials, render_depth
from producers.errors import (
    ApiError,
    BacklogFull,
    ConnectionFailed,
    FairqError,
    FairqTimeout,
    InvalidRequest,
    NoDispatcher,
    PublishFailed,
    RequestFailed,
)

pytestmark = pytest.mark.integration
S = Subjects()
CAP = 3  # per-(endpoint, tenant) backlog cap of the test broker
# A long duplicate window, so the PubAck's duplicate flag does not depend on how fast two
# publishes follow each other on a loaded machine (fairq's default is 0.1 s).
SETTINGS = BrokerSettings(max_queued_per_subject=CAP, duplicate_window_s=60.0, storage="memory")
REPO = Path(__file__).resolve().parents[2]
WAIT_S = 10.0  # upper bound for anything that should take milliseconds


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """A service connection (full permissions): the test's broker admin and fake dispatcher."""
    conn = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=0)
    yield conn
    await conn.close()


@pytest.fixture
async def js(nc: NATS) -> JetStreamContext:
    js = nc.jetstream(timeout=5)
    await provision(js, SETTINGS)
    return js


@pytest.fixture
async def client(nats_url: str, js: JetStreamContext) -> AsyncIterator[Client]:
    async with Client.connect(nats_url, allow_reconnect=False, api_timeout_s=2.0) as fq:
        yield fq


async def stored(js: JetStreamContext, seq: int) -> tuple[str, dict[str, str], bytes]:
    msg = await js.get_msg(S.requests_stream, seq)
    assert msg.subject is not None and msg.data is not None
    return msg.subject, dict(msg.headers or {}), msg.data


async def stream_count(js: JetStreamContext) -> int:
    return (await js.stream_info(S.requests_stream)).state.messages


async def no_interest(nc: NATS, subject: str, fq: Client) -> bool:
    """True when nobody subscribes to `subject` (a core request gets "no responders").

    The client's connection is flushed first, so its unsubscribe has reached the server.
    """
    if not fq.connection.is_closed:
        await fq.connection.flush()
    # A listener that does not answer times every attempt out; a loaded machine has been
    # seen to time one out after 10 s with no listener at all.
    for _ in range(3):
        try:
            await nc.request(subject, b"", timeout=10)
        except nats.errors.NoRespondersError:
            return True
        except nats.errors.TimeoutError:
            continue
        return False
    return False


async def publish_events(
    nc: NATS, subject: str, events: list[Event], encoding: Encoding = Encoding.JSON
) -> None:
    for event in events:
        await nc.publish(
            subject, encode(event, encoding), headers={HDR_CONTENT_TYPE: encoding.content_type}
        )
    await nc.flush()


def done_event(request_id: str, text: str = "Hello world", seq: int = 2) -> DoneEvent:
    return DoneEvent(
        id=request_id,
        seq=seq,
        text=text,
        usage=Usage(5, 2, 0.06),
        timings=Timings(queued_s=0.2, ttft_s=0.3, total_s=0.4),
        metadata={"job": "7"},
    )


def answer(request_id: str) -> list[Event]:
    return [
        TokenEvent(request_id, 0, "Hello"),
        TokenEvent(request_id, 1, " world"),
        done_event(request_id),
    ]


async def play_worker(
    nc: NATS, js: JetStreamContext, tenant: str, events: Callable[[str], list[Event]]
) -> dict[str, str]:
    """Take the next stored request, answer it in its encoding, ack it; return its headers."""
    consumer = tenant_consumer(S, tenant)
    await ensure_consumer(js, S.requests_stream, consumer)
    sub = await js.pull_subscribe_bind(consumer.durable, S.requests_stream)
    (msg,) = await sub.fetch(1, timeout=WAIT_S)
    headers = dict(msg.headers or {})
    encoding = Encoding.from_content_type(headers.get(HDR_CONTENT_TYPE))
    await publish_events(nc, headers[HDR_REPLY], events(headers[HDR_MSG_ID]), encoding)
    await msg.ack()
    return headers


async def respond(nc: NATS, subject: str, reply: Callable[[bytes], bytes]):
    """A fake dispatcher API: answers every request on `subject` with `reply(body)`."""

    async def handler(msg: Msg) -> None:
        await msg.respond(reply(msg.data))

    subscription = await nc.subscribe(subject, cb=handler)
    await nc.flush()  # the server knows the responder before the test calls it
    return subscription


# -- submit ----------------------------------------------------------------------------------


async def test_submit_returns_after_puback_with_the_exact_contract_message(
    client: Client, js: JetStreamContext
) -> None:
    deadline = time.time() + 60
    submitted = await client.submit(
        "chat",
        "acme",
        prompt="Hello",
        max_tokens=8,
        priority=2,
        deadline=deadline,
        session="s1",
        metadata={"job": "7"},
        id="r-1",
    )
    assert (submitted.id, submitted.stream_seq, submitted.duplicate) == ("r-1", 1, False)
    assert submitted.reply_subject is not None and submitted.reply_subject.startswith("_INBOX.")
    assert client.listening == 1

    subject, headers, body = await stored(js, submitted.stream_seq)
    # Published to fq.req.chat.acme, stored in acme's shard (the stream's transform).
    assert subject == f"fq.q.{shard_of('acme', BrokerSettings().intake_shards)}.chat.acme"
    assert headers == {
        HDR_MSG_ID: "r-1",
        HDR_REPLY: submitted.reply_subject,
        HDR_CONTENT_TYPE: "application/json",
    }
    assert json.loads(body) == {
        "id": "r-1",
        "prompt": "Hello",
        "max_tokens": 8,
        "priority": 2,
        "deadline": deadline,
        "session": "s1",
        "metadata": {"job": "7"},
    }
    # What the dispatcher will make of it.
    submission = parse_submission(subject, body, headers, S)
    assert (submission.endpoint, submission.tenant, submission.id) == ("chat", "acme", "r-1")
    assert submission.reply == submitted.reply_subject
    assert submission.encoding is Encoding.JSON


async def test_submit_msgpack_with_messages_and_a_generated_id(
    client: Client, js: JetStreamContext
) -> None:
    submitted = await client.submit(
        "chat", "acme", messages=[{"role": "user", "content": "Hi"}], encoding=Encoding.MSGPACK
    )
    assert len(submitted.id) == 32 and submitted.encoding is Encoding.MSGPACK
    subject, headers, body = await stored(js, submitted.stream_seq)
    assert headers == {
        HDR_MSG_ID: submitted.id,
        HDR_REPLY: submitted.reply_subject,
        HDR_CONTENT_TYPE: "application/msgpack",
    }
    assert msgspec.msgpack.decode(body) == {
        "id": submitted.id,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    assert parse_submission(subject, body, headers, S).encoding is Encoding.MSGPACK


async def test_submit_without_reply_subject_sends_no_fq_reply(
    client: Client, js: JetStreamContext
) -> None:
    submitted = await client.submit("chat", "acme", prompt="x", id="async-1", reply=False)
    assert submitted.reply_subject is None and client.listening == 0
    _, headers, _ = await stored(js, submitted.stream_seq)
    assert headers == {HDR_MSG_ID: "async-1", HDR_CONTENT_TYPE: "application/json"}
    with pytest.raises(FairqError, match="without a reply subject.*status"):
        await anext(client.stream(submitted))


async def test_submit_to_an_explicit_reply_subject(
    client: Client, js: JetStreamContext, nc: NATS
) -> None:
    submitted = await client.submit("chat", "acme", prompt="x", reply="results.acme.r-9", id="r-9")
    _, headers, _ = await stored(js, submitted.stream_seq)
    assert headers[HDR_REPLY] == "results.acme.r-9"
    await publish_events(nc, "results.acme.r-9", answer("r-9"))
    events = [e async for e in client.stream(submitted, timeout_s=WAIT_S)]
    assert events == answer("r-9")
    with pytest.raises(InvalidRequest, match="reserved"):
        await client.submit("chat", "acme", prompt="x", reply="fq.req.chat.globex")


async def test_duplicate_id_is_flagged_and_stored_once(
    client: Client, js: JetStreamContext
) -> None:
    first = await client.submit("chat", "acme", prompt="x", id="dup-1")
    again = await client.submit("chat", "acme", prompt="x", id="dup-1")
    assert not first.duplicate and again.duplicate
    assert again.stream_seq == first.stream_seq
    assert await stream_count(js) == 1
    # The stored request answers the first reply subject: the second one is not kept.
    assert client.listening == 1


async def test_full_backlog_raises_backlog_full_and_spares_other_tenants(
    client: Client, js: JetStreamContext, nc: NATS
) -> None:
    for i in range(CAP):
        await client.submit("chat", "acme", prompt="x", id=f"acme-{i}")
    listening = client.listening
    with pytest.raises(BacklogFull, match="'acme'.*'chat'.*retry later") as caught:
        await client.submit("chat", "acme", prompt="x", id="acme-over", reply="late.acme")
    assert (caught.value.endpoint, caught.value.tenant) == ("chat", "acme")
    assert caught.value.code is ErrorCode.OVERLOADED
    assert isinstance(caught.value, PublishFailed)
    # The refused request's subscription is gone: no leak, nobody listens there.
    assert client.listening == listening
    assert await no_interest(nc, "late.acme", client)

    other = await client.submit("chat", "globex", prompt="x", id="globex-0")
    elsewhere = await client.submit("embed", "acme", prompt="x", id="acme-embed-0")
    assert not other.duplicate and not elsewhere.duplicate
    assert await stream_count(js) == CAP + 2


async def test_publish_without_provisioned_stream_fails_clearly(nats_url: str) -> None:
    async with Client.connect(nats_url, allow_reconnect=False) as fq:
        with pytest.raises(
            PublishFailed, match="no JetStream stream stores fq.req.chat.acme.*FQ_REQUESTS"
        ):
            await fq.submit("chat", "acme", prompt="x")
        assert fq.listening == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
            "exactly one of `prompt` and `messages`.*both",
        ),
        ({}, "exactly one of `prompt` and `messages`.*neither"),
        ({"prompt": "x", "max_tokens": 0}, r"Expected `int` >= 1 - at `\$.max_tokens`"),
        (
            {"prompt": "x", "max_tokens": True},
            r"Expected `int \| null`, got `bool` - at `\$.max_tokens`",
        ),
        ({"prompt": "x", "id": "has space"}, "invalid request id 'has space'"),
        ({"prompt": "x", "deadline": math.nan}, "`deadline` must be a finite"),
        ({"messages": [{"role": "user", "text": "y"}]}, "unknown field `text`"),
        ({"prompt": "x", "metadata": {"n": 1}}, r"Expected `str`, got `int` - at `\$.metadata"),
        ({"prompt": "x", "images": [object()]}, "cannot encode the request: .*object"),
    ],
)
async def test_local_validation_rejects_before_sending(
    client: Client, js: JetStreamContext, kwargs: dict, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        await client.submit("chat", "acme", **kwargs)
    assert caught.value.code is ErrorCode.INVALID_REQUEST
    assert client.listening == 0
    assert await stream_count(js) == 0


async def test_a_request_over_the_brokers_largest_message_is_an_invalid_request(
    client: Client, js: JetStreamContext
) -> None:
    limit = client.connection.max_payload
    with pytest.raises(
        InvalidRequest,
        match=rf"bytes with its headers, over the broker's "
        rf"largest message \({limit} bytes, its "
        rf"max_payload\)",
    ):
        await client.submit("chat", "acme", prompt="x" * limit)
    # The body alone fits; with its headers (the server counts them) it does not.
    body_fits = limit - len(b'{"prompt":""}') - 10
    with pytest.raises(InvalidRequest, match="bytes with its headers, over the broker's"):
        await client.submit("chat", "acme", prompt="x" * body_fits)
    assert client.listening == 0
    assert await stream_count(js) == 0


@pytest.mark.parametrize(
    ("endpoint", "tenant", "message"),
    [
        ("chat", "ac me", "invalid tenant 'ac me'"),
        ("chat.v2", "acme", "invalid endpoint 'chat.v2'"),
        ("chat", "", "invalid tenant ''"),
    ],
)
async def test_bad_subject_tokens_are_rejected(
    client: Client, js: JetStreamContext, endpoint: str, tenant: str, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        await client.submit(endpoint, tenant, prompt="x")
    assert await stream_count(js) == 0


# -- events ----------------------------------------------------------------------------------


async def test_stream_yields_events_until_the_first_final_one(client: Client, nc: NATS) -> None:
    submitted = await client.submit("chat", "acme", prompt="Hello", id="r-1")
    assert submitted.reply_subject is not None
    stray = TokenEvent("someone-else", 0, "not ours")
    await publish_events(
        nc,
        submitted.reply_subject,
        [stray, *answer("r-1"), done_event("r-1"), TokenEvent("r-1", 3, "late")],
    )
    events = [e async for e in client.stream(submitted, timeout_s=WAIT_S)]
    assert events == answer("r-1")
    assert client.listening == 0
    assert await no_interest(nc, submitted.reply_subject, client)


async def test_stream_decodes_by_the_event_content_type(client: Client, nc: NATS) -> None:
    submitted = await client.submit(
        "chat", "acme", prompt="Hello", id="r-2", encoding=Encoding.MSGPACK
    )
    assert submitted.reply_subject is not None
    error = ErrorEvent("r-2", ErrorCode.RATE_LIMITED, "slow down", retry_after_s=1.5)
    await publish_events(
        nc, submitted.reply_subject, [TokenEvent("r-2", 0, "Hé"), error], Encoding.MSGPACK
    )
    events = [e async for e in client.stream(submitted, timeout_s=WAIT_S)]
    assert events == [TokenEvent("r-2", 0, "Hé"), error]


async def test_stream_times_out_when_nothing_arrives(client: Client, nc: NATS) -> None:
    submitted = await client.submit("chat", "acme", prompt="x", id="quiet")
    started = time.monotonic()
    with pytest.raises(FairqTimeout, match="no event for request quiet within 0.2s") as caught:
        async for _ in client.stream(submitted, timeout_s=0.2):
            pass
    assert isinstance(caught.value, asyncio.TimeoutError)
    assert time.monotonic() - started < WAIT_S
    assert client.listening == 0
    assert submitted.reply_subject is not None
    assert await no_interest(nc, submitted.reply_subject, client)
    with pytest.raises(FairqError, match="already streamed"):
        await anext(client.stream(submitted))


async def test_malformed_event_is_an_error_not_a_silent_drop(client: Client, nc: NATS) -> None:
    submitted = await client.submit("chat", "acme", prompt="x", id="bad-event")
    assert submitted.reply_subject is not None
    await nc.publish(submitted.reply_subject, b'{"type":"token","id":"bad-event"}')
    with pytest.raises(FairqError, match="malformed event"):
        await anext(client.stream(submitted, timeout_s=WAIT_S))


async def test_run_returns_the_done_event(client: Client, nc: NATS, js: JetStreamContext) -> None:
    worker = asyncio.create_task(play_worker(nc, js, "acme", answer))
    done = await client.run("chat", "acme", prompt="Hello", id="run-1", timeout_s=WAIT_S)
    assert done == done_event("run-1")
    assert (await worker)[HDR_MSG_ID] == "run-1"
    assert client.listening == 0


async def test_run_raises_request_failed_on_an_error_event(
    client: Client, nc: NATS, js: JetStreamContext
) -> None:
    error = ErrorEvent("run-2", ErrorCode.QUOTA_EXCEEDED, "monthly quota used up")
    worker = asyncio.create_task(play_worker(nc, js, "acme", lambda _: [error]))
    with pytest.raises(RequestFailed, match="run-2 failed: quota_exceeded: monthly") as caught:
        await client.run("chat", "acme", prompt="Hello", id="run-2", timeout_s=WAIT_S)
    assert caught.value.event == error and caught.value.code is ErrorCode.QUOTA_EXCEEDED
    await worker
    assert client.listening == 0


async def test_stream_of_a_duplicate_collects_the_stored_result(client: Client, nc: NATS) -> None:
    await client.submit("chat", "acme", prompt="x", id="dup-2", reply=False)
    again = await client.submit("chat", "acme", prompt="x", id="dup-2")
    assert again.duplicate
    polls: list[str] = []

    def status(body: bytes) -> bytes:
        polls.append(json.loads(body)["id"])
        if len(polls) < 2:
            return encode(StatusReply("dup-2", "running"))
        return encode(StatusReply("dup-2", "done", result=done_event("dup-2")))

    await respond(nc, S.status("acme"), status)
    events = [e async for e in client.stream(again, timeout_s=WAIT_S)]
    assert events == [done_event("dup-2")]
    assert polls == ["dup-2", "dup-2"]


# -- request/reply APIs ------------------------------------------------------------------------


async def test_apis_without_a_dispatcher_raise_no_dispatcher_quickly(client: Client) -> None:
    started = time.monotonic()
    calls = [client.status("acme", "r-1"), client.cancel("acme", "r-1"), client.depth()]
    for call, subject in zip(calls, ["fq.api.status.acme", "fq.api.cancel.acme", "fq.api.depth"]):
        with pytest.raises(NoDispatcher, match=f"no dispatcher is running.*{subject}"):
            await call
    assert time.monotonic() - started < 1.5  # well under the 2 s API timeout


async def test_api_replies_are_decoded(client: Client, nc: NATS) -> None:
    await respond(
        nc,
        S.status("acme"),
        lambda body: encode(StatusReply(json.loads(body)["id"], "queued", position=3)),
    )
    await respond(nc, S.cancel("acme"), lambda body: b'{"id":"r-1","cancelled":true}')
    depth = DepthReply([DepthEntry("chat", "gold", "acme", 12, 4, 0.8)])
    await respond(nc, S.depth, lambda body: encode(depth) if json.loads(body) == {} else b"")
    assert await client.status("acme", "r-1") == StatusReply("r-1", "queued", position=3)
    assert (await client.cancel("acme", "r-1")).cancelled is True
    assert await client.depth() == depth


async def test_api_error_answers_raise_api_error(client: Client, nc: NATS) -> None:
    refusal = ErrorEvent("", ErrorCode.INVALID_REQUEST, "invalid body: bad id")
    await respond(nc, S.status("acme"), lambda body: encode(refusal))
    await respond(nc, S.cancel("acme"), lambda body: b"not json")
    with pytest.raises(ApiError, match="invalid_request: fq.api.status.acme: invalid body") as e:
        await client.status("acme", "r-1")
    assert e.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(ApiError, match="internal: .*malformed API reply") as e:
        await client.cancel("acme", "r-1")
    assert e.value.code is ErrorCode.INTERNAL


async def test_api_timeout_is_fairq_timeout(nats_url: str, nc: NATS) -> None:
    await nc.subscribe(S.depth)  # listens, never answers
    await nc.flush()
    async with Client.connect(nats_url, allow_reconnect=False, api_timeout_s=0.2) as fq:
        with pytest.raises(FairqTimeout, match="no answer on fq.api.depth within 0.2s"):
            await fq.depth()


async def test_api_ids_and_tenants_are_checked_locally(client: Client) -> None:
    with pytest.raises(InvalidRequest, match="invalid request id"):
        await client.status("acme", "a b")
    with pytest.raises(InvalidRequest, match="invalid tenant"):
        await client.cancel("a.b", "r-1")


# -- connections -------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_connect_to_no_server_fails_fast_and_clearly() -> None:
    with pytest.raises(ValueError, match="invalid subject prefix 'f.q'"):
        Client.connect("nats://127.0.0.1:1", prefix="f.q")
    url = f"nats://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionFailed, match=f"cannot connect to NATS at {url}"):
        await Client.connect(url, allow_reconnect=False, connect_timeout_s=2)
    assert time.monotonic() - started < WAIT_S


async def test_wrapped_connection_is_left_open(nc: NATS, js: JetStreamContext) -> None:
    async with Client(nc) as fq:
        submitted = await fq.submit("chat", "acme", prompt="x")
        assert fq.listening == 1
    assert nc.is_connected
    assert submitted.reply_subject is not None
    assert await no_interest(nc, submitted.reply_subject, fq)  # close() dropped it


async def test_tenant_user_submits_and_streams_through_its_own_inbox(nats_binary: Path) -> None:
    config = render_auth_config(build_users(S, {"acme": "acme-pw"}, {"svc": "svc-pw"}))
    async with EmbeddedNatsServer(binary=nats_binary, config=config) as server:
        service = await nats.connect(
            server.url, user="svc", password="svc-pw", max_reconnect_attempts=0
        )
        try:
            await provision(service.jetstream(timeout=5), SETTINGS)
            async with Client.connect(
                server.url,
                user="acme",
                password="acme-pw",
                tenant_inboxes="acme",
                allow_reconnect=False,
                api_timeout_s=2.0,
            ) as fq:
                submitted = await fq.submit("chat", "acme", prompt="Hello", id="t-1")
                assert submitted.stream_seq == 1
                assert submitted.reply_subject is not None
                assert submitted.reply_subject.startswith("_INBOX_acme.")
                await publish_events(service, submitted.reply_subject, answer("t-1"))
                assert [e async for e in fq.stream(submitted, timeout_s=WAIT_S)] == answer("t-1")
                with pytest.raises(NoDispatcher):
                    await fq.status("acme", "t-1")
                with pytest.raises(InvalidRequest, match="connected as tenant 'acme'"):
                    await fq.submit("chat", "globex", prompt="x")
                with pytest.raises(InvalidRequest, match="must start with '_INBOX_acme.'"):
                    await fq.submit("chat", "acme", prompt="x", reply="elsewhere.acme")
                with pytest.raises(InvalidRequest, match="service users only"):
                    await fq.depth()
        finally:
            await service.close()


# -- top's table -------------------------------------------------------------------------------


def test_depth_trend_and_table() -> None:
    first = DepthReply([DepthEntry("chat", "gold", "acme", 10, 2, 1.25, 100, 4)])
    second = DepthReply(
        [
            DepthEntry("chat", "gold", "acme", 4, 4, 0.5, 130, 10),
            DepthEntry("chat", "free", "zed", 6, 0, 3.0, 6, 0),
        ]
    )
    trend = DepthTrend()
    assert trend.update(first, 100.0) == {}
    changes = trend.update(second, 102.0)
    assert changes[("chat", "gold", "acme")].admitted_per_s == 15.0
    assert changes[("chat", "gold", "acme")].rejected_per_s == 3.0
    assert changes[("chat", "free", "zed")].admitted_per_s == 3.0  # absent before: was 0

    table = render_depth(second, changes, "TITLE").splitlines()
    assert table[0] == "TITLE  queues=2 queued=10 running=4"
    assert table[2].split() == [
        "ENDPOINT",
        "TIER",
        "TENANT",
        "QUEUED",
        "RUNNING",
        "OLDEST",
        "WAIT",
        "ADMITTED/S",
        "REJECTED/S",
    ]
    assert table[3].split() == ["chat", "free", "zed", "6", "0", "3.0s", "3.0", "0.0"]
    assert table[4].split() == ["chat", "gold", "acme", "4", "4", "0.5s", "15.0", "3.0"]
    assert render_depth(DepthReply([]), {}, "T").splitlines()[-1] == "(no traffic yet)"
    assert render_depth(first, {}, "T").splitlines()[-1].split()[-2:] == ["-", "-"]


def test_top_never_shows_credentials() -> None:
    assert _without_credentials("nats://acme:s3cret@10.0.0.1:4222") == "nats://10.0.0.1:4222"
    assert _without_credentials("nats://10.0.0.1:4222") == "nats://10.0.0.1:4222"


# -- the command line --------------------------------------------------------------------------


async def fairq(*args: str) -> tuple[int, str, str]:
    """Run `fairq ARGS` as a child process; (exit code, stdout, stderr)."""
    env = {
        k: v for k, v in os.environ.items() if k != "NATS_URL" and not k.startswith("FAIRQ_NATS_")
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "producers.cli",
        *args,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_cli_submit_no_wait_prints_the_id(nats_url: str, js: JetStreamContext) -> None:
    code, out, err = await fairq(
        "submit",
        "--nats",
        nats_url,
        "--endpoint",
        "chat",
        "--tenant",
        "acme",
        "--prompt",
        "Hello",
        "--max-tokens",
        "4",
        "--id",
        "cli-1",
        "--no-wait",
    )
    assert (code, out, err) == (0, "cli-1\n", "")
    _, headers, body = await stored(js, 1)
    assert HDR_REPLY not in headers
    assert json.loads(body) == {"id": "cli-1", "prompt": "Hello", "max_tokens": 4}


async def test_cli_submit_streams_the_answer(nats_url: str, nc: NATS, js: JetStreamContext) -> None:
    worker = asyncio.create_task(play_worker(nc, js, "acme", answer))
    code, out, err = await fairq(
        "submit",
        "--nats",
        nats_url,
        "--endpoint",
        "chat",
        "--tenant",
        "acme",
        "--messages",
        '[{"role":"user","content":"Hi"}]',
        "--msgpack",
        "--priority",
        "3",
        "--deadline-in",
        "60",
        "--id",
        "cli-2",
    )
    headers = await worker
    assert headers[HDR_CONTENT_TYPE] == "application/msgpack"
    assert (code, out) == (0, "Hello world\n")
    assert err.startswith(
        "done id=cli-2 input_tokens=5 output_tokens=2 model_units=0.06 "
        "queued=0.200s ttft=0.300s total=0.400s"
    )


async def test_cli_submit_error_event_exits_nonzero(
    nats_url: str, nc: NATS, js: JetStreamContext
) -> None:
    def events(request_id: str) -> list[Event]:
        return [ErrorEvent(request_id, ErrorCode.RATE_LIMITED, "slow down", retry_after_s=2)]

    worker = asyncio.create_task(play_worker(nc, js, "acme", events))
    code, out, err = await fairq(
        "submit",
        "--nats",
        nats_url,
        "--endpoint",
        "chat",
        "--tenant",
        "acme",
        "--prompt",
        "Hi",
        "--id",
        "cli-3",
    )
    await worker
    assert (code, out) == (1, "")
    assert err == "fairq submit: request cli-3 failed: rate_limited: slow down (retry after 2s)\n"


async def test_cli_invalid_request_is_one_line(nats_url: str, js: JetStreamContext) -> None:
    code, out, err = await fairq(
        "submit",
        "--nats",
        nats_url,
        "--endpoint",
        "chat",
        "--tenant",
        "acme",
        "--prompt",
        "Hi",
        "--max-tokens",
        "0",
    )
    assert (code, out) == (2, "")
    assert err == "fairq submit: invalid body: Expected `int` >= 1 - at `$.max_tokens`\n"


async def test_cli_top_once_without_dispatcher_exits_2(nats_url: str) -> None:
    code, out, err = await fairq("top", "--nats", nats_url, "--once", "--timeout", "2")
    assert (code, out) == (2, "")
    assert err == "fairq top: no dispatcher is running (nobody answers fq.api.depth)\n"


async def test_cli_top_once_prints_the_table(nats_url: str, nc: NATS) -> None:
    depth = DepthReply([DepthEntry("chat", "gold", "acme", 12, 4, 0.8)])
    await respond(nc, S.depth, lambda body: encode(depth))
    code, out, err = await fairq("top", "--nats", nats_url, "--once")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert "queues=1 queued=12 running=4" in lines[0]
    assert lines[-1].split() == ["chat", "gold", "acme", "12", "4", "0.8s", "-", "-"]


async def test_cli_status_and_cancel_print_json(nats_url: str, nc: NATS) -> None:
    await respond(
        nc,
        S.status("acme"),
        lambda body: encode(StatusReply("r-1", "done", result=done_event("r-1"))),
    )
    await respond(nc, S.cancel("acme"), lambda body: b'{"id":"r-1","cancelled":false}')
    code, out, err = await fairq("status", "--nats", nats_url, "--tenant", "acme", "r-1")
    assert (code, err) == (0, "")
    assert json.loads(out)["result"]["text"] == "Hello world"
    code, out, err = await fairq("cancel", "--nats", nats_url, "--tenant", "acme", "r-1")
    assert (code, json.loads(out), err) == (0, {"id": "r-1", "cancelled": False}, "")


async def test_cli_without_server_exits_2_with_one_line() -> None:
    url = f"nats://127.0.0.1:{closed_port()}"
    code, out, err = await fairq("status", "--nats", url, "--tenant", "acme", "r-1")
    assert (code, out) == (2, "")
    assert err.startswith(f"fairq status: cannot connect to NATS at {url}: ")
    assert err.count("\n") == 1 and "Traceback" not in err

"""The front's translation between OpenAI's shapes and fairq's wire, its keys and its
config, without a network; and the dispatcher's `unavailable` for an endpoint nobody
serves."""

from __future__ import annotations

import msgspec
import pytest

from broker_config.config import ConfigError, FrontKey, load_config, parse_config
from broker_config.limits import InputLimits, over_limits
from broker_config.subjects import Subjects
from broker_config.wire import (
    DoneEvent,
    Encoding,
    ErrorCode,
    ErrorEvent,
    SubmitRequest,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
)
from costmodel.units import Usage
from dispatcher.core.scheduler import Scheduler
from dispatcher.core.types import Outcome, Request
from producers.openai_front import openai_wire as ow
from producers.openai_front.errors import FrontError, error_for, event_error, submit_error
from producers.openai_front.keys import KeyRing, key_hash, new_key, with_dev_key
from producers.submission import prepare_submit

CAP = 1024  # the chat endpoint's max_tokens_cap in the example config

STATUS = {
    "invalid_request": 400,
    "unknown_tenant": 401,
    "unknown_endpoint": 404,
    "rate_limited": 429,
    "quota_exceeded": 429,
    "overloaded": 429,
    "deadline_exceeded": 504,
    "cancelled": 499,
    "internal": 500,
    "unavailable": 503,
}


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_contract_error_has_an_http_status_and_openai_body(code: ErrorCode) -> None:
    error = error_for(code, "why", retry_after_s=2.5)
    assert error.status == STATUS[code]
    assert error.body() == {
        "error": {"message": "why", "type": error.type, "param": None, "code": str(code)}
    }


def chat(**fields: object) -> ow.ChatRequest:
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ow.decode_body(msgspec.json.encode(body), ow.ChatRequest)


def test_a_chat_request_becomes_a_submit_with_sampling_and_extensions() -> None:
    fields = ow.chat_submit(
        chat(
            temperature=0.2,
            stop="END",
            seed=1,
            max_completion_tokens=9,
            max_tokens=5,
            logprobs=True,
            top_logprobs=2,
            top_k=4,
            user="u",
            response_format={"type": "text"},
            fairq={"priority": 3, "session": "s"},
        ),
        CAP,
    )
    assert fields == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 9,
        "sampling": {"temperature": 0.2, "stop": ["END"], "seed": 1, "top_k": 4, "logprobs": 2},
        "priority": 3,
        "session": "s",
    }
    assert ow.chat_submit(chat(), CAP)["sampling"] is None


def test_image_parts_must_be_data_urls() -> None:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": "look: "}, part]
    fields = ow.chat_submit(chat(messages=[{"role": "user", "content": content}]), CAP)
    assert fields["messages"] == [{"role": "user", "content": "look: "}]
    assert fields["images"] == ["AAAA"]
    remote = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    with pytest.raises(FrontError, match="data URLs") as caught:
        ow.chat_submit(chat(messages=[{"role": "user", "content": [remote]}]), CAP)
    assert caught.value.status == 400 and caught.value.param == "messages[0].content"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_what_the_front_cannot_honour_is_refused_by_name(fields: dict, param: str) -> None:
    with pytest.raises(FrontError) as caught:
        ow.chat_submit(chat(**fields), CAP)
    assert caught.value.status == 400 and caught.value.param == param


def test_bad_json_and_wrong_types_are_400s_naming_the_field() -> None:
    with pytest.raises(FrontError, match="not valid JSON"):
        ow.decode_body(b"{", ow.ChatRequest)
    with pytest.raises(FrontError) as caught:
        ow.decode_body(b'{"model":"chat","messages":"hi"}', ow.ChatRequest)
    assert caught.value.status == 400 and caught.value.param == "messages"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "chat"}, "messages"),
        ({"messages": []}, "model"),
        ({"model": "chat", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "chat", "messages": [], "fairq": {"bogus": 1}}, "fairq.bogus"),
        ({"model": "chat", "messages": [], "fairq": {"metadata": {"a": 1}}}, "fairq.metadata"),
    ],
)
def test_a_missing_or_unknown_field_is_named_too(body: dict, param: str) -> None:
    with pytest.raises(FrontError) as caught:
        ow.decode_body(msgspec.json.encode(body), ow.ChatRequest)
    assert caught.value.status == 400 and caught.value.param == param


def completion(**fields: object) -> ow.CompletionRequest:
    body = {"model": "chat", "prompt": "hi", **fields}
    return ow.decode_body(msgspec.json.encode(body), ow.CompletionRequest)


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (chat(temperature=5), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(top_k=-1), "top_k"),
        (chat(min_p=2), "min_p"),
        (chat(presence_penalty=3), "presence_penalty"),
        (chat(frequency_penalty=-3), "frequency_penalty"),
        (chat(repetition_penalty=0), "repetition_penalty"),
        (chat(seed=2**64), "seed"),
        (chat(stop=["ok", ""]), "stop"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens=5, max_completion_tokens=0), "max_completion_tokens"),
        (chat(messages=[]), "messages"),
        (chat(fairq={"priority": 2**40}), "fairq.priority"),
        (completion(logprobs=21), "logprobs"),
        (completion(max_tokens=-1), "max_tokens"),
    ],
)
def test_what_the_sdk_refuses_names_the_callers_parameter(request_: object, param: str) -> None:
    """The checks of `Client.submit` (the wire contract) name fairq's fields, as in
    `$.sampling.logprobs`; the error names what the caller sent."""
    submit = ow.chat_submit if isinstance(request_, ow.ChatRequest) else ow.completion_submit
    fields = submit(request_, CAP)  # type: ignore[arg-type]
    with pytest.raises(ValueError) as refused:
        prepare_submit(Subjects(), "chat", "acme", fields, "r1", None, Encoding.JSON)
    error = submit_error(refused.value, request_.param_names())  # type: ignore[attr-defined]
    assert error.status == 400 and error.param == param
    assert error.message.startswith(f"invalid `{param}`: Expected ") and "$." not in error.message


def embedding(**fields: object) -> ow.EmbeddingRequest:
    body = {"model": "embed", "input": "hi", **fields}
    return ow.decode_body(msgspec.json.encode(body), ow.EmbeddingRequest)


@pytest.mark.parametrize(
    ("wire", "request_", "param"),
    [
        ({"prompt": "long"}, completion(), "prompt"),
        ({"prompt": "long"}, embedding(), "input"),
        ({"messages": [{"role": "user", "content": "long"}]}, chat(), "messages"),
        ({"messages": [{"role": "user", "content": ""}] * 3}, chat(), "messages"),
        ({"prompt": "", "images": ["", ""]}, chat(), "messages"),
        ({"prompt": "", "images": ["AAA="]}, chat(), "messages"),  # no image at all
        ({"prompt": "", "images": ["!"]}, chat(), "messages"),  # not base64
        ({"prompt": "", "metadata": {"a": "1", "b": "2"}}, embedding(), "fairq.metadata"),
        ({"prompt": "", "metadata": {"key": "long value"}}, chat(), "fairq.metadata"),
        ({"prompt": "", "session": "a long one"}, completion(), "fairq.session"),
        ({"prompt": "", "metadata": {"x" * 200: ""}}, chat(), None),  # the body as a whole
    ],
)
def test_what_the_dispatcher_refuses_names_the_callers_parameter(
    wire: dict, request_: object, param: str | None
) -> None:
    """`[dispatcher.input]`'s messages (broker_config.limits) name the limit; the error
    names the parameter the limit bounds."""
    limits = InputLimits(
        max_body_bytes=150,
        max_prompt_chars=3,
        max_messages=2,
        max_images=1,
        max_metadata_entries=1,
        max_metadata_chars=5,
        max_session_chars=5,
    )
    request = msgspec.convert(wire, SubmitRequest)
    violation = over_limits(request, len(msgspec.json.encode(wire)), limits)
    assert violation is not None
    event = ErrorEvent("r1", ErrorCode.INVALID_REQUEST, f"over a limit: {violation}")
    error = event_error(event, request_.param_names())  # type: ignore[attr-defined]
    assert error.status == 400 and error.param == param and error.message == event.message


def test_a_worker_refusing_images_and_errors_of_other_codes() -> None:
    text_only = "it has images, and this endpoint's model takes text only"  # workers/service
    event = ErrorEvent("r1", ErrorCode.INVALID_REQUEST, text_only)
    assert event_error(event, chat().param_names()).param == "messages"
    limited = ErrorEvent("r1", ErrorCode.RATE_LIMITED, "max_tokens is 3", retry_after_s=2.0)
    error = event_error(limited, chat().param_names())
    assert error.status == 429 and error.param is None and error.retry_after_s == 2.0


def test_max_tokens_over_the_endpoints_cap_is_refused_naming_it() -> None:
    """As OpenAI and vLLM do, rather than lowering it to the cap without a word."""
    for request_, param in (
        (chat(max_tokens=CAP + 1), "max_tokens"),
        (chat(max_tokens=1, max_completion_tokens=CAP + 1), "max_completion_tokens"),
    ):
        with pytest.raises(FrontError) as caught:
            ow.chat_submit(request_, CAP)
        error = caught.value
        assert error.status == 400 and error.param == param and error.code == "invalid_value"
        assert f"`{param}` is {CAP + 1}" in error.message and f"at most {CAP}" in error.message
    assert ow.chat_submit(chat(max_tokens=CAP), CAP)["max_tokens"] == CAP
    with pytest.raises(FrontError, match="at most 8 tokens") as caught:
        ow.completion_submit(completion(max_tokens=9), 8)
    assert caught.value.param == "max_tokens"
    assert ow.completion_submit(completion(), 8)["max_tokens"] == 8  # not OpenAI's 16


def test_completions_take_one_prompt_and_default_to_16_tokens() -> None:
    def completion(**fields: object) -> dict:
        body = {"model": "chat", **fields}
        request = ow.decode_body(msgspec.json.encode(body), ow.CompletionRequest)
        return ow.completion_submit(request, CAP)

    assert completion(prompt=["once"], logprobs=0) == {
        "prompt": "once",
        "max_tokens": 16,
        "sampling": {"logprobs": 0},
    }
    for bad in ({"prompt": ["a", "b"]}, {"prompt": [1, 2]}, {"prompt": "a", "echo": True}):
        with pytest.raises(FrontError):
            completion(**bad)


def test_logprobs_in_both_of_openais_shapes() -> None:
    entries = [
        TokenLogprob("He", -0.1, [TopLogprob("He", -0.1), TopLogprob("A", -2.0)]),
        TokenLogprob("y", -0.5, [TopLogprob("y", -0.5)]),
    ]
    assert ow.chat_logprobs(entries) == {
        "content": [
            {
                "token": "He",
                "logprob": -0.1,
                "bytes": [72, 101],
                "top_logprobs": [
                    {"token": "He", "logprob": -0.1, "bytes": [72, 101]},
                    {"token": "A", "logprob": -2.0, "bytes": [65]},
                ],
            },
            {
                "token": "y",
                "logprob": -0.5,
                "bytes": [121],
                "top_logprobs": [{"token": "y", "logprob": -0.5, "bytes": [121]}],
            },
        ]
    }
    assert ow.completion_logprobs(entries, offset=3) == {
        "tokens": ["He", "y"],
        "token_logprobs": [-0.1, -0.5],
        "top_logprobs": [{"He": -0.1, "A": -2.0}, {"y": -0.5}],
        "text_offset": [3, 5],
    }
    assert ow.chat_logprobs(None) is None and ow.completion_logprobs(None) is None


def test_keys_are_stored_hashed_and_name_their_tenant() -> None:
    key = new_key()
    assert key.startswith("fq-") and len(key) > 40 and new_key() != key
    ring = KeyRing([FrontKey("acme", key_hash(key)), FrontKey("globex", key_hash("other"))])
    assert ring.tenant(key) == "acme" and ring.tenant("other") == "globex"
    assert ring.tenant("") is None and ring.tenant(key + "x") is None
    config, dev = with_dev_key(load_config(), "initech")
    assert KeyRing(config.front.keys).tenant(dev) == "initech"


def test_front_keys_in_the_config_are_checked() -> None:
    base = '[endpoints.chat]\n[[tiers]]\nname = "t"\n[tenants.acme]\ntier = "t"\n[front]\nkeys = ['
    digest = key_hash("k")
    with pytest.raises(ConfigError, match="front.keys`: every key must be distinct"):
        parse_config(
            base + f'{{tenant="acme", sha256="{digest}"}}, {{tenant="acme", sha256="{digest}"}}]'
        )
    with pytest.raises(ConfigError, match=r"front.keys\[0\].tenant`: not a tenant"):
        parse_config(base + f'{{tenant="nobody", sha256="{digest}"}}]')
    with pytest.raises(ConfigError, match="sha256"):
        parse_config(base + '{tenant="acme", sha256="not-hex"}]')
    assert parse_config(base + f'{{tenant="acme", sha256="{digest}"}}]').front.keys


def scheduler_with_grace(grace: float | None) -> Scheduler:
    config = load_config()
    return Scheduler(
        msgspec.structs.replace(
            config, dispatcher=msgspec.structs.replace(config.dispatcher, no_worker_grace_s=grace)
        )
    )


def check(scheduler: Scheduler, now: float) -> object:
    return scheduler.check(
        Request(
            id=f"r{now}",
            tenant="acme",
            endpoint="chat",
            input_tokens=10,
            max_tokens=10,
            arrival=now,
        ),
        now,
    )


def test_an_endpoint_nobody_serves_turns_requests_away_after_the_grace() -> None:
    grace = 30.0
    scheduler = scheduler_with_grace(grace)
    assert isinstance(check(scheduler, 0.0), list)  # nobody says: the simulator
    scheduler.endpoints["chat"].set_serving(False, 100.0)
    assert isinstance(check(scheduler, 100.0 + grace - 1), list)
    decision = check(scheduler, 100.0 + grace)
    assert decision.outcome is Outcome.UNAVAILABLE and decision.retry_after_s == grace
    assert "no worker serves endpoint 'chat'" in decision.message
    scheduler.endpoints["chat"].set_serving(True, 200.0)
    assert isinstance(check(scheduler, 300.0), list)


def test_without_a_grace_requests_wait_for_a_worker_however_long() -> None:
    scheduler = scheduler_with_grace(None)  # the default
    assert load_config().dispatcher.no_worker_grace_s is None
    scheduler.endpoints["chat"].set_serving(False, 0.0)
    assert isinstance(check(scheduler, 1e6), list)


def test_a_stream_passes_tokens_on_in_order_once_even_when_a_request_runs_again() -> None:
    chunks = ow.StreamChunks(ow.ResponseIds("chatcmpl", "r", "chat"), chat=True, include_usage=True)
    (start,) = chunks.start()
    assert start["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    events = [
        TokenEvent("r", 0, "a"),
        TokenEvent("r", 1, "b"),
        TokenEvent("r", 0, "a"),
        TokenEvent("r", 2, "c"),
        TokenEvent("r", 1, "b"),
    ]
    sent = [chunk for event in events for chunk in chunks.of(event)]
    assert [c["choices"][0]["delta"]["content"] for c in sent] == ["a", "b", "c"]
    assert all(c["usage"] is None for c in sent)
    done = DoneEvent(
        "r", 3, "abc", Usage(2, 3, 0.0), Timings(0.0, 0.1, 0.2), finish_reason="length"
    )
    finish, usage = chunks.of(done)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
    }


def test_a_stream_that_missed_a_token_sends_the_rest_or_says_it_cannot() -> None:
    def stream() -> ow.StreamChunks:
        return ow.StreamChunks(ow.ResponseIds("cmpl", "r", "chat"), chat=False, include_usage=False)

    assert stream().start() == []  # legacy completions send no role chunk
    done = DoneEvent("r", 3, "abc", Usage(1, 3, 0.0), Timings(0.0, 0.1, 0.2), finish_reason="stop")
    tail = stream()
    assert [c["choices"][0]["text"] for c in tail.of(TokenEvent("r", 0, "a"))] == ["a"]
    rest, finish = tail.of(done)  # "b" and "c" were missed at the end
    assert rest["choices"][0]["text"] == "bc" and finish["choices"][0]["finish_reason"] == "stop"
    gap = stream()
    gap.of(TokenEvent("r", 0, "a"))
    gap.of(TokenEvent("r", 2, "c"))  # "b" was missed in the middle
    (error,) = gap.of(done)
    assert error["error"]["type"] == "server_error" and "missed" in error["error"]["message"]
    assert gap.finished

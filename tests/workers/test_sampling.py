"""Sampling parameters and embeddings without a network: the wire's `sampling` object,
stop strings on streamed text, and what the simulated engine does with them."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker_config.wire import SUBMIT_REQUEST, Encoding, Sampling, WireError, decode_request
from workers.engine import Delta, EngineRequest
from workers.sim_engine import EMBEDDING_DIM, SimEngine
from workers.stops import StopScanner

pytestmark = pytest.mark.timeout(30)


# -- the wire ------------------------------------------------------------------------------


def submit(sampling: object) -> bytes:
    return msgspec.json.encode({"id": "r", "prompt": "p", "sampling": sampling})


def test_sampling_round_trips_and_old_clients_are_unaffected() -> None:
    fields = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "stop": ["\n\n", "END"],
        "seed": -3,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logprobs": 5,
        "n": 1,
    }
    request = decode_request(submit(fields), None)
    assert msgspec.to_builtins(request.sampling) == {k: v for k, v in fields.items() if k != "n"}
    for encoding in Encoding:
        assert (
            SUBMIT_REQUEST.decode(
                msgspec.msgpack.encode(msgspec.to_builtins(request))
                if encoding is Encoding.MSGPACK
                else msgspec.json.encode(request),
                encoding,
            )
            == request
        )
    plain = decode_request(b'{"id":"r","prompt":"p"}', None)
    assert plain.sampling is None and b"sampling" not in msgspec.json.encode(plain)


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"temperature": 2.5}, r"Expected `float` <= 2.0 - at `\$.sampling.temperature`"),
        ({"temperature": -0.1}, r">= 0.0 - at `\$.sampling.temperature`"),
        ({"top_p": 0}, r"> 0.0 - at `\$.sampling.top_p`"),
        ({"top_k": -1}, r">= 0 - at `\$.sampling.top_k`"),
        ({"min_p": 1.5}, r"<= 1.0 - at `\$.sampling.min_p`"),
        ({"stop": [""]}, r"length >= 1 - at `\$.sampling.stop\[0\]`"),
        ({"stop": ["s"] * 17}, r"length <= 16 - at `\$.sampling.stop`"),
        ({"stop": "END"}, r"Expected `array`, got `str` - at `\$.sampling.stop`"),
        ({"seed": 2**63}, r"at `\$.sampling.seed`"),
        ({"presence_penalty": 3}, r"<= 2.0 - at `\$.sampling.presence_penalty`"),
        ({"repetition_penalty": 0}, r"> 0.0 - at `\$.sampling.repetition_penalty`"),
        ({"logprobs": 21}, r"<= 20 - at `\$.sampling.logprobs`"),
        ({"n": 2}, r"<= 1 - at `\$.sampling.n`"),
        ({"best_of": 2}, r"unknown field `best_of` - at `\$.sampling`"),
        ([], r"Expected `object | null`, got `array` - at `\$.sampling`"),
    ],
)
def test_bad_sampling_values_are_invalid_requests(sampling: object, message: str) -> None:
    with pytest.raises(WireError, match=message) as caught:
        decode_request(submit(sampling), {"Nats-Msg-Id": "r"})
    assert caught.value.code == "invalid_request" and caught.value.request_id == "r"


# -- stop strings --------------------------------------------------------------------------


def scan(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    scanner, sent = StopScanner(stops), []
    for piece in pieces:
        text, stopped = scanner.feed(piece)
        sent.append(text)
        if stopped:
            return "".join(sent), True
    return "".join(sent) + scanner.flush(), False


def test_a_stop_string_across_pieces_is_never_sent() -> None:
    scanner = StopScanner(["END"])
    assert scanner.feed("abc E") == ("abc ", False)  # "E" may begin the stop string
    assert scanner.feed("N") == ("", False)
    assert scanner.feed("Dx") == ("", True)
    assert scan(["END"], ["abc E", "Nd"]) == ("abc ENd", False)
    assert scan(["ab", "b"], ["xab"]) == ("x", True)  # the earliest stop wins


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopScanner(["a", ""])


@given(
    st.lists(st.text("abc", max_size=4), max_size=8),
    st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_streamed_text_stops_after_the_first_piece_that_completes_a_stop(
    pieces: list[str], stops: list[str]
) -> None:
    """Before the earliest stop string the text holds then, as if each piece's text were
    searched whole."""
    text, expected = "", None
    for piece in pieces:
        text += piece
        if found := [at for stop in stops if (at := text.find(stop)) >= 0]:
            expected = (text[: min(found)], True)
            break
    assert scan(stops, pieces) == (expected or (text, False))


# -- the simulated engine ------------------------------------------------------------------


async def run(
    engine: SimEngine,
    rid: str,
    prompt: str = "hello world",
    max_tokens: int = 40,
    **sampling: object,
) -> list[Delta]:
    request = EngineRequest(
        rid, max_tokens, prompt=prompt, sampling=msgspec.convert(sampling, Sampling)
    )
    return [delta async for delta in engine.generate(request)]


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


async def test_the_same_seed_or_greedy_sampling_gives_the_same_text() -> None:
    async with SimEngine(time_scale=0) as engine:
        seeded = [text_of(await run(engine, rid, seed=5)) for rid in ("a", "b")]
        greedy = [text_of(await run(engine, rid, temperature=0.0)) for rid in ("c", "d")]
        by_id = [text_of(await run(engine, rid)) for rid in ("e", "f")]
        other_prompt = text_of(await run(engine, "g", prompt="other", seed=5))
    assert seeded[0] == seeded[1] and greedy[0] == greedy[1]
    assert by_id[0] != by_id[1] and other_prompt != seeded[0]


async def test_a_stop_string_ends_the_output_before_it_with_finish_reason_stop() -> None:
    async with SimEngine(time_scale=0) as engine:
        first = text_of(await run(engine, "a", seed=9, max_tokens=60))
        words = first.split(" ")
        assert len(words) > 6, first
        stop = f"{words[4]} {words[5]}"  # spans two tokens
        deltas = await run(engine, "b", seed=9, max_tokens=60, stop=[stop])
    text, final = text_of(deltas), deltas[-1]
    assert final.finish_reason == "stop" and stop not in text
    assert first.startswith(text + stop)
    # Every token generated is counted, the stop string's too.
    assert final.output_tokens == sum(d.token_count for d in deltas[:-1])


async def test_logprobs_come_with_every_token_when_asked() -> None:
    async with SimEngine(time_scale=0) as engine:
        deltas = (await run(engine, "a", logprobs=3))[:-1]
        plain = (await run(engine, "b"))[:-1]
    assert all(d.logprobs is not None and len(d.logprobs) == 1 for d in deltas)
    for delta in deltas:
        (entry,) = delta.logprobs or ()
        assert entry.token == delta.text and entry.logprob < 0 and len(entry.top) == 3
        assert entry.top[0].token == entry.token
        assert [t.logprob for t in entry.top] == sorted(
            (t.logprob for t in entry.top), reverse=True
        )
    assert all(d.logprobs is None for d in plain)


async def test_an_embedding_request_returns_a_unit_vector_and_no_text() -> None:
    async with SimEngine(time_scale=0.01) as engine:

        def embed(rid: str, prompt: str) -> EngineRequest:
            return EngineRequest(rid, 1, prompt=prompt, embed=True)

        outputs = [
            [d async for d in engine.generate(embed(rid, prompt))]
            for rid, prompt in (("a", "same text"), ("b", "same text"), ("c", "other"))
        ]
    vectors = []
    for (final,) in outputs:
        assert final.finished and final.text == "" and final.output_tokens == 0
        assert final.input_tokens > 0 and final.embedding is not None
        assert len(final.embedding) == EMBEDDING_DIM
        assert sum(v * v for v in final.embedding) == pytest.approx(1.0)
        vectors.append(final.embedding)
    assert vectors[0] == vectors[1] != vectors[2]

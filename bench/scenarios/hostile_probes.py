"""The hostile suite's contract (`bench.scenarios.hostile_inputs` draws the attacks): a
`Probe` is one attack, its `Send`s the messages with the outcome the contract promises for
each; the suite's input limits; and the strategies that draw valid requests, which the
attacks start from.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass

import msgspec
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


def typed(body: object, content_type: str | None) -> tuple[bytes, tuple[tuple[str, str], ...]]:
    return encode(body, content_type), (
        () if content_type is None else (("Content-Type", content_type),)
    )


# -- valid requests ------------------------------------------------------------------------

text = st.text(st.characters(codec="utf-8"), max_size=64)
token = st.text("abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=16)
encodings = st.sampled_from([None, MSGPACK])
tenants = st.sampled_from(TENANTS)


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
        body: dict[str, object] = {"prompt": draw(text)}
    else:
        body = {
            "messages": draw(
                st.lists(
                    st.fixed_dictionaries(
                        {"role": st.sampled_from(["system", "user", "assistant"]), "content": text}
                    ),
                    min_size=1,
                    max_size=3,
                )
            )
        }
    body["max_tokens"] = draw(st.integers(1, 6))
    optional = {
        "priority": st.integers(-3, 3),
        "session": token,
        "images": st.lists(images(max_pixels=LIMITS.max_image_pixels), max_size=2),
        "metadata": st.dictionaries(token, token, max_size=3),
        "input_tokens": st.integers(0, 64),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True)):
        body[name] = draw(optional[name])
    return body


@st.composite
def valid(draw: st.DrawFn) -> Probe:
    body, headers = typed(draw(valid_bodies()), draw(encodings))
    return Probe(
        "valid", (Send(request_subject(tenant=draw(tenants)), body, "done", headers=headers),)
    )


# -- a body that breaks the contract ------------------------------------------------------


def invalid(
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


def not_an_empty_object(data: bytes) -> bool:
    try:
        return json.loads(data) != {}
    except ValueError:
        return True

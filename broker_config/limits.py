"""What one submitted request may hold (`[dispatcher.input]`).

Checked when admission takes a request on, before its tokens are counted or it is
queued; requests already held, finished or adopted from a worker are not judged again
(the broker's largest message, `[broker] max_msg_size`, bounds what is decoded before). A request over a limit ends with `invalid_request`, whose message
names the limit, its value and what the request had. The defaults leave room for
long-context chats; lower them for a service whose requests are smaller.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import msgspec

if TYPE_CHECKING:
    from broker_config.wire import SubmitRequest

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


class InputLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # The encoded body: nats-server's default largest message (1 MiB).
    max_body_bytes: PositiveInt = 1 << 20
    # The prompt, or all messages' content together.
    max_prompt_chars: PositiveInt = 1 << 20
    max_messages: PositiveInt = 1024
    max_images: NonNegativeInt = 16
    # Each image as sent (base64 or a URL).
    max_image_chars: PositiveInt = 1 << 20
    max_metadata_entries: NonNegativeInt = 32
    # Keys and values of all entries together.
    max_metadata_chars: NonNegativeInt = 8192
    max_session_chars: PositiveInt = 256


def over_limits(request: SubmitRequest, body_bytes: int, limits: InputLimits) -> str | None:
    """What of a submitted request (decoded from `body_bytes`) is over a limit, or None."""
    return next(_violations(request, body_bytes, limits), None)


def _violations(request: SubmitRequest, body_bytes: int, limits: InputLimits) -> Iterator[str]:
    messages = request.messages or ()
    prompt_chars = (len(request.prompt) if request.prompt is not None
                    else sum(len(m.content) for m in messages))
    for name, had in (
            ("max_body_bytes", body_bytes),
            ("max_prompt_chars", prompt_chars),
            ("max_messages", len(messages)),
            ("max_images", len(request.images)),
            ("max_image_chars", max(map(len, request.images), default=0)),
            ("max_metadata_entries", len(request.metadata)),
            ("max_metadata_chars", sum(len(k) + len(v) for k, v in request.metadata.items())),
            ("max_session_chars", len(request.session or ""))):
        limit = getattr(limits, name)
        if had > limit:
            yield f"{name} is {limit}, the request has {had}"

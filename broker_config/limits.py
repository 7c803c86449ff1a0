"""What one submitted request may hold (`[dispatcher.input]`).

Checked when admission takes a request on, before its tokens are counted or it is
queued; requests already held, finished or adopted from a worker are not judged again
(the broker's largest message, `[broker] max_msg_size`, bounds what is decoded before).
A request over a limit ends with `invalid_request`, whose message names the limit, its
value and what the request had. The cheap checks (counts and lengths) come first; only
then is each image decoded from base64 and its header read, never its pixels. The
defaults leave room for long-context chats; lower them for a service whose requests are
smaller.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import imagesize
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
    # Each image as sent (its base64).
    max_image_chars: PositiveInt = 1 << 20
    # Width x height of each image, by its header: 2**25 admits 8K UHD (7680x4320).
    max_image_pixels: PositiveInt = 1 << 25
    max_metadata_entries: NonNegativeInt = 32
    # Keys and values of all entries together.
    max_metadata_chars: NonNegativeInt = 8192
    max_session_chars: PositiveInt = 256


def over_limits(request: SubmitRequest, body_bytes: int, limits: InputLimits) -> str | None:
    """What of a submitted request (decoded from `body_bytes`) is over a limit, or which
    image is no PNG, JPEG, GIF or WebP image; None if nothing."""
    return next(_violations(request, body_bytes, limits), None)


def _violations(request: SubmitRequest, body_bytes: int, limits: InputLimits) -> Iterator[str]:
    messages = request.messages or ()
    prompt_chars = (
        len(request.prompt) if request.prompt is not None else sum(len(m.content) for m in messages)
    )
    for name, had in (
        ("max_body_bytes", body_bytes),
        ("max_prompt_chars", prompt_chars),
        ("max_messages", len(messages)),
        ("max_images", len(request.images)),
        ("max_image_chars", max(map(len, request.images), default=0)),
        ("max_metadata_entries", len(request.metadata)),
        ("max_metadata_chars", sum(len(k) + len(v) for k, v in request.metadata.items())),
        ("max_session_chars", len(request.session or "")),
    ):
        limit = getattr(limits, name)
        if had > limit:
            yield f"{name} is {limit}, the request has {had}"
    for index, image in enumerate(request.images):
        violation = _image_violation(index, image, limits.max_image_pixels)
        if violation is not None:
            yield violation


def _image_violation(index: int, image: str, max_pixels: int) -> str | None:
    """What is wrong with one image (`index` counts from 0), from its header only.

    `imagesize` reads the fixed header fields (and walks JPEG's markers by their
    lengths): unlike an image library's open, it inflates no PNG text chunk and
    allocates no canvas, so a hostile image costs no more than its own bytes."""
    try:
        data = decode_image(index, image)
    except ValueError as exc:
        return str(exc)
    if not _admitted_format(data):
        return f"image {index} is not a PNG, JPEG, GIF or WebP image"
    try:
        width, height = imagesize.get(io.BytesIO(data), exif_rotation=False)
    except Exception:  # a truncated or contradictory header breaks the reader its own way
        width = height = -1
    if width < 1 or height < 1:
        return f"image {index} is not a readable PNG, JPEG, GIF or WebP image: no size"
    return over_pixels(index, width, height, max_pixels)


def decode_image(index: int, image: str) -> bytes:
    """An image's bytes from its base64 (`index` counts from 0); ValueError naming it.
    The dispatcher checks images with it, and the worker decodes them with it."""
    try:
        return base64.b64decode(image, validate=True)
    except ValueError as exc:  # binascii.Error, or a str that is not ASCII
        raise ValueError(f"image {index} is not valid base64: {exc}") from None


def over_pixels(index: int, width: int, height: int, max_pixels: int) -> str | None:
    """What `max_image_pixels` says of image `index` of this size; None within it."""
    if width * height > max_pixels:
        return (
            f"max_image_pixels is {max_pixels}, image {index} has "
            f"{width}x{height} = {width * height} pixels"
        )
    return None


def _admitted_format(data: bytes) -> bool:
    """PNG, JPEG, GIF or WebP, by the bytes each format starts with."""
    return data.startswith((b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a")) or (
        data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    )

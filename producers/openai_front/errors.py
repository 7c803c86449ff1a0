"""OpenAI's error body, and which of the request's parameters an error is about.

A request is checked in three places: the front decodes its body, the SDK checks the
submit built from it against the wire contract, and the dispatcher checks its
`[dispatcher.input]` limits (the worker, its images). The last two name fairq's fields
(`sampling.temperature`, `max_session_chars`), so `param` is translated back to what the
caller sent (`temperature`, `fairq.session`); `names` are the request's own names for
the submit's fields where they differ (`param_names` of each request type).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from broker_config.config_errors import error_path
from broker_config.wire import ErrorCode, ErrorEvent


class FrontError(Exception):
    """An HTTP error in OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# The HTTP status, OpenAI error type and code for each of the contract's error codes.
_ERRORS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.UNKNOWN_TENANT: (401, "authentication_error"),
    ErrorCode.UNKNOWN_ENDPOINT: (404, "invalid_request_error"),
    ErrorCode.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorCode.QUOTA_EXCEEDED: (429, "insufficient_quota"),
    ErrorCode.OVERLOADED: (429, "rate_limit_error"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    ErrorCode.CANCELLED: (499, "cancelled"),
    ErrorCode.INTERNAL: (500, "server_error"),
    ErrorCode.UNAVAILABLE: (503, "server_error"),
}

# The submit's fields that the caller sends in the request's `fairq` object.
FAIRQ_FIELDS = frozenset({"priority", "deadline", "session", "metadata"})

# The submit field each `[dispatcher.input]` limit (broker_config.limits) bounds.
_LIMIT_FIELDS = {
    "max_prompt_chars": "prompt",
    "max_messages": "messages",
    "max_images": "images",
    "max_image_chars": "images",
    "max_image_pixels": "images",
    "max_metadata_entries": "metadata",
    "max_metadata_chars": "metadata",
    "max_session_chars": "session",
}


def error_for(
    code: ErrorCode,
    message: str,
    retry_after_s: float | None = None,
    param: str | None = None,
) -> FrontError:
    status, type_ = _ERRORS[code]
    return FrontError(
        status, message, type_=type_, code=str(code), param=param, retry_after_s=retry_after_s
    )


def body_param(exc: msgspec.ValidationError) -> str | None:
    """The field of the body msgspec found wrong, also when the field itself is missing
    or unknown (msgspec names it in the message, and only its parent in the path)."""
    path = error_path(exc)
    field = re.search(r"(?:missing required|unknown) field `([^`]+)`", str(exc))
    if field is not None:
        path = f"{path}.{field[1]}" if path else field[1]
    return path.replace("[...]", "") if path else None


def submit_param(path: str | None, names: Mapping[str, str]) -> str | None:
    """The caller's parameter a field of its submit (`sampling.stop[0]`) was made from."""
    if path is None:
        return None
    name = re.split(r"[.\[]", path.removeprefix("sampling."), maxsplit=1)[0]
    if name == "messages":
        return path  # the same shape in OpenAI's request: keep the index and field
    if name in FAIRQ_FIELDS:
        return f"fairq.{name}"
    return names.get(name, name)


def submit_error(exc: Exception, names: Mapping[str, str]) -> FrontError:
    """The 400 for a submit the SDK refused, naming the caller's parameter rather than
    the wire's field path (`- at $.sampling.temperature`)."""
    message = str(exc)
    param = submit_param(error_path(exc), names)
    if param is not None:
        reason = re.sub(r"^invalid body: | - at `\$[^`]*`$", "", message)
        message = f"invalid `{param}`: {reason}"
    return FrontError(400, message, param=param)


def event_error(event: ErrorEvent, names: Mapping[str, str]) -> FrontError:
    """The error a request's error event is answered with; an `invalid_request` names the
    parameter over a `[dispatcher.input]` limit, or the images a check refused."""
    param = None
    if event.code == ErrorCode.INVALID_REQUEST:
        limit = re.search(r"\b(max_\w+) is \d+", event.message)
        field = _LIMIT_FIELDS.get(limit[1]) if limit is not None else None
        if field is None and re.search(r"\bimages?\b", event.message):
            field = "images"
        param = submit_param(field, names)
    return error_for(event.code, event.message, event.retry_after_s, param)

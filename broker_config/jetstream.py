"""JetStream's own protocol, spelled once: API subjects and bodies, status headers, the
names the KV layer puts on streams and subjects, and what an ack subject says.

fairq talks to parts of the JetStream API that nats-py does not wrap (standing pull
requests through one inbox, batch direct gets, puts acked on one subscription); every
module that does reads the protocol's names from here.
"""

from __future__ import annotations

import json

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import APIError, ServiceUnavailableError

# Headers of status messages (a message with no payload and a `Status` header).
STATUS = "Status"
DESCRIPTION = "Description"
# Statuses fairq acts on.
END_OF_BATCH = "204"  # a batch direct get ended
NOT_FOUND = "404"  # a direct get found nothing; a pull to a consumer that is gone
REQUEST_TIMEOUT = "408"  # a pull request expired
NO_RESPONDERS = "503"  # nothing listens (no such stream or consumer)
# Headers of a direct get reply.
NATS_SUBJECT = "Nats-Subject"
NATS_SEQUENCE = "Nats-Sequence"
KV_OPERATION = "KV-Operation"  # DEL or PURGE on a KV tombstone: no value
# A publish with this header set to 0 is stored only if its subject holds no message.
EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"

# JetStream API error codes (err_code) that provisioning and publishers act on.
ERR_STREAM_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"
ERR_MAX_MSGS_PER_SUBJECT = 10077  # "maximum messages per subject exceeded"
ERR_CONSUMER_NOT_UNIQUE = 10100  # "filtered consumer not unique on workqueue stream"
ERR_WRONG_LAST_SEQUENCE = 10071  # "wrong last sequence": a create-only put found a value


def status_of(msg: Msg) -> tuple[str | None, str]:
    """(status, description) of a status message; (None, "") for a message with data."""
    headers = msg.headers or {}
    return headers.get(STATUS), headers.get(DESCRIPTION, "")


# -- KV buckets ------------------------------------------------------------------------------


def unanswered(exc: BaseException) -> bool:
    """The broker did not answer (a timeout, no responders, no JetStream leader during a
    cluster's election): worth asking again soon, unlike a setting it refused."""
    return isinstance(exc, nats.errors.Error) and (
        isinstance(exc, ServiceUnavailableError) or not isinstance(exc, APIError)
    )


def kv_stream(bucket: str) -> str:
    """The stream behind a KV bucket."""
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str) -> str:
    """The subject a KV key is stored on."""
    return f"$KV.{bucket}.{key}"


def is_put_ack(data: bytes) -> bool:
    """True for a plain successful publish ack (`{"stream":...}` without an error), read
    without parsing JSON: the worker's hot path stores one final event per request."""
    return data.startswith(b'{"stream":') and b'"error"' not in data


def ack_error(data: bytes) -> tuple[int | None, str]:
    """(err_code, description) of a publish ack that is not `is_put_ack`."""
    try:
        error = json.loads(data)["error"]
        return error.get("err_code"), error["description"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, f"unreadable ack {data[:200]!r}"


# -- pull consumers --------------------------------------------------------------------------


def pull_subject(stream: str, consumer: str) -> str:
    """Where a pull request for a durable consumer goes."""
    return f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def pull_request(batch: int, expires_s: float) -> bytes:
    """A pull request for up to `batch` messages, standing for `expires_s`."""
    return json.dumps({"batch": batch, "expires": int(expires_s * 1e9)}).encode()


def delivery_of(ack_subject: str) -> tuple[float, int]:
    """When a delivered message was stored (seconds since the epoch) and how many times it
    has been delivered, read from its ack subject. Cheaper than nats-py's `Msg.metadata`,
    which builds a datetime."""
    tokens, stream = _ack_tokens(ack_subject)
    return int(tokens[stream + 5]) / 1e9, int(tokens[stream + 2])


def stream_seq_of(ack_subject: str) -> int:
    """The stream sequence of a delivered message, from its ack subject."""
    tokens, stream = _ack_tokens(ack_subject)
    return int(tokens[stream + 3])


def consumer_of(ack_subject: str) -> str:
    """The consumer that delivered a message, from its ack subject."""
    tokens, stream = _ack_tokens(ack_subject)
    return tokens[stream + 1]


def _ack_tokens(ack_subject: str) -> tuple[list[str], int]:
    """An ack subject's tokens and the index of the stream name in them:
    `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>`,
    or the form with domain and account hash before the stream and a token after."""
    tokens = ack_subject.split(".")
    return tokens, 2 if len(tokens) == 9 else 4


# -- stream messages -------------------------------------------------------------------------


def msg_delete_subject(stream: str) -> str:
    return f"$JS.API.STREAM.MSG.DELETE.{stream}"


def msg_delete_request(seq: int) -> bytes:
    """Delete one message by sequence; `no_erase`: no overwrite of its bytes on disk."""
    return json.dumps({"seq": seq, "no_erase": True}).encode()


def api_error(data: bytes) -> dict | None:
    """The `error` object of a JetStream API reply (None on success or unreadable)."""
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, dict) else None


# -- direct gets -----------------------------------------------------------------------------


def direct_get_subject(stream: str) -> str:
    return f"$JS.API.DIRECT.GET.{stream}"


def direct_get_last(subjects: list[str]) -> bytes:
    """A batch direct get of the newest message on each subject (nats-server >= 2.11)."""
    return json.dumps({"multi_last": subjects, "batch": len(subjects)}).encode()


def direct_get_next(subject_filter: str, from_seq: int, batch: int) -> bytes:
    """A batch direct get of up to `batch` messages on `subject_filter` from `from_seq` on."""
    return json.dumps({"next_by_subj": subject_filter, "seq": from_seq, "batch": batch}).encode()

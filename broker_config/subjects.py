"""Subjects, headers and JetStream names: the addressing half of the wire contract.

Public subjects (firm, see docs/protocol.md):

    <prefix>.req.<endpoint>.<tenant>     submit (JetStream publish)
    <prefix>.api.status.<tenant>         request/reply
    <prefix>.api.cancel.<tenant>         request/reply
    <prefix>.api.depth                   request/reply
    <prefix>.admin.reload                request/reply, every dispatcher answers (operators)

Stored subjects (may change): the requests stream keeps each request under
`<prefix>.q.<shard>.<endpoint>.<tenant>`, the shard a hash of the tenant (the stream's
subject transform, so publishers never see it), and the dispatcher moves a flooding
tenant's excess to `<prefix>.park.<endpoint>.<tenant>` in the parked stream
(dispatcher/intake/shards.py explains why).

Internal subjects (may change; only fairq's own services use them) live under
`<prefix>.int.`, so one permission line covers them all:

    <prefix>.int.work.<endpoint>.<worker>   dispatcher -> worker: batches
    <prefix>.int.abort.<endpoint>           dispatcher -> all workers of an endpoint: abort ids
    <prefix>.int.hb.<endpoint>.<worker>     worker -> dispatcher: heartbeats
    <prefix>.int.done.<endpoint>.<worker>   worker -> dispatcher: completions
    <prefix>.int.evict.<endpoint>.<worker>  dispatcher -> worker: it failed its probes
    <prefix>.int.scale.<endpoint>           dispatcher -> supervisor: desired replicas
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

TOKEN_PATTERN = r"[A-Za-z0-9_-]{1,64}"
REQUEST_ID_PATTERN = r"[A-Za-z0-9._-]{1,128}"
_TOKEN_RE = re.compile(TOKEN_PATTERN)
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)

HDR_MSG_ID = "Nats-Msg-Id"
HDR_REPLY = "Fq-Reply"
HDR_CONTENT_TYPE = "Content-Type"
# On `<prefix>.admin.*` calls: what is asked. A message the broker or a service publishes
# on a subject some caller named as its reply (a PubAck, an API answer) carries none.
HDR_ADMIN_OP = "Fq-Admin-Op"


def message_bytes(payload: bytes, headers: Mapping[str, str] | None = None) -> int:
    """What a message counts against the server's `max_payload`: its payload and its
    headers as sent (`NATS/1.0`, a line per header, a blank line), which nats-py leaves
    out of its own check; the server drops the connection of a client over it."""
    if not headers:
        return len(payload)
    lines = "".join(f"{key}: {value}\r\n" for key, value in headers.items())
    return len(payload) + len(f"NATS/1.0\r\n{lines}\r\n".encode())


CONTENT_TYPE_JSON = "application/json"
CONTENT_TYPE_MSGPACK = "application/msgpack"

# NATS puts no hard limit on subject length; this one keeps a hostile Fq-Reply small.
MAX_REPLY_LENGTH = 256
# The shard of requests stored before the requests stream had shards.
UNSHARDED = "unsharded"
# Prefix of every tenant's inbox; a tenant user may subscribe only below its own.
TENANT_INBOX_BASE = "_INBOX_"


def shard_of(tenant: str, shards: int) -> int:
    """The shard a tenant's requests are stored in: FNV-1a (32 bit) of the tenant token,
    modulo `shards`, as nats-server's `partition` subject transform computes it."""
    digest = 0x811C9DC5
    for byte in tenant.encode():
        digest = ((digest ^ byte) * 0x01000193) & 0xFFFFFFFF
    return digest % shards


class SubjectError(ValueError):
    """A subject, token or name that does not follow the contract."""


class ApiKind(Enum):
    STATUS = "status"
    CANCEL = "cancel"
    DEPTH = "depth"


def is_token(value: str) -> bool:
    """True for a valid tenant, endpoint, worker id or subject prefix."""
    return _TOKEN_RE.fullmatch(value) is not None


def is_request_id(value: str) -> bool:
    return _REQUEST_ID_RE.fullmatch(value) is not None


def check_token(value: str, what: str) -> str:
    """`value` if it is a valid token, else a SubjectError naming `what`."""
    if not isinstance(value, str) or not is_token(value):
        raise SubjectError(f"invalid {what} {value!r}: must match {TOKEN_PATTERN}")
    return value


def check_request_id(value: str) -> str:
    if not isinstance(value, str) or not is_request_id(value):
        raise SubjectError(f"invalid request id {value!r}: must match {REQUEST_ID_PATTERN}")
    return value


@dataclass(frozen=True, slots=True)
class Subjects:
    """Every subject and JetStream name fairq uses, derived from one prefix.

    Deployments sharing a server need prefixes that differ in more than letter case,
    because stream and bucket names are the upper-cased prefix.
    """

    prefix: str = "fq"

    def __post_init__(self) -> None:
        check_token(self.prefix, "subject prefix")

    # -- submit -------------------------------------------------------------------------

    def request(self, endpoint: str, tenant: str) -> str:
        """`<prefix>.req.<endpoint>.<tenant>`: where a client submits."""
        return (
            f"{self.prefix}.req.{check_token(endpoint, 'endpoint')}.{check_token(tenant, 'tenant')}"
        )

    def parse_request(self, subject: str) -> tuple[str, str]:
        """`(endpoint, tenant)` of a request subject, as published or as stored."""
        parts = self._request_parts(subject)
        if parts is None:
            raise SubjectError(
                f"not a request subject: {subject!r} "
                f"(expected {self.prefix}.req.<endpoint>.<tenant>)"
            )
        return check_token(parts[0], "endpoint"), check_token(parts[1], "tenant")

    def _request_parts(self, subject: str) -> tuple[str, str] | None:
        """The endpoint and tenant tokens of a published, stored or parked request subject."""
        parts = subject.split(".")
        if len(parts) == 4 and parts[0] == self.prefix and parts[1] in ("req", "park"):
            return parts[2], parts[3]
        if len(parts) == 5 and parts[0] == self.prefix and parts[1] == "q":
            return parts[3], parts[4]
        return None

    @property
    def all_requests(self) -> str:
        """Filter for every request subject; also the request stream's subject."""
        return f"{self.prefix}.req.*.*"

    def tenant_requests(self, tenant: str) -> str:
        """Filter for one tenant's requests to every endpoint (its user's publish
        permission; a valid tenant name)."""
        return f"{self.prefix}.req.*.{check_token(tenant, 'tenant')}"

    def tenant_of(self, subject: str) -> str | None:
        """The tenant of a request subject (published, stored or parked) or an API subject,
        if its tenant token is a valid name; None otherwise, whatever else is wrong with it."""
        request = self._request_parts(subject)
        if request is not None:
            return request[1] if is_token(request[1]) else None
        parts = subject.split(".")
        if len(parts) == 4 and parts[0] == self.prefix and parts[1] == "api" and is_token(parts[3]):
            return parts[3]
        return None

    # -- request/reply APIs -------------------------------------------------------------

    def status(self, tenant: str) -> str:
        return f"{self.prefix}.api.status.{check_token(tenant, 'tenant')}"

    def cancel(self, tenant: str) -> str:
        return f"{self.prefix}.api.cancel.{check_token(tenant, 'tenant')}"

    @property
    def depth(self) -> str:
        return f"{self.prefix}.api.depth"

    @property
    def admin_reload(self) -> str:
        """Every dispatcher re-reads its config file and answers (dispatcher/api/reload.py).
        Outside `tenant_api` and `tenant_requests`, so no tenant user may publish it."""
        return f"{self.prefix}.admin.reload"

    def api_filter(self, kind: ApiKind) -> str:
        """What the dispatcher subscribes to for one API (every tenant's status, ...)."""
        return self.depth if kind is ApiKind.DEPTH else f"{self.prefix}.api.{kind.value}.*"

    def tenant_api(self, tenant: str) -> str:
        """Filter for every API subject of one tenant (its user's publish permission)."""
        return f"{self.prefix}.api.*.{check_token(tenant, 'tenant')}"

    def parse_api(self, subject: str) -> tuple[ApiKind, str | None]:
        """`(kind, tenant)` of an API subject; tenant is None for depth."""
        if subject == self.depth:
            return ApiKind.DEPTH, None
        parts = subject.split(".")
        kinds = {ApiKind.STATUS.value: ApiKind.STATUS, ApiKind.CANCEL.value: ApiKind.CANCEL}
        if len(parts) != 4 or parts[0] != self.prefix or parts[1] != "api" or parts[2] not in kinds:
            raise SubjectError(f"not an API subject: {subject!r}")
        return kinds[parts[2]], check_token(parts[3], "tenant")

    # -- internal (may change) ----------------------------------------------------------

    @property
    def internal(self) -> str:
        """Filter for every internal subject."""
        return f"{self.prefix}.int.>"

    def work(self, endpoint: str, worker_id: str) -> str:
        """Batches for one worker."""
        return self._internal("work", endpoint, worker_id)

    def evict(self, endpoint: str, worker_id: str) -> str:
        """Tells one worker it was evicted (failed health probes)."""
        return self._internal("evict", endpoint, worker_id)

    def abort(self, endpoint: str) -> str:
        """Abort broadcast to every worker of an endpoint."""
        return f"{self.prefix}.int.abort.{check_token(endpoint, 'endpoint')}"

    def heartbeat(self, endpoint: str, worker_id: str) -> str:
        return self._internal("hb", endpoint, worker_id)

    def heartbeats(self, endpoint: str) -> str:
        """Filter for every heartbeat of an endpoint's workers."""
        return self._every("hb", endpoint)

    def completion(self, endpoint: str, worker_id: str) -> str:
        return self._internal("done", endpoint, worker_id)

    def completions(self, endpoint: str) -> str:
        """Filter for every completion of an endpoint's workers."""
        return self._every("done", endpoint)

    def scale(self, endpoint: str) -> str:
        """Autoscaling decisions for an endpoint's workers."""
        return f"{self.prefix}.int.scale.{check_token(endpoint, 'endpoint')}"

    def batches(self, endpoint: str) -> str:
        """Filter for every batch sent to an endpoint's workers (for observers)."""
        return self._every("work", endpoint)

    def evictions(self, endpoint: str) -> str:
        """Filter for every eviction of an endpoint's workers (for observers)."""
        return self._every("evict", endpoint)

    def _internal(self, kind: str, endpoint: str, worker_id: str) -> str:
        return (
            f"{self.prefix}.int.{kind}.{check_token(endpoint, 'endpoint')}"
            f".{check_token(worker_id, 'worker id')}"
        )

    def _every(self, kind: str, endpoint: str) -> str:
        return f"{self.prefix}.int.{kind}.{check_token(endpoint, 'endpoint')}.*"

    # -- JetStream names ----------------------------------------------------------------

    @property
    def requests_stream(self) -> str:
        return f"{self.prefix.upper()}_REQUESTS"

    @property
    def results_bucket(self) -> str:
        return f"{self.prefix.upper()}_RESULTS"

    @property
    def limits_bucket(self) -> str:
        return f"{self.prefix.upper()}_LIMITS"

    @property
    def leases_bucket(self) -> str:
        return f"{self.prefix.upper()}_LEASES"

    @property
    def parked_stream(self) -> str:
        return f"{self.prefix.upper()}_PARKED"

    def stored_request_transform(self, shards: int) -> tuple[str, str]:
        """The requests stream's subject transform: `<prefix>.req.<endpoint>.<tenant>` is
        stored as `<prefix>.q.<shard>.<endpoint>.<tenant>`, the shard being
        `shard_of(tenant, shards)` (the server's `partition` function)."""
        return (
            self.all_requests,
            f"{self.prefix}.q.{{{{partition({shards},2)}}}}.{{{{wildcard(1)}}}}"
            f".{{{{wildcard(2)}}}}",
        )

    @property
    def all_stored(self) -> str:
        """Filter for every stored request subject."""
        return f"{self.prefix}.q.*.*.*"

    def shard_filter(self, shard: int | str) -> str:
        """Filter for one shard's stored requests (the dispatcher's consumer of it).

        The UNSHARDED shard holds requests stored before the stream had shards, as
        published. Its filter is not `all_requests`: nats-server takes a consumer whose
        filter is the stream's own subject for one over every message, and on a
        work-queue stream then keeps every message the other consumers ack until this
        one has passed it."""
        if shard == UNSHARDED:
            return f"{self.prefix}.req.>"
        return f"{self.prefix}.q.{shard}.*.*"

    def shard_consumer(self, shard: int | str) -> str:
        """Durable pull consumer over one shard (`~` cannot occur in a token)."""
        return f"{self.prefix}~shard~{shard}"

    def shard_key(self, subject: str) -> str:
        """The shard of a stored request subject, as a string (UNSHARDED for one stored
        before the stream had shards)."""
        parts = subject.split(".")
        return parts[2] if len(parts) == 5 else UNSHARDED

    def stored_tenant_filter(self, tenant: str) -> str:
        """Filter for one tenant's stored requests, any subject token, valid name or not."""
        return f"{self.prefix}.q.*.*.{tenant}"

    def parked(self, subject: str) -> str:
        """Where a stored request of `subject` is parked: `<prefix>.park.<endpoint>.<tenant>`."""
        endpoint, tenant = self._request_parts(subject) or ("", "")
        if not endpoint or not tenant:
            raise SubjectError(f"not a request subject: {subject!r}")
        return f"{self.prefix}.park.{endpoint}.{tenant}"

    def is_parked(self, subject: str) -> bool:
        return subject.startswith(f"{self.prefix}.park.")

    @property
    def all_parked(self) -> str:
        """Filter for every parked request; also the parked stream's subject."""
        return f"{self.prefix}.park.*.*"

    def parked_tenant_filter(self, tenant: str) -> str:
        """Filter for one tenant's parked requests, any subject token."""
        return f"{self.prefix}.park.*.{tenant}"

    def parked_consumer(self, tenant: str) -> str:
        """Durable pull consumer over one tenant's parked requests.

        A subject token that is not a valid tenant name (any token can be published to)
        gets a hashed name, so its requests can still be answered rather than stranded.
        """
        if is_token(tenant):
            return f"{self.prefix}~parked~{tenant}"
        digest = hashlib.sha256(tenant.encode()).hexdigest()[:24]
        return f"{self.prefix}~parked-hash~{digest}"

    @staticmethod
    def result_key(tenant: str, request_id: str) -> str:
        """KV key of a request's final event: `<tenant>.<id>`, with `.` in the id as `=`.

        Ids may contain dots (even `..`), which would break a KV key into empty tokens;
        `=` never occurs in an id, so the mapping is reversible.
        """
        return f"{check_token(tenant, 'tenant')}.{check_request_id(request_id).replace('.', '=')}"

    @staticmethod
    def tenant_results(tenant: str) -> str:
        """The KV key filter matching every result key of `tenant` (to watch them)."""
        return f"{check_token(tenant, 'tenant')}.*"

    @staticmethod
    def parse_result_key(key: str) -> tuple[str, str]:
        """`(tenant, request_id)` of a result key."""
        tenant, sep, encoded = key.partition(".")
        if not sep:
            raise SubjectError(f"not a result key: {key!r} (expected <tenant>.<id>)")
        return check_token(tenant, "tenant"), check_request_id(encoded.replace("=", "."))

    # -- tenant inboxes and reply subjects ----------------------------------------------

    @staticmethod
    def inbox_prefix(tenant: str) -> str:
        """The inbox prefix a tenant's client must use (nats-py: `inbox_prefix=`)."""
        return f"{TENANT_INBOX_BASE}{check_token(tenant, 'tenant')}"

    def check_reply(self, reply: str, tenant: str | None, *, tenant_inboxes: bool = False) -> str:
        """`reply` if fairq may publish a request's events there, else a SubjectError.

        fairq's services publish with full permissions, so a reply subject inside fairq's
        own namespace or a `$` system namespace would let a client inject messages (for
        example a forged request into another tenant's queue). With per-tenant users
        (`tenant_inboxes`), a reply must also lie in the tenant's own inbox.
        """
        if not reply or len(reply) > MAX_REPLY_LENGTH:
            raise SubjectError(
                f"invalid {HDR_REPLY} subject {reply[:MAX_REPLY_LENGTH]!r}: "
                f"must be 1 to {MAX_REPLY_LENGTH} characters"
            )
        tokens = reply.split(".")
        if any(not t or t in ("*", ">") or any(c.isspace() for c in t) for t in tokens):
            raise SubjectError(
                f"invalid {HDR_REPLY} subject {reply!r}: must be a subject without "
                "empty tokens, wildcards or whitespace"
            )
        if tokens[0] == self.prefix or reply.startswith("$"):
            raise SubjectError(
                f"invalid {HDR_REPLY} subject {reply!r}: subjects under "
                f"'{self.prefix}.' and '$' are reserved"
            )
        if tenant_inboxes:
            inbox = self.inbox_prefix(tenant)
            if tokens[0] != inbox or len(tokens) < 2:
                raise SubjectError(
                    f"invalid {HDR_REPLY} subject {reply!r}: must start with '{inbox}.'"
                )
        return reply

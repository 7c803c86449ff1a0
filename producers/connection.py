"""Opening the NATS connection `Client.connect` uses: credentials and options checked
before anything is opened, and every failure to connect raised as `ConnectionFailed`,
with the reason nats-py reported.

    options = nats_options(url, inbox_prefix=tenant_inbox("acme"), nkey="acme.nk")
    nc = await open_connection(url, options)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NATS

from broker_config.connection import ConnectionOptionsError, credentials, server_urls
from broker_config.subjects import SubjectError, Subjects
from producers.errors import ConnectionFailed, InvalidRequest, describe

__all__ = ["nats_options", "open_connection", "tenant_inbox"]

# The SDK's logger, named for the module users import (`Client` lives there).
_log = logging.getLogger("producers.client")


def tenant_inbox(tenant: str) -> str:
    """The inbox prefix a tenant's own connection must have (InvalidRequest: bad tenant)."""
    try:
        return Subjects.inbox_prefix(tenant)
    except SubjectError as exc:
        raise InvalidRequest(str(exc)) from exc


def nats_options(
    url: str,
    *,
    user: str | None = None,
    password: str | None = None,
    creds: str | Path | None = None,
    nkey: str | Path | None = None,
    inbox_prefix: str | None = None,
    connect_timeout_s: float = 5.0,
    allow_reconnect: bool = True,
) -> dict[str, Any]:
    """`nats.connect`'s keywords; ConnectionFailed for conflicting or unreadable credentials.

    `allow_reconnect=False` fails at once when the server is unreachable; otherwise
    nats-py keeps retrying the server, also on the first connect.
    """
    try:
        secrets = credentials(user=user, password=password, creds=creds, nkey=nkey)
    except ConnectionOptionsError as exc:
        raise ConnectionFailed(f"cannot connect to NATS at {url}: {exc}") from None
    options: dict[str, Any] = {
        **secrets,
        "connect_timeout": connect_timeout_s,
        "allow_reconnect": allow_reconnect,
    }
    if inbox_prefix:
        options["inbox_prefix"] = inbox_prefix
    if not allow_reconnect:
        # nats-py tries a server at least twice before giving up; make it quick.
        options |= {"max_reconnect_attempts": 1, "reconnect_time_wait": 0}
    return options


async def open_connection(url: str, options: dict[str, Any]) -> NATS:
    """Connect to the servers of `url` (comma-separated) with `nats_options`' keywords."""
    errors = _ErrorLog()
    try:
        return await nats.connect(server_urls(url), error_cb=errors.record, **options)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        # "no servers available" hides why: the last attempt's error says it.
        cause = errors.last if isinstance(exc, nats.errors.NoServersError) else None
        raise ConnectionFailed(
            f"cannot connect to NATS at {url}: {describe(cause or exc)}"
        ) from exc


class _ErrorLog:
    """nats-py's error callback: logs each error and remembers the last one.

    Connection-level failures are raised to the caller or followed by a reconnect, so they
    are only debug noise; anything else (permission violations, slow consumers) is not.
    """

    _ROUTINE = (OSError, TimeoutError, nats.errors.NoServersError, nats.errors.StaleConnectionError)

    def __init__(self) -> None:
        self.last: Exception | None = None

    async def record(self, exc: Exception) -> None:
        self.last = exc
        level = logging.DEBUG if isinstance(exc, self._ROUTINE) else logging.WARNING
        _log.log(level, "nats: %s", describe(exc))

"""Operator calls on the dispatchers: `reload_dispatchers` asks every dispatcher to
re-read its config file (`<prefix>.admin.reload`, dispatcher/api/reload.py) and gathers
their replies.

Every dispatcher answers the one request, so this is a request to many: the request is
published with a reply inbox and the replies are collected until `timeout_s` has passed
(how many dispatchers run is not known here; a caller that knows can check the count).
"""

from __future__ import annotations

import time

import msgspec
from nats.aio.client import Client as NATS

from broker_config.subjects import HDR_ADMIN_OP, Subjects
from dispatcher.api.reload import ReloadReply


async def reload_dispatchers(
    nc: NATS, subjects: Subjects, timeout_s: float, expected: int | None = None
) -> list[ReloadReply]:
    """The replies of every dispatcher that answered within `timeout_s` (or until
    `expected` have), in arrival order; a reply that cannot be decoded comes back as a
    failed one that says so."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    replies: list[ReloadReply] = []
    try:
        await nc.publish(
            subjects.admin_reload, b"{}", reply=inbox, headers={HDR_ADMIN_OP: "reload"}
        )
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and (
            expected is None or len(replies) < expected
        ):
            try:
                msg = await subscription.next_msg(timeout=left)
            except TimeoutError:
                break
            try:
                replies.append(msgspec.json.decode(msg.data, type=ReloadReply))
            except msgspec.DecodeError as exc:
                replies.append(ReloadReply(False, "?", error=f"unreadable reply: {exc}"))
    finally:
        await subscription.unsubscribe()
    return replies


def tenant_changes(reply: ReloadReply) -> str:
    """What a dispatcher's reload changed, for people."""

    def names(tenants: list[str]) -> str:
        return ", ".join(tenants) or "none"

    return (
        f"tenants added {names(reply.added)}, removed {names(reply.removed)}, "
        f"changed {names(reply.changed)}"
    )

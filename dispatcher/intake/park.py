"""Moving a flooding tenant's stored requests out of its shard, into the parked stream.

    async with Park(nc, subjects) as park:
        await park.move(msgs)        # each stored once in the parked stream, then acked

A shard consumer delivers its tenants' requests in stream order, so a request of a
tenant behind another tenant's deep backlog is reached only by reading through that
backlog. What is read of a tenant whose window is full is moved here: published to
`<prefix>.park.<endpoint>.<tenant>` with the original headers, and only once the parked
stream acknowledged it, acked in the requests stream. A dispatcher that dies in between
leaves the original to be redelivered and moved again; the copy's `Nats-Msg-Id` is the
original's stream sequence, so the parked stream stores it once.

The copy carries the request's own id and the time it was first stored in headers of
its own; `restore` puts them back for admission, so the request keeps its id and its
place in line.

A copy the parked stream refuses for good (the tenant's parked requests at the stream's
per-subject cap) is handed over as it is instead: its tenant then holds more than its
window, but nobody behind it waits on a move that cannot happen.

Drain order on exit: the writer fails the moves still waiting for an ack (their
originals are nak'd by the caller, nothing is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Mapping

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from broker_config import jetstream
from broker_config.kv_writer import Refused, StreamWriter
from broker_config.subjects import HDR_MSG_ID, Subjects

log = logging.getLogger("fairq.intake")

HDR_PARKED_ID = "Fq-Parked-Id"  # the request's own Nats-Msg-Id
HDR_PARKED_AT = "Fq-Parked-At"  # when the requests stream stored it, ns since the epoch
# A move that failed is tried again after this long (the original is nak'd with it).
MOVE_RETRY_S = 1.0


def restore(msg: Msg) -> Msg:
    """A parked copy (delivered from the parked stream) as the original was published:
    its own id back in Nats-Msg-Id."""
    msg.headers = restored_headers(msg.headers or {})
    return msg


def restored_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """A parked copy's headers as the original's (only a parked copy's: a client could
    send the header with its request)."""
    restored = dict(headers)
    if HDR_PARKED_ID in restored:
        original = restored.pop(HDR_PARKED_ID)
        if original:
            restored[HDR_MSG_ID] = original
        else:  # the original had none (its id was in the body)
            restored.pop(HDR_MSG_ID, None)
    return restored


def stored_at(msg: Msg, subjects: Subjects) -> float:
    """When a delivered request was first stored (seconds since the epoch): for a parked
    copy the original's time, not the move's. Only a parked copy's header is believed
    (a client could send one with its request)."""
    if subjects.is_parked(msg.subject):
        with contextlib.suppress(ValueError, TypeError):
            return int((msg.headers or {}).get(HDR_PARKED_AT)) / 1e9
    return jetstream.delivery_of(msg.reply)[0]


class Moved(enum.Enum):
    MOVED = "moved"  # stored in the parked stream, acked in the requests stream
    REFUSED = "refused"  # the parked stream refused it for good: still held, unacked
    FAILED = "failed"  # not stored this time: nak'd, to be redelivered and moved again


class Park:
    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self.subjects = subjects
        self.writer = StreamWriter(nc, subjects.parked_stream)

    async def __aenter__(self) -> Park:
        await self.writer.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.writer.__aexit__(*exc_info)

    async def move(self, msgs: list[Msg]) -> list[Moved]:
        """Store each in the parked stream and ack it here."""
        return list(await asyncio.gather(*(self._move(msg) for msg in msgs)))

    async def _move(self, msg: Msg) -> Moved:
        # The client's own publish expectations (`Nats-Expected-Stream`...) were about the
        # requests stream: the parked stream would refuse the copy for them.
        headers = {
            name: value
            for name, value in (msg.headers or {}).items()
            if not name.lower().startswith("nats-expected")
        }
        ns, seq = _origin(msg.reply)
        headers[HDR_PARKED_ID] = headers.pop(HDR_MSG_ID, "")  # "": it had none
        headers[HDR_PARKED_AT] = str(ns)
        headers[HDR_MSG_ID] = f"park-{seq}"
        try:
            await self.writer.publish(self.subjects.parked(msg.subject), msg.data, headers)
            await msg.ack()
            return Moved.MOVED
        except Refused as exc:
            log.warning(
                "the parked stream refused request %s of %s (%s): handed over as it is",
                seq,
                msg.subject,
                exc,
            )
            return Moved.REFUSED
        except nats.errors.Error as exc:
            log.warning(
                "moving request %s of %s to the parked stream failed: %s", seq, msg.subject, exc
            )
            with contextlib.suppress(nats.errors.Error):
                await msg.nak(delay=MOVE_RETRY_S)
            return Moved.FAILED


def _origin(ack_subject: str) -> tuple[int, int]:
    """(ns when stored, stream sequence) of a delivered message."""
    stored, _ = jetstream.delivery_of(ack_subject)
    return round(stored * 1e9), jetstream.stream_seq_of(ack_subject)

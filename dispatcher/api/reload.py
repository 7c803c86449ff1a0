"""Reloading the config file at run time: tenants, tiers and `unlisted_tenants` change
without a restart (docs/configuration.md, "Reloading").

Two triggers, one path: SIGHUP (`install_reload_signal`) and a request on
`<prefix>.admin.reload`, which every dispatcher answers with a `ReloadReply`
(producers/admin.py gathers the replies). A reload re-reads the file, refuses it whole
if it does not parse or changes a section a reload cannot (the running configuration
stays, the reply says why), applies it to the scheduler (dispatcher/core/reconfigure.py)
and ends the queued requests of removed tenants with `unknown_tenant`.

The file is compared with itself as it was read at start (or at the last reload), not
with the running configuration: flags may have overridden sections of it (the
dispatcher's options, the broker's), and those overrides are kept; only the reloadable
sections are taken from the file.

Reloads run one at a time. A reload is the scheduler's swap (`Scheduler.reconfigure`),
whose configuration every part reads (`Parts.config`), so admission never sees half of
it; a request checked before it and queued after it (its tenant removed meanwhile) is
set aside by the scheduler (`Scheduler.removed`) and ended on the next maintenance tick.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from nats.aio.msg import Msg

from broker_config.config import Config, ConfigError, load_config
from broker_config.subjects import HDR_ADMIN_OP
from dispatcher.core.reconfigure import RELOADABLE, ReloadError, check_reloadable, tenant_changes
from dispatcher.core.types import Decision, Outcome, Request
from dispatcher.dispatch.endings import Endings
from dispatcher.parts import Parts

if TYPE_CHECKING:
    from dispatcher.service import Dispatcher

log = logging.getLogger("fairq.dispatcher")


class ReloadReply(msgspec.Struct, frozen=True):
    """One dispatcher's answer on `<prefix>.admin.reload` (JSON)."""

    ok: bool
    dispatcher: str
    added: list[str] = []
    removed: list[str] = []
    changed: list[str] = []
    error: str | None = None


def removed_message(tenant: str) -> str:
    return f"tenant {tenant!r} was removed from the configuration"


def dispatcher_name() -> str:
    """How a dispatcher names itself in its replies: host, process, and a suffix that
    tells apart two dispatchers of one process."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Reloader:
    def __init__(self, parts: Parts, endings: Endings, path: str | Path | None) -> None:
        self.parts = parts
        self.endings = endings
        self.path = None if path is None else Path(path)
        self.name = dispatcher_name()
        # The file as last read (see the module doc).
        self.file_config: Config | None = None
        self._started = False  # what a reload changes exists
        self._lock = asyncio.Lock()
        self._triggered: set[asyncio.Task[ReloadReply]] = set()

    def start(self) -> None:
        """Read the file once at start, as the reference for the first reload (unless
        given one: a later tenure of a process keeps its predecessor's, dispatcher.ha.tenures)."""
        if self.path is not None and self.file_config is None:
            self.file_config = load_config(self.path)
        self._started = True

    async def close(self) -> None:
        """Stop reloads triggered by signal that are still running."""
        for task in self._triggered:
            task.cancel()
        await asyncio.gather(*self._triggered, return_exceptions=True)

    def trigger(self) -> None:
        """Start a reload and return (a signal handler cannot wait)."""
        task = asyncio.get_running_loop().create_task(self.reload())
        self._triggered.add(task)
        task.add_done_callback(self._triggered.discard)

    async def reload(self) -> ReloadReply:
        """Re-read the file and apply it, or leave the running configuration in force;
        never raises for a bad file. One at a time."""
        async with self._lock:
            reply = await self._reload()
        if reply.ok:
            log.info(
                "config reloaded from %s: tenants added %s, removed %s, changed %s",
                self.path,
                reply.added,
                reply.removed,
                reply.changed,
            )
        else:
            log.error("config reload refused, the running configuration stays: %s", reply.error)
        return reply

    async def _reload(self) -> ReloadReply:
        if self.path is None:
            return self._refused(
                "this dispatcher was started without a config file "
                "(--config): there is nothing to reload"
            )
        if not self._started:
            return self._refused("this dispatcher is still starting; reload once it runs")
        try:
            read = await asyncio.to_thread(load_config, self.path)
        except ConfigError as exc:
            return self._refused(str(exc))
        scheduler = self.parts.scheduler
        config = msgspec.structs.replace(
            scheduler.config, **{name: getattr(read, name) for name in RELOADABLE}
        )
        old_registry = scheduler.registry
        try:
            check_reloadable(self.file_config, read)
            ended = scheduler.reconfigure(config, time.time())
        except ReloadError as exc:
            return self._refused(f"{self.path}: {exc}")
        self.file_config = read
        changes = tenant_changes(old_registry, scheduler.registry)
        await self.end_removed(ended)
        if ended:
            log.info("%d queued requests of removed tenants ended", len(ended))
        return ReloadReply(True, self.name, changes.added, changes.removed, changes.changed)

    def _refused(self, error: str) -> ReloadReply:
        return ReloadReply(False, self.name, error=error)

    async def end_removed(self, requests: Iterable[Request]) -> None:
        """End queued requests of removed tenants with `unknown_tenant`."""
        now = time.time()
        for request in requests:
            waiting = self.parts.held.admitted.pop((request.tenant, request.id), None)
            if waiting is not None:
                await self.endings.reject(
                    waiting, Decision(Outcome.UNKNOWN_TENANT, removed_message(request.tenant)), now
                )

    async def end_set_aside(self) -> None:
        """End the requests the scheduler set aside since (see the module doc)."""
        scheduler = self.parts.scheduler
        if scheduler.removed:
            requests, scheduler.removed = scheduler.removed, []
            await self.end_removed(requests)

    async def on_request(self, msg: Msg) -> None:
        """`<prefix>.admin.reload`: the header `Fq-Admin-Op: reload`, and an empty body or
        a JSON object (no fields yet). The header keeps out what lands here without being
        asked for: a PubAck or an API answer whose caller named this as its reply."""
        if (msg.headers or {}).get(HDR_ADMIN_OP) != "reload":
            log.warning("a message on %s without %s: reload; ignored", msg.subject, HDR_ADMIN_OP)
            reply = self._refused(f"not a reload request: send the header {HDR_ADMIN_OP}: reload")
        else:
            try:
                if msg.data.strip() and not isinstance(msgspec.json.decode(msg.data), dict):
                    raise msgspec.DecodeError("expected a JSON object")
            except msgspec.DecodeError as exc:
                reply = self._refused(f"invalid reload request: {exc}; send an empty body or {{}}")
            else:
                reply = await self.reload()
        if msg.reply:
            await msg.respond(msgspec.json.encode(reply))


def install_reload_signal(
    loop: asyncio.AbstractEventLoop, current: Callable[[], Dispatcher]
) -> None:
    """SIGHUP reloads the config file of the `current()` dispatcher (for the process entry
    points, whose dispatcher is a new one after each tenure)."""
    loop.add_signal_handler(signal.SIGHUP, lambda: current().reloader.trigger())

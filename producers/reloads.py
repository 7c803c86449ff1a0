"""`fairq up`'s reloads (SIGHUP): the dispatcher re-reads the config file, and with
`--auth` the broker users follow its tenants (docs/configuration.md, "Reloading")."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from broker_config.auth import RenderedAuth, registered_tenants, render_auth_dir
from broker_config.config import Config, ConfigError, load_config
from broker_config.server import EmbeddedServerError
from dispatcher.service import Dispatcher
from producers.admin import tenant_changes


class Reloads:
    """SIGHUP: the config file's tenants, tiers and limits, without a restart, one reload
    at a time. With `--auth` the broker users follow the tenants: a new tenant's user is
    rendered (and nats-server reloaded) before the dispatcher admits it, a removed
    tenant's only after the dispatcher has ended its queued requests (so it can still
    read why), and none change when the dispatcher refuses the file."""

    def __init__(
        self,
        dispatcher: Callable[[], Dispatcher],
        config: Config,
        auth: RenderedAuth | None,
        say: Callable[[str], None],
        *,
        reload_broker: Callable[[], None] | None,
    ) -> None:
        """`dispatcher`: the one serving; `reload_broker`: nats-server re-reads its users
        (needed with `auth`)."""
        if auth is not None and reload_broker is None:
            raise ValueError("broker users need a broker to reload")
        self.reload_broker = reload_broker
        self.say = say
        self.dispatcher = dispatcher
        # The front's keys are made at start (the development key), not read from the file.
        self.front_tenants = {key.tenant for key in config.front.keys}
        self.tenants = {*registered_tenants(config), *self.front_tenants}
        self.auth = auth
        self._lock = asyncio.Lock()
        self._running: set[asyncio.Task[None]] = set()

    def trigger(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload())
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def close(self) -> None:
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)

    async def reload(self) -> None:
        async with self._lock:
            wanted = await self._tenants_in_file() if self.auth is not None else None
            if wanted is not None:
                await self._render_users(self.tenants | wanted)
            reply = await self.dispatcher().reload()
            if wanted is not None:
                self.tenants = wanted if reply.ok else self.tenants
                await self._render_users(self.tenants)
        if reply.ok:
            self.say(f"reloaded {self.dispatcher().reloader.path}: {tenant_changes(reply)}")
        else:
            self.say(f"reload refused, the running configuration stays: {reply.error}")

    async def _tenants_in_file(self) -> set[str] | None:
        """The tenants that get broker users by the file; None when it cannot be read
        (the dispatcher's reload then says why)."""
        try:
            config = await asyncio.to_thread(load_config, self.dispatcher().reloader.path)
        except ConfigError:
            return None
        return {*registered_tenants(config), *self.front_tenants}

    async def _render_users(self, tenants: set[str]) -> None:
        try:
            rendered = await asyncio.to_thread(
                render_auth_dir, self.auth.directory, self.dispatcher().config.subjects, tenants
            )
            if rendered.added or rendered.removed:
                await asyncio.to_thread(self.reload_broker)
        except (ValueError, OSError, EmbeddedServerError) as exc:
            self.say(f"reload: broker users unchanged: {exc}")
            return
        for name in rendered.added:
            self.say(f"new broker user {name}: {rendered.seeds[name]}")
        for name in rendered.removed:
            self.say(f"broker user {name} removed")

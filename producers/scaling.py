"""`fairq up --autoscale`: worker processes started and stopped as the dispatcher's
autoscaling decisions say (`ScaleEvent`s on `<prefix>.int.scale.<endpoint>`).

Scaling up starts workers under the lowest numbers neither running nor still draining
(`<endpoint>-w<n>`: two processes must never share a worker id); scaling
down stops the highest-numbered ones with SIGTERM, each in the background: a worker
drains (it stops taking work, its running requests finish and are acked) before it
exits, so nothing is lost, and the dispatcher, told by its last heartbeat, sends it
nothing more. A malformed event is logged and ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections.abc import Callable, Iterable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from broker_config import wire_internal
from broker_config.config import Config
from costmodel.capacity import ScalingPolicy
from producers.supervisor import Child, Supervisor

log = logging.getLogger("fairq.up")


def with_autoscaling(config: Config, default: ScalingPolicy) -> Config:
    """`config` with `default` for every endpoint that has no autoscale table."""
    endpoints = {
        name: spec
        if spec.autoscale is not None
        else msgspec.structs.replace(spec, autoscale=default)
        for name, spec in config.endpoints.items()
    }
    return msgspec.structs.replace(config, endpoints=endpoints)


class ScaleFollower:
    def __init__(
        self,
        nc: NATS,
        config: Config,
        supervisor: Supervisor,
        child: Callable[[str, int], Child],
        say: Callable[[str], None],
    ) -> None:
        self.nc = nc
        self.config = config
        self.supervisor = supervisor
        self.child = child  # the worker process `<endpoint>-w<n>`
        self.say = say
        self._subscriptions: list[Subscription] = []
        # Workers draining, by name: their numbers stay taken until they have exited (a
        # new process under the same worker id would share its work subject).
        self._stopping: dict[str, asyncio.Task[int | None]] = {}

    async def __aenter__(self) -> ScaleFollower:
        for name, spec in self.config.endpoints.items():
            if spec.autoscale is not None:
                self._subscriptions.append(
                    await self.nc.subscribe(self.config.subjects.scale(name), cb=self._on_event)
                )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Unsubscribes, then waits for the workers being stopped to finish draining."""
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        if self._stopping:
            await asyncio.gather(*self._stopping.values(), return_exceptions=True)

    def numbers(self, endpoint: str, names: Iterable[str]) -> list[int]:
        """The numbers of the endpoint's workers among `names`, ascending."""
        pattern = re.compile(rf"{re.escape(endpoint)}-w(\d+)")
        return sorted(int(m.group(1)) for name in names if (m := pattern.fullmatch(name)))

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = wire_internal.SCALE_EVENT.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring a malformed scale event on %s: %s", msg.subject, exc)
            return
        if event.endpoint not in self.config.endpoints or event.desired < 0:
            log.warning("ignoring a scale event for %r to %d", event.endpoint, event.desired)
            return
        await self.apply(event.endpoint, event.desired)

    async def apply(self, endpoint: str, desired: int) -> None:
        running = self.numbers(
            endpoint, (name for name in self.supervisor.children if name not in self._stopping)
        )
        if desired > len(running):
            taken = set(running) | set(self.numbers(endpoint, self._stopping))
            free = (n for n in itertools.count(1) if n not in taken)
            for n in [next(free) for _ in range(desired - len(running))]:
                child = await self.supervisor.add(self.child(endpoint, n))
                self.say(f"scaled {endpoint} up: started {child.name} ({desired} wanted)")
        for n in reversed(running[desired:]):
            name = f"{endpoint}-w{n}"
            self.say(f"scaled {endpoint} down: draining {name} ({desired} wanted)")
            task = asyncio.create_task(self.supervisor.stop(name), name=f"stop {name}")
            self._stopping[name] = task
            task.add_done_callback(lambda _, name=name: self._stopping.pop(name, None))

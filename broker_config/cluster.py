"""A NATS cluster of embedded nats-server processes on 127.0.0.1, for the tests and for
trying a cluster on one machine: each node with JetStream and a store of its own, routes
to every other.

    with EmbeddedNatsCluster(3) as cluster:
        cluster.url                 # "nats://127.0.0.1:p1,nats://127.0.0.1:p2,..."
        cluster.nodes[1].kill()     # kill -9 of one node; .start() brings it back

With `[broker] replicas = 3` the requests stream and every bucket keep a copy on each
node, so a node lost (even the leader of a stream) costs no acknowledged request; clients
given the cluster's URLs (or any one: the server tells them the others) reconnect to
another node on their own. docs/operations.md says what each failure costs.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Self

import nats
import nats.errors

from broker_config.server import HOST, EmbeddedNatsServer, EmbeddedServerError, free_port

CLUSTER_NAME = "fairq"


def node_config(name: str, route_port: int, route_ports: list[int], sync: str | None) -> str:
    """nats-server config text for one node of the cluster."""
    routes = ", ".join(f"nats-route://{HOST}:{port}" for port in route_ports)
    jetstream = f"jetstream {{ sync_interval: {sync} }}\n" if sync else ""
    return (
        f"server_name: {name}\n{jetstream}"
        f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: {HOST}:{route_port}\n"
        f"  routes: [{routes}]\n}}\n"
    )


class EmbeddedNatsCluster:
    """`size` nodes named n1..n<size>; `sync` is nats-server's JetStream `sync_interval`
    ("always": every write on disk before it is acknowledged; None: the server's
    default, see docs/operations.md)."""

    def __init__(
        self,
        size: int = 3,
        *,
        store_root: str | Path | None = None,
        sync: str | None = None,
        ready_timeout_s: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, got {size}")
        route_ports = [free_port() for _ in range(size)]
        self.ready_timeout_s = ready_timeout_s
        self.nodes = [
            EmbeddedNatsServer(
                config=node_config(f"n{i + 1}", route_ports[i], route_ports, sync),
                store_dir=Path(store_root) / f"n{i + 1}" if store_root else None,
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (`--nats` takes this)."""
        return ",".join(node.url for node in self.nodes)

    def node(self, server_name: str) -> EmbeddedNatsServer:
        return self.nodes[int(server_name.removeprefix("n")) - 1]

    def start(self) -> Self:
        try:
            for node in self.nodes:
                node.start()
            asyncio.run(self.wait_for_jetstream())
        except BaseException:
            self.stop()
            raise
        return self

    async def wait_for_jetstream(self) -> None:
        """Until the nodes have elected a JetStream meta leader (streams can be made)."""
        deadline = time.monotonic() + self.ready_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                nc = await nats.connect(
                    self.url.split(","), connect_timeout=2, allow_reconnect=False
                )
            except (OSError, nats.errors.Error) as exc:
                last = exc
                await asyncio.sleep(0.2)
                continue
            try:
                await nc.jetstream().account_info()
                return
            except nats.errors.Error as exc:
                last = exc
                await asyncio.sleep(0.2)
            finally:
                await nc.close()
        raise EmbeddedServerError(
            f"the cluster's JetStream was not ready within {self.ready_timeout_s}s: {last!r}"
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)

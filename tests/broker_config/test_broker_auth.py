"""Per-tenant NATS users: rendered config, and what the broker then allows on a real server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from broker_config.auth import (
    NatsUser,
    Permissions,
    build_users,
    render_auth_config,
    tenant_permissions,
)
from broker_config.config import BrokerSettings
from broker_config.server import EmbeddedNatsServer
from broker_config.streams import provision
from broker_config.subjects import HDR_MSG_ID, Subjects

S = Subjects()
PASSWORDS = {"acme": 'a"c\\m$e {#}', "globex": "globex-pw"}
SERVICE = {"fq-service": "service-pw"}


def test_tenant_permissions_are_exactly_its_own_subjects() -> None:
    assert tenant_permissions(S, "acme") == Permissions(
        publish=("fq.req.*.acme", "fq.api.*.acme"), subscribe=("_INBOX_acme.>",)
    )
    assert tenant_permissions(Subjects("stage"), "acme").publish == (
        "stage.req.*.acme",
        "stage.api.*.acme",
    )


def test_build_users() -> None:
    users = build_users(S, PASSWORDS, SERVICE)
    assert [u.name for u in users] == ["acme", "globex", "fq-service"]
    assert users[0].permissions == tenant_permissions(S, "acme")
    assert users[2].permissions is None


@pytest.mark.parametrize(
    "tenants, services, fragment",
    [
        ({"acme": "x"}, {"acme": "y"}, "defined twice"),
        ({"ac me": "x"}, {}, "invalid tenant"),
        ({"acme": ""}, {}, "non-empty printable ASCII"),
        ({"acme": "p\nw"}, {}, "non-empty printable ASCII"),
        ({}, {"svc one": "x"}, "invalid NATS user name"),
    ],
)
def test_build_users_rejects(
    tenants: dict[str, str], services: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        build_users(S, tenants, services)


def test_render_rejects_bad_users_built_by_hand() -> None:
    with pytest.raises(ValueError, match="password"):
        render_auth_config([NatsUser("x", "")])


# -- on a real server --------------------------------------------------------------------------


@pytest.fixture
async def server(nats_binary: Path) -> AsyncIterator[EmbeddedNatsServer]:
    config = render_auth_config(build_users(S, PASSWORDS, SERVICE))
    async with EmbeddedNatsServer(binary=nats_binary, config=config) as srv:
        yield srv


class Tenant:
    """A tenant's connection, recording the async errors (permission violations) it gets."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: Client

    async def connect(self, url: str, tenant: str, *, inbox: bool = True) -> Tenant:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        options = {"inbox_prefix": S.inbox_prefix(tenant)} if inbox else {}
        self.nc = await nats.connect(
            url,
            user=tenant,
            password=PASSWORDS[tenant],
            error_cb=on_error,
            max_reconnect_attempts=0,
            **options,
        )
        return self

    async def violation(self, fragment: str) -> bool:
        """Wait (bounded) for a permission violation mentioning `fragment`.

        nats-py lower-cases the server's message, so the match ignores case.
        """
        wanted = fragment.lower()
        for _ in range(100):
            if any("permissions violation" in e and wanted in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False


async def eventually(send, receive, attempts: int = 20):
    """`send` then `receive` until it works: seen here about once in ten runs, interest
    from one connection reaches another a moment after its flush (bounded retries)."""
    for attempt in range(attempts):
        if send is not None:
            await send()
        try:
            return await receive()
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.05)


@pytest.fixture
async def service(server: EmbeddedNatsServer) -> AsyncIterator[Client]:
    nc = await nats.connect(
        server.url, user="fq-service", password=SERVICE["fq-service"], max_reconnect_attempts=0
    )
    await provision(nc.jetstream(timeout=5), BrokerSettings())
    yield nc
    await nc.close()


@pytest.fixture
async def acme(server: EmbeddedNatsServer, service: Client) -> AsyncIterator[Tenant]:
    tenant = await Tenant().connect(server.url, "acme")
    yield tenant
    await tenant.nc.close()


@pytest.mark.integration
async def test_tenant_submits_to_its_own_subject_only(acme: Tenant, service: Client) -> None:
    js = acme.nc.jetstream(timeout=0.5)
    ack = await js.publish(S.request("chat", "acme"), b'{"prompt":"x"}', headers={HDR_MSG_ID: "r1"})
    assert ack.stream == "FQ_REQUESTS" and ack.seq == 1
    with pytest.raises(nats.errors.TimeoutError):
        await js.publish(S.request("chat", "globex"), b'{"prompt":"x"}', headers={HDR_MSG_ID: "r2"})
    assert await acme.violation('publish to "fq.req.chat.globex"')
    state = (await service.jetstream(timeout=5).stream_info("FQ_REQUESTS")).state
    assert state.messages == 1  # nothing reached globex's queue


@pytest.mark.integration
async def test_tenant_receives_only_on_its_inbox(acme: Tenant, service: Client) -> None:
    events = await acme.nc.subscribe(f"{S.inbox_prefix('acme')}.events")
    await acme.nc.flush()
    msg = await eventually(
        lambda: service.publish(f"{S.inbox_prefix('acme')}.events", b'{"type":"token"}'),
        lambda: events.next_msg(timeout=0.5),
    )
    assert msg.data == b'{"type":"token"}'
    await acme.nc.subscribe(f"{S.inbox_prefix('globex')}.>")
    assert await acme.violation('subscription to "_INBOX_globex.>"')
    await acme.nc.subscribe(S.all_requests)
    assert await acme.violation('subscription to "fq.req.*.*"')


@pytest.mark.integration
async def test_tenant_calls_only_its_own_apis(acme: Tenant, service: Client) -> None:
    async def answer(msg: Msg) -> None:
        await msg.respond(b'{"id":"r1","state":"unknown"}')

    await service.subscribe("fq.api.>", cb=answer)
    await service.flush()
    reply = await eventually(
        None, lambda: acme.nc.request(S.status("acme"), b'{"id":"r1"}', timeout=0.5)
    )
    assert reply.data == b'{"id":"r1","state":"unknown"}'
    for subject in (S.status("globex"), S.depth, S.work("chat", "w1")):
        with pytest.raises(nats.errors.TimeoutError):
            await acme.nc.request(subject, b"{}", timeout=0.3)
        assert await acme.violation(f'publish to "{subject}"')


@pytest.mark.integration
async def test_tenant_without_its_inbox_prefix_gets_no_acks(
    server: EmbeddedNatsServer, service: Client
) -> None:
    tenant = await Tenant().connect(server.url, "acme", inbox=False)
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await tenant.nc.jetstream(timeout=0.5).publish(S.request("chat", "acme"), b"{}")
        assert await tenant.violation('subscription to "_INBOX.')
    finally:
        await tenant.nc.close()


@pytest.mark.integration
async def test_wrong_password_is_refused(server: EmbeddedNatsServer) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(
            server.url,
            user="acme",
            password="wrong",
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
        )

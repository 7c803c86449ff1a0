"""The OpenAI front on a broker with per-tenant users (`broker_config.auth`): it connects
as a front user allowed only the tenants it serves, its requests' events go to those
tenants' inboxes (which the dispatcher, with `tenant_inboxes`, requires), and a key of a
tenant it does not serve gets nothing through the broker."""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from broker_config.auth import build_users, front_inbox_prefix, render_auth_config
from broker_config.config import load_config
from broker_config.server import EmbeddedNatsServer
from broker_config.subjects import Subjects
from dispatcher.service import Dispatcher
from producers.client import Client
from producers.openai_front.app import Front
from producers.openai_front.keys import KeyRing, with_dev_key
from producers.openai_front.server import FrontServer
from workers.service import WorkerService
from workers.sim_engine import SimEngine

pytestmark = pytest.mark.integration

SUBJECTS = Subjects("fq")
TENANTS = {"acme": "acme-secret", "globex": "globex-secret"}
SERVICES = {"fq-service": "service-secret"}
FRONTS = {"front": ("front-secret", ["acme"])}


def test_a_front_user_may_act_only_for_the_tenants_it_serves() -> None:
    (front,) = [u for u in build_users(SUBJECTS, TENANTS, SERVICES, FRONTS) if u.name == "front"]
    assert front.permissions is not None
    assert front.permissions.publish == ("fq.req.*.acme", "fq.api.*.acme")
    assert front.permissions.subscribe == ("_INBOX_front.>", "_INBOX_acme.>")
    with pytest.raises(ValueError, match="defined twice"):
        build_users(SUBJECTS, TENANTS, SERVICES, {"acme": ("x", ["acme"])})


async def test_the_front_serves_with_its_own_credentials_on_a_broker_with_users(
    nats_binary: Path,
) -> None:
    config, acme_key = with_dev_key(load_config(), "acme")
    config, globex_key = with_dev_key(config, "globex")  # a key the broker will not honour
    config = msgspec.structs.replace(
        config,
        dispatcher=msgspec.structs.replace(config.dispatcher, tenant_inboxes=True, settle_s=0.2),
    )
    users = render_auth_config(build_users(SUBJECTS, TENANTS, SERVICES, FRONTS))
    async with (
        EmbeddedNatsServer(binary=nats_binary, config=users) as server,
        contextlib.AsyncExitStack() as stack,
    ):
        nc = await nats.connect(
            server.url, user="fq-service", password="service-secret", max_reconnect_attempts=0
        )
        stack.push_async_callback(nc.close)
        dispatcher = await stack.enter_async_context(Dispatcher(nc, config))
        results = await nc.jetstream().key_value(dispatcher.subjects.results_bucket)
        engine = await stack.enter_async_context(SimEngine(time_scale=0.0))
        await stack.enter_async_context(
            WorkerService(
                nc,
                engine,
                endpoint="chat",
                worker_id="w1",
                subjects=dispatcher.subjects,
                results=results,
            )
        )
        client = await stack.enter_async_context(
            await Client.connect(
                server.url,
                user="front",
                password="front-secret",
                inbox_prefix=front_inbox_prefix("front"),
                publish_timeout_s=1.0,
            )
        )
        front = await stack.enter_async_context(
            FrontServer(Front(client, config, KeyRing(config.front.keys)), config.front, 0)
        )

        acme = openai.AsyncOpenAI(
            base_url=front.base_url, api_key=acme_key, max_retries=0, timeout=30.0
        )
        answer = await acme.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert answer.choices[0].message.content
        stream = await acme.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        assert "".join([c.choices[0].delta.content or "" async for c in stream])
        await acme.close()

        globex = openai.AsyncOpenAI(
            base_url=front.base_url, api_key=globex_key, max_retries=0, timeout=30.0
        )
        with pytest.raises(openai.APIStatusError) as refused:
            await globex.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        assert refused.value.status_code == 503 and "globex" in refused.value.message
        await globex.close()

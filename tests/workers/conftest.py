"""Fixtures of the worker tests that talk to a real nats-server: a connection, the
provisioned result bucket, and recorders of the reply and internal subjects."""

from __future__ import annotations

from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from broker_config.config import BrokerSettings
from broker_config.streams import provision
from tests.workers.test_worker_service import Recorder, S


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=0)
    yield client
    await client.close()


@pytest.fixture
async def results(nc: Client) -> KeyValue:
    provisioned = await provision(nc.jetstream(timeout=5), BrokerSettings(storage="memory"))
    return provisioned.results


@pytest.fixture
async def inbox(nc: Client) -> Recorder:
    """Every event published to the test items' reply subjects."""
    return await Recorder().start(nc, "_INBOX.t.>")


@pytest.fixture
async def internal(nc: Client) -> Recorder:
    """Heartbeats and completions, in the order the worker sent them."""
    return await Recorder().start(nc, S.internal)

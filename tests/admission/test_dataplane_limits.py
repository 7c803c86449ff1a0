"""Honest token accounting end to end: real nats-server, dispatcher, simulated workers,
both limiter stores (the embedded one, its monthly usage in NATS KV; and Redis).

A tenant that declares 1 input token for a 500-token prompt is charged the truth at
admission: counted by the endpoint's tokenizer, or without one never below its text's
rough count; what admission still counted short is charged when the request finishes,
at the engine's count. A tenant quota holds across endpoints; monthly usage outlives a
dispatcher restart, and with Redis (append-only) a Redis crash.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import pytest
import redis.asyncio as aioredis
from tokenizers import Tokenizer, models, pre_tokenizers

from broker_config.config import (
    BrokerSettings,
    Config,
    DispatcherOptions,
    WorkerOptions,
    parse_config,
)
from broker_config.server import EmbeddedNatsServer, EmbeddedRedisServer
from broker_config.wire import DoneEvent, ErrorCode
from dispatcher.admission.kv_store import StoredUsage
from dispatcher.admission.redis_store import DEFAULT_PREFIX
from dispatcher.core.limits import month_key
from producers.client import Client
from producers.errors import RequestFailed
from tests.local_stack import LocalStack, StackOptions
from tests.wire_support import until

pytestmark = pytest.mark.integration

WORDS = 500
# 500 three-letter words: 500 tokens by the test's tokenizer, and by the simulated
# engine's count of 4 characters a token (1,999 characters).
PROMPT = " ".join(["abc"] * WORDS)
# One output token, whatever the seed: a request really uses exactly 501 tokens.
MAX_TOKENS = 1
REAL = WORDS + MAX_TOKENS
BURST = 2000  # three requests of 501 pass, a fourth does not
FAST = DispatcherOptions(settle_s=0.2, tick_s=0.05, worker_timeout_s=3.0, grace_s=5.0)


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    vocabulary = {"[UNK]": 0, "abc": 1, "abcdefg": 2}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(params=["nats-kv", "redis"])
def redis(request: pytest.FixtureRequest) -> Iterator[EmbeddedRedisServer | None]:
    """None: the embedded store; else a Redis of this test's own, append-only."""
    if request.param == "nats-kv":
        yield None
        return
    with EmbeddedRedisServer(append_only=True) as server:
        yield server


def limits_config(
    tokenizer: Path, limits: str, tenant_quota: int | None = None
) -> tuple[Config, str, str]:
    """`chat` counts with the tokenizer, `code` has none; a liar and an honest tenant."""
    suffix = uuid.uuid4().hex[:8]
    liar, honest = f"liar-{suffix}", f"honest-{suffix}"
    quota = f"monthly_quota_tokens = {tenant_quota}" if tenant_quota else ""
    config = parse_config(
        f"""
        [endpoints.chat]
        tokenizer = "{tokenizer}"
        latency_target_s = 1e6
        [endpoints.code]
        latency_target_s = 1e6
        [[tiers]]
        name = "free"
        limits = {{ {limits} }}
        [tenants.{liar}]
        tier = "free"
        {quota}
        [tenants.{honest}]
        tier = "free"
        {quota}
    """,
        source="limits.toml",
    )
    return config, liar, honest


def stack_options(redis: EmbeddedRedisServer | None) -> StackOptions:
    return StackOptions(
        workers=1,
        time_scale=0.02,
        dispatcher=FAST,
        redis_url=redis.url if redis is not None else None,
        workers_settings=WorkerOptions(heartbeat_interval_s=0.2),
    )


async def run_until_refused(
    fq: Client, tenant: str, endpoints: list[str], *, declared: int, attempts: int = 6
) -> tuple[int, RequestFailed]:
    """Requests one after another until one is refused: (how many ran, the refusal)."""
    for n in range(attempts):
        try:
            done = await fq.run(
                endpoints[n % len(endpoints)],
                tenant,
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                input_tokens=declared,
                timeout_s=10,
            )
        except RequestFailed as refusal:
            return n, refusal
        assert done.usage.input_tokens + done.usage.output_tokens == REAL
    raise AssertionError(f"{tenant}: none of {attempts} requests was refused")


async def test_a_tokenizer_charges_a_liar_as_if_it_told_the_truth(
    tokenizer_file: Path, redis: EmbeddedRedisServer | None
) -> None:
    config, liar, honest = limits_config(tokenizer_file, f"tpm = 6, tpm_burst = {BURST}")
    async with LocalStack(config, stack_options(redis)) as stack:
        fq = Client(stack.nc)
        ran_honest, refused_honest = await run_until_refused(fq, honest, ["chat"], declared=WORDS)
        ran_liar, refused_liar = await run_until_refused(fq, liar, ["chat"], declared=1)
    assert ran_honest == ran_liar == 3
    assert refused_honest.code is refused_liar.code is ErrorCode.RATE_LIMITED
    # Both owe the same debt: 4 x 501 tokens against a bucket of 2,000 at 1 per 10 s.
    assert refused_liar.event.retry_after_s == pytest.approx(
        refused_honest.event.retry_after_s, abs=2.0
    )


async def test_without_a_tokenizer_a_liar_is_charged_its_texts_length(
    tokenizer_file: Path, redis: EmbeddedRedisServer | None
) -> None:
    """Without a tokenizer a declared count is taken, but never below the text's rough
    count (4 characters a token): a liar sending its requests all at once gets no more
    in than one that tells the truth."""
    config, liar, honest = limits_config(tokenizer_file, f"tpm = 6, tpm_burst = {BURST}")
    async with LocalStack(config, stack_options(redis)) as stack:
        fq = Client(stack.nc)
        outcomes = {}
        for tenant, declared in ((honest, WORDS), (liar, 1)):
            results = await asyncio.gather(
                *(
                    fq.run(
                        "code",
                        tenant,
                        prompt=PROMPT,
                        max_tokens=MAX_TOKENS,
                        input_tokens=declared,
                        timeout_s=10,
                    )
                    for _ in range(8)
                ),
                return_exceptions=True,
            )
            outcomes[tenant] = sorted(
                "done" if isinstance(result, DoneEvent) else result.code.value for result in results
            )
    assert outcomes[honest] == outcomes[liar] == ["done"] * 3 + ["rate_limited"] * 5


async def test_what_admission_counted_short_is_charged_when_the_request_finishes(
    tokenizer_file: Path, redis: EmbeddedRedisServer | None
) -> None:
    """The endpoint's tokenizer reads each 7-letter word as one token; the engine reads
    two (it counts 4 characters a token): admission charges 251 a request, completion the
    other 250. So the fourth request gets in on credit and then the debt holds."""
    config, tenant, _ = limits_config(
        tokenizer_file, f"tpm = 6, tpm_burst = {BURST}", tenant_quota=10_000
    )
    prompt = " ".join(["abcdefg"] * (WORDS // 2))
    async with LocalStack(config, stack_options(redis)) as stack:
        fq = Client(stack.nc)
        ran = 0
        with pytest.raises(RequestFailed) as refused:
            for ran in range(6):  # noqa: B007 - read after the loop
                done = await fq.run(
                    "chat", tenant, prompt=prompt, max_tokens=MAX_TOKENS, timeout_s=10
                )
                assert done.usage.input_tokens == WORDS
        if redis is None:
            await stack.dispatcher.limiter.flush()
        used = await stored_usage(stack.nc, redis, tenant)
    assert ran == 4 and refused.value.code is ErrorCode.RATE_LIMITED
    assert used == 4 * REAL  # the quota holds what ran, not what admission counted


async def test_a_tenant_quota_holds_across_endpoints_and_counts_the_truth(
    tokenizer_file: Path, redis: EmbeddedRedisServer | None
) -> None:
    config, liar, honest = limits_config(tokenizer_file, "", tenant_quota=BURST)
    async with LocalStack(config, stack_options(redis)) as stack:
        fq = Client(stack.nc)
        ran_honest, refused_honest = await run_until_refused(
            fq, honest, ["chat", "code"], declared=WORDS
        )
        ran_liar, refused_liar = await run_until_refused(fq, liar, ["chat", "code"], declared=1)
        if redis is None:
            await stack.dispatcher.limiter.flush()  # written behind: now, not in a moment
        used = await stored_usage(stack.nc, redis, liar)
    assert ran_honest == 3
    assert refused_honest.code is refused_liar.code is ErrorCode.QUOTA_EXCEEDED
    assert "monthly quota of 2000 tokens" in refused_liar.event.message
    assert ran_liar == 3
    assert used == 3 * REAL


async def test_monthly_usage_outlives_a_dispatcher_restart_and_a_redis_crash(
    tokenizer_file: Path, redis: EmbeddedRedisServer | None
) -> None:
    config, _, tenant = limits_config(tokenizer_file, "", tenant_quota=BURST)
    async with EmbeddedNatsServer() as server:
        async with LocalStack(config, stack_options(redis), nats_url=server.url) as stack:
            fq = Client(stack.nc)
            for _ in range(3):
                await fq.run("chat", tenant, prompt=PROMPT, max_tokens=MAX_TOKENS, timeout_s=10)
        if redis is not None:
            redis.kill()
            redis.start()
        async with LocalStack(config, stack_options(redis), nats_url=server.url) as stack:
            fq = Client(stack.nc)
            with pytest.raises(RequestFailed) as refused:
                await fq.run("chat", tenant, prompt=PROMPT, max_tokens=MAX_TOKENS, timeout_s=10)
            assert refused.value.code is ErrorCode.QUOTA_EXCEEDED
            # What is left of the quota still passes: 2,000 - 3 x 501 = 497.
            await fq.run("chat", tenant, prompt=" ".join(["abc"] * 400), max_tokens=1, timeout_s=10)


async def stored_usage(nc: nats.NATS, redis: EmbeddedRedisServer | None, tenant: str) -> float:
    """The tenant's usage across endpoints this month, as the store keeps it."""
    key = f"quota-total:{tenant}:{month_key(time.time())}"
    if redis is None:
        kv = await nc.jetstream().key_value(BrokerSettings().subjects.limits_bucket)
        try:
            entry = await kv.get(key.replace(":", "."))
        except nats.js.errors.KeyNotFoundError:
            return 0.0
        return msgspec.json.decode(entry.value, type=StoredUsage).used
    client = aioredis.Redis.from_url(redis.url)
    try:
        return float(await client.hget(f"{DEFAULT_PREFIX}used:{key}", "used") or 0.0)
    finally:
        await client.aclose()


async def test_requests_that_never_run_give_their_tokens_back(
    tokenizer_file: Path, redis: EmbeddedRedisServer | None
) -> None:
    """A queued request cancelled, and one whose deadline passes in the queue (`code`
    has no worker here), are given back what admission charged."""
    config, tenant, _ = limits_config(tokenizer_file, "", tenant_quota=1500)
    options = dataclasses.replace(stack_options(redis), endpoints=("chat",))
    async with LocalStack(config, options) as stack:
        fq = Client(stack.nc)
        kept = await fq.submit("code", tenant, prompt=PROMPT, max_tokens=MAX_TOKENS, reply=False)
        await fq.submit(
            "code",
            tenant,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            deadline=time.time() + 1.0,
            reply=False,
        )
        await until(lambda: stack.dispatcher.scheduler.queued_count("code") == 2, "queued")
        assert (await fq.cancel(tenant, kept.id)).cancelled
        await until(lambda: stack.dispatcher.scheduler.queued_count("code") == 0, "expired")
        # 1,002 tokens were charged and given back: two requests of 501 fit in 1,500.
        for _ in range(2):
            await fq.run("chat", tenant, prompt=PROMPT, max_tokens=MAX_TOKENS, timeout_s=10)
        if redis is None:
            await stack.dispatcher.limiter.flush()
        assert await stored_usage(stack.nc, redis, tenant) == 2 * REAL


async def test_requests_handed_over_at_a_stop_are_charged_once_by_whoever_holds_them(
    tokenizer_file: Path, redis: EmbeddedRedisServer | None
) -> None:
    """A dispatcher that stops hands its queued requests back and gives their charge
    back; the next one charges them again at admission (a redelivery is never taken as
    paid) and settles them at what they used, unused max_tokens included."""
    config, tenant, _ = limits_config(tokenizer_file, "", tenant_quota=10_000)
    charge = WORDS + 50  # input + max_tokens at admission
    async with EmbeddedNatsServer() as server:
        no_code_worker = dataclasses.replace(stack_options(redis), endpoints=("chat",))
        ids = []
        for holder in range(2):  # two dispatchers in turn hold them queued, then stop
            async with LocalStack(config, no_code_worker, nats_url=server.url) as stack:
                fq = Client(stack.nc)
                for _ in range(3 if holder == 0 else 0):
                    ids.append(
                        (
                            await fq.submit(
                                "code", tenant, prompt=PROMPT, max_tokens=50, reply=False
                            )
                        ).id
                    )
                await until(lambda: stack.dispatcher.scheduler.queued_count("code") == 3, "queued")
                if redis is None:
                    await stack.dispatcher.limiter.flush()
                assert await stored_usage(stack.nc, redis, tenant) == 3 * charge
            async with await nats.connect(server.url) as nc:  # given back at the stop
                assert await stored_usage(nc, redis, tenant) == 0
        async with LocalStack(config, stack_options(redis), nats_url=server.url) as stack:
            await until(
                lambda: stack.counted(stack.metrics.input_tokens, "code") == 3 * WORDS, "completed"
            )
            fq = Client(stack.nc)
            used = 0
            for request_id in ids:
                usage = (await fq.status(tenant, request_id)).result.usage
                used += usage.input_tokens + usage.output_tokens
            if redis is None:
                await stack.dispatcher.limiter.flush()
            assert used < 3 * charge  # some max_tokens went unused, and came back
            assert await stored_usage(stack.nc, redis, tenant) == used

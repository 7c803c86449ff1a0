"""Status, cancel and metrics against a real nats-server, for requests wherever they are:
still in the stream beyond the tenant's intake window, queued, running; and the engine
priority a request gets, which only the dispatcher decides."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.request

import msgspec
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker_config.config import DispatcherOptions, WorkerOptions, load_config
from broker_config.subjects import Subjects
from dispatcher.admission.admit import COUNTS_MEMORY_S
from dispatcher.api.http import HttpApi
from dispatcher.core.endpoint import DEBT_MEMORY_S
from dispatcher.observe.metrics import DispatcherMetrics
from dispatcher.service import Dispatcher
from tests.local_stack import LocalStack, StackOptions
from tests.wire_support import api, eventually, image_b64
from workers.engine import EngineRequest
from workers.service import WorkerService
from workers.sim_engine import SimEngine

pytestmark = pytest.mark.integration

S = Subjects()
FAST = DispatcherOptions(settle_s=0.2, tick_s=0.05, worker_timeout_s=5.0, grace_s=2.0)
# Never dispatches (it settles for an hour), with a small window: most of a backlog
# stays in the stream.
HOLD = DispatcherOptions(settle_s=3600.0, tick_s=0.05, tenant_window=8, grace_s=0.0)
WAIT_S = 15.0


def config_with(options: DispatcherOptions):
    return msgspec.structs.replace(load_config(), dispatcher=options)


def flat_config_with(options: DispatcherOptions):
    """The example config with its chat profile flat: output priced at its batch-1 time
    whatever batch the worker runs, so a charge can be checked to the token."""
    config = config_with(options)
    profile = config.profiles["llama-7b-sim"]
    flat = msgspec.structs.replace(
        profile, beta=profile.beta, decode_base_s=None, decode_per_seq_s=None, operating_batch=1
    )
    return msgspec.structs.replace(config, profiles={**config.profiles, flat.name: flat})


@pytest.fixture
async def client(nats_url):
    nc = await nats.connect(nats_url)
    yield nc
    # Closed, not drained: a test's subscriptions read with next_msg may keep unread
    # events, and a drain waits its whole timeout (30 s) for them to be handled.
    await nc.close()


async def publish(js, tenant: str, rid: str, reply: str | None = None, **body) -> None:
    headers = {"Nats-Msg-Id": rid, **({"Fq-Reply": reply} if reply else {})}
    await js.publish(
        S.request("chat", tenant),
        json.dumps({"prompt": "hello", "max_tokens": 4, **body}).encode(),
        headers=headers,
    )


async def test_a_request_beyond_the_window_is_queued_and_cancellable_for_good(client):
    """Seen on a live system before: with 300 queued, depth said queued, status said
    unknown and cancel said false for everything beyond the tenant's window."""
    js = client.jetstream()
    inbox = client.new_inbox()
    events = await client.subscribe(f"{inbox}.>")
    async with Dispatcher(client, config_with(HOLD)):
        for i in range(40):
            await publish(js, "acme", f"r{i}", reply=f"{inbox}.r{i}")

        async def window_filled():
            return (await api(client, S.status("acme"), {"id": "r7"}))["state"] == "queued"

        await eventually(window_filled, timeout=WAIT_S, what="the window taken in")
        # r30 is still in the stream: the dispatcher holds only its window of 8.
        status = await api(client, S.status("acme"), {"id": "r30"})
        assert status == {"id": "r30", "state": "queued", "position": 30}
        assert await api(client, S.status("acme"), {"id": "nope"}) == {
            "id": "nope",
            "state": "unknown",
        }

        assert await api(client, S.cancel("acme"), {"id": "r30"}) == {
            "id": "r30",
            "cancelled": True,
        }
        event = json.loads((await events.next_msg(timeout=5)).data)
        assert (event["type"], event["id"], event["code"]) == ("error", "r30", "cancelled")
        status = await api(client, S.status("acme"), {"id": "r30"})
        assert status["state"] == "failed" and status["result"]["code"] == "cancelled"
        # Its message left the stream; r31 moved up one place.
        assert (await api(client, S.status("acme"), {"id": "r31"}))["position"] == 30
        assert await api(client, S.cancel("acme"), {"id": "nope"}) == {
            "id": "nope",
            "cancelled": False,
        }

    # A new dispatcher with a worker runs everything else, and never the cancelled one.
    engine = Recording(time_scale=0.0)
    async with (
        Dispatcher(client, config_with(FAST)) as dispatcher,
        engine,
        WorkerService(
            client,
            engine,
            endpoint="chat",
            worker_id="w1",
            subjects=S,
            results=await js.key_value(S.results_bucket),
            settings=WorkerOptions(heartbeat_interval_s=0.2),
        ),
    ):

        async def all_done():
            states = [
                (await api(client, S.status("acme"), {"id": f"r{i}"}))["state"] for i in range(40)
            ]
            return states.count("done") == 39 and states[30] == "failed"

        await eventually(all_done, timeout=30, what="the other 39 requests done")
        assert dispatcher.scheduler.queued_count() == 0
    assert "acme.r30" not in engine.seen
    assert len(engine.seen) == 39


async def test_a_cancel_racing_admission_never_reaches_a_worker(client):
    """A request cancelled while in the stream, taken in right after: refused at
    admission (its stored event, or the dispatcher's memory of the cancel)."""
    js = client.jetstream()
    engine = Recording(time_scale=0.0)
    async with (
        Dispatcher(client, config_with(FAST)) as dispatcher,
        engine,
        WorkerService(
            client,
            engine,
            endpoint="chat",
            worker_id="w1",
            subjects=S,
            results=await js.key_value(S.results_bucket),
            settings=WorkerOptions(heartbeat_interval_s=0.2),
        ),
    ):
        rids = [f"c{i}" for i in range(30)]
        for rid in rids:
            await publish(js, "globex", rid)
        replies = await asyncio.gather(
            *(api(client, S.cancel("globex"), {"id": rid}) for rid in rids)
        )
        cancelled = {r["id"] for r in replies if r["cancelled"]}

        async def settled():
            states = {rid: (await api(client, S.status("globex"), {"id": rid})) for rid in rids}
            return (
                states if all(s["state"] in ("done", "failed") for s in states.values()) else None
            )

        states = await eventually(settled, timeout=WAIT_S, what="every request finished")
        assert dispatcher.scheduler.queued_count() == 0
    for rid in rids:
        if rid in cancelled and f"globex.{rid}" not in engine.seen:
            assert states[rid]["result"]["code"] == "cancelled", states[rid]
        if f"globex.{rid}" in engine.seen:  # a cancel that came after the start aborts it
            assert states[rid]["state"] in ("done", "failed")
    never_ran = {rid for rid in cancelled if f"globex.{rid}" not in engine.seen}
    assert never_ran, "no cancel found its request before a worker did (nothing tested)"


class Recording(SimEngine):
    """The simulated engine, recording the engine priority each request arrived with."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: dict[str, int] = {}

    def generate(self, request: EngineRequest):
        self.seen[request.id] = request.priority
        return super().generate(request)


async def test_engine_priority_is_the_dispatchers_decision_not_the_clients(client):
    """A tenant that asks for priority 1e9 orders its own queue with it, and nothing more:
    the engine sees only the dispatcher's expedited flag. Another tenant arriving behind
    its flood is expedited (it runs below its fair share) and starts first in the engine."""
    js = client.jetstream()
    engine = Recording(time_scale=0.2)
    inbox = client.new_inbox()
    replies = await client.subscribe(f"{inbox}.>")
    async with (
        Dispatcher(client, config_with(FAST)),
        engine,
        WorkerService(
            client,
            engine,
            endpoint="chat",
            worker_id="w1",
            subjects=S,
            results=await js.key_value(S.results_bucket),
            settings=WorkerOptions(heartbeat_interval_s=0.2),
        ),
    ):
        for i in range(80):
            await publish(
                js, "globex", f"g{i}", reply=f"{inbox}.g{i}", priority=10**9, max_tokens=40
            )

        async def flood_running():
            return sum(k.startswith("globex.") for k in engine.seen) >= 40

        await eventually(flood_running, timeout=WAIT_S, what="the flood filling the engine")
        await publish(js, "acme", "a1", reply=f"{inbox}.a1", max_tokens=4)
        done = None
        deadline = time.monotonic() + WAIT_S
        while done is None:
            event = json.loads(
                (await replies.next_msg(timeout=max(0.01, deadline - time.monotonic()))).data
            )
            if event["id"] == "a1" and event["type"] in ("done", "error"):
                done = event
        assert done["type"] == "done", done
    assert engine.seen["acme.a1"] == 1  # expedited
    assert set(engine.seen.values()) <= {0, 1}, "a client's own priority reached the engine"
    assert sum(p == 0 for k, p in engine.seen.items() if k.startswith("globex.")) >= 39


class FullLength(SimEngine):
    """The simulated engine, every request generating all of its max_tokens."""

    def generate(self, request: EngineRequest):
        return super().generate(
            dataclasses.replace(request, target_output_tokens=request.max_tokens)
        )


async def test_a_running_requests_output_is_charged_as_the_worker_reports_it(client):
    """The tenant pays for output while it is generated (the worker's heartbeats say how
    far each request is), not only for its prompt until the request ends."""
    js = client.jetstream()
    engine = FullLength(time_scale=0.5)  # 200 tokens: about 2.5 s
    async with (
        Dispatcher(client, flat_config_with(FAST)) as dispatcher,
        engine,
        WorkerService(
            client,
            engine,
            endpoint="chat",
            worker_id="w1",
            subjects=S,
            results=await js.key_value(S.results_bucket),
            settings=WorkerOptions(heartbeat_interval_s=0.2),
        ),
    ):
        # Two requests: the second keeps acme queued while the first runs.
        await publish(js, "acme", "long", max_tokens=200, input_tokens=1000)
        await publish(js, "acme", "next", max_tokens=200, input_tokens=1000)
        scheduler = dispatcher.scheduler
        profile = scheduler.endpoints["chat"].profile

        async def charged_for_output():
            request = scheduler.running_request("acme", "long")
            return request if request is not None and request.output_charged >= 20 else None

        request = await eventually(
            charged_for_output, timeout=WAIT_S, what="output charged while the request runs"
        )
        generated = request.output_charged
        assert generated < 200  # still running
        assert request.charged_cost == pytest.approx(profile.model_units(1000, generated))
        assert scheduler.flow("chat", "acme").served_cost >= request.charged_cost


async def test_metrics_report_the_queue_running_and_admissions(nats_url):
    """Values after a known sequence, scraped over HTTP as Prometheus does."""
    # Five sequence slots, one kept for health probes and one held back as the newcomer
    # reserve: acme alone runs three.
    engine = msgspec.structs.replace(SimEngine().params, max_sequences=5)
    metrics = DispatcherMetrics(["chat", "embed"])
    http = HttpApi(metrics)
    port = http.serve(0)
    # The hung engine below stands for long requests: no probes to find it.
    options = StackOptions(
        workers=1,
        endpoints=("chat",),
        time_scale=1.0,
        engine=engine,
        dispatcher=DispatcherOptions(
            settle_s=0.2, tick_s=0.05, grace_s=0.0, probe_stall_s=3600.0, probe_idle_s=3600.0
        ),
        workers_settings=WorkerOptions(heartbeat_interval_s=0.2, drain_timeout_s=0.0),
    )
    try:
        async with LocalStack(load_config(), options, nats_url=nats_url, metrics=metrics) as stack:
            stack.engines[0].faults.hang = True  # what starts keeps running
            nc = await nats.connect(nats_url)
            js = nc.jetstream()
            for i in range(5):
                await publish(js, "acme", f"m{i}")

            def samples() -> dict[tuple[str, tuple], float]:
                text = (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                    .read()
                    .decode()
                )
                return {
                    (s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in text_string_to_metric_families(text)
                    for s in family.samples
                }

            acme = (("endpoint", "chat"), ("tenant", "acme"), ("tier", "enterprise"))

            async def exported():
                values = samples()
                return values if values.get(("fairq_running", acme)) == 3 else None

            values = await eventually(exported, timeout=WAIT_S, what="the gauges exported")
            assert values[("fairq_queue_depth", acme)] == 2
            assert (
                values[("fairq_admissions_total", (("endpoint", "chat"), ("outcome", "admitted")))]
                == 5
            )
            assert (
                values[
                    ("fairq_admissions_total", (("endpoint", "chat"), ("outcome", "rate_limited")))
                ]
                == 0
            )
            for counter in (
                "fairq_probes_total",
                "fairq_worker_evictions_total",
                "fairq_redispatched_total",
                "fairq_failed_by_lost_worker_total",
            ):
                assert values[(counter, (("endpoint", "chat"),))] == 0  # exported at zero
            stack.engines[0].faults.hang = False

            async def drained():
                values = samples()
                return (
                    values
                    if values.get(("fairq_running", acme), 0) == 0
                    and values.get(("fairq_queue_depth", acme), 0) == 0
                    else None
                )

            values = await eventually(drained, timeout=30, what="everything finished")
            assert values[("fairq_time_to_first_token_seconds_count", (("endpoint", "chat"),))] == 5
            assert values[("fairq_queue_wait_seconds_count", (("endpoint", "chat"),))] == 5
            await nc.drain()
    finally:
        http.close()


async def test_image_model_units_stay_charged_after_completion(nats_url, monkeypatch):
    """The charge is corrected on completion to the engine time the worker attributed to
    the request; the images' time is part of it (it used to be refunded: the usage was
    built without them)."""
    monkeypatch.setattr("dispatcher.service.FORGET_IDLE_S", 3600.0)  # acme's flow stays
    options = StackOptions(
        workers=1,
        endpoints=("chat",),
        time_scale=0.0,
        dispatcher=FAST,
        workers_settings=WorkerOptions(heartbeat_interval_s=0.2),
    )
    async with LocalStack(load_config(), options, nats_url=nats_url) as stack:
        nc = await nats.connect(nats_url)
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        await publish(nc.jetstream(), "acme", "img", reply=inbox, images=[image_b64()] * 2)
        done = None
        while done is None:
            event = json.loads((await replies.next_msg(timeout=WAIT_S)).data)
            done = event if event["type"] in ("done", "error") else None
        assert done["type"] == "done", done
        usage = done["usage"]
        assert usage["other_units"] == 2
        scheduler = stack.dispatcher.scheduler

        # The client hears of the end before the dispatcher does: the worker publishes the
        # final event, then its Completion, which corrects the charge.
        async def completed() -> bool:
            return scheduler.state("acme", "img") is None

        await eventually(completed, timeout=WAIT_S, what="the dispatcher seeing the completion")
        profile = scheduler.endpoints["chat"].profile
        charged = scheduler.flow("chat", "acme").served_cost
        prompt_and_images = profile.alpha * usage["input_tokens"] + 2 * profile.gamma
        assert charged >= prompt_and_images, (charged, prompt_and_images)
        await nc.drain()


async def test_a_lookup_the_broker_does_not_answer_gets_a_retryable_error_not_silence(
    client, monkeypatch
):
    """Status and cancel of a request the dispatcher does not hold look in the stream; if
    that lookup fails (a timeout on a starved machine), the caller is told at once."""
    from broker_config.direct_get import DirectGetError

    async with Dispatcher(client, config_with(HOLD)) as dispatcher:

        async def broker_times_out(tenant, wanted):
            raise DirectGetError("batch direct get on FQ_REQUESTS: TimeoutError()")

        monkeypatch.setattr(dispatcher.api.lookup, "_scan", broker_times_out)
        for kind in ("status", "cancel"):
            started = time.monotonic()
            reply = await api(client, f"fq.api.{kind}.acme", {"id": "r1"})
            assert time.monotonic() - started < 2.0, kind
            assert (reply["type"], reply["id"], reply["code"]) == ("error", "r1", "internal")
            assert reply["retry_after_s"] == 0.5 and "try again" in reply["message"]


async def test_one_tenants_slow_lookups_hold_up_no_other_call(client, monkeypatch):
    """Status calls run side by side: a tenant whose lookups in the streams are slow (a
    deep backlog, a flood of ids never sent) delays neither another tenant's calls nor
    its own beyond one scan, and its concurrent lookups share scans."""
    async with Dispatcher(client, config_with(HOLD)) as dispatcher:
        lookup = dispatcher.api.lookup
        real_scan = lookup._scan
        scans: list[tuple[str, set[str]]] = []

        async def slow_for_acme(tenant, wanted):
            scans.append((tenant, set(wanted)))
            if tenant == "acme":
                await asyncio.sleep(1.0)
            return await real_scan(tenant, wanted)

        monkeypatch.setattr(lookup, "_scan", slow_for_acme)
        flood = [
            asyncio.create_task(api(client, S.status("acme"), {"id": f"never-{i}"}))
            for i in range(40)
        ]
        await asyncio.sleep(0.2)  # the first scan of acme runs; the rest wait for the next
        started = time.monotonic()
        assert await api(client, S.status("globex"), {"id": "g1"}) == {
            "id": "g1",
            "state": "unknown",
        }
        assert time.monotonic() - started < 0.9  # not behind acme's scan
        replies = await asyncio.gather(*flood)
        assert all(reply["state"] == "unknown" for reply in replies)
        acme_scans = [wanted for tenant, wanted in scans if tenant == "acme"]
        # Ids asked for before a scan starts join it; those that come while it runs
        # share the next: forty calls, at most two scans.
        assert 1 <= len(acme_scans) <= 2, [len(wanted) for wanted in acme_scans]
        assert set().union(*acme_scans) == {f"never-{i}" for i in range(40)}


async def test_concurrent_cancels_of_one_request_send_one_cancelled_event(client):
    js = client.jetstream()
    inbox = client.new_inbox()
    events = await client.subscribe(inbox)
    async with Dispatcher(client, config_with(HOLD)):
        await publish(js, "acme", "c1", reply=inbox)

        async def queued():
            return (await api(client, S.status("acme"), {"id": "c1"}))["state"] == "queued"

        await eventually(queued, timeout=WAIT_S, what="c1 taken in")
        replies = await asyncio.gather(
            *(api(client, S.cancel("acme"), {"id": "c1"}) for _ in range(8))
        )
        # Those that came while the first attempt ran share it; one after it finds
        # nothing left to cancel.
        assert {"id": "c1", "cancelled": True} in replies, replies
        assert all(reply["id"] == "c1" and "cancelled" in reply for reply in replies), replies
        first = json.loads((await events.next_msg(timeout=5)).data)
        assert (first["type"], first["code"]) == ("error", "cancelled")
        with pytest.raises(nats.errors.TimeoutError):
            await events.next_msg(timeout=1.0)


async def test_unlisted_tenants_that_came_once_leave_no_state_behind(nats_url, client):
    """Tenant names used once (unlisted tenants named per end user, say) must not pile
    up: once idle and forgotten, neither the scheduler nor the depth API keeps them."""
    options = StackOptions(workers=1, endpoints=("chat",), time_scale=0.05, dispatcher=FAST)
    async with LocalStack(load_config(), options, nats_url=nats_url) as stack:
        js = client.jetstream()
        inbox = client.new_inbox()
        events = await client.subscribe(f"{inbox}.>")
        once = [f"once-{n}" for n in range(10)]
        for tenant in once:
            await publish(js, tenant, f"r-{tenant}", reply=f"{inbox}.{tenant}")
        finals = []
        while len(finals) < len(once):
            event = json.loads((await events.next_msg(timeout=WAIT_S)).data)
            if event["type"] != "token":
                finals.append(event)
        assert all(event["type"] == "done" for event in finals), finals
        depth = await api(client, S.depth, {})
        assert {row["tenant"] for row in depth["queues"]} >= set(once)
        dispatcher = stack.dispatcher
        later = time.time() + max(DEBT_MEMORY_S, COUNTS_MEMORY_S)
        dispatcher._forget_idle(later)  # what the sweep does then
        assert all(dispatcher.scheduler.flow("chat", tenant) is None for tenant in once)
        depth = await api(client, S.depth, {})
        assert not {row["tenant"] for row in depth["queues"]} & set(once)


async def test_an_api_answer_never_goes_to_fairqs_own_or_the_servers_subjects(client):
    """A caller names its reply subject freely and the broker checks it against no
    permission: the dispatcher (full access) must not publish into `fq.*` or `$KV.*` for
    it. An ordinary inbox is answered."""
    probe = await client.subscribe(">")
    async with Dispatcher(client, config_with(FAST)):
        answer = await api(client, S.status("acme"), {"id": "r1"})
        assert answer["state"] == "unknown"
        for reply in (
            "fq.admin.reload",
            f"$KV.{S.results_bucket}.acme.r1",
            f"$KV.{S.limits_bucket}.quota-total.acme.x",
        ):
            await client.publish(S.status("acme"), b'{"id": "r1"}', reply=reply)
        await client.flush()
        await asyncio.sleep(0.5)
    landed = []
    while True:
        try:
            msg = await probe.next_msg(timeout=0.01)
        except nats.errors.TimeoutError:
            break
        landed.append(msg.subject)
    await probe.unsubscribe()
    assert not [s for s in landed if s.startswith(("fq.admin", "$KV"))], landed

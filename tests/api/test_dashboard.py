"""The live queue dashboard: its figures (pure, from the dispatcher's own state), and the
page in a real browser (Debian's Chromium through Playwright) against `fairq up`, whose
numbers must move while requests run. Also the Grafana dashboard (deploy/grafana): every
metric it queries is one that `fairq up`'s dispatcher exposes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.core.scheduler import DepthRow
from dispatcher.observe.dashboard import (
    LATENCY_WINDOW_S,
    RATE_WINDOW_S,
    WATCHED_S,
    QueueWatch,
    Watched,
)
from producers.client import Client
from producers.errors import RequestFailed
from tests.conftest import service_unavailable
from tests.observe.dashboard_support import Count, Queues, snapshot, watched
from tests.producers.test_openai_front import Up, fairq_up

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

ROOT = Path(__file__).resolve().parents[2]
TIERS = {"acme": "enterprise", "globex": "standard", "initech": "free"}
ORDER = ["enterprise", "standard", "free"]
# umbrella is unlisted: free, like initech, with the same weight.
IN_FLIGHT = {"acme": 40, "globex": 20, "initech": 8, "umbrella": 16}
# Where to keep the page's screenshot (docs/img/dashboard.png for the docs); a
# temporary directory otherwise.
SCREENSHOT_ENV = "FQ_DASHBOARD_SCREENSHOT"
BROWSER_S = 30.0


QUEUES = Queues(TIERS, ORDER)


def test_figures_per_tenant_tier_and_endpoint() -> None:
    watch = watched(["chat", "embed"])
    counts = {("chat", "acme"): Count(), ("chat", "globex"): Count()}
    watch.refresh(Watched([], counts, QUEUES), 100.0)
    counts[("chat", "acme")].admitted = 20
    counts[("chat", "globex")] = Count(admitted=5, rejected=10)
    for n in range(1, 21):
        watch.waited("chat", "acme", n / 10, 104.0)  # 0.1 .. 2.0 s
        watch.first_token("chat", "acme", n, 104.0)
    watch.waited("chat", "globex", 5.0, 104.0)
    rows = [
        DepthRow("chat", "enterprise", "acme", 7, 3, 1.0),
        DepthRow("chat", "standard", "globex", 1, 0, 0.5),
    ]
    watch.refresh(Watched(rows, counts, QUEUES), 105.0)
    view = snapshot(watch)
    assert (view.at, view.rate_window_s, view.latency_window_s) == (
        105.0,
        RATE_WINDOW_S,
        LATENCY_WINDOW_S,
    )
    chat, embed = view.endpoints
    assert (embed.figures.name, embed.figures.queued, embed.tiers) == ("embed", 0, [])
    assert [tier.figures.name for tier in chat.tiers] == ["enterprise", "standard"]
    (acme,), (globex,) = (tier.tenants for tier in chat.tiers)
    assert (acme.queued, acme.running, acme.admitted_per_s, acme.rejected_per_s) == (7, 3, 4.0, 0.0)
    assert (acme.p95_queue_wait_s, acme.p95_ttft_s) == (1.9, 19)
    assert (globex.admitted_per_s, globex.rejected_per_s, globex.p95_ttft_s) == (1.0, 2.0, None)
    total = chat.figures
    assert (total.queued, total.running, total.admitted_per_s, total.rejected_per_s) == (
        8,
        3,
        5.0,
        2.0,
    )
    # Pooled over both tenants' 21 waits: the 20th smallest.
    assert total.p95_queue_wait_s == 2.0


def test_old_samples_and_forgotten_tenants_leave_the_page() -> None:
    watch = watched(["chat"])
    counts = {("chat", "acme"): Count(admitted=1)}
    watch.waited("chat", "acme", 1.0, 0.0)
    watch.refresh(Watched([], counts, QUEUES), 1.0)
    assert snapshot(watch).endpoints[0].tiers[0].tenants[0].p95_queue_wait_s == 1.0
    watch.refresh(Watched([], counts, QUEUES), LATENCY_WINDOW_S + 1.0)
    (tier,) = snapshot(watch).endpoints[0].tiers
    assert tier.tenants[0].p95_queue_wait_s is None  # the sample fell out of the window
    watch.refresh(Watched([], {}, QUEUES), LATENCY_WINDOW_S + 2.0)  # admission forgot it
    assert snapshot(watch).endpoints[0].tiers == []


def test_counts_that_start_over_give_no_negative_rate() -> None:
    watch = watched(["chat"])
    watch.refresh(Watched([], {("chat", "acme"): Count(admitted=50)}, QUEUES), 0.0)
    watch.refresh(Watched([], {("chat", "acme"): Count(admitted=2)}, QUEUES), 1.0)
    watch.refresh(Watched([], {("chat", "acme"): Count(admitted=4)}, QUEUES), 2.0)
    assert snapshot(watch).endpoints[0].tiers[0].tenants[0].admitted_per_s == 2.0


def test_nobody_watching_costs_no_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    watch = QueueWatch(["chat"])
    rows = [DepthRow("chat", "free", "t0", 3, 1, 0.0)]
    watch.refresh(Watched(rows, {}, QUEUES), 1.0)
    assert snapshot(watch).at == 0.0  # built at start, not since: nobody read it
    watch.refresh(Watched(rows, {}, QUEUES), 2.0)  # read just now
    assert snapshot(watch).at == 2.0
    later = time.monotonic() + WATCHED_S + 1
    monkeypatch.setattr("dispatcher.observe.dashboard.time.monotonic", lambda: later)
    watch.refresh(Watched(rows, {}, QUEUES), 3.0)
    assert snapshot(watch).at == 2.0


def test_the_busiest_tenants_come_first_and_unknown_tenants_are_left_out() -> None:
    watch = watched(["chat"])
    tiers = {f"t{n}": "free" for n in range(5)}
    rows = [DepthRow("chat", "free", f"t{n}", n, 0, 0.0) for n in range(5)]
    watch.waited("chat", "gone", 1.0, 0.0)  # no tier: no longer in the registry
    watch.refresh(Watched(rows, {}, Queues(tiers, ORDER)), 1.0)
    (tier,) = snapshot(watch).endpoints[0].tiers
    assert [t.name for t in tier.tenants] == ["t4", "t3", "t2", "t1", "t0"]


# -- the page in a browser -----------------------------------------------------------------


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, nats_binary: Path) -> Iterator[Up]:
    with fairq_up(tmp_path_factory.mktemp("dashboard"), time_scale=0.5) as running:
        yield running


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        service_unavailable("no chromium binary (apt-get install -y chromium)")
    return path


def load_in_background(nats_url: str, stop: threading.Event) -> threading.Thread:
    """Three tenants keep the chat endpoint busy until `stop` is set; rate-limited
    requests are part of the picture (the page shows them as rejected)."""

    async def one(client: Client, tenant: str) -> None:
        while not stop.is_set():
            try:
                await client.run(
                    "chat", tenant, prompt=f"{tenant} asks", max_tokens=32, timeout_s=30.0
                )
            except RequestFailed:
                await asyncio.sleep(0.2)

    async def run() -> None:
        async with Client.connect(nats_url) as client:
            await asyncio.gather(
                *(
                    one(client, tenant)
                    for tenant, in_flight in IN_FLIGHT.items()
                    for _ in range(in_flight)
                )
            )

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    return thread


@pytest.mark.integration
def test_the_page_shows_the_queues_move_in_a_real_browser(
    up: Up, chromium: str, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    url = up.values["DASHBOARD_URL"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/dashboard")
    with urllib.request.urlopen(url + ".json", timeout=5) as answer:
        assert answer.headers["Content-Type"] == "application/json"
    screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "dashboard.png")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium, headless=True, chromium_sandbox=False
        )
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(url)
            chat = page.locator('section[data-endpoint="chat"]')
            expect(page.locator("#status")).to_contain_text("updated", timeout=BROWSER_S * 1000)
            admitted = chat.locator('.summary [data-field="admitted_per_s"] b')
            expect(admitted).to_have_text("0")
            expect(chat.locator("tr.tenant")).to_have_count(0)
            stop = threading.Event()
            load = load_in_background(up.nats_url, stop)
            try:
                for tenant in TIERS:
                    expect(chat.locator(f'tr.tenant[data-tenant="{tenant}"]')).to_be_visible(
                        timeout=BROWSER_S * 1000
                    )
                expect(admitted).not_to_have_text("0", timeout=BROWSER_S * 1000)
                running = chat.locator('.summary [data-field="running"] b')
                expect(running).not_to_have_text("0", timeout=BROWSER_S * 1000)
                acme_ttft = chat.locator(
                    'tr.tenant[data-tenant="acme"] td[data-field="p95_ttft_s"]'
                )
                expect(acme_ttft).not_to_have_text("–", timeout=BROWSER_S * 1000)
                tiers = chat.locator("tr.tier")
                assert tiers.evaluate_all("rows => rows.map(row => row.dataset.tier)") == ORDER
                expect_waits_and_shares(chat)
                expect_the_history_to_outlive_a_reload(page, chat)
                page.wait_for_timeout(3000)  # a few more seconds of figures
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot), full_page=True)
            finally:
                stop.set()
                load.join(timeout=60)
            assert not load.is_alive()
        finally:
            browser.close()
    assert screenshot.stat().st_size > 10_000


def expect_waits_and_shares(chat: Locator) -> None:
    """The oldest wait of what is queued, and each tenant's share of its tier's service
    next to its weight's (initech shares the free tier with umbrella, of equal weight)."""
    from playwright.sync_api import expect

    timeout = BROWSER_S * 1000
    oldest = chat.locator('.summary [data-field="oldest_wait_s"] b')
    expect(oldest).not_to_have_text("–", timeout=timeout)
    acme = chat.locator('tr.tenant[data-tenant="acme"]')
    for field in ("service_share", "weight_share"):
        expect(acme.locator(f'td[data-field="{field}"]')).to_have_text(
            re.compile(r"^\d+%$"), timeout=timeout
        )
    initech = chat.locator('tr.tenant[data-tenant="initech"] td[data-field="weight_share"]')
    expect(initech).to_have_text("50%", timeout=timeout)
    headers = set(chat.locator("th").all_text_contents())
    assert {
        "oldest queued wait",
        "p95 wait (dispatched)",
        "served model units/s",
        "service share",
        "weight share",
        "fairness (Jain)",
    } <= headers


def expect_the_history_to_outlive_a_reload(page: Page, chat: Locator) -> None:
    """Charts with a time axis, value axes in their units and legends, drawn from the
    dispatcher's history: a reloaded page shows it at once."""
    from playwright.sync_api import expect

    requests = chat.locator('figure.history[data-chart="requests"]')
    waits = chat.locator('figure.history[data-chart="waits"]')
    for figure, title in ((requests, "requests"), (waits, "wait")):
        expect(figure.locator("g.axis.x text")).to_have_count(6)
        expect(figure.locator("g.axis.y text")).to_have_count(3)
        assert figure.locator("text.axis-title").all_text_contents() == [title, "time"]
    assert re.fullmatch(r"[\d.]+ (s|ms)", waits.locator("g.axis.y text").last.text_content() or "")
    assert requests.locator("figcaption span").all_text_contents() == ["queued", "running"]
    assert waits.locator("figcaption span").all_text_contents() == [
        f"{tier} {line}"
        for tier in ORDER
        for line in ("oldest queued wait", "p95 wait (dispatched)")
    ]
    points = requests.locator("svg")
    expect(points).to_have_attribute("data-points", re.compile(r"^([3-9]|\d\d+)$"))
    page.reload()
    expect(page.locator("#status")).to_contain_text("updated", timeout=BROWSER_S * 1000)
    assert int(points.get_attribute("data-points") or 0) >= 3


# -- the Grafana dashboard -------------------------------------------------------------------

GRAFANA_DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "fairq.json"
# The series a metric family of each type exposes, by suffix.
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gauge": ("",),
    "summary": ("", "_count", "_sum"),
}


def queried_metrics() -> set[str]:
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    exprs += [variable["query"]["query"] for variable in dashboard["templating"]["list"]]
    return {name for expr in exprs for name in re.findall(r"\bfairq_[a-z0-9_]+", expr)}


@pytest.mark.integration
def test_every_metric_the_grafana_dashboard_queries_exists(up: Up) -> None:
    with urllib.request.urlopen(up.values["METRICS_URL"], timeout=5) as answer:
        exposed = text_string_to_metric_families(answer.read().decode())
    series = {family.name + suffix for family in exposed for suffix in SUFFIXES[family.type]}
    queried = queried_metrics()
    assert len(queried) >= 15
    assert queried <= series, sorted(queried - series)

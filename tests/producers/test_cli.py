"""The `fairq` command line as a new user meets it (issue 44): help texts, what `submit`
prints for an embedding, `status` of an unknown id, the warning for a tenant the config
does not list, `top`'s tier order, and what `pip install -e .` brings.

Where a dispatcher or a worker is needed, the test plays it with plain NATS, as in
test_client.py (whose helpers it uses)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from broker_config.config import EXAMPLE_CONFIG, BrokerSettings, load_config
from broker_config.streams import provision
from broker_config.subjects import Subjects
from broker_config.wire import (
    DepthEntry,
    DepthReply,
    DoneEvent,
    Event,
    StatusReply,
    Timings,
    Usage,
    encode,
)
from producers.cli import build_parser
from producers.commands import render_depth
from producers.request_commands import embedding_line, unlisted_tenant_warning
from tests.producers.test_client import fairq, play_worker, respond

REPO = Path(__file__).resolve().parents[2]
S = Subjects()
PRODUCER_COMMANDS = ("submit", "status", "cancel", "top", "reload", "up", "demo", "auth")
# Those that start their own server or connect to none.
NO_NATS_OPTION = ("up", "auth")


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """The test's broker admin, fake dispatcher and fake worker; streams provisioned."""
    conn = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=0)
    await provision(conn.jetstream(timeout=5), BrokerSettings(storage="memory"))
    yield conn
    await conn.close()


# -- help ----------------------------------------------------------------------------------


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: commands.choices[name] for name in PRODUCER_COMMANDS}


def test_every_option_of_the_producer_commands_says_what_it_is() -> None:
    for name, parser in command_parsers().items():
        silent = [
            action.dest
            for action in parser._actions
            if not action.help and not isinstance(action, argparse._HelpAction)
        ]
        assert not silent, f"fairq {name}: no help for {silent}"
    help_of = {action.dest: action.help for action in command_parsers()["submit"]._actions}
    assert "default: the endpoint's max_tokens_cap" in help_of["max_tokens"]


def test_help_names_nats_url_but_never_shows_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_URL", "nats://acme:s3cret@10.0.0.1:4222")
    for name, parser in command_parsers().items():
        text = parser.format_help()
        assert "s3cret" not in text, f"fairq {name} --help shows $NATS_URL's value"
        if name not in NO_NATS_OPTION:
            assert "(default: $NATS_URL, else nats://127.0.0.1:4222)" in " ".join(text.split())


# -- submit --------------------------------------------------------------------------------


def test_an_embedding_is_shown_as_its_dimension_and_first_values() -> None:
    assert embedding_line([0.5, -0.25]) == "embedding of 2 dimensions: [0.5, -0.25]"
    vector = [i / 3 for i in range(384)]
    assert embedding_line(vector) == (
        "embedding of 384 dimensions: [0, 0.3333, 0.6667, 1, 1.333, 1.667, 2, 2.333, ...]"
    )


async def test_cli_submit_to_an_embedding_endpoint_prints_the_vector(
    nats_url: str, nc: NATS
) -> None:
    def embedded(request_id: str) -> list[Event]:
        usage, timings = Usage(3, 0, 0.01), Timings(queued_s=0.1, ttft_s=None, total_s=0.2)
        return [DoneEvent(request_id, 0, "", usage, timings, embedding=[0.125, -1.5, 2.0])]

    worker = asyncio.create_task(play_worker(nc, nc.jetstream(timeout=5), "acme", embedded))
    code, out, err = await fairq(
        *("submit", "--nats", nats_url, "--endpoint", "embed", "--tenant", "acme"),
        *("--prompt", "a sentence", "--id", "emb-1"),
    )
    await worker
    assert (code, out) == (0, "embedding of 3 dimensions: [0.125, -1.5, 2]\n"), err
    assert err.startswith("done id=emb-1 input_tokens=3 output_tokens=0 ")


def test_a_tenant_the_config_does_not_list_gets_a_warning_naming_its_fate(
    tmp_path: Path,
) -> None:
    config = load_config(EXAMPLE_CONFIG)
    assert unlisted_tenant_warning(EXAMPLE_CONFIG, config, "acme") is None
    assert unlisted_tenant_warning(EXAMPLE_CONFIG, config, "acmee") == (
        f"tenant 'acmee' is not listed in {EXAMPLE_CONFIG}: the dispatcher admits it as an "
        "unlisted tenant, tier 'free'; did you mean 'acme'?"
    )
    strict = tmp_path / "strict.toml"
    strict.write_text(EXAMPLE_CONFIG.read_text().replace('policy = "admit"', 'policy = "reject"'))
    assert unlisted_tenant_warning(strict, load_config(strict), "zzz") == (
        f"tenant 'zzz' is not listed in {strict}: the dispatcher rejects it (unknown_tenant)"
    )


async def test_cli_submit_warns_of_an_unlisted_tenant_then_submits(
    nats_url: str, nc: NATS, tmp_path: Path
) -> None:
    args = ["submit", "--nats", nats_url, "--endpoint", "chat", "--prompt", "Hi", "--no-wait"]
    code, out, err = await fairq(*args, "--tenant", "acmee", "--id", "typo-1")
    assert (code, out) == (0, "typo-1\n")
    assert err == (
        f"fairq submit: warning: tenant 'acmee' is not listed in {EXAMPLE_CONFIG}: the "
        "dispatcher admits it as an unlisted tenant, tier 'free'; did you mean 'acme'?\n"
    )
    stored = await nc.jetstream(timeout=5).get_msg(S.requests_stream, 1)
    assert stored.subject.endswith(".chat.acmee")  # and on it went
    # --config names the file the warning is about; one it cannot read is an error.
    own = tmp_path / "own.toml"
    own.write_text(EXAMPLE_CONFIG.read_text() + '\n[tenants.acmee]\ntier = "free"\n')
    code, out, err = await fairq(*args, "--tenant", "acmee", "--config", str(own))
    assert (code, err) == (0, "")
    code, out, err = await fairq(*args, "--tenant", "acme", "--config", str(tmp_path / "no"))
    assert (code, out) == (2, "")
    assert err.startswith(f"fairq submit: {tmp_path / 'no'}: cannot read config")


# -- status --------------------------------------------------------------------------------


async def test_cli_status_of_an_unknown_id_exits_3_with_a_line_on_stderr(
    nats_url: str, nc: NATS
) -> None:
    await respond(nc, S.status("acme"), lambda body: encode(StatusReply("r-9", "unknown")))
    code, out, err = await fairq("status", "--nats", nats_url, "--tenant", "acme", "r-9")
    assert (code, json.loads(out)) == (3, {"id": "r-9", "state": "unknown"})
    assert err == (
        "fairq status: no request 'r-9' of tenant 'acme': never submitted under this "
        "tenant, or finished longer ago than the results are kept ([broker] results_ttl_s)\n"
    )
    code, out, _ = await fairq("status", "--help")
    assert code == 0 and "3 no request with this id" in " ".join(out.split())


# -- top -----------------------------------------------------------------------------------


def test_top_lists_tiers_in_the_configs_order() -> None:
    reply = DepthReply(
        [
            DepthEntry("chat", "free", "initech", 1, 0, 0.1),
            DepthEntry("chat", "standard", "globex", 2, 0, 0.2),
            DepthEntry("chat", "enterprise", "acme", 3, 0, 0.3),
            DepthEntry("chat", "gold", "zed", 4, 0, 0.4),  # not in the config: last
            DepthEntry("chat", "enterprise", "aaa", 5, 0, 0.5),
            DepthEntry("embed", "free", "initech", 6, 0, 0.6),
        ]
    )
    tiers = ["enterprise", "standard", "free"]
    rows = render_depth(reply, {}, "T", tiers).splitlines()[3:]
    assert [row.split()[:3] for row in rows] == [
        ["chat", "enterprise", "aaa"],
        ["chat", "enterprise", "acme"],
        ["chat", "standard", "globex"],
        ["chat", "free", "initech"],
        ["chat", "gold", "zed"],
        ["embed", "free", "initech"],
    ]


async def test_cli_top_reads_the_tier_order_from_the_config(
    nats_url: str, nc: NATS, tmp_path: Path
) -> None:
    depth = DepthReply(
        [
            DepthEntry("chat", "enterprise", "acme", 1, 0, 0.1),
            DepthEntry("chat", "free", "initech", 2, 0, 0.2),
            DepthEntry("chat", "standard", "globex", 3, 0, 0.3),
        ]
    )
    await respond(nc, S.depth, lambda body: encode(depth))
    top = ["top", "--nats", nats_url, "--once"]
    code, out, err = await fairq(*top)
    assert (code, err) == (0, "")
    assert [line.split()[1] for line in out.splitlines()[3:]] == ["enterprise", "standard", "free"]
    reversed_tiers = tmp_path / "reversed.toml"  # the same tiers, named the other way up
    reversed_tiers.write_text(
        EXAMPLE_CONFIG.read_text()
        .replace('name = "enterprise"', 'name = "lowest"')
        .replace('name = "free"', 'name = "enterprise"')
        .replace('name = "lowest"', 'name = "free"')
    )
    code, out, err = await fairq(*top, "--config", str(reversed_tiers))
    assert (code, err) == (0, "")
    assert [line.split()[1] for line in out.splitlines()[3:]] == ["free", "standard", "enterprise"]


# -- installing ----------------------------------------------------------------------------


def test_installing_fairq_brings_no_test_or_browser_tooling() -> None:
    """`pip install -e .` is enough for `fairq up`; the `dev` extra adds the tests' tools,
    and CI installs it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    tooling = {"pytest", "pytest-xdist", "playwright", "testcontainers", "ruff", "hypothesis"}

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=\[ ;]", requirement, maxsplit=1)[0] for requirement in requirements}

    assert not names(project["dependencies"]) & tooling
    assert tooling <= names(project["optional-dependencies"]["dev"])
    assert "pip install --quiet -e '.[dev]'" in (REPO / ".ci" / "run").read_text()

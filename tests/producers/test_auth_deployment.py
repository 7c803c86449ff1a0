"""A deployment's broker users (`fairq auth`): the rendering, then a real nats-server run
with the rendered config, a real dispatcher (tenant inboxes on) and a simulated worker
process, each as its own nkey user, and tenants that try to act as each other."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import stat
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import nats.errors
import nats.js.errors
import nkeys
import pytest
from nats.aio.client import Client as NATS

from broker_config.auth import (
    AUTH_CONF,
    DISPATCHER_USER,
    FAIRQ_ACCOUNT,
    FRONT_USER,
    LOCK_FILE,
    MANIFEST,
    OPERATOR_USER,
    WORKER_USER,
    RenderedAuth,
    deployment_accounts,
    front_permissions,
    registered_tenants,
    render_auth_dir,
    tenant_permissions,
    with_tenant_inboxes,
)
from broker_config.config import EXAMPLE_CONFIG, load_config
from broker_config.connection import ConnectionOptionsError, credentials
from broker_config.server import EmbeddedNatsServer
from broker_config.subjects import HDR_MSG_ID, HDR_REPLY, Subjects
from broker_config.wire import DoneEvent, ErrorCode, ErrorEvent
from dispatcher.service import Dispatcher
from producers.client import Client
from producers.errors import ConnectionFailed
from producers.request_commands import EXIT_UNKNOWN

REPO = Path(__file__).resolve().parents[2]
S = Subjects()
START_S = 30.0  # a worker interpreter's imports, connection and first heartbeat
REQUEST_S = 20.0


# -- rendering ----------------------------------------------------------------------------------


def accounts_in(conf: Path) -> dict[str, dict]:
    """auth.conf's `accounts` block (JSON after the comment lines)."""
    return json.loads(conf.read_text().split("\naccounts: ", 1)[1])


def keys_in(conf: Path) -> dict[str, str]:
    """Each user's public key, from the comment line naming it."""
    return dict(
        line[2:].split(": ") for line in conf.read_text().splitlines()[1:] if line.startswith("# ")
    )


def public_key(seed: Path) -> str:
    return nkeys.from_seed(bytearray(seed.read_bytes().strip())).public_key.decode()


def test_render_puts_each_tenant_and_the_front_in_an_account_of_its_own(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    rendered = render_auth_dir(out, S, ["globex", "acme", "acme"])
    assert (
        rendered.added
        == ("acme", "globex", DISPATCHER_USER, WORKER_USER, OPERATOR_USER, FRONT_USER)
        and rendered.removed == ()
    )
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [AUTH_CONF, MANIFEST, LOCK_FILE, *(f"{name}.nk" for name in rendered.added)]
    )
    for seed in rendered.seeds.values():
        assert stat.S_IMODE(seed.stat().st_mode) == 0o600
        assert seed.read_text().startswith("SU")  # a user's seed
    keys = keys_in(rendered.config)
    assert keys == {name: public_key(seed) for name, seed in rendered.seeds.items()}
    assert len(set(keys.values())) == len(keys)
    accounts = accounts_in(rendered.config)
    assert list(accounts) == [FAIRQ_ACCOUNT, "acme", "globex", FRONT_USER]

    fairq = accounts[FAIRQ_ACCOUNT]
    assert fairq["jetstream"] == "enabled"
    assert fairq["users"] == [
        {"nkey": keys[name]}  # full access in its own account
        for name in (DISPATCHER_USER, WORKER_USER, OPERATOR_USER)
    ]
    shared = {
        name: [
            ("service", f"fq.req.*.{name}"),
            ("service", f"fq.api.*.{name}"),
            ("stream", f"_INBOX_{name}.>"),
        ]
        for name in ("acme", "globex")
    }
    assert fairq["exports"] == [
        {kind: subject, "accounts": [name, FRONT_USER]}
        for name in ("acme", "globex")
        for kind, subject in shared[name]
    ]

    def imports(*tenants: str) -> list[dict]:
        return [
            {kind: {"account": FAIRQ_ACCOUNT, "subject": subject}}
            for name in tenants
            for kind, subject in shared[name]
        ]

    for name in ("acme", "globex"):
        own = tenant_permissions(S, name)
        assert accounts[name] == {
            "users": [
                {
                    "nkey": keys[name],
                    "permissions": {
                        "publish": {"allow": list(own.publish)},
                        "subscribe": {"allow": list(own.subscribe)},
                    },
                }
            ],
            "imports": imports(name),
        }
        assert "jetstream" not in accounts[name]
    front = front_permissions(S, FRONT_USER, ["acme", "globex"])
    assert accounts[FRONT_USER] == {
        "users": [
            {
                "nkey": keys[FRONT_USER],
                "permissions": {
                    "publish": {"allow": list(front.publish)},
                    "subscribe": {"allow": list(front.subscribe)},
                },
            }
        ],
        "imports": imports("acme", "globex"),
    }
    conf = rendered.config.read_text()
    assert not any(seed.read_text().strip() in conf for seed in rendered.seeds.values())


def test_render_uses_the_configured_subject_prefix(tmp_path: Path) -> None:
    rendered = render_auth_dir(tmp_path, Subjects("stage"), ["acme"])
    accounts = accounts_in(rendered.config)
    assert [list(e.values())[0] for e in accounts[FAIRQ_ACCOUNT]["exports"]] == [
        "stage.req.*.acme",
        "stage.api.*.acme",
        "_INBOX_acme.>",
    ]
    assert accounts["acme"]["users"][0]["permissions"]["publish"]["allow"] == [
        "stage.req.*.acme",
        "stage.api.*.acme",
    ]


def test_rerender_keeps_seeds_and_adds_and_removes_tenants(tmp_path: Path) -> None:
    first = render_auth_dir(tmp_path, S, ["acme", "globex"])
    seeds = {name: path.read_bytes() for name, path in first.seeds.items()}
    keys = keys_in(first.config)
    second = render_auth_dir(tmp_path, S, ["acme", "initech"])
    assert second.added == ("initech",) and second.removed == ("globex",)
    assert not (tmp_path / "globex.nk").exists()
    for name, path in second.seeds.items():
        if name != "initech":
            assert path.read_bytes() == seeds[name]
    after = keys_in(second.config)
    assert "globex" not in after and "globex" not in accounts_in(second.config)
    assert all(after[name] == keys[name] for name in after if name != "initech")


def test_rerender_removes_only_the_seeds_it_made(tmp_path: Path) -> None:
    render_auth_dir(tmp_path, S, ["acme", "globex"])
    mine = tmp_path / "mine.nk"  # the operator's own key, kept next to them
    mine.write_text("SU-not-fairqs")
    second = render_auth_dir(tmp_path, S, ["acme"])
    assert second.removed == ("globex",) and not (tmp_path / "globex.nk").exists()
    assert mine.read_text() == "SU-not-fairqs"
    assert "mine" not in keys_in(second.config)


def test_render_refuses_a_directory_that_is_not_its_own(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "prod.nk").write_text("SU-someone-elses")
    with pytest.raises(ValueError, match="not rendered by fairq auth"):
        render_auth_dir(other, S, ["acme"])
    assert [p.name for p in other.iterdir() if p.name != LOCK_FILE] == ["prod.nk"]
    (other / AUTH_CONF).write_text("authorization { users = [] }\n")  # not ours either
    with pytest.raises(ValueError, match="not rendered by fairq auth"):
        render_auth_dir(other, S, ["acme"])


def test_concurrent_renders_agree_on_every_seed(tmp_path: Path) -> None:
    """Two renders at once, each adding the same tenant: without the lock, one's seed
    and the other's auth.conf could disagree (seen 4 times in 100)."""
    for trial in range(30):
        out = tmp_path / str(trial)
        render_auth_dir(out, S, ["acme"])
        start = threading.Barrier(4)
        errors: list[BaseException] = []

        def render() -> None:  # joined below, within the iteration
            start.wait()  # noqa: B023
            try:
                render_auth_dir(out, S, ["acme", "newco"])  # noqa: B023
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)  # noqa: B023

        threads = [threading.Thread(target=render) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        keys = keys_in(out / AUTH_CONF)
        assert keys["newco"] == public_key(out / "newco.nk"), trial
        assert accounts_in(out / AUTH_CONF)["newco"]["users"][0]["nkey"] == keys["newco"]


def test_render_refuses_reserved_names_and_broken_seeds(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        render_auth_dir(tmp_path / "a", S, ["acme", FRONT_USER])
    with pytest.raises(ValueError, match="reserved"):
        render_auth_dir(tmp_path / "a", S, [FAIRQ_ACCOUNT])
    render_auth_dir(tmp_path / "b", S, ["acme"])
    (tmp_path / "b" / "acme.nk").write_text("not a seed")
    with pytest.raises(ValueError, match="acme.nk: not a readable nkey seed"):
        render_auth_dir(tmp_path / "b", S, ["acme"])
    with pytest.raises(ValueError, match="invalid tenant"):
        render_auth_dir(tmp_path / "c", S, ["ac me"])


def test_render_refuses_a_bad_public_key(tmp_path: Path) -> None:
    rendered = render_auth_dir(tmp_path, S, ["acme"])
    keys = {
        name: nkeys.from_seed(bytearray(path.read_bytes().strip())).public_key.decode()
        for name, path in rendered.seeds.items()
    }
    assert deployment_accounts(S, ["acme"], keys)  # every key as rendered is taken
    with pytest.raises(ValueError, match="not an nkey user public key"):
        deployment_accounts(S, ["acme"], keys | {"acme": "UABC"})


def test_registered_tenants_include_the_fronts() -> None:
    config = load_config()
    assert registered_tenants(config) == sorted(config.tenants)
    from producers.openai_front.keys import with_dev_key

    with_key, _ = with_dev_key(config, "umbrella")
    assert "umbrella" in registered_tenants(with_key)


def test_credentials_conflicts_and_unreadable_files(tmp_path: Path) -> None:
    seed = tmp_path / "x.nk"
    seed.write_text("SU...")
    assert credentials(nkey=seed) == {"nkeys_seed": str(seed)}
    assert credentials(user="a", password="b") == {"user": "a", "password": "b"}
    assert credentials() == {}
    with pytest.raises(ConnectionOptionsError, match="--creds and --nkey conflict"):
        credentials(creds=seed, nkey=seed)
    with pytest.raises(ConnectionOptionsError, match="--user/--password and --nkey conflict"):
        credentials(user="a", nkey=seed)
    with pytest.raises(ConnectionOptionsError, match="--password needs --user"):
        credentials(password="b")
    with pytest.raises(ConnectionOptionsError, match="cannot read it"):
        credentials(nkey=tmp_path / "missing.nk")
    (tmp_path / "empty.creds").write_text("")
    with pytest.raises(ConnectionOptionsError, match="empty"):
        credentials(creds=tmp_path / "empty.creds")


# -- a deployment on a real broker --------------------------------------------------------------


@dataclass
class Deployment:
    server: EmbeddedNatsServer
    auth: RenderedAuth
    dispatcher_nc: NATS

    def seed(self, user: str) -> Path:
        return self.auth.seeds[user]


async def worker_process(url: str, seed: Path, log: Path) -> asyncio.subprocess.Process:
    with open(log, "wb") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "workers",
            "--nats",
            url,
            "--nkey",
            str(seed),
            "--endpoint",
            "chat",
            "--worker-id",
            "chat-w1",
            "--engine",
            "sim",
            "--time-scale",
            "0",
            "--config",
            str(EXAMPLE_CONFIG),
            cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )


@contextlib.asynccontextmanager
async def deployment(
    nats_binary: Path, tmp_path: Path, tenants: list[str]
) -> AsyncIterator[Deployment]:
    config = load_config()
    config = with_tenant_inboxes(
        msgspec.structs.replace(
            config, dispatcher=msgspec.structs.replace(config.dispatcher, settle_s=0.2)
        )
    )
    auth = render_auth_dir(tmp_path / "auth", S, tenants)
    async with (
        EmbeddedNatsServer(binary=nats_binary, config_file=auth.config) as server,
        contextlib.AsyncExitStack() as stack,
    ):
        nc = await nats.connect(
            server.url, nkeys_seed=str(auth.seeds[DISPATCHER_USER]), max_reconnect_attempts=0
        )
        stack.push_async_callback(nc.close)
        await stack.enter_async_context(Dispatcher(nc, config))
        beats = await nc.subscribe(S.heartbeats("chat"))
        worker = await worker_process(server.url, auth.seeds[WORKER_USER], tmp_path / "worker.log")

        async def stop_worker() -> None:
            if worker.returncode is None:
                worker.terminate()
                await asyncio.wait_for(worker.wait(), START_S)

        stack.push_async_callback(stop_worker)
        try:
            await beats.next_msg(timeout=START_S)  # the worker serves, as its own user
        except nats.errors.TimeoutError:
            pytest.fail(f"no heartbeat: {(tmp_path / 'worker.log').read_text()}")
        await beats.unsubscribe()
        yield Deployment(server, auth, nc)


class Errors:
    """A connection's async errors (permission violations)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def record(self, exc: Exception) -> None:
        self.seen.append(str(exc).lower())

    async def violation(self, fragment: str) -> bool:
        for _ in range(150):
            if any("permissions violation" in e and fragment.lower() in e for e in self.seen):
                return True
            await asyncio.sleep(0.02)
        return False


async def tenant_connection(d: Deployment, tenant: str, errors: Errors) -> NATS:
    return await nats.connect(
        d.server.url,
        nkeys_seed=str(d.seed(tenant)),
        inbox_prefix=S.inbox_prefix(tenant),
        error_cb=errors.record,
        max_reconnect_attempts=0,
    )


async def fairq_cli(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "FAIRQ_NATS_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "producers.cli",
        *args,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.integration
async def test_tenants_cannot_act_as_each_other(nats_binary: Path, tmp_path: Path) -> None:
    async with deployment(nats_binary, tmp_path, ["acme", "globex"]) as d:
        # acme, through the SDK with its own seed, is served.
        async with Client.connect(
            d.server.url, nkey=d.seed("acme"), tenant_inboxes="acme", publish_timeout_s=2.0
        ) as acme:
            done = await acme.run("chat", "acme", prompt="hi", max_tokens=4, timeout_s=REQUEST_S)
            assert isinstance(done, DoneEvent)

        errors = Errors()
        nc = await tenant_connection(d, "acme", errors)
        globex_errors = Errors()
        globex = await tenant_connection(d, "globex", globex_errors)
        try:
            js = nc.jetstream(timeout=1.0)
            # Cannot publish as globex: the broker refuses, no PubAck.
            with pytest.raises(nats.errors.TimeoutError):
                await js.publish(
                    S.request("chat", "globex"),
                    b'{"prompt":"x"}',
                    headers={HDR_MSG_ID: "as-globex"},
                )
            assert await errors.violation('publish to "fq.req.chat.globex"')
            # Cannot read globex's events.
            await nc.subscribe(f"{S.inbox_prefix('globex')}.>")
            assert await errors.violation('subscription to "_inbox_globex.>"')
            # Cannot read globex's status or cancel its requests.
            for subject in (S.status("globex"), S.cancel("globex"), S.depth):
                with pytest.raises(nats.errors.TimeoutError):
                    await nc.request(subject, b'{"id":"g1"}', timeout=0.5)
                assert await errors.violation(f'publish to "{subject}"')

            # Cannot send its events into globex's inbox: stored, then refused.
            globex_inbox = await globex.subscribe(f"{S.inbox_prefix('globex')}.>")
            await globex.flush()
            ack = await js.publish(
                S.request("chat", "acme"),
                b'{"prompt":"hi","max_tokens":4}',
                headers={HDR_MSG_ID: "misdirected", HDR_REPLY: f"{S.inbox_prefix('globex')}.steal"},
            )
            assert ack.seq > 0
            async with Client(nc, tenant_inboxes="acme", api_timeout_s=2.0) as client:
                for _ in range(100):
                    status = await client.status("acme", "misdirected")
                    if status.result is not None:
                        break
                    await asyncio.sleep(0.1)
            assert isinstance(status.result, ErrorEvent), status
            assert status.result.code == ErrorCode.INVALID_REQUEST
            assert "must start with '_INBOX_acme.'" in status.result.message
            with pytest.raises(nats.errors.TimeoutError):
                await globex_inbox.next_msg(timeout=1.0)  # globex received nothing
            assert not globex_errors.seen
        finally:
            await nc.close()
            await globex.close()


@pytest.mark.integration
async def test_a_reply_subject_cannot_reach_into_fairqs_account(
    nats_binary: Path, tmp_path: Path
) -> None:
    """nats-server checks no one's permissions against a reply subject. The PubAck of a
    submit and the dispatcher's answer to a status call go there; with the tenants in
    accounts of their own, they go back into the caller's account, never into FAIRQ's
    (a KV key, another tenant's results or inbox, the dispatchers' reload subject)."""
    async with deployment(nats_binary, tmp_path, ["acme", "globex"]) as d:
        targets = [
            f"$KV.{S.limits_bucket}.quota-total.acme.2026-01",
            f"$KV.{S.results_bucket}.globex.victim",
            S.admin_reload,
            f"{S.inbox_prefix('globex')}.stolen",
        ]
        operator = await nats.connect(
            d.server.url, nkeys_seed=str(d.seed(OPERATOR_USER)), max_reconnect_attempts=0
        )
        globex_errors, errors = Errors(), Errors()
        globex = await tenant_connection(d, "globex", globex_errors)
        acme = await tenant_connection(d, "acme", errors)
        try:
            spies = {target: await operator.subscribe(target) for target in targets}
            # The control: what acme sends does arrive in FAIRQ, on its own subject.
            arrived = await operator.subscribe(S.tenant_requests("acme"))
            globex_inbox = await globex.subscribe(f"{S.inbox_prefix('globex')}.>")
            await operator.flush()
            await globex.flush()
            for n, target in enumerate(targets):
                await acme.publish(
                    S.request("chat", "acme"),
                    b'{"prompt":"hi","max_tokens":4}',
                    reply=target,
                    headers={
                        HDR_MSG_ID: f"attack-{n}",
                        HDR_REPLY: f"{S.inbox_prefix('acme')}.r{n}",
                    },
                )
                await acme.publish(S.status("acme"), b'{"id":"attack-0"}', reply=target)
            await acme.flush()
            assert (await arrived.next_msg(timeout=5)).subject == S.request("chat", "acme")
            await asyncio.sleep(1.0)  # time for a PubAck or an answer to go astray
            for target, spy in spies.items():
                with pytest.raises(nats.errors.TimeoutError):
                    msg = await spy.next_msg(timeout=0.2)
                    pytest.fail(f"{target} got {msg.data!r} (reply of {msg.subject})")
            with pytest.raises(nats.errors.TimeoutError):
                await globex_inbox.next_msg(timeout=0.2)
            results = await operator.jetstream().key_value(S.results_bucket)
            with pytest.raises(nats.js.errors.KeyNotFoundError):
                await results.get("globex.victim")
            assert not errors.seen and not globex_errors.seen
            # The requests themselves were taken, as any of acme's: the hole is closed,
            # not the service.
            async with Client(acme, tenant_inboxes="acme", api_timeout_s=5.0) as client:
                for _ in range(100):
                    status = await client.status("acme", "attack-0")
                    if status.state == "done":
                        break
                    await asyncio.sleep(0.1)
                assert status.state == "done", status
        finally:
            for nc in (acme, globex, operator):
                await nc.close()


@pytest.mark.integration
async def test_the_cli_works_with_its_own_credentials(nats_binary: Path, tmp_path: Path) -> None:
    async with deployment(nats_binary, tmp_path, ["acme", "globex"]) as d:
        url = d.server.url
        acme = str(d.seed("acme"))
        code, out, err = await fairq_cli(
            "submit",
            "--nats",
            url,
            "--nkey",
            acme,
            "--tenant",
            "acme",
            "--endpoint",
            "chat",
            "--prompt",
            "hi",
            "--max-tokens",
            "4",
            "--id",
            "cli-1",
        )
        assert code == 0 and "done id=cli-1" in err, (out, err)
        code, out, err = await fairq_cli(
            "status", "--nats", url, "--nkey", acme, "--tenant", "acme", "cli-1"
        )
        assert code == 0, err
        assert json.loads(out)["state"] == "done"
        # acme's seed does not make it globex.
        code, out, err = await fairq_cli(
            "status", "--nats", url, "--nkey", acme, "--tenant", "globex", "--timeout", "1", "cli-1"
        )
        assert code == 2 and 'permissions violation for publish to "fq.api.status.globex"' in err
        # The operator's user sees every tenant.
        code, out, err = await fairq_cli(
            "top", "--once", "--nats", url, "--nkey", str(d.seed(OPERATOR_USER))
        )
        assert code == 0 and "acme" in out, (out, err)
        # Without credentials, nothing.
        code, out, err = await fairq_cli("status", "--nats", url, "--tenant", "acme", "cli-1")
        assert code == 2 and "authorization violation" in err.lower(), err
        code, out, err = await fairq_cli(
            "status", "--nats", url, "--tenant", "acme", "--nkey", acme, "--user", "acme", "cli-1"
        )
        assert code == 2 and "conflict" in err, err


@pytest.mark.integration
async def test_a_rerender_and_reload_lets_a_new_tenant_in_without_a_restart(
    nats_binary: Path, tmp_path: Path
) -> None:
    async with deployment(nats_binary, tmp_path, ["acme", "globex"]) as d:
        pid = d.server.pid
        assert not (d.auth.directory / "initech.nk").exists()
        old_globex = d.seed("globex")
        globex_seed = old_globex.read_bytes()
        globex_closed = asyncio.Event()

        async def on_closed() -> None:
            globex_closed.set()

        globex = await nats.connect(
            d.server.url,
            nkeys_seed=str(old_globex),
            inbox_prefix=S.inbox_prefix("globex"),
            allow_reconnect=False,
            closed_cb=on_closed,
        )
        rendered = render_auth_dir(d.auth.directory, S, ["acme", "initech"])
        assert rendered.added == ("initech",) and rendered.removed == ("globex",)
        await asyncio.to_thread(d.server.reload)
        assert d.server.pid == pid
        # The removed tenant's open connection is closed by the reload.
        await asyncio.wait_for(globex_closed.wait(), 10)
        assert globex.is_closed
        async with Client.connect(
            d.server.url, nkey=rendered.seeds["initech"], tenant_inboxes="initech"
        ) as initech:
            done = await initech.run(
                "chat", "initech", prompt="hi", max_tokens=4, timeout_s=REQUEST_S
            )
            assert isinstance(done, DoneEvent)
        # A removed tenant's credentials no longer open a connection.
        old_globex.write_bytes(globex_seed)
        with pytest.raises(ConnectionFailed, match="(?i)authorization violation"):
            await Client.connect(
                d.server.url, nkey=old_globex, tenant_inboxes="globex", allow_reconnect=False
            )
        # The services' own users were kept: the dispatcher still serves acme.
        async with Client.connect(d.server.url, nkey=d.seed("acme"), tenant_inboxes="acme") as acme:
            assert isinstance(
                await acme.run("chat", "acme", prompt="hi", max_tokens=4, timeout_s=REQUEST_S),
                DoneEvent,
            )


# -- .creds files: a NATS operator-mode server, JWTs minted here --------------------------------


def keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats_claims: dict) -> str:
    """A NATS JWT (v2): ed25519-nkey signed, `jti` the claims' SHA-512/256 as nats-io/jwt
    computes it."""
    claims = {
        "jti": "",
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": {**nats_claims, "version": 2},
    }
    claims["jti"] = (
        base64.b32encode(hashlib.new("sha512_256", json.dumps(claims).encode()).digest())
        .decode()
        .rstrip("=")
    )
    signed = (
        f"{b64(json.dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}).encode())}."
        f"{b64(json.dumps(claims).encode())}"
    )
    return f"{signed}.{b64(issuer.sign(signed.encode()))}"


UNLIMITED = {"subs": -1, "data": -1, "payload": -1}


def creds_file(path: Path, user_jwt: str, user: nkeys.KeyPair) -> Path:
    path.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n"
        "------END USER NKEY SEED------\n"
    )
    path.chmod(0o600)
    return path


@pytest.mark.integration
async def test_the_sdk_and_cli_connect_with_a_creds_file(nats_binary: Path, tmp_path: Path) -> None:
    operator = keypair(nkeys.PREFIX_BYTE_OPERATOR)
    account = keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    system = keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    account_limits = {
        "limits": {
            **UNLIMITED,
            "imports": -1,
            "exports": -1,
            "wildcards": True,
            "conn": -1,
            "leaf": -1,
            "mem_storage": -1,
            "disk_storage": -1,
            "streams": -1,
            "consumer": -1,
        },
        "type": "account",
    }
    # JetStream is for the fairq account only: nats-server refuses it on the system one.
    system_limits = {
        "limits": {
            **UNLIMITED,
            "imports": -1,
            "exports": -1,
            "wildcards": True,
            "conn": -1,
            "leaf": -1,
        },
        "type": "account",
    }
    accounts = {
        key.public_key.decode(): jwt(operator, key.public_key.decode(), name, limits)
        for key, name, limits in (
            (account, "fairq", account_limits),
            (system, "SYS", system_limits),
        )
    }
    operator_jwt = jwt(operator, operator.public_key.decode(), "op", {"type": "operator"})
    config = (
        f"operator: {operator_jwt}\n"
        f"system_account: {system.public_key.decode()}\n"
        "resolver: MEMORY\n"
        f"resolver_preload: {json.dumps(accounts)}\n"
    )

    def user_creds(name: str, signer: nkeys.KeyPair, tenant: str | None = "acme") -> Path:
        """A .creds file for a tenant's user (None: full access)."""
        user = keypair(nkeys.PREFIX_BYTE_USER)
        own = tenant_permissions(S, tenant) if tenant else None
        claims = {**UNLIMITED, "type": "user"} | (
            {"pub": {"allow": list(own.publish)}, "sub": {"allow": list(own.subscribe)}}
            if own
            else {}
        )
        return creds_file(
            tmp_path / f"{name}.creds", jwt(signer, user.public_key.decode(), name, claims), user
        )

    acme = user_creds("acme", account)
    forged = user_creds("forged", keypair(nkeys.PREFIX_BYTE_ACCOUNT))  # signer not trusted
    async with EmbeddedNatsServer(binary=nats_binary, config=config) as server:
        service = await nats.connect(
            server.url,
            user_credentials=str(user_creds("service", account, None)),
            max_reconnect_attempts=0,
        )
        try:

            async def answer(msg) -> None:
                await msg.respond(b'{"id":"r1","state":"unknown"}')

            await service.subscribe(S.status("acme"), cb=answer)
            await service.flush()
            async with Client.connect(server.url, creds=acme, tenant_inboxes="acme") as client:
                status = await client.status("acme", "r1")
                assert status.state == "unknown"
            code, out, err = await fairq_cli(
                "status", "--nats", server.url, "--creds", str(acme), "--tenant", "acme", "r1"
            )
            # Connected and answered: the dispatcher knows no such request (exit 3).
            assert code == EXIT_UNKNOWN and json.loads(out)["state"] == "unknown", err
            code, out, err = await fairq_cli(
                "status",
                "--nats",
                server.url,
                "--creds",
                str(acme),
                "--tenant",
                "globex",
                "--timeout",
                "1",
                "r1",
            )
            assert code == 2 and "permissions violation" in err, err
        finally:
            await service.close()
        with pytest.raises(ConnectionFailed, match="(?i)authorization violation"):
            await Client.connect(server.url, creds=forged, allow_reconnect=False)

"""Per-tenant NATS users, rendered into nats-server configuration.

A tenant user may publish only to its own `<prefix>.req.*.<tenant>` (submit) and
`<prefix>.api.*.<tenant>` (status, cancel) subjects, and subscribe only below its own
inbox prefix `_INBOX_<tenant>` (nats-py: `nats.connect(..., inbox_prefix="_INBOX_<tenant>")`).
Since the broker checks the subject, the tenant in it is authenticated.

No `$JS.API` permission is needed to submit: a JetStream publish is a core publish whose
PubAck comes back to the publisher's inbox. `Fq-Reply` must then lie in the tenant's inbox
too (the dispatcher checks it with `Subjects.check_reply(..., tenant_inboxes=True)`).
Service users (dispatcher, workers, operators) get full access; `fq.api.depth`, which
shows every tenant, is for them only. A front user (the OpenAI-compatible front) acts for
the tenants it serves: their subjects and inboxes, and its own inbox `_INBOX_<user>` for
its PubAcks and API replies (user names are unique, so no tenant's inbox is that).

Users come in two kinds: password users (`NatsUser`, `build_users`) and nkey users
(`NkeyUser`), whose secret is a seed file the client keeps and whose public key alone is
in the server's config. `render_auth_dir` (`fairq auth`) renders a deployment's nkey
users from its config into a directory: `auth.conf` plus one seed file per user. It keeps
the seeds of users that still exist, so the credentials stay stable across re-renders, and
a `nats-server --signal reload` (SIGHUP) applies an added or removed tenant at run time.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nkeys

from broker_config.config import Config
from broker_config.subjects import Subjects, check_token

# The service and front users `render_auth_dir` makes besides one user per tenant.
DISPATCHER_USER = "fq-dispatcher"
WORKER_USER = "fq-worker"
OPERATOR_USER = "fq-operator"
FRONT_USER = "fq-front"
SERVICE_USERS = (DISPATCHER_USER, WORKER_USER, OPERATOR_USER)
AUTH_CONF = "auth.conf"
SEED_SUFFIX = ".nk"


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NatsUser:
    """A user; `permissions` None means full access.

    nats-server reads a password starting with `$2a$` as a bcrypt hash, so hashes can be
    passed instead of plain text.
    """

    name: str
    password: str
    permissions: Permissions | None = None


@dataclass(frozen=True, slots=True)
class NkeyUser:
    """A user that signs in with an nkey seed; `nkey` is its public key ("U...")."""

    name: str
    nkey: str
    permissions: Permissions | None = None


def tenant_permissions(subjects: Subjects, tenant: str) -> Permissions:
    return Permissions(
        publish=(subjects.tenant_requests(tenant), subjects.tenant_api(tenant)),
        subscribe=(f"{subjects.inbox_prefix(tenant)}.>",),
    )


def front_permissions(subjects: Subjects, user: str, tenants: Iterable[str]) -> Permissions:
    served = [check_token(tenant, "tenant") for tenant in tenants]
    return Permissions(
        publish=tuple(subject for tenant in served for subject in (
            subjects.tenant_requests(tenant), subjects.tenant_api(tenant))),
        subscribe=(f"{front_inbox_prefix(user)}.>",
                   *(f"{subjects.inbox_prefix(tenant)}.>" for tenant in served)),
    )


def front_inbox_prefix(user: str) -> str:
    """The inbox prefix a front's connection uses (nats-py's `inbox_prefix`)."""
    return f"_INBOX_{check_token(user, 'front user')}"


def build_users(subjects: Subjects, tenants: Mapping[str, str],
                services: Mapping[str, str],
                fronts: Mapping[str, tuple[str, Iterable[str]]] | None = None) -> list[NatsUser]:
    """One restricted user per tenant (name = tenant), one full user per service, and one
    user per front for the tenants it serves.

    `tenants` and `services` map user name to password, `fronts` to (password, tenants).
    """
    users = [NatsUser(check_token(tenant, "tenant"), password, tenant_permissions(subjects, tenant))
             for tenant, password in tenants.items()]
    users += [NatsUser(name, password) for name, password in services.items()]
    users += [NatsUser(name, password, front_permissions(subjects, name, served))
              for name, (password, served) in (fronts or {}).items()]
    _check_users(users)
    return users


def _check_users(users: list[NatsUser | NkeyUser]) -> None:
    seen: set[str] = set()
    for user in users:
        if not user.name or not user.name.isascii() or any(
                c.isspace() or not c.isprintable() for c in user.name):
            raise ValueError(f"invalid NATS user name {user.name!r}")
        if user.name in seen:
            raise ValueError(f"NATS user {user.name!r} defined twice (tenant and service "
                             "user names share one namespace)")
        seen.add(user.name)
        if isinstance(user, NkeyUser):
            if not _is_user_public_key(user.nkey):
                raise ValueError(f"NATS user {user.name!r}: {user.nkey!r} is not an nkey "
                                 "user public key")
        elif not user.password or not (user.password.isascii() and user.password.isprintable()):
            raise ValueError(f"NATS user {user.name!r}: the password must be non-empty "
                             "printable ASCII")


def render_auth_config(users: list[NatsUser | NkeyUser]) -> str:
    """nats-server config text with an `authorization` block for `users`.

    The config format accepts JSON values, so every string is JSON-quoted: passwords
    with quotes, `$`, `#` or braces need no further escaping. An nkey user's name is
    not part of nats-server's entry; a comment line above it names it.
    """
    _check_users(users)
    body = "\n".join(f"    # {user.name}\n    {json.dumps(_user_entry(user))}"
                     if isinstance(user, NkeyUser) else f"    {json.dumps(_user_entry(user))}"
                     for user in users)
    return ("# fairq broker users, generated by broker_config.auth\n"
            f"authorization {{\n  users = [\n{body}\n  ]\n}}\n")


def _user_entry(user: NatsUser | NkeyUser) -> dict[str, object]:
    entry: dict[str, object] = ({"nkey": user.nkey} if isinstance(user, NkeyUser)
                                else {"user": user.name, "password": user.password})
    if user.permissions is not None:
        entry["permissions"] = {
            "publish": {"allow": list(user.permissions.publish)},
            "subscribe": {"allow": list(user.permissions.subscribe)},
        }
    return entry


# -- a deployment's nkey users (`fairq auth`) --------------------------------------------------


@dataclass(frozen=True, slots=True)
class RenderedAuth:
    """What `render_auth_dir` wrote: the config include and each user's seed file."""

    directory: Path
    config: Path
    seeds: dict[str, Path]
    added: tuple[str, ...]
    removed: tuple[str, ...]


def with_tenant_inboxes(config: Config) -> Config:
    """`config` for a broker with per-tenant users: replies in the tenants' own inboxes."""
    return msgspec.structs.replace(config, dispatcher=msgspec.structs.replace(
        config.dispatcher, tenant_inboxes=True))


def registered_tenants(config: Config) -> list[str]:
    """The tenants that get a broker user: `[tenants]` and those of the front's keys."""
    return sorted({*config.tenants, *(key.tenant for key in config.front.keys)})


def deployment_users(subjects: Subjects, tenants: Iterable[str],
                     public_keys: Mapping[str, str]) -> list[NkeyUser]:
    """One user per tenant, the service users (full access) and the front, which may act
    for every tenant: it authenticates API keys itself and then submits as their tenant."""
    served = sorted(set(tenants))
    users = [NkeyUser(check_token(t, "tenant"), public_keys[t], tenant_permissions(subjects, t))
             for t in served]
    users += [NkeyUser(name, public_keys[name]) for name in SERVICE_USERS]
    users.append(NkeyUser(FRONT_USER, public_keys[FRONT_USER],
                          front_permissions(subjects, FRONT_USER, served)))
    return users


def render_auth_dir(directory: Path, subjects: Subjects, tenants: Iterable[str]) -> RenderedAuth:
    """Write `auth.conf` and one seed file `<user>.nk` (mode 0600) per user into
    `directory` (made mode 0700 if missing). A user whose seed file exists keeps it;
    seed files of users no longer present are removed. Raises ValueError for a bad
    tenant name or seed file."""
    tenants = sorted({check_token(tenant, "tenant") for tenant in tenants})
    names = [*tenants, *SERVICE_USERS, FRONT_USER]
    if len(set(names)) != len(names):
        clash = sorted(set(tenants) & {*SERVICE_USERS, FRONT_USER})
        raise ValueError(f"tenant name(s) {', '.join(clash)} are reserved for fairq's own "
                         "broker users")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = {path.name[:-len(SEED_SUFFIX)]: path
                for path in directory.glob(f"*{SEED_SUFFIX}")}
    seeds, public_keys, added = {}, {}, []
    for name in names:
        path = directory / f"{name}{SEED_SUFFIX}"
        if name in existing:
            public_keys[name] = _public_key(path)
        else:
            public_keys[name] = _new_seed(path)
            added.append(name)
        seeds[name] = path
    users = deployment_users(subjects, tenants, public_keys)
    config = directory / AUTH_CONF
    _write_atomically(config, render_auth_config(users).encode(), 0o644)
    removed = sorted(set(existing) - set(names))
    for name in removed:
        existing[name].unlink()
    return RenderedAuth(directory, config, seeds, tuple(added), tuple(removed))


def _is_user_public_key(key: str) -> bool:
    """A user public key: base32 of the user prefix byte, 32 key bytes and their CRC16."""
    try:
        raw = base64.b32decode(key + "=" * (-len(key) % 8))
    except (binascii.Error, ValueError):
        return False
    return (len(raw) == 35 and raw[0] == nkeys.PREFIX_BYTE_USER
            and nkeys.crc16_checksum(raw[:-2]) == raw[-2:])


def _public_key(seed_file: Path) -> str:
    try:
        seed = bytearray(seed_file.read_bytes().strip())
        key = nkeys.from_seed(seed).public_key.decode()
    except (OSError, nkeys.NkeysError, ValueError) as exc:
        raise ValueError(f"{seed_file}: not a readable nkey seed ({exc or type(exc).__name__}); "
                         "remove it to make a new one") from exc
    if not key.startswith("U"):
        raise ValueError(f"{seed_file}: the seed of {key[:1]!r} key, not of a user")
    return key


def _new_seed(path: Path) -> str:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    _write_atomically(path, seed + b"\n", 0o600)
    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    """A reader (nats-server on reload, a client) sees the old file or the new one."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise

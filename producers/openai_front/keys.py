"""API keys of the OpenAI-compatible front: made random, stored as SHA-256 hashes.

A fast hash is enough because keys are 256-bit random tokens, not passwords: there is
nothing to guess from a leaked hash. A lookup is by the hash of the key sent, so timing
tells an attacker nothing about a stored key.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import sys
from collections.abc import Iterable

import msgspec

from broker_config.config import Config, ConfigError, FrontKey

KEY_PREFIX = "fq-"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def front_key(tenant: str, key: str) -> FrontKey:
    """The config entry for `key`; msgspec.ValidationError if `tenant` is no name."""
    return msgspec.convert({"tenant": tenant, "sha256": key_hash(key)}, FrontKey)


class KeyRing:
    """Which tenant an API key belongs to."""

    def __init__(self, keys: Iterable[FrontKey]) -> None:
        self._tenants = {key.sha256: key.tenant for key in keys}

    def tenant(self, key: str) -> str | None:
        return self._tenants.get(key_hash(key))


def with_dev_key(config: Config, tenant: str) -> tuple[Config, str]:
    """`config` that also accepts a new key for `tenant`, and the key."""
    key = new_key()
    try:
        front = msgspec.structs.replace(
            config.front, keys=[*config.front.keys, front_key(tenant, key)]
        )
    except msgspec.ValidationError as exc:
        raise ConfigError(f"--dev-key-for {tenant!r}: {exc}") from exc
    if tenant not in config.tenants and config.unlisted_tenants.policy == "reject":
        raise ConfigError(f"--dev-key-for: {tenant!r} is not a tenant of the config")
    return msgspec.structs.replace(config, front=front), key


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "front-key",
        help="make an API key for the OpenAI-compatible front",
        description="Print a new API key for TENANT and the line that makes the front "
        "accept it (the config keeps only its hash).",
    )
    parser.add_argument("tenant")
    parser.set_defaults(run=_run_front_key)


def _run_front_key(args: argparse.Namespace) -> int:
    key = new_key()
    try:
        entry = front_key(args.tenant, key)
    except msgspec.ValidationError as exc:
        print(f"fairq front-key: invalid tenant {args.tenant!r}: {exc}", file=sys.stderr)
        return 2
    print(f"OPENAI_API_KEY={key}")
    print(f'# under [front] keys: {{ tenant = "{entry.tenant}", sha256 = "{entry.sha256}" }}')
    return 0

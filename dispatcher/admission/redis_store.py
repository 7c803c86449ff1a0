"""Limiter stores for the async service: Redis (shared by dispatchers) or in-process.

`RedisLimiterStore` runs the arithmetic of `dispatcher.core.limits` (GCRA and
calendar quotas) as one Lua script, `gcra.lua`, so every `apply` is atomic across all
dispatchers sharing the Redis. The caller passes the time; Redis's clock is never read,
so decisions equal `MemoryLimiterStore`'s exactly (tests/admission/test_limiter_contract.py).

Failure policy: a Redis that cannot be reached, times out (DEFAULT_TIMEOUT_S) or answers
with an error makes `apply` and `settle` raise `LimiterUnavailable`; neither ever admits
or denies in Redis's place. The dispatcher should reject such a request with the wire
error `internal` (the client retries; the next request reconnects), and log and count
the failure. A failed `settle` only loses that correction (the tenant stays charged
what admission charged), so it is logged, not retried.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from importlib import resources
from typing import Protocol, Self

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from dispatcher.core.limits import (
    CLOCK_EPSILON_S,
    Check,
    MemoryLimiterStore,
    QuotaCheck,
    RateCheck,
    Settlement,
    rejection,
)
from dispatcher.core.types import ADMITTED, Decision

DEFAULT_PREFIX = "fq:limits:"
# Admission waits on Redis, so an outage must surface quickly rather than after
# redis-py's defaults (5 s timeouts, ten retries).
DEFAULT_TIMEOUT_S = 0.5
# Keys outlive the state they hold by this much: a later request whose `now` was read
# before a network delay may still need a tat that has just passed on Redis's clock.
DEFAULT_EXPIRY_GRACE_S = 1.0

_SCRIPT = resources.files("dispatcher.admission").joinpath("gcra.lua").read_text(encoding="utf-8")


class LimiterUnavailable(RuntimeError):
    """The limiter store could not decide (Redis down, timed out or failing)."""


class AsyncLimiterStore(Protocol):
    """What the dispatcher calls; both stores below implement it."""

    async def apply(self, checks: Sequence[Check], now: float) -> Decision:
        """All checks pass and are charged, or the first failing check's rejection."""
        ...

    async def settle(self, settlement: Settlement, now: float) -> None:
        """Charge `settlement.charge` whatever the limits, give back `settlement.refund`."""
        ...

    async def aclose(self) -> None: ...


class MemoryLimiterAsync:
    """`MemoryLimiterStore` behind the async interface, so the service has one code path."""

    def __init__(self, store: MemoryLimiterStore | None = None) -> None:
        self._store = store if store is not None else MemoryLimiterStore()

    async def apply(self, checks: Sequence[Check], now: float) -> Decision:
        validate_checks(checks, now)
        return self._store.apply(list(checks), now)

    async def settle(self, settlement: Settlement, now: float) -> None:
        validate_checks((*settlement.charge, *settlement.refund), now)
        self._store.settle(settlement, now)

    async def aclose(self) -> None:
        """Nothing to release; present for the common interface."""


class RedisLimiterStore:
    """Rate limits and quotas in Redis, under keys `<prefix>tat:<key>` (GCRA) and
    `<prefix>used:<key>` (quota hash {used, exp})."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        expiry_grace_s: float = DEFAULT_EXPIRY_GRACE_S,
        owns_client: bool = False,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._grace = _checked_grace(expiry_grace_s)
        self._owns_client = owns_client
        # EVALSHA, loading the script again if the server lost it (restart, SCRIPT FLUSH).
        self._script = client.register_script(_SCRIPT)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        expiry_grace_s: float = DEFAULT_EXPIRY_GRACE_S,
    ) -> Self:
        """A store with its own client; bad URLs raise ValueError (from redis-py)."""
        _checked_grace(expiry_grace_s)  # before a client exists that would need closing
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # One immediate retry on a broken connection (a pooled connection that died
            # with a Redis restart). Timeouts are not retried: the script may have run.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        return cls(client, prefix=prefix, expiry_grace_s=expiry_grace_s, owns_client=True)

    async def apply(self, checks: Sequence[Check], now: float) -> Decision:
        validate_checks(checks, now)
        if not checks:
            return ADMITTED
        keys = [self._key(check) for check in checks]
        args: list[str] = ["apply", _num(now), _num(CLOCK_EPSILON_S), _num(self._grace)]
        for check in checks:
            args.extend(_check_args(check))
        reply = await self._run(keys, args)
        failed = int(reply[0])
        if failed == 0:
            return ADMITTED
        return rejection(checks[failed - 1], float(reply[1]))

    async def settle(self, settlement: Settlement, now: float) -> None:
        steps = [("charge", check) for check in settlement.charge] + [
            ("refund", check) for check in settlement.refund
        ]
        validate_checks([check for _, check in steps], now)
        if not steps:
            return
        args = ["settle", _num(now), _num(self._grace)]
        for direction, check in steps:
            args += [direction, *_check_args(check)]
        await self._run([self._key(check) for _, check in steps], args)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    def _key(self, check: Check) -> str:
        # Separate namespaces, as MemoryLimiterStore keeps separate dicts.
        kind = "tat:" if isinstance(check, RateCheck) else "used:"
        return f"{self._prefix}{kind}{check.key}"

    async def _run(self, keys: list[str], args: list[str]) -> list[bytes | str | int]:
        try:
            reply = await self._script(keys=keys, args=args)
        except RedisError as exc:
            raise LimiterUnavailable(f"redis limiter store failed: {exc}") from exc
        return list(reply)


def validate_checks(checks: Sequence[Check], now: float) -> None:
    """Reject input the arithmetic cannot take (zero rates, negative costs, NaN) with a
    ValueError naming the field, instead of a division error or a silent wrong answer."""
    _require(
        isinstance(now, (int, float)) and math.isfinite(now),
        f"now must be a finite number, got {now!r}",
    )
    for check in checks:
        _validate_check(check)


def _validate_check(check: Check) -> None:
    if not isinstance(check, (RateCheck, QuotaCheck)):
        raise ValueError(f"not a limiter check: {check!r}")
    what = f"{type(check).__name__} {check.key!r}"
    _require(
        isinstance(check.key, str) and check.key != "", f"{what}: key must be a non-empty string"
    )
    if isinstance(check, RateCheck):
        _require_number(what, "per_minute", check.per_minute, positive=True)
        _require_number(what, "burst", check.burst, positive=True)
        _require_number(what, "cost", check.cost)
    else:
        _require_number(what, "limit", check.limit)
        _require_number(what, "cost", check.cost)
        _require(
            isinstance(check.expires_at, (int, float)) and math.isfinite(check.expires_at),
            f"{what}: expires_at must be a finite number, got {check.expires_at!r}",
        )


def _checked_grace(expiry_grace_s: float) -> float:
    _require(
        math.isfinite(expiry_grace_s) and expiry_grace_s >= 0,
        f"expiry_grace_s must be a finite number >= 0, got {expiry_grace_s!r}",
    )
    return expiry_grace_s


def _require_number(what: str, field: str, value: float, *, positive: bool = False) -> None:
    bound = "> 0" if positive else ">= 0"
    ok = (
        isinstance(value, (int, float))
        and math.isfinite(value)
        and (value > 0 if positive else value >= 0)
    )
    _require(ok, f"{what}: {field} must be a finite number {bound}, got {value!r}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_args(check: Check) -> list[str]:
    if isinstance(check, RateCheck):
        return ["rate", _num(check.per_minute), _num(check.burst), _num(check.cost)]
    return ["quota", _num(check.limit), _num(check.cost), _num(check.expires_at)]


def _num(value: float) -> str:
    # repr is the shortest string that reads back as the same double, in Python and Lua.
    return repr(float(value))

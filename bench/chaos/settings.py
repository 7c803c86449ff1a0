"""What a chaos run (`bench.chaos.run`) does: its settings and the presets of its
command line (full, smoke, the dispatchers' and the broker's faults, saturated)."""

from __future__ import annotations

from dataclasses import dataclass

from bench.chaos.ha import HA_FAULTS

# The worker processes' faults (`bench.chaos.workers`).
FAULTS = ("kill", "stop", "hang", "slow")


@dataclass(frozen=True, slots=True)
class Settings:
    requests: int = 5_000
    tenants: int = 20
    workers: int = 4
    faults: tuple[str, ...] = FAULTS * 2
    rate_per_s: float = 25.0
    time_scale: float = 1.0
    max_tokens: int = 256  # the simulated engine draws a length in [1, max_tokens]
    first_fault_s: float = 8.0
    fault_gap_s: float = 20.0
    slow_for_s: float = 10.0
    finish_timeout_s: float = 180.0
    seed: int = 1
    # > 0: the false-kill run (no faults, every worker full for this many seconds).
    saturate_s: float = 0.0
    prompt_tokens: tuple[int, int] = (16, 512)  # uniform; the saturated run: long prefills
    # The dispatcher's probe_stall_s and probe_idle_s (None: the defaults); a tiny value
    # probes a worker at every heartbeat that reports no new token.
    probe_stall_s: float | None = None
    # The dispatchers' and the broker's faults (HA_FAULTS) run on `bench.chaos.ha`'s
    # stack: a 3-node cluster, two dispatchers, the workers.
    cluster: bool = False
    # Requests submitted at once just before each of those faults: they fill the
    # workers, so some wait in the dispatcher when it strikes.
    burst_before_fault: int = 0


SMOKE = Settings(requests=500, faults=FAULTS, rate_per_s=10.0, fault_gap_s=10.0)
HA = Settings(
    requests=3_000,
    workers=2,
    faults=HA_FAULTS * 2,
    rate_per_s=10.0,
    cluster=True,
    burst_before_fault=100,
)
HA_SMOKE = Settings(
    requests=1_000,
    workers=2,
    faults=HA_FAULTS,
    rate_per_s=10.0,
    fault_gap_s=8.0,
    cluster=True,
    burst_before_fault=100,
)
SATURATED = Settings(
    workers=2, faults=(), saturate_s=300.0, max_tokens=2048, prompt_tokens=(2_000, 8_000)
)

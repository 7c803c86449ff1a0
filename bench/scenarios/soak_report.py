"""The soak's verdict and report (`bench.scenarios.soak`): its figures from the records
and the samples, the goals it missed, its markdown digest and its plot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from bench.harness.machine import table
from bench.harness.measured import DONE, LOST, REFUSED, Measured
from bench.harness.plots import time_series
from bench.scenarios.soak_load import INVALID, KINDS, Settings, Tenant
from dispatcher.intake.shards import PARKED_CONSUMER_IDLE_S
from dispatcher.sim.fairness import latency_summary

# How long after the parked consumers' idle threshold the server has to remove them.
RETIRE_MARGIN_S = 10.0
MIB = 1024


def _at(samples: list[dict[str, Any]], t: float) -> dict[str, Any]:
    """The first sample taken at or after `t` (else the last)."""
    return next((s for s in samples if s["t"] >= t), samples[-1])


def verdict(
    settings: Settings,
    tenants: list[Tenant],
    measured: list[Measured],
    samples: list[dict[str, Any]],
) -> dict[str, Any]:
    """The run's figures: outcomes (overall, by kind), memory and consumers over time."""
    kinds = {t.name: t.kind for t in tenants}
    by_kind: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}
    for m in measured:
        by_kind[kinds[m.tenant]][m.outcome] += 1
    garbage = by_kind["garbage"]
    well_formed = sum((by_kind[kind] for kind in KINDS if kind != "garbage"), Counter())
    warm, load_end, end = (
        _at(samples, settings.warmup_s),
        _at(samples, settings.duration_s),
        samples[-1],
    )
    after_warmup = [s for s in samples if s["t"] >= warm["t"]]

    def rss(sample: dict[str, Any], process: str) -> int:
        return sample["rss_kb"][process]

    def consumers(stream: str) -> dict[str, int]:
        counts = [s["consumers"][stream] for s in samples]
        return {"min": min(counts), "max": max(counts), "end": counts[-1]}

    done_s: dict[str, list[float]] = {kind: [] for kind in ("all", *KINDS)}
    for m in measured:
        if m.outcome == DONE and m.submitted is not None:
            done_s[kinds[m.tenant]].append(m.finished - m.submitted)
            done_s["all"].append(m.finished - m.submitted)
    return {
        "tenants": {
            kind: {
                "count": sum(t.kind == kind for t in tenants),
                "unlisted": sum(t.kind == kind and not t.listed for t in tenants),
            }
            for kind in KINDS
        },
        "requests": len(measured),
        "outcomes": dict(sorted(Counter(m.outcome for m in measured).items())),
        "outcomes_by_kind": {kind: dict(sorted(c.items())) for kind, c in by_kind.items()},
        "lost": sum(c[LOST] for c in by_kind.values()),
        "refused": sum(c[REFUSED] for c in by_kind.values()),
        "well_formed": sum(well_formed.values()),
        "well_formed_not_done": sum(well_formed.values()) - well_formed[DONE],
        "garbage": sum(garbage.values()),
        "garbage_answered": garbage[INVALID],
        # Submit to final event at the client, of the requests that ended done.
        "done_latency_s": {kind: latency_summary(v) for kind, v in done_s.items()},
        "samples": samples,
        "warmup_end_t": warm["t"],
        "dispatcher_rss_kb": {
            "warmup_end": rss(warm, "dispatcher"),
            "load_end": rss(load_end, "dispatcher"),
            "end": rss(end, "dispatcher"),
            "max_after_warmup": max(rss(s, "dispatcher") for s in after_warmup),
        },
        "dispatcher_rss_growth": rss(end, "dispatcher") / rss(warm, "dispatcher") - 1,
        "server_rss_kb": {
            "warmup_end": rss(warm, "nats-server"),
            "load_end": rss(load_end, "nats-server"),
            "end": rss(end, "nats-server"),
            "max": max(rss(s, "nats-server") for s in samples),
        },
        "consumers": {"requests": consumers("requests"), "parked": consumers("parked")},
    }


def failures(figures: dict[str, Any], settings: Settings) -> dict[str, str]:
    """Each goal missed: its name -> why, in a sentence."""
    failed, shards = {}, figures["shards"]
    for name, what in (
        ("lost", "requests without a final event"),
        ("refused", "requests the broker did not store"),
        ("well_formed_not_done", "well-formed requests that did not end done"),
    ):
        if figures[name]:
            failed[name] = f"{figures[name]} {what}"
    if figures["garbage_answered"] != figures["garbage"]:
        failed["garbage_unanswered"] = (
            f"{figures['garbage'] - figures['garbage_answered']} of {figures['garbage']} "
            f"garbage requests not answered {INVALID}"
        )
    if figures["dispatcher_rss_growth"] >= settings.rss_goal:
        rss = figures["dispatcher_rss_kb"]
        failed["rss_growth"] = (
            f"dispatcher RSS grew {figures['dispatcher_rss_growth']:.1%} after the warm-up "
            f"({rss['warmup_end'] / MIB:.1f} -> {rss['end'] / MIB:.1f} MiB), goal < "
            f"{settings.rss_goal:.0%}"
        )
    if figures["consumers"]["requests"]["max"] > shards:
        failed["requests_consumers"] = (
            f"{figures['consumers']['requests']['max']} consumers on the requests stream, "
            f"more than its {shards} shards"
        )
    parked_left = figures["consumers"]["parked"]["end"]
    if settings.settle_s >= PARKED_CONSUMER_IDLE_S + RETIRE_MARGIN_S and parked_left:
        failed["parked_consumers_left"] = (
            f"{parked_left} parked consumers left {settings.settle_s:g} s after the last request"
        )
    return failed


# -- report --------------------------------------------------------------------------------


def render(summary: dict[str, Any]) -> str:
    figures = summary["figures"]
    outcome_names = sorted(
        {o for c in figures["outcomes_by_kind"].values() for o in c},
        key=lambda o: (o != DONE, o != INVALID, o),
    )
    latency = figures["done_latency_s"]
    rows = []
    for kind, counts in figures["outcomes_by_kind"].items():
        tenants = figures["tenants"][kind]
        if not tenants["count"]:
            continue
        rows.append(
            [
                kind,
                f"{tenants['count']} ({tenants['unlisted']})",
                f"{sum(counts.values()):,}",
                *(f"{counts.get(o, 0):,}" for o in outcome_names),
                f"{_s(latency[kind]['p50'])} / {_s(latency[kind]['p99'])}",
            ]
        )
    rows.append(
        [
            "all",
            f"{sum(t['count'] for t in figures['tenants'].values())}",
            f"{figures['requests']:,}",
            *(f"{figures['outcomes'].get(o, 0):,}" for o in outcome_names),
            f"{_s(latency['all']['p50'])} / {_s(latency['all']['p99'])}",
        ]
    )
    lines = table(
        ["tenants", "count (unlisted)", "requests", *outcome_names, "done: p50 / p99 s"], rows
    )
    c = figures["consumers"]
    lines += ["", *_memory_table(figures)]
    lines += [
        "",
        *table(
            ["consumers", "min", "max", "end"],
            [[stream, str(v["min"]), str(v["max"]), str(v["end"])] for stream, v in c.items()],
        ),
    ]
    lines += [
        "",
        (
            f"Garbage answered {INVALID}: {figures['garbage_answered']:,} of "
            f"{figures['garbage']:,}. The latest publish "
            f"{figures['max_submit_lateness_s']:.2f} s behind its schedule. "
            "Every request answered "
            f"{figures['answered_s']:.0f} s after the start; CPU seconds: "
            + ", ".join(f"{name} {v:.0f}" for name, v in figures["cpu_s"].items())
            + "."
        ),
    ]
    if summary["failed"]:
        lines += ["", "FAILED: " + "; ".join(summary["failed"].values())]
    return "\n".join(lines)


def _memory_table(figures: dict[str, Any]) -> list[str]:
    """The dispatcher's and nats-server's RSS at the end of the warm-up, of the load, and
    at the end."""
    d, s = figures["dispatcher_rss_kb"], figures["server_rss_kb"]
    rows = [
        ("dispatcher", d, figures["dispatcher_rss_growth"], d["max_after_warmup"]),
        ("nats-server", s, s["end"] / s["warmup_end"] - 1, s["max"]),
    ]
    return table(
        ["", "end of warm-up", "end of load", "end", "growth after warm-up", "max"],
        [
            [
                f"{name} RSS, MiB",
                *(_mib(rss[at]) for at in ("warmup_end", "load_end", "end")),
                f"{growth:+.1%}",
                _mib(peak),
            ]
            for name, rss, growth, peak in rows
        ],
    )


def _mib(kb: float) -> str:
    return f"{kb / MIB:.1f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(figures: dict[str, Any], settings: Settings, path: Path) -> None:
    samples = figures["samples"]
    churn = figures["tenants"]["once"]["count"]
    once = f" (+{churn:,} sending once)" if churn else ""
    t = [s["t"] for s in samples]
    rates = {"published": [], "finished": []}
    for before, after in zip(samples, samples[1:]):
        span = after["t"] - before["t"]
        rates["published"].append((after["published"] - before["published"]) / span)
        rates["finished"].append(
            (sum(after["finished"].values()) - sum(before["finished"].values())) / span
        )
    time_series(
        {
            "Resident memory (VmRSS)": (
                "MiB",
                {
                    name: (t, [s["rss_kb"][name] / MIB for s in samples])
                    for name in ("dispatcher", "nats-server")
                },
            ),
            "Consumers": (
                "consumers",
                {
                    f"{stream} stream": (t, [s["consumers"][stream] for s in samples])
                    for stream in ("requests", "parked")
                },
            ),
            "Requests per second (between samples)": (
                "requests/s",
                {name: (t[1:], values) for name, values in rates.items()},
            ),
        },
        path,
        xlabel="seconds since the start of the load",
        title=(
            f"Soak: {settings.tenants:,} tenants{once}, {settings.minutes:g} min, "
            f"{figures['requests']:,} requests"
        ),
        marks={"end of warm-up": figures["warmup_end_t"], "end of load": settings.duration_s},
    )

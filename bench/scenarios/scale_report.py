"""The tables of scenario 5 (`bench.scenarios.scale`): dispatch rate and memory per tenant
count, and a newcomer's time to first token behind N-1 backlogged tenants."""

from __future__ import annotations

from typing import Any

from bench.harness.machine import table

RATE_HEADER = [
    "tenants",
    "fairq per run",
    "fairq median",
    "of the fewest tenants'",
    "raw, consumer per shard",
    "fairq / raw",
    "CPU us/request: server / dispatcher / raw's server",
    "dispatcher RSS when up, MiB",
    "after the run, MiB",
    "peak, MiB",
    "nats-server RSS after, MiB",
    "consumers",
]
NEWCOMER_HEADER = [
    "N",
    "backlog (tenants x requests)",
    "backlogged at first / after last",
    "first newcomer TTFT",
    "later listed",
    "later unlisted",
    "dispatcher peak RSS, MiB",
]


def render(summary: dict[str, Any]) -> str:
    settings = summary["settings"]
    lines = [
        (
            "Dispatch rate, requests/s (instant engine, scenario 3's fairq run; "
            f"{settings['registered']:,} tenants registered in the config, "
            "the active ones among them), beside the raw path with fairq's consumer "
            "layout (one pull consumer per shard, fetch and ack, no processing), and "
            "memory:"
        ),
        "",
        *table(RATE_HEADER, rate_rows(summary["tenants"])),
        "",
        (
            "A newcomer's time to first token behind N-1 backlogged tenants, wall ms "
            f"(engine time x{settings['time_scale']:g}). The first newcomer "
            "arrives just after the N-1 became backlogged; the later ones (p50 / max) "
            "once the first was served:"
        ),
        "",
        *table(NEWCOMER_HEADER, newcomer_rows(summary["tenants"])),
    ]
    return "\n".join(lines)


def rate_rows(tenants: dict[str, Any]) -> list[list[str]]:
    rates = {count: row["rate"] for count, row in tenants.items() if row.get("rate")}
    fewest = rates[min(rates, key=int)]["median"] if rates else None
    return [
        [
            count,
            ", ".join(f"{r:,.0f}" for r in rate["rates"]),
            f"{rate['median']:,.0f}",
            f"{rate['median'] / fewest:.0%}",
            ", ".join(f"{r:,.0f}" for r in rate["raw_shards_rates"]),
            f"{rate['fairq_over_raw_median']:.0%}",
            " / ".join(
                f"{rate['cpu_us_per_request'][p]:.0f}"
                for p in ("nats-server", "dispatcher", "raw nats-server")
            ),
            mib(rate["rss_at_start_kb"]),
            mib(rate["rss_end_kb"]),
            mib(rate["peak_rss_kb"]),
            mib(rate["server_rss_end_kb"]),
            str(rate["consumers"]),
        ]
        for count, rate in rates.items()
    ]


def newcomer_rows(tenants: dict[str, Any]) -> list[list[str]]:
    rows = []
    for count, row in tenants.items():
        new = row["newcomer"]
        rows.append(
            [
                count,
                f"{new['backlogged_tenants']} x {new['backlog_per_tenant']}",
                (
                    f"{new['backlogged_at_first_newcomer']} / "
                    f"{new['backlogged_after_last_newcomer']}"
                ),
                f"{num(new['first_ttft_ms'])} (queued {num(new['first_queued_ms'])})",
                pair(new["later_ttft_ms"]["listed"]),
                pair(new["later_ttft_ms"]["unlisted"]),
                mib(new["dispatcher_memory_kb"]["peak_rss_kb"]),
            ]
        )
    return rows


def describe_newcomers(new: dict[str, Any]) -> str:
    """One newcomer run in a line (the progress note on stderr)."""
    later = new["later_ttft_ms"]
    return (
        f"first {num(new['first_ttft_ms'])} ms, later listed {pair(later['listed'])} ms, "
        f"unlisted {pair(later['unlisted'])} ms"
    )


def mib(kb: float) -> str:
    return f"{kb / 1024:.0f}"


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def pair(values: dict[str, float | None]) -> str:
    return f"{num(values['p50'])} / {num(values['max'])}"

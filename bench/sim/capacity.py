"""Capacity invariance: what one full replica completes per second, priced in engine time
and in today's model units, on nine traffic mixes (issue 36).

    python -m bench.sim.capacity [--quick] [--seeds 1 2 3] [--shapes a b] [--trace CSV]
                                 [--exact-max-tokens] [--out JSON]

One replica of the simulated engine (configs/engine.toml) serves the example config's
chat endpoint alone, admission out of the way (`scheduling_only`), fairq dispatching.
The endpoint's profile is the engine's own curve (`engine_time_profile`), put in the
config in place of `llama-7b-sim`: so the occupancy the endpoint reads, and everything
it prices, is what it is in production with a batched profile.

Shapes: the seven of `bench.sim.fairness_matrix` (the Azure conversation trace only
with --trace or $FQ_AZURE_TRACE; skipped, and said so, otherwise) and `long-prompt`:
20 tenants at 0.5 requests/s and a flood at 4/s, every prompt 2,000 tokens and every
answer 50. Each shape's requests, in arrival order and with their tenants, are the
records of one `ClosedLoop` client: it sends the next whenever a sequence slot outside
the newcomer reserve is free of running and queued work, so the replica is kept as full
as the dispatcher fills it (sequences, or KV-cache tokens, which it reserves as input +
max_tokens: the cap, 1,024, unless --exact-max-tokens makes it each request's real
output). The client holds enough requests for more than the whole window: their
engine time at the operating batch (a lower bound of the time they take) is 1.2x the
window's end. The measured window skips a warm-up (filling the
replica, and the occupancy reading settling) and ends before the client runs out, so
the drain is not measured; `last_send_s` >= the window's end says the replica was full
all through it.

Pricing, over the requests that finish inside the window:

- engine time, at the endpoint's occupancy: the endpoint's own drift reading
  (`EndpointQueues.completed_mu`, read at the step ends that bound the window). Each
  finished request is priced there from its real usage, by the profile, at the
  occupancy EMA the endpoint holds when it completes: what admission, the autoscaler and
  drift price work with. Not recomputed from the records: this is the reading itself;
- engine time at the operating batch (64): the same profile with no occupancy reading
  (what a batched profile prices before any worker has reported), recomputed from the
  records;
- flat model units: the same engine priced at batch 1 (alpha 0.000125, beta 0.025: the
  unit before issue 36), from the records' usage (a flat profile does not read the
  occupancy, so this is what its drift reading would say);
- the sanity columns: what the worker attributed to those requests (`engine_s`) per
  second, which adds up to the busy time by construction, and the busy fraction (step
  time inside the window).

Invariance: max over min of each pricing's per-second figure over the shapes, per seed
and on the means over seeds; the goal is <= 1.15 in engine time. The profile is the
simulated engine's own curve, so this measures the unit and its occupancy reading, not
how well `fairq calibrate` fits a real engine. Writes bench/results/capacity/summary.json
(or --out); prints markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec

from bench.harness.cli import write_json
from bench.harness.machine import command_line, machine_facts, table
from bench.harness.paths import RESULTS_DIR
from bench.harness.traces import add_trace_argument, azure_trace
from bench.sim.fairness_matrix import AZURE, SHAPES, Source, _named, arrivals, workload
from broker_config.config import EXAMPLE_CONFIG, EXAMPLE_ENGINE, Config, load_config
from costmodel.engine_model import EngineParams, engine_time_profile, load_engine_params
from costmodel.units import ModelProfile
from dispatcher.core.limits import scheduling_only
from dispatcher.sim.clients import ClosedLoop
from dispatcher.sim.simulator import Simulation
from dispatcher.sim.trace import TraceRecord
from producers.loadgen import SizeModel, TraceError

RESULTS = RESULTS_DIR / "capacity" / "summary.json"
BOUND = 1.15  # the goal: max over min of engine time per second, over the shapes
LONG_PROMPT = "long-prompt"
LONG = SizeModel(
    input_median=2000.0,
    input_sigma=0.0,
    input_range=(2000, 2000),
    output_median=50.0,
    output_sigma=0.0,
    output_range=(50, 50),
)
SHAPE_NAMES = (*SHAPES, AZURE, LONG_PROMPT)
# The client's requests last at least this many times the window's end.
MARGIN = 1.2
# The pricings compared: key in a cell -> column title.
PRICINGS = {
    "engine_mu_per_s": "engine time, endpoint occupancy",
    "engine_op_mu_per_s": "engine time, batch 64",
    "flat_mu_per_s": "flat model units",
}


def long_prompt_sources() -> list[Source]:
    return [*_named("l", 20, 0.5, LONG), Source("flood", 4.0, LONG)]


@dataclass(frozen=True, slots=True)
class Settings:
    seeds: tuple[int, ...] = (1, 2, 3)
    shapes: tuple[str, ...] = SHAPE_NAMES
    warmup_s: float = 60.0
    measure_s: float = 240.0
    # Each request's max_tokens its real output (a client that says what it needs), so
    # the dispatcher reserves the KV cache the engine uses; else the endpoint's cap.
    exact_max_tokens: bool = False

    @property
    def end_s(self) -> float:
        return self.warmup_s + self.measure_s


FULL = Settings()
QUICK = Settings(
    seeds=(1,),
    shapes=("prefill-heavy", "decode-heavy", "mixed", "weights", LONG_PROMPT),
    warmup_s=30.0,
    measure_s=120.0,
)


def engine_profile(params: EngineParams) -> ModelProfile:
    return engine_time_profile(params, name="llama-7b-sim")


def flat_profile(params: EngineParams) -> ModelProfile:
    """The engine's flat batch-1 price list: the unit before issue 36."""
    return msgspec.structs.replace(
        engine_profile(params), beta=params.beta, decode_base_s=None, decode_per_seq_s=None
    )


def capacity_config(profile: ModelProfile) -> Config:
    """The example config, chat alone, scheduling only, its profile replaced."""
    config = scheduling_only(load_config(EXAMPLE_CONFIG))
    chat = config.endpoints["chat"]
    return msgspec.structs.replace(
        config,
        endpoints={"chat": chat},
        profiles={**config.profiles, chat.profile: profile},
    )


def shape_records(
    shape: str, seed: int, need_s: float, profile: ModelProfile, trace: Path | None
) -> list[TraceRecord]:
    """The shape's first requests, in arrival order, whose engine time at the profile's
    operating batch reaches `need_s` (more arrivals drawn until it does)."""
    span = need_s
    while True:
        if shape == LONG_PROMPT:
            records = arrivals(long_prompt_sources(), seed, span)
        else:
            records, _ = workload(shape, seed, span, trace)
        total = 0.0
        for count, r in enumerate(records, 1):
            total += profile.model_units(r.input_tokens, r.output_tokens)
            if total >= need_s:
                return records[:count]
        if shape == AZURE and span > 1e6:
            raise ValueError(f"the Azure trace holds less than {need_s:.0f} s of work")
        span *= 2


class MeteredSimulation(Simulation):
    """A simulation that reads the endpoint's drift reading and the engine's steps at
    the window's bounds."""

    def __init__(self, *args: Any, window: tuple[float, float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window = window
        self.mu_at = [0.0, 0.0]  # completed_mu at the last step end <= each bound
        self.busy_s = 0.0  # step time inside the window
        self.steps = 0  # steps ending inside the window, and their emitting sequences
        self.emitting = 0
        self.occupancy_at_end: float | None = None

    def _end_step(self, replica: Any) -> None:
        step = replica.step
        super()._end_step(replica)
        start, end = self.window
        queues = self.scheduler.endpoints[replica.worker.endpoint]
        self.busy_s += max(0.0, min(self.now, end) - max(self.now - step.duration_s, start))
        if start < self.now <= end:
            self.steps += 1
            self.emitting += len(step.first_tokens) + len(step.tokens)
        for i, bound in enumerate(self.window):
            if self.now <= bound:
                self.mu_at[i] = queues.completed_mu
        if self.now <= end:
            self.occupancy_at_end = queues.occupancy


def measure(
    records: list[TraceRecord], settings: Settings, params: EngineParams, flat: ModelProfile
) -> dict[str, Any]:
    """Run `records` as one closed-loop client on one replica; price the window."""
    engine = engine_profile(params)
    start, end = settings.warmup_s, settings.end_s
    sim = MeteredSimulation(
        [],
        capacity_config(engine),
        params,
        closed_loop=[ClosedLoop(records)],
        window=(start, end),
    )
    done = [r for r in sim.run() if r.finished is not None and start < r.finished <= end]
    span = settings.measure_s
    return {
        "requests": len(records),
        "last_send_s": max(e.request.arrival for e in sim.entries),
        "finished_in_window": len(done),
        "engine_mu_per_s": (sim.mu_at[1] - sim.mu_at[0]) / span,
        "engine_op_mu_per_s": sum(
            engine.model_units(r.input_tokens, r.output_tokens, 0.0, r.cached_tokens) for r in done
        )
        / span,
        "flat_mu_per_s": sum(
            flat.model_units(r.input_tokens, r.output_tokens, 0.0, r.cached_tokens) for r in done
        )
        / span,
        "attributed_per_s": sum(r.engine_s for r in done) / span,
        "busy_fraction": sim.busy_s / span,
        "mean_emitting_per_step": sim.emitting / max(sim.steps, 1),
        "occupancy_reading": sim.occupancy_at_end,
        "input_tokens_per_s": sum(r.input_tokens for r in done) / span,
        "output_tokens_per_s": sum(r.output_tokens for r in done) / span,
    }


def run_all(settings: Settings, trace_flag: Path | None, command: str) -> dict[str, Any]:
    """`measure_all` with the machine's facts (the JSON the benchmark writes)."""
    facts = machine_facts(command)
    return {"scenario": "capacity", "machine": facts, **measure_all(settings, trace_flag)}


def measure_all(settings: Settings, trace_flag: Path | None) -> dict[str, Any]:
    """Every shape and seed of `settings`: settings, skipped shapes, cells, invariance."""
    params = load_engine_params(EXAMPLE_ENGINE)
    engine, flat = engine_profile(params), flat_profile(params)
    trace, skipped = None, {}
    if AZURE in settings.shapes:
        try:
            trace = azure_trace(trace_flag)
        except TraceError as exc:
            skipped[AZURE] = str(exc)
    rows: dict[str, dict[str, Any]] = {}
    for shape in settings.shapes:
        if shape in skipped:
            continue
        for seed in settings.seeds:
            started = time.monotonic()
            records = shape_records(shape, seed, MARGIN * settings.end_s, engine, trace)
            if settings.exact_max_tokens:
                records = [replace(r, max_tokens=r.output_tokens) for r in records]
            rows.setdefault(shape, {})[str(seed)] = cell = measure(records, settings, params, flat)
            print(
                f"{shape}, seed {seed}: {cell['finished_in_window']} finished in the window; "
                f"engine time {cell['engine_mu_per_s']:.3f}/s, flat {cell['flat_mu_per_s']:.2f}"
                f" MU/s ({time.monotonic() - started:.1f} s)",
                file=sys.stderr,
            )
    summary = {
        "settings": {
            "seeds": list(settings.seeds),
            "shapes": list(settings.shapes),
            "warmup_s": settings.warmup_s,
            "measure_s": settings.measure_s,
            "exact_max_tokens": settings.exact_max_tokens,
            "policy": "fairq",
            "engine": msgspec.to_builtins(params),
            "profiles": {
                "engine": msgspec.to_builtins(engine),
                "flat": msgspec.to_builtins(flat),
            },
        },
        "skipped": skipped,
        "shapes": rows,
    }
    summary["invariance"] = invariance(summary)
    return summary


def mean_over_seeds(cells: dict[str, Any], metric: str) -> float:
    return statistics.fmean(cell[metric] for cell in cells.values())


def spread(values: list[float]) -> float | None:
    """Max over min (None if nothing, or a zero)."""
    return max(values) / min(values) if values and min(values) > 0 else None


def _ratio(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def invariance(summary: dict[str, Any]) -> dict[str, Any]:
    """Max over min over the shapes, per pricing: on the means over seeds and per seed;
    and whether every cell kept its replica full through the window."""
    shapes = summary["shapes"]
    metrics = [*PRICINGS, "attributed_per_s"]
    seeds = [str(s) for s in summary["settings"]["seeds"]]
    return {
        "means": {m: spread([mean_over_seeds(c, m) for c in shapes.values()]) for m in metrics},
        "per_seed": {
            seed: {m: spread([c[seed][m] for c in shapes.values() if seed in c]) for m in metrics}
            for seed in seeds
        },
        "full_through_window": all(
            cell["last_send_s"]
            >= summary["settings"]["warmup_s"] + summary["settings"]["measure_s"]
            for cells in shapes.values()
            for cell in cells.values()
        ),
        "bound": BOUND,
    }


_COLUMNS = (
    ("requests/s", None, 2),
    ("input tok/s", "input_tokens_per_s", 0),
    ("output tok/s", "output_tokens_per_s", 0),
    ("emitting per step", "mean_emitting_per_step", 1),
    ("engine time, endpoint occupancy (engine-s/s)", "engine_mu_per_s", 3),
    ("engine time, batch 64", "engine_op_mu_per_s", 3),
    ("flat model units (MU/s)", "flat_mu_per_s", 2),
    ("worker attribution (engine-s/s)", "attributed_per_s", 3),
    ("busy", "busy_fraction", 3),
)


def render(summary: dict[str, Any]) -> str:
    span = summary["settings"]["measure_s"]
    rows = []
    for shape, cells in summary["shapes"].items():
        row = [shape]
        for _, metric, digits in _COLUMNS:
            value = (
                mean_over_seeds(cells, "finished_in_window") / span
                if metric is None
                else mean_over_seeds(cells, metric)
            )
            row.append(f"{value:,.{digits}f}")
        rows.append(row)
    inv = summary["invariance"]
    means = inv["means"]
    rows.append(
        [
            "**max / min**",
            *[""] * 4,
            *(f"**{_ratio(means[m])}**" for m in PRICINGS),
            _ratio(means["attributed_per_s"]),
            "",
        ]
    )
    seeds = ", ".join(map(str, summary["settings"]["seeds"]))
    kv = "real output" if summary["settings"]["exact_max_tokens"] else "the endpoint's cap"
    lines = [f"Means over seeds {seeds} (per seed in the JSON); max_tokens {kv}:", ""]
    lines += table(["shape", *(title for title, _, _ in _COLUMNS)], rows)
    lines += ["", "Max over min over the shapes, per seed:", ""]
    lines += table(
        ["seed", *PRICINGS.values(), "worker attribution"],
        [
            [seed, *(_ratio(by_metric[m]) for m in [*PRICINGS, "attributed_per_s"])]
            for seed, by_metric in inv["per_seed"].items()
        ],
    )
    lines += ["", verdict(inv)]
    if not inv["full_through_window"]:
        lines += ["", "WARNING: a client ran out before the window's end (see last_send_s)."]
    for shape, reason in summary["skipped"].items():
        lines += ["", f"{shape}: skipped: {reason}"]
    return "\n".join(lines)


def verdict(inv: dict[str, Any]) -> str:
    """Whether engine time's max/min over the shapes is within the bound."""
    engine = [inv["means"]["engine_mu_per_s"]]
    engine += [by_metric["engine_mu_per_s"] for by_metric in inv["per_seed"].values()]
    if None in engine or len(engine) < 2:
        return "Too few shapes to compare."
    worst = max(engine[1:])
    holds = "holds" if max(engine) <= BOUND else "does NOT hold"
    return (
        f"Engine time at the endpoint's occupancy: max/min {engine[0]:.3f} on the means, "
        f"at most {worst:.3f} on one seed: <= {BOUND} {holds}. Flat model units: "
        f"{_ratio(inv['means']['flat_mu_per_s'], 2)}."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim.capacity", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="five shapes, one seed, a 120 s window"
    )
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--shapes", nargs="+", choices=SHAPE_NAMES)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--exact-max-tokens",
        action="store_true",
        help="each request's max_tokens is its real output (default: the endpoint's cap)",
    )
    add_trace_argument(parser)
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    settings = replace(
        settings,
        seeds=tuple(args.seeds or settings.seeds),
        shapes=tuple(args.shapes or settings.shapes),
        exact_max_tokens=args.exact_max_tokens,
    )
    summary = run_all(settings, args.trace, command_line("bench.sim.capacity", argv))
    write_json(args.out, summary)
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

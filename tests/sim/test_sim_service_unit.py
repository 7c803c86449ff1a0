"""`fairq sim --service-unit`: service and fairness in engine time, VTC's unit or model
units, from the same run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producers.cli import main


def sim(tmp_path: Path, unit: str) -> dict:
    trace = tmp_path / "t.csv"
    rows = ["tenant,arrival_s,input_tokens,output_tokens"]
    rows += [f"flood,{i * 0.01:.2f},2000,20" for i in range(300)]
    rows += [f"chat{k},{i * 0.5 + k:.2f},100,200" for k in range(2) for i in range(40)]
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / f"{unit}.json"
    args = ["sim", "--trace", str(trace), "--scheduling-only", "--out", str(out)]
    assert main([*args, "--service-unit", unit]) == 0
    return json.loads(out.read_text())


def test_engine_time_service_is_what_the_engine_attributed(tmp_path: Path) -> None:
    result = sim(tmp_path, "engine")
    summary = result["summary"]
    assert summary["service_unit"] == "engine"
    served = [r for r in result["records"] if r["finished"] is not None]
    assert served and all(r["engine_s"] > 0 for r in served)
    for tenant, row in summary["tenants"].items():
        mine = sum(r["engine_s"] for r in served if r["tenant"] == tenant)
        assert row["service"] == pytest.approx(mine)
    # Attribution spends every engine-second of the run: the total is the busy time.
    busy = sum(r["engine_s"] for r in served)
    assert 0 < busy <= summary["simulation"]["makespan_s"] + 1e-9


def test_the_default_unit_stays_vtcs_and_the_units_differ(tmp_path: Path) -> None:
    vtc, engine = sim(tmp_path, "vtc")["summary"], sim(tmp_path, "engine")["summary"]
    assert vtc["service_unit"] == "vtc"
    flood = vtc["tenants"]["flood"]
    assert flood["service"] == sum(2000 + 2 * 20 for _ in range(flood["served"]))
    # The same run: only the unit differs.
    assert vtc["throughput_tokens_per_s"] == engine["throughput_tokens_per_s"]
    assert vtc["service_diff_avg"] != engine["service_diff_avg"]


def test_an_unknown_unit_is_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["sim", "--scenario", "noisy-neighbour", "--service-unit", "joules", "--out", "x"])
    assert exit_.value.code == 2
    assert "--service-unit" in capsys.readouterr().err

"""Hydra multirun sweeps: every point runs, the summary's rows match each point's report (the
layout of each, data parallelism included), and a point that fails gets a row saying why while
the sweep goes on; after the summary the sweep exits 1. (The README's sweeps are run, and their
summaries checked, in test_readme.)"""

import csv
import json

import pytest

from conftest import run_cli


@pytest.mark.slow
def test_a_sweep_summarises_every_point_and_exits_1_for_a_failed_one(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "steps=1", "model=gpt2", "stages=2,5", "parallel.dp=1,2", f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]  # a point failed: after the summary, exit 1
    assert "2 failed" in proc.stdout
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert len(rows) == 4
    assert (sweep / "summary.md").read_text().count("\n") == 6
    assert (sweep / "summary.png").stat().st_size > 1000
    for row in rows:
        point = sweep / row["point"]
        if "stages=5" in row["overrides"]:
            assert row["check"] == "error" and "stages=5" in row["error"]
            assert json.loads((point / "error.json").read_text())["exit_status"] == 2
            continue
        report = json.loads((point / "report.json").read_text())
        assert row["check"] == "passed" and report["ok"]
        assert row["layout"] == f"pp2xdp{report['layout']['dp']}xtp1"
        assert row["model"] == report["model"] and int(row["stages"]) == report["stages"]
        assert row["strategy"] == report["split_strategy"]
        assert row["split_points"] == " ".join(report["split_points"])
        assert float(row["balance_flops"]) == pytest.approx(report["balance"]["flops"], abs=1e-4)
        assert float(row["step_time_s"]) == pytest.approx(report["run"]["step_time_s"], abs=1e-6)
        timeline = report["run"]["timeline"]  # the pipeline's bubble and stage-time imbalance
        assert float(row["bubble"]) == pytest.approx(timeline["bubble_mean"], abs=1e-4)
        assert float(row["bubble_theory"]) == pytest.approx(timeline["bubble_theory"], abs=1e-4)
        assert float(row["imbalance"]) == pytest.approx(timeline["imbalance"], abs=1e-4) and float(row["imbalance"]) >= 1
    assert sorted(r["layout"] for r in rows if r["check"] == "passed") == ["pp2xdp1xtp1", "pp2xdp2xtp1"]

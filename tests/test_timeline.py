"""What the pipeline did, timed: every rank records each schedule action of each step, and the
run folder gets a Chrome trace of them (timeline.json) whose actions are exactly the schedule's."""

import json
from collections import Counter

import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow

STEPS, MICROBATCHES = 2, 4
CASES = {  # schedule -> (stages, the actions each stage takes per microbatch)
    "1f1b": (2, ("forward", "backward")),
    "interleaved_1f1b": (4, ("forward", "backward")),
    "zbv": (4, ("forward", "backward_input", "backward_weight")),
}


@pytest.mark.parametrize("schedule", CASES)
def test_the_timeline_holds_every_action_of_the_schedule_per_rank_and_step(tmp_path, schedule):
    stages, actions = CASES[schedule]
    proc = run_cli(f"schedule={schedule}", f"stages={stages}", f"steps={STEPS}", f"microbatches={MICROBATCHES}",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = json.loads((tmp_path / "run" / "report.json").read_text())["run"]
    timeline = run["timeline"]
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert all(isinstance(e["ts"], float) and e["dur"] >= 0 and isinstance(e["pid"], int) and isinstance(e["tid"], int)
               for e in spans)
    assert {e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"} == {"rank 0", "rank 1"}
    # Each stage: one of each action per microbatch per step, on the rank that holds it.
    per_stage = Counter((e["args"]["stage"], e["cat"], e["args"]["step"]) for e in spans if "stage" in e.get("args", {}))
    want = {(s, a, k): MICROBATCHES for s in range(stages) for a in actions for k in range(1, STEPS + 1)}
    assert dict(per_stage) == want
    mbs = Counter((e["args"]["stage"], e["cat"], e["args"]["microbatch"]) for e in spans if "stage" in e.get("args", {}))
    assert set(mbs.values()) == {STEPS} and {m for _, _, m in mbs} == set(range(MICROBATCHES))
    holders = {e["args"]["stage"]: e["pid"] for e in spans if "stage" in e.get("args", {})}
    assert sorted(set(holders.values())) == [0, 1] and len(holders) == stages
    assert Counter(e["pid"] for e in spans if e["cat"] == "step") == {0: STEPS, 1: STEPS}
    assert timeline["steps_recorded"] == STEPS and timeline["median_step"] in range(1, STEPS + 1)
    assert set(timeline["bubble"]) == {"0", "1"} and all(0 <= b < 1 for b in timeline["bubble"].values())

"""What the pipeline did, timed: every rank records each schedule action of each step, and the
run folder gets a Chrome trace of them (timeline.json) whose actions are exactly the schedule's,
a picture of the median step (timeline.png), and the bubble measured and by the schedule's own
action lists (played out by ppsplit/train/bubble.py, checked here against the closed forms
where a schedule has one)."""

import json
from collections import Counter

import pytest

from conftest import run_cli
from ppsplit.train import bubble as schedule_bubble
from ppsplit.config.schedules import SCHEDULES, plan_ranks, stages_of_rank


def gpipe_lists(p, m):
    return {r: [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)}


def one_f_one_b_lists(p, m):
    out = {}
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [(r, "F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [(r, "F", warm + i), (r, "B", i)]
        out[r] = acts + [(r, "B", i) for i in range(m - warm, m)]
    return out


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 4), (4, 8)])
def test_the_play_out_of_gpipe_and_1f1b_lists_gives_their_closed_form_bubble(p, m):
    want = (p - 1) / (m + p - 1)  # every rank idles for p - 1 forward+backward slots of m + p - 1
    for lists in (gpipe_lists(p, m), one_f_one_b_lists(p, m)):
        assert schedule_bubble.complete(lists, p, m)
        result = schedule_bubble.simulate(lists)
        assert result["bubble_mean"] == pytest.approx(want)
        assert result["makespan"] == pytest.approx(3 * (m + p - 1))


def test_lists_that_cannot_run_or_lack_an_action_are_told_apart():
    lists = one_f_one_b_lists(2, 4)
    lists[1] = [a for a in lists[1] if a != (1, "F", 0)]  # what torch 2.13 plans for 1F1B's last rank
    assert not schedule_bubble.complete(lists, 2, 4)
    with pytest.raises(ValueError, match="cannot all run"):
        schedule_bubble.simulate(lists)


@pytest.fixture
def fake_world():
    """A process group of the 'fake' backend: rank 0 of a world of any size, in this process,
    enough for torch's schedules to plan every rank's actions."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(size):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def torch_plan(schedule, ranks, microbatches):
    import torch
    from torch.distributed import pipelining

    placement = SCHEDULES[schedule][1]
    stages = ranks * (1 if placement == "single" else 2)
    plan = plan_ranks(schedule, stages, None, microbatches)
    pipe_stages = [pipelining.PipelineStage(torch.nn.Linear(2, 2), i, stages, torch.device("cpu"))
                   for i in stages_of_rank(0, plan.ranks, plan.stages_per_rank, plan.placement)]
    cls = getattr(pipelining, SCHEDULES[schedule][0])
    made = cls(pipe_stages if placement != "single" else pipe_stages[0], n_microbatches=microbatches,
               loss_fn=lambda out, target: out.sum())
    return schedule_bubble.action_lists(made), stages


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_schedule_plans_lists_whose_play_out_gives_its_bubble(fake_world, ranks):
    m = 8
    fake_world(ranks)
    bubbles = {}
    for schedule in SCHEDULES:
        lists, stages = torch_plan(schedule, ranks, m)
        assert sorted(lists) == list(range(ranks))
        if schedule == "1f1b":  # torch's plan skips the last rank's first forward; the run uses the order as run
            assert not schedule_bubble.complete(lists, stages, m)
            continue
        assert schedule_bubble.complete(lists, stages, m), schedule
        bubbles[schedule] = schedule_bubble.simulate(lists)["bubble_mean"]
    p, v = ranks, 2
    assert bubbles["gpipe"] == pytest.approx((p - 1) / (m + p - 1))
    assert bubbles["interleaved_1f1b"] == pytest.approx((p - 1) / (v * m + p - 1))  # v stages a rank
    for zero_bubble in ("interleaved_zb", "zbv", "dualpipev"):  # the split backward fills the drain
        assert bubbles[zero_bubble] < bubbles["interleaved_1f1b"] / 2


STEPS, MICROBATCHES = 2, 4
CASES = {  # schedule -> (stages, the actions each stage takes per microbatch)
    "1f1b": (2, ("forward", "backward")),
    "interleaved_1f1b": (4, ("forward", "backward")),
    "zbv": (4, ("forward", "backward_input", "backward_weight")),
}


@pytest.mark.slow
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
    # Each rank waited on its sends and receives (the first stage for the backward's gradients,
    # the last for the forward's activations), on a track of its own.
    waits = [e for e in spans if e["cat"] == "wait"]
    assert {e["pid"] for e in waits} == {0, 1} and {e["tid"] for e in waits} == {1000}
    assert {e["name"] for e in waits} <= {"wait send", "wait recv", "wait send+recv"}
    assert all(0 <= w <= timeline["bubble"][r] + 1e-9 for r, w in timeline["wait"].items())
    # The schedule's own bubble: 1F1B and interleaved 1F1B have closed forms to hold it to.
    p, m = 2, MICROBATCHES
    want = {"1f1b": (p - 1) / (m + p - 1), "interleaved_1f1b": (p - 1) / (2 * m + p - 1)}
    if schedule in want:
        assert timeline["bubble_theory"] == pytest.approx(want[schedule])
    assert timeline["bubble_theory_from"] == ("as run" if schedule == "1f1b" else "pipeline_order")
    assert 0 <= timeline["bubble_theory"] < 0.5 and 0 <= timeline["bubble_expected"] < 1
    # Per stage: the times of exactly its actions, and the bytes one microbatch saves for backward.
    rows = {r["stage"]: r for r in timeline["stages"]}
    assert sorted(rows) == list(range(stages))
    field = {"forward": "forward_ms", "backward": "backward_ms", "backward_input": "backward_input_ms",
             "backward_weight": "backward_weight_ms"}
    for row in rows.values():
        assert all((row[field[a]] is not None) == (a in actions) for a in field)
        assert row["compute_ms"] > 0 and row["activation_bytes"] > 2 ** 16
    assert timeline["imbalance"] >= 1
    layout = run["rank_layout"]
    assert all(r["peak_rss_bytes"] > 50 * 2 ** 20 and r["cuda_max_allocated_bytes"] is None for r in layout)
    # The picture of the median step: a PNG, wide enough to read.
    picture = tmp_path / "run" / "timeline.png"
    assert timeline["picture"] == str(picture)
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(picture).shape
    assert width >= 1000 and height >= 200
    assert "bubble (step" in proc.stdout and "by the schedule's action lists" in proc.stdout

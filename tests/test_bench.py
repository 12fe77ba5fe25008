"""Smoke test of bench/: every benchmark runs in quick mode and writes the JSON it promises.

Timings are never asserted on; only the shape of the results.
"""

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # bench/ sits beside tests/, not inside the installed package
    sys.path.insert(0, ROOT)


def positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def run_quick(name, tmp_path):
    import importlib

    module = importlib.import_module(f"bench.{name}")
    returned = module.main(quick=True, out_dir=str(tmp_path))
    path = tmp_path / f"{name}.json"
    assert path.is_file()
    data = json.loads(path.read_text())
    assert data["benchmark"] == name and data["quick"] is True
    assert data["threads"] == 1
    machine = data["machine"]
    for key in ("cpu_count", "torch_version", "torch_threads", "date"):
        assert key in machine
    assert machine["torch_threads"] == 1
    assert positive(data["ratio"]) and data["ratio"] == returned["ratio"]
    return data


def check_sides(row, sides):
    for side in sides:
        s = row[side]
        assert all(positive(s[k]) for k in ("median", "min", "max"))
        assert s["min"] <= s["median"] <= s["max"]


def test_split_time(tmp_path):
    data = run_quick("split_time", tmp_path)
    check_sides(data["main"], ("ppsplit", "pipeline", "ppsplit_split_only"))
    assert positive(data["main"]["split_only_ratio"])
    assert positive(data["main"]["ratio"]) and isinstance(data["main"]["meets_target"], bool)
    assert data["series"]
    for row in data["series"]:
        check_sides(row, ("ppsplit", "pipeline"))
        assert positive(row["ratio"])
        assert positive(row["ppsplit_per_layer_s"]) and positive(row["pipeline_per_layer_s"])
    assert set(data["series_fit"]) == {"ppsplit", "pipeline"}
    assert isinstance(data["warnings"], list)


def test_stage_overhead(tmp_path):
    data = run_quick("stage_overhead", tmp_path)
    assert data["sizes"]
    for row in data["sizes"]:
        check_sides(row, ("generated", "unfolded", "interpreter", "eager", "eager_mask"))
        for key in ("generated_over_eager", "unfolded_over_eager", "interpreter_over_eager",
                    "eager_mask_over_eager"):
            assert positive(row[key])
        assert row["max_abs_diff_vs_eager"] == {"generated": 0.0, "unfolded": 0.0, "interpreter": 0.0}


def test_dynamic_shapes(tmp_path):
    data = run_quick("dynamic_shapes", tmp_path)
    assert data["sizes"]
    for size in data["sizes"]:
        assert positive(size["dynamic_trace_s"])
        assert [r["seq"] for r in size["lengths_measured"]] == size["lengths"]
        for row in size["lengths_measured"]:
            check_sides(row, ("dynamic", "static", "eager"))
            assert positive(row["dynamic_over_static"]) and positive(row["static_over_eager"])
            assert row["max_abs_diff_vs_unsplit"] == {"dynamic": 0.0, "static": 0.0}


def test_tied_memory(tmp_path):
    data = run_quick("tied_memory", tmp_path)
    assert positive(data["original_bytes"])
    for side in ("ppsplit", "pipeline"):
        assert len(data[side]["stage_bytes"]) == 2
        assert all(positive(b) for b in data[side]["stage_bytes"])
        assert positive(data[side]["ratio"])


@pytest.mark.slow
def test_pipeline_efficiency(tmp_path):
    data = run_quick("pipeline_efficiency", tmp_path)
    assert positive(data["t1"]["median"])
    assert data["points"]
    for row in data["points"]:
        assert row["ok"], row.get("error") or row.get("output_tail")
        assert positive(row["step_time_s"]) and positive(row["ideal_s"]) and positive(row["ratio"])


def test_cli_rejects_unknown_benchmark():
    from bench.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--only", "nope"])
    assert exc.value.code == 2


def test_balance(tmp_path):
    from bench import balance

    balance.main(quick=True, out_dir=str(tmp_path))
    data = json.loads((tmp_path / "balance.json").read_text())
    for result in data["results"]:
        assert {"ppsplit even", "ppsplit params", "ppsplit flops", "ppsplit flops, block starts only",
                "PiPPy equal-size", "torchtitan weighting"} == set(result["strategies"])
        for figures in result["strategies"].values():
            assert figures["params"] >= 1.0 and figures["flops"] >= 1.0
        assert result["flops_strategy_best_on_flops"] is True  # optimal on its own cost
        with_head, blocks_only = (result["strategies"][k]["flops"]
                                  for k in ("ppsplit flops", "ppsplit flops, block starts only"))
        assert with_head <= blocks_only + 1e-12  # one more place to cut can only help


@pytest.mark.slow
def test_meta_memory(tmp_path):
    from bench import meta_memory

    meta_memory.main(quick=True, out_dir=str(tmp_path))
    data = json.loads((tmp_path / "meta_memory.json").read_text())
    for side in data["driver"].values():
        assert positive(side["ratio"]["ratio"]) and positive(side["peak_rss_bytes"]["ppsplit"])
    assert [g["layers"] for g in data["tracing_growth"]] == [2, 4]
    assert all(positive(r["stage_bytes"]) for r in data["ranks"]["per_rank"])


def test_layouts(tmp_path):
    data = run_quick("layouts", tmp_path)
    for name in ("pp2", "pp2xdp2", "pp2xtp2"):
        row = data["layouts"][name]
        assert row["ok"] and positive(row["max_held_bytes"]) and row["max_loss_rel_diff"] <= 1e-5
        check_sides(row, ("step",))
    assert data["layouts"]["pp2xdp2"]["held_ratio"] < 0.75  # FSDP shards what each rank holds


@pytest.mark.slow
def test_rank_memory(tmp_path):
    data = run_quick("rank_memory", tmp_path)
    by_layout = data["layouts"]["release"]
    for name in ("pp2", "pp2xdp2 reshard=microbatch units"):
        f = by_layout[name]
        assert f["ok"] and positive(f["max_ratio"]) and positive(f["step_s"]), f
        for r in f["ranks"]:
            assert positive(r["held_bytes"]) and positive(r["overhead_bytes"])
            assert r["held_bytes"] == 2 * r["param_bytes"] + r["optimizer_bytes"]
    assert positive(data["dp_ratio"]["release"]["pp2xdp2 reshard=microbatch units"])


def test_training(tmp_path):
    data = run_quick("training", tmp_path)
    check_sides(data["step_time_s"], ("pipeline", "unsplit_1t", "unsplit_2t", "recompute"))
    assert all(positive(v) for v in data["tokens_per_s"].values())
    for key in ("pipeline_over_unsplit_1t", "pipeline_over_unsplit_2t", "recompute_over_plain",
                "metrics_row_s", "metrics_share_of_step"):
        assert positive(data[key]), key


def test_finetune(tmp_path):
    data = run_quick("finetune", tmp_path)
    check_sides(data["step_time_s"], ("lora", "full", "padded"))
    assert all(positive(v) for v in data["scored_tokens_per_s"].values())
    assert data["scored_tokens_per_row"]["lora"] > data["scored_tokens_per_row"]["padded"]  # packed rows score more
    assert 0 < data["lora_over_full_optimizer_bytes"] < 0.2  # adamw's moments for the adapters alone
    for key in ("lora_over_full_tokens_per_s", "packing_over_padding_tokens_per_s",
                "packing_over_padding_scored_tokens_per_s"):
        assert positive(data[key]), key


def test_corpora(tmp_path):
    data = run_quick("corpora", tmp_path)
    assert set(data["jobs"]) == {"0.5", "2"} and set(data["tokenize"]) == {"1", "2"}
    for job in data["jobs"].values():
        assert all(positive(job[k]) for k in ("corpus_bytes", "cache_bytes", "tokenize_s", "driver_peak_bytes",
                                              "worst_rank_peak_bytes", "step_s"))
        assert job["cache_bytes"] < job["corpus_bytes"]  # two bytes a token, under three bytes of text a token
    check_sides(data["read"]["per_batch_s"], ("mapped", "in_memory"))
    assert isinstance(data["meets_target"], bool) and positive(data["read_share_of_step"])
    assert set(data["sft"]) == {"0.2"}
    assert all(positive(j["driver_peak_bytes"]) and positive(j["worst_rank_peak_bytes"]) for j in data["sft"].values())


def test_checkpoint_cost(tmp_path):
    data = run_quick("checkpoint_cost", tmp_path)
    check_sides(data["seconds"], ("step", "save", "seal", "async_blocking"))
    assert positive(data["state_mb"]) and positive(data["save_s_per_mb"]) and positive(data["seal_s_per_mb"])
    assert set(data["share_of_steps"]) == {"10", "100", "1000"} and all(map(positive, data["share_of_steps"].values()))


def test_timeline_overhead(tmp_path):
    data = run_quick("timeline_overhead", tmp_path)
    check_sides(data["seconds"], ("noop_plain", "noop_recorded", "wait_plain", "wait_recorded", "block"))
    assert data["overhead_per_action_s"] >= 0 and data["overhead_per_wait_s"] >= 0 and data["share_of_step"] >= 0


def test_pipeline_bubbles(tmp_path):
    data = run_quick("pipeline_bubbles", tmp_path)
    (point,) = data["points"]
    assert point["schedule"] == "1f1b" and point["ranks"] == 2
    for side in ("even", "flops"):
        p = point[side]
        assert p["ok"], p
        assert 0 <= p["bubble"] <= 1 and 0 < p["efficiency"] <= 1
        assert p["bubble_theory"] == pytest.approx(1 / 5)  # 1F1B, 2 ranks, 4 microbatches: (p-1)/(m+p-1)


@pytest.mark.slow
def test_step_overheads(tmp_path):
    """What ppsplit adds per step at pp2 x dp2 (FSDP2, clipping) does not grow with depth: one
    all-reduce (the gradient norm with the loss and stop flags), no DTensor collective; FSDP's
    own gathers and scatters do grow."""
    from bench import step_overheads

    data = step_overheads.main(quick=True, out_dir=str(tmp_path))
    assert json.loads((tmp_path / "step_overheads.json").read_text())["depths"] == [2, 4]
    shallow, deep = (data["results"]["fsdp2"][str(d)] for d in data["depths"])
    assert shallow["ok"] and deep["ok"], (shallow, deep)
    assert shallow["kinds"]["ours"] == deep["kinds"]["ours"] == 1
    assert shallow["kinds"]["dtensor"] == deep["kinds"]["dtensor"] == 0
    assert deep["kinds"]["fsdp"] > shallow["kinds"]["fsdp"] > 0
    assert deep["kinds"]["sync"] == shallow["kinds"]["sync"]


def test_gpu_check_skips_cleanly_without_a_gpu(tmp_path):
    import torch

    from bench import gpu_check

    if torch.cuda.is_available():  # where a GPU is at hand the check runs for real
        data = gpu_check.main(quick=True, out_dir=str(tmp_path))
        assert not data["skipped"] and data["numerics_fp32"]["ok"] and data["materialised"]["ok"], data
        return
    data = gpu_check.main(quick=True, out_dir=str(tmp_path))
    assert data == {"quick": True, "skipped": True}
    assert json.loads((tmp_path / "gpu_check.json").read_text())["skipped"] is True

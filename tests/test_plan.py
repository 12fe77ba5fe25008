"""Split strategies: optimal partitions (checked against brute force), explicit layer counts,
and the balance figures in the report."""

import itertools
import json
import random

import pytest

import ppsplit
from ppsplit import PpsplitError
from ppsplit.app.cli import run
from ppsplit.stages.plan import balance, layer_sizes, linear_partition, stage_costs, unit_costs
from ppsplit.stages.points import find_blocks, module_run_order, unit_starts
from ppsplit.stages.trace import export
from helpers import compose_cfg, model_and_batch


def brute_force(costs, parts):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_linear_partition_is_optimal(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    parts = rng.randint(1, n)
    costs = [rng.choice([rng.random(), rng.randint(1, 5), 0.0]) for _ in range(n)]
    sizes = linear_partition(costs, parts)
    assert len(sizes) == parts and all(s >= 1 for s in sizes) and sum(sizes) == n
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == pytest.approx(brute_force(costs, parts))


def test_layer_sizes():
    assert layer_sizes(14, None, [3, 4, 4, 3]) == [3, 4, 4, 3]
    assert layer_sizes(14, 4, None, first_stage_less=1, last_stage_less=1) == [3, 4, 4, 3]
    twelve = layer_sizes(12, 4, None, first_stage_less=1, last_stage_less=1)
    assert sum(twelve) == 12 and twelve[0] < 4 and twelve[-1] < 4 and max(twelve) == 4
    eight = layer_sizes(12, 8, None, first_stage_less=1, last_stage_less=1)
    assert sum(eight) == 12 and min(eight) >= 1 and eight[0] == eight[-1] == 1
    assert sorted(layer_sizes(7, 3, None)) == [2, 2, 3]
    assert layer_sizes(8, 2, None, first_stage_less=0, last_stage_less=2) == [5, 3]
    with pytest.raises(PpsplitError, match="add up"):
        layer_sizes(4, None, [1, 2])
    with pytest.raises(PpsplitError, match="more stages than"):
        layer_sizes(4, 5, None, first_stage_less=1)


@pytest.mark.parametrize("model", ["gpt2", "llama", "bert", "t5"])
def test_balanced_strategies_beat_or_match_every_other_split_on_their_own_cost(model):
    net, mbs, _ = model_and_batch(model, "model.config.vocab_size=8000")
    program = export(net, mbs[0].args, mbs[0].kwargs)
    run_order = module_run_order(program)
    starts = unit_starts(program, run_order, find_blocks(net, run_order))  # blocks and the head
    chosen_cost = {}
    for kind in ("params", "flops"):
        chosen = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=3, strategy=kind, program=program)
        chosen_cost[kind] = max(stage_costs(chosen)[kind])
        assert ppsplit.verify_fqns(net, chosen).ok
    for cut in itertools.combinations(range(1, len(starts)), 2):  # each other split once, both costs
        other = stage_costs(ppsplit.split(net, mbs[0].args, mbs[0].kwargs, points=[starts[i] for i in cut],
                                          program=program))
        for kind, cost in chosen_cost.items():
            assert cost <= max(other[kind]) * (1 + 1e-9), (kind, cut)


def test_flops_strategy_moves_blocks_off_the_head_stage():
    # vocab 8000 makes GPT2's head heavy: the flops split gives the last stage fewer blocks
    net, mbs, _ = model_and_batch("gpt2", "model.config.vocab_size=8000", "model.config.n_layer=8")
    even = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=3)
    flops = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=3, strategy="flops")
    assert even.points == ["transformer.h.3", "transformer.h.6"]

    def blocks_of_last(split):
        return [b for b in split.blocks if b in split.stage_modules[-1]]

    assert len(blocks_of_last(flops)) < len(blocks_of_last(even))
    assert balance(stage_costs(flops)["flops"]) < balance(stage_costs(even)["flops"])


@pytest.mark.parametrize("model,head", [
    ("gpt2", "transformer.ln_f"), ("llama", "model.norm"), ("bert", "cls"),
    ("t5", "decoder.final_layer_norm"),
])
def test_the_head_can_be_a_stage_of_its_own(model, head):
    net, mbs, loss_fn = model_and_batch(model)
    program = export(net, mbs[0].args, mbs[0].kwargs)
    run_order = module_run_order(program)
    blocks = find_blocks(net, run_order)
    assert unit_starts(program, run_order, blocks) == [*blocks, head]
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, points=[blocks[len(blocks) // 2], head],
                          program=program)
    assert not [b for b in split.blocks if b in split.stage_modules[-1]]
    assert ppsplit.verify_fqns(net, split).ok
    numerics = ppsplit.verify_numerics(net, split, mbs, loss_fn)
    assert numerics.ok(1e-6), numerics


def test_flops_gives_a_heavy_head_its_own_stage():
    # At vocab 8000 GPT2's head costs about ten of its 64-wide blocks.
    net, mbs, _ = model_and_batch("gpt2", "model.config.vocab_size=8000")
    split = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, stages=2, strategy="flops")
    assert split.points == ["transformer.ln_f"]
    assert set(split.stage_keys[1]) == {"transformer.ln_f.weight", "transformer.ln_f.bias",
                                        "lm_head.weight"}
    blocks_only = find_blocks(net, module_run_order(split.program))
    for point in blocks_only[1:]:
        other = ppsplit.split(net, mbs[0].args, mbs[0].kwargs, points=[point], program=split.program)
        assert max(stage_costs(split)["flops"]) < max(stage_costs(other)["flops"])


def test_unit_costs_count_embedding_and_head_where_they_run():
    net, mbs, _ = model_and_batch("gpt2")
    program = export(net, mbs[0].args, mbs[0].kwargs)
    run_order = module_run_order(program)
    blocks = find_blocks(net, run_order)
    costs = unit_costs(net, program, blocks, run_order)
    block_params = sum(p.numel() for p in net.transformer.h[1].parameters())
    wte = net.transformer.wte.weight.numel()
    assert costs["params"][1] == block_params
    assert costs["params"][0] >= block_params + wte  # embeddings run before block 0
    assert costs["params"][-1] >= block_params + wte  # the tied head runs after the last block
    assert costs["flops"][-1] > costs["flops"][1]


@pytest.mark.parametrize("split,expect_points", [
    (["split=layers", "split.layers=[1,3]"], ["transformer.h.1"]),
    (["split=layers", "split.first_stage_less=1", "split.last_stage_less=1", "stages=2"], ["transformer.h.2"]),
    (["split=params", "stages=2"], None),
    (["split=flops", "stages=2"], None),
])
def test_strategies_from_the_config_report_balance(tmp_path, split, expect_points):
    cfg = compose_cfg("model=gpt2", "launcher=inline", "steps=0", *split)
    assert run(cfg, str(tmp_path)) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    if expect_points:
        assert data["split_points"] == expect_points
    assert set(data["balance"]) == {"params", "flops"} and data["balance"]["flops"] >= 1.0
    for row in data["stage_info"]:
        assert row["num_params"] > 0 and row["flops"] > 0

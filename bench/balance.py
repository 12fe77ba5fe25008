"""Balance of each split strategy, beside PiPPy-style equal-size splitting and torchtitan-style
weighting, at GPT2 124M and LLaMA 7B shapes traced on meta (no weights allocated).

The balance figure is max/mean of the stages' cost: 1.0 is perfect, and the pipeline runs at
the pace of the max. Each strategy is scored under both costs (parameters and forward+backward
FLOPs); ``flops`` must be at least as good as every other strategy on FLOPs. ppsplit's
``params`` and ``flops`` may cut before the final norm, so the head can be a stage of its own
(the sizes then count the head as one more unit); "flops, block starts only" shows what that
adds, and every other row cuts at block starts.
"""

from __future__ import annotations

import time

import torch

from bench import harness
from ppsplit.models import build
from ppsplit.stages import plan
from ppsplit.stages.points import find_blocks, module_run_order, unit_starts
from ppsplit.stages.trace import export

SHAPES = {
    "gpt2-124M": ("GPT2LMHeadModel", dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, bos_token_id=0, eos_token_id=0,
                                          n_positions=1024, use_cache=False), 1024),
    "llama-7B": ("LlamaForCausalLM", dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008,
                                          num_attention_heads=32, num_key_value_heads=32,
                                          vocab_size=32000, max_position_embeddings=4096,
                                          use_cache=False), 4096),
}
QUICK = {
    "gpt2-tiny": ("GPT2LMHeadModel", dict(n_layer=8, n_embd=64, n_head=4, vocab_size=8000, bos_token_id=0, eos_token_id=0,
                                          n_positions=128, use_cache=False), 64),
}
CALL_KWARGS = {"return_dict": False, "use_cache": False}


def equal_size_sizes(params: list[float], stages: int) -> list[int]:
    """PiPPy's ``split_into_equal_size`` idea: walk the units in order and cut once the running
    parameter count reaches total/stages (greedy, by size)."""
    target = sum(params) / stages
    sizes, current, acc = [], 0, 0.0
    for i, p in enumerate(params):
        current += 1
        acc += p
        remaining_units = len(params) - i - 1
        remaining_stages = stages - len(sizes) - 1
        if remaining_stages and (acc >= target or remaining_units == remaining_stages):
            sizes.append(current)
            current, acc = 0, 0.0
    sizes.append(current)
    while len(sizes) < stages:  # pad (cannot happen with at least as many units as stages)
        sizes.append(0)
    return sizes


def stage_sums(costs: list[float], sizes: list[int]) -> list[float]:
    out, start = [], 0
    for s in sizes:
        out.append(sum(costs[start:start + s]))
        start += s
    return out


def strategies(by_block: dict[str, list[float]], with_head: dict[str, list[float]],
               stages: int) -> dict[str, tuple[dict[str, list[float]], list[int]]]:
    """Each strategy's units and its stage sizes in them. ppsplit's balanced strategies may also
    cut before the final norm (``with_head``: one more unit); the others cut at block starts."""
    n = len(by_block["params"])
    return {
        "ppsplit even": (by_block, _even(n, stages)),
        "ppsplit params": (with_head, plan.linear_partition(with_head["params"], stages)),
        "ppsplit flops": (with_head, plan.linear_partition(with_head["flops"], stages)),
        "ppsplit flops, block starts only": (by_block, plan.linear_partition(by_block["flops"], stages)),
        "PiPPy equal-size": (by_block, equal_size_sizes(by_block["params"], stages)),
        # torchtitan counts the embedding and the norm+head as one layer each
        "torchtitan weighting": (by_block, plan.layer_sizes(n, stages, None, first_stage_less=1,
                                                            last_stage_less=1)),
    }


def _even(n: int, stages: int) -> list[int]:
    base, extra = divmod(n, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def unit_costs_on_meta(class_name: str, config: dict, seq_len: int) -> tuple[dict, dict]:
    """Unit costs with a unit per block, and with the head after the last block a unit too."""
    model = build.build_on_meta(class_name, config)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    program = export(model, (ids,), CALL_KWARGS)
    order = module_run_order(program)
    blocks = find_blocks(model, order)
    return (plan.unit_costs(model, program, blocks, order),
            plan.unit_costs(model, program, unit_starts(program, order, blocks), order))


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    shapes = QUICK if quick else SHAPES
    stage_counts = (4,) if quick else (4, 8)
    rows, results = [], []
    with harness.torch_threads():
        for shape, (cls, config, seq) in shapes.items():
            start = time.perf_counter()
            by_block, with_head = unit_costs_on_meta(cls, config, seq)
            trace_s = time.perf_counter() - start
            for stages in stage_counts:
                balances = {}
                for name, (units, sizes) in strategies(by_block, with_head, stages).items():
                    b = {kind: plan.balance(stage_sums(units[kind], sizes)) for kind in ("params", "flops")}
                    balances[name] = {"sizes": sizes, **b}
                    rows.append([shape, stages, name, " ".join(map(str, sizes)),
                                 f"{b['params']:.3f}", f"{b['flops']:.3f}"])
                best_other = min(v["flops"] for k, v in balances.items() if k != "ppsplit flops")
                results.append({
                    "shape": shape, "stages": stages, "seq_len": seq, "trace_s": trace_s,
                    "strategies": balances,
                    "flops_strategy_best_on_flops": balances["ppsplit flops"]["flops"] <= best_other + 1e-12,
                    "flops_gain_vs_best_other": best_other / balances["ppsplit flops"]["flops"],
                })
        print(harness.table(["shape", "stages", "strategy", "units per stage", "balance params",
                             "balance flops"], rows))
        for r in results:
            print(f"{r['shape']} x{r['stages']}: flops strategy best on FLOPs: "
                  f"{r['flops_strategy_best_on_flops']} (best other is {r['flops_gain_vs_best_other']:.3f}x "
                  "its max/mean)")
        data = {"quick": quick, "results": results}
        harness.write_json("balance", data, out_dir)
    return data


if __name__ == "__main__":
    main()

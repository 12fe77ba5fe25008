"""Parameter memory of the stages over the original model's, for ppsplit and torch's pipeline().

Per stage, each distinct parameter tensor counts once (distinct by storage, so two Parameter
objects that share memory count once, and a name tied to another in the same stage costs
nothing); the stages' totals are summed and divided by the original model's parameter bytes
(its tied ``wte``/``lm_head`` counted once). GPT2 ties ``lm_head.weight`` to
``transformer.wte.weight``, which sits in the first stage while the head sits in the last, so
any 2-stage split holds that matrix twice; the question is whether anything more is held.

Not a timing: one run gives the figure exactly.
"""

from __future__ import annotations

import copy

import torch

from bench import harness, models

NAME = "tied_memory"
EXPECTED_PIPELINE = 1.62  # from the issue
TARGET_PPSPLIT = 1.31


def param_bytes(module: torch.nn.Module) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for _, p in module.named_parameters(remove_duplicate=False):
        key = (p.untyped_storage().data_ptr(), p.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += p.numel() * p.element_size()
    return total


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    import ppsplit
    from torch.distributed.pipelining import SplitPoint, pipeline

    with harness.torch_threads(harness.DEFAULT_THREADS) as threads:
        shape = dict(models.GPT2_TINY if quick else models.GPT2_124M)
        seq = 32 if quick else 128
        model = models.gpt2(**shape)
        ids = models.token_ids(model, 1, seq)
        original = param_bytes(model)

        split = ppsplit.split(model, (ids,), dict(models.CALL_KWARGS), stages=2)
        point = split.points[0]
        ours = [param_bytes(s) for s in split.stages]
        # pipeline() patches the model it traces; give it a copy.
        pipe = pipeline(copy.deepcopy(model), mb_args=(ids,), mb_kwargs=dict(models.CALL_KWARGS),
                        split_spec={point: SplitPoint.BEGINNING})
        pipe_stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
        theirs = [param_bytes(s) for s in pipe_stages]

        def holders(stages, name):
            return [i for i, s in enumerate(stages)
                    if name in dict(s.named_parameters(remove_duplicate=False))]

        sides = {
            name: {"stage_bytes": sizes, "total_bytes": sum(sizes),
                   "ratio": sum(sizes) / original,
                   # Where the tied matrix's two names live shows what the excess is.
                   "lm_head_in_stages": holders(stages, "lm_head.weight"),
                   "wte_in_stages": holders(stages, "transformer.wte.weight")}
            for name, stages, sizes in (("ppsplit", split.stages, ours),
                                        ("pipeline", pipe_stages, theirs))
        }

        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        print(f"\n== {NAME}: parameter bytes of 2 stages over the original's, gpt2 "
              f"{shape['n_layer']}L x {shape['n_embd']}, vocab {shape['vocab_size']}, split at "
              f"{point}, torch threads={threads} ==")
        headers = ["splitter", "stage 0", "stage 1", "total", "original", "total/original",
                   "lm_head.weight in", "wte.weight in"]
        rows = [[name, mib(s["stage_bytes"][0]), mib(s["stage_bytes"][1]), mib(s["total_bytes"]),
                 mib(original), f"{s['ratio']:.3f}x", s["lm_head_in_stages"], s["wte_in_stages"]]
                for name, s in sides.items()]
        print(harness.table(headers, rows))
        print(f"expected: pipeline() ~{EXPECTED_PIPELINE}x, ppsplit target ~{TARGET_PPSPLIT}x "
              "(at the 124M shape)")

        data = {
            "quick": quick,
            "threads": threads,
            "model": shape,
            "split_points": [point],
            "original_bytes": original,
            "ppsplit": sides["ppsplit"],
            "pipeline": sides["pipeline"],
            "ratio": sides["ppsplit"]["ratio"],
            "pipeline_over_ppsplit": sides["pipeline"]["total_bytes"] / sides["ppsplit"]["total_bytes"],
            "expected_pipeline_ratio": EXPECTED_PIPELINE,
            "target_ppsplit_ratio": TARGET_PPSPLIT,
        }
        harness.write_json(NAME, data, out_dir)
        return data


if __name__ == "__main__":
    main()

"""What one CUDA device can check (``python -m bench --only gpu_check``).

A multi-rank pipeline needs a GPU per rank (NCCL refuses two ranks on one GPU), so on a machine
with one GPU this runs what one device can:

- the stages chained in one process on the GPU against the unsplit model there, in float32 and
  under bf16 autocast (ppsplit's own check, ``verify_numerics``, at the precision's tolerance);
- stage 0's forward against the same layers run eagerly (``bench.stage_overhead``'s sides, on
  the GPU, synchronised);
- a split traced on meta, one stage given storage on the GPU block by block as a rank does
  (``materialize_stages``), against the same model built with real weights;
- ``torch.cuda.max_memory_allocated`` over all of it.

Without a CUDA device it says so and writes ``{"skipped": true}``: the check is for machines that
have one.
"""

from __future__ import annotations

import time

import torch

from bench import harness

NAME = "gpu_check"
GPT2 = dict(n_layer=4, n_embd=128, n_head=4, vocab_size=2000, n_positions=256)
CALL = {"use_cache": False, "return_dict": False}  # as conf/model/gpt2.yaml calls it


def _model(device, meta: bool = False):
    from ppsplit.models import build

    if meta:
        return build.build_on_meta("GPT2LMHeadModel", dict(GPT2))
    return build.build_model("GPT2LMHeadModel", dict(GPT2), seed=0).to(device)


def numerics(device, precision: str) -> dict:
    import ppsplit
    from ppsplit.data.batch import make_batch
    from ppsplit.train.objective import Objective
    from ppsplit.config.train_spec import BF16_TOLERANCE
    from ppsplit.train.loop import precision_context

    model = _model(device)
    batch = make_batch("causal_lm", model, 8, 64, 0, call_kwargs=CALL).to(device)
    microbatches = batch.microbatches(4)
    split = ppsplit.split(model, microbatches[0].args, microbatches[0].kwargs, stages=2)  # traced per microbatch
    with precision_context(precision, device.type):
        result = ppsplit.verify_numerics(model, split, microbatches, Objective("causal_lm"))
    rtol = BF16_TOLERANCE if precision == "bf16" else 1e-5  # the precision's default tolerance
    return {"ok": result.ok(rtol), "forward_max_abs_diff": result.forward_max_abs_diff,
            "grad_max_abs_diff": result.grad_max_abs_diff, "rtol": rtol}


def stage_overhead(device, repeats: int) -> dict:
    import ppsplit
    from bench.stage_overhead import eager_stage0
    from ppsplit.data.batch import make_batch

    model = _model(device).eval()
    ids = make_batch("causal_lm", model, 4, 128, 0).args[0].to(device)
    split = ppsplit.split(model, (ids,), dict(CALL), stages=2)
    stage = split.stages[0]

    def timed(run) -> float:
        for _ in range(3):  # the first calls set up the stage's cached constants
            run()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / repeats

    with torch.no_grad():
        staged = timed(lambda: stage(ids))
        eager = timed(lambda: eager_stage0(model, ids, GPT2["n_layer"] // 2))
    return {"stage_s": staged, "eager_s": eager, "ratio": staged / eager}


def materialised(device) -> dict:
    from ppsplit.models import build
    from ppsplit.data.batch import make_batch
    from ppsplit.parallel.materialize import materialize_stages, trace_device
    from ppsplit.stages.trace import split as split_model

    model = _model(device, meta=True)
    example = make_batch("causal_lm", model, 2, 32, 0, call_kwargs=CALL).to(trace_device(device))
    split = split_model(model, example.args, example.kwargs, stages=2)
    stage = materialize_stages(model, split, [1], 0, None, device)[1]
    real = build.build_model("GPT2LMHeadModel", dict(GPT2), seed=0).state_dict()
    equal = all(torch.equal(v.cpu(), real[k]) for k, v in stage.state_dict().items())
    return {"ok": equal, "keys": len(stage.state_dict()),
            "on_device": all(t.device.type == "cuda" for t in stage.state_dict().values())}


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: skipped")
        data = {"quick": quick, "skipped": True}
        harness.write_json(NAME, data, out_dir)
        return data
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(device)
    data: dict = {"quick": quick, "skipped": False, "device": torch.cuda.get_device_name(device)}
    checks = {"numerics_fp32": lambda: numerics(device, "fp32"), "numerics_bf16": lambda: numerics(device, "bf16"),
              "stage_overhead": lambda: stage_overhead(device, 10 if quick else 100),
              "materialised": lambda: materialised(device)}
    for name, check in checks.items():
        try:
            data[name] = check()
        except Exception as err:  # one check that breaks is reported; the others still run
            data[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    data["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    print(harness.table(["check", "result"], [[k, v] for k, v in data.items() if k not in ("quick", "skipped")]))
    harness.write_json(NAME, data, out_dir)
    return data

"""A stage's forward against the same work done eagerly by the original model's modules.

Stage 0 of a GPT2 split in two at its middle block takes ``input_ids`` and returns the causal
mask and the hidden state after the first half of ``transformer.h``. The eager side repeats
``GPT2Model.forward`` up to that point on the original modules: ``wte(ids) + wpe(positions)``,
``create_causal_mask`` exactly as transformers calls it, ``drop``, then the first half of the
blocks with the same arguments GPT2Model passes them. So both sides start from the same token
ids and end at the same hidden state (checked equal before timing). One difference is inherent
and part of what is measured: eagerly, transformers with SDPA attention returns no mask and lets
SDPA apply causality itself, while the traced stage materializes the boolean mask (it must hand
it to stage 1) and passes it to SDPA.

The sides, all under ``torch.no_grad()`` in eval mode:
- ``generated``: the stage as ppsplit builds it (unflattened modules running generated code, the
  mask region, which reads no input, computed once: ``stage_code.fold_constants``);
- ``unfolded`` (diagnostic): the same without that folding, so the mask is built on every call;
- ``interpreter``: the unfolded stage switched back to ``torch.fx.Interpreter``
  (``_run_with_interpreter=True``), torch's default;
- ``eager``: the original modules as above;
- ``eager_mask`` (diagnostic): the same, but the blocks get the stage's materialized boolean
  mask, made once outside the timing, instead of none. Its distance to ``eager`` is the cost of
  attention with an explicit mask; ``unfolded`` minus ``eager_mask`` is the cost of building the
  mask on every call plus any cost of the stage's code itself, and ``generated`` minus
  ``eager_mask`` what remains of the latter once the mask is built once.
"""

from __future__ import annotations

import math
import time
from unittest import mock

import torch

from bench import harness, models

NAME = "stage_overhead"

# (label, model shape, microbatch (batch, seq), target generated/eager)
SIZES = [
    ("8L x 256", dict(n_layer=8, n_embd=256, n_head=8, vocab_size=8000, n_positions=1024), (2, 128), 1.02),
    ("4L x 64", dict(models.GPT2_TINY), (4, 16), 1.2),
]


def eager_stage0(model, ids: torch.Tensor, n_blocks: int, mask=None) -> torch.Tensor:
    """What stage 0 computes, run the way ``GPT2Model.forward`` runs it (no cache). With
    ``mask`` given, that ready-made mask replaces transformers' own (see ``eager_mask``)."""
    from transformers.masking_utils import create_causal_mask

    tr = model.transformer
    embeds = tr.wte(ids)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    hidden = embeds + tr.wpe(positions)
    if mask is None:
        mask = create_causal_mask(config=tr.config, inputs_embeds=embeds, attention_mask=None,
                                  cache=None, position_ids=positions)
    hidden = tr.drop(hidden)
    for block in tr.h[:n_blocks]:
        hidden = block(hidden, None, mask, None, encoder_attention_mask=None, use_cache=False,
                       position_ids=positions)
    return hidden


def _interpreted(module: torch.nn.Module) -> torch.nn.Module:
    for sub in module.modules():
        if hasattr(sub, "_run_with_interpreter"):
            sub._run_with_interpreter = True
    return module


def _measure(label, shape, microbatch, target, repeats: int, sample_s: float) -> dict:
    import ppsplit

    model = models.gpt2(**shape)
    ids = models.token_ids(model, *microbatch)
    n_blocks = (shape["n_layer"] + 1) // 2
    kwargs = dict(models.CALL_KWARGS)
    split = ppsplit.split(model, (ids,), kwargs, stages=2)
    assert split.points == [f"transformer.h.{n_blocks}"], split.points
    with mock.patch("ppsplit.stages.code.fold_constants", lambda module: 0):
        unfolded = ppsplit.split(model, (ids,), kwargs, stages=2).stages[0]
        interp_stage = _interpreted(ppsplit.split(model, (ids,), kwargs, stages=2).stages[0])
    stage = split.stages[0]

    with torch.no_grad():
        hidden = eager_stage0(model, ids, n_blocks)
        outs = {"generated": stage(ids), "unfolded": unfolded(ids), "interpreter": interp_stage(ids)}
        # The stage returns the mask and the hidden state; find the hidden state by its shape.
        hidden_pos, = [i for i, t in enumerate(outs["generated"])
                       if t.is_floating_point() and t.shape == hidden.shape]
        stage_mask, = [t for t in outs["generated"] if t.dtype == torch.bool]
        masked = eager_stage0(model, ids, n_blocks, mask=stage_mask)
        assert torch.equal(masked, hidden)
        diffs = {k: (v[hidden_pos] - hidden).abs().max().item() for k, v in outs.items()}
        assert all(d == 0.0 for d in diffs.values()), diffs

        # Same number of calls per sample on every side, sized from the eager call's time.
        eager_call = lambda _: eager_stage0(model, ids, n_blocks)  # noqa: E731
        for _ in range(3):
            eager_call(None)
        start = time.perf_counter()
        eager_call(None)
        inner = max(1, math.ceil(sample_s / max(time.perf_counter() - start, 1e-6)))
        cases = {
            # The two sides of the target next to each other in every round.
            "generated": harness.Case(lambda _: stage(ids), inner=inner),
            "eager": harness.Case(eager_call, inner=inner),
            "unfolded": harness.Case(lambda _: unfolded(ids), inner=inner),
            "interpreter": harness.Case(lambda _: interp_stage(ids), inner=inner),
            "eager_mask": harness.Case(lambda _: eager_stage0(model, ids, n_blocks, stage_mask),
                                       inner=inner),
        }
        samples = harness.interleaved(cases, repeats=repeats, warmup=1)
    sides = {k: harness.summary(v) for k, v in samples.items()}
    gen = harness.ratio(samples["generated"], samples["eager"])
    interp = harness.ratio(samples["interpreter"], samples["eager"])
    unfolded_r = harness.ratio(samples["unfolded"], samples["eager"])
    masked_r = harness.ratio(samples["eager_mask"], samples["eager"])
    return {
        "label": label,
        "model": dict(shape),
        "microbatch": list(microbatch),
        "stage_blocks": n_blocks,
        "stage_outputs": split.stage_outputs[0],
        "calls_per_sample": inner,
        "max_abs_diff_vs_eager": diffs,
        **sides,
        "generated_over_eager": gen["ratio"],
        "generated_over_eager_pairs": [gen["pair_min"], gen["pair_max"]],
        "unfolded_over_eager": unfolded_r["ratio"],
        "interpreter_over_eager": interp["ratio"],
        "interpreter_over_eager_pairs": [interp["pair_min"], interp["pair_max"]],
        "eager_mask_over_eager": masked_r["ratio"],
        "target_max_ratio": target,
        "meets_target": gen["ratio"] <= target,
    }


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    with harness.torch_threads(harness.DEFAULT_THREADS) as threads:
        note = harness.load_note()
        if note:
            print(note)
        sizes = SIZES[1:] if quick else SIZES
        repeats, sample_s = (5, 0.02) if quick else (20, 0.2)
        rows, warnings = [], []
        for label, shape, mb, target in sizes:
            row = _measure(label, shape, mb, target, repeats, sample_s)
            warnings += harness.noise_warnings(
                f"{NAME} {label}",
                {k: row[k] for k in ("generated", "unfolded", "interpreter", "eager", "eager_mask")})
            rows.append(row)

        print(f"\n== {NAME}: GPT2 stage 0 forward (embeddings + first half of the blocks), "
              f"no_grad, torch threads={threads} ==")
        headers = ["model", "microbatch", "generated [min, max]", "unfolded [min, max]",
                   "interpreter [min, max]", "eager [min, max]", "eager_mask [min, max]",
                   "gen/eager", "unfolded/eager", "interp/eager", "eager_mask/eager", "target"]
        table = [[r["label"], "x".join(map(str, r["microbatch"])), harness.fmt_stats(r["generated"]),
                  harness.fmt_stats(r["unfolded"]), harness.fmt_stats(r["interpreter"]),
                  harness.fmt_stats(r["eager"]), harness.fmt_stats(r["eager_mask"]),
                  f"{r['generated_over_eager']:.3f}x", f"{r['unfolded_over_eager']:.3f}x",
                  f"{r['interpreter_over_eager']:.3f}x",
                  f"{r['eager_mask_over_eager']:.3f}x",
                  f"<= {r['target_max_ratio']}x {'met' if r['meets_target'] else 'NOT met'}"]
                 for r in rows]
        print(harness.table(headers, table))
        print("times are per call; stage output equals the eager hidden state exactly "
              f"(max abs diff {max(max(r['max_abs_diff_vs_eager'].values()) for r in rows):g})")
        for w in warnings:
            print(w)

        data = {
            "quick": quick,
            "threads": threads,
            "compared": "ppsplit stage 0 (generated code with constants folded / without / fx "
                        "interpreter) vs GPT2Model.forward's "
                        "own steps up to the split block on the original modules",
            "ratio": rows[0]["generated_over_eager"],
            "sizes": rows,
            "warnings": warnings,
            "load_note": note,
        }
        harness.write_json(NAME, data, out_dir)
        return data


if __name__ == "__main__":
    main()

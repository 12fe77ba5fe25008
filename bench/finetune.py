"""What fine-tuning costs, side by side in one run: real ppsplit jobs (2 local ranks, one torch
thread each, ``verify=off``, adamw) on chat records made here (``ppsplit.data.toy_corpus``).

1. LoRA against full fine-tuning at pp2: tokens/s (median step after the first) and each rank's
   optimizer bytes (adamw's two moments: for the adapters alone, or for every weight).
2. Packing against one padded example a row (both under LoRA): tokens/s, and scored tokens/s
   (the answer tokens a step trains on, counted from the rows the step draws): packing fills a
   row with several examples, so a step scores more of them.

Jobs interleaved round by round, so drift on the machine falls on every side alike.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import tempfile


from bench import harness

NAME = "finetune"
FULL = dict(model=["model=llama", "model.config.hidden_size=128", "model.config.intermediate_size=352",
                   "model.config.num_hidden_layers=8", "model.config.num_attention_heads=4",
                   "model.config.num_key_value_heads=2", "model.config.max_position_embeddings=512"],
            batch_size=8, seq_len=512, microbatches=4, steps=8, rounds=3, chat=600, vocab=1000)
QUICK = dict(model=["model=llama", "model.config.max_position_embeddings=256"], batch_size=8, seq_len=256,
             microbatches=4, steps=3, rounds=1, chat=200, vocab=400)
SIDES = {"lora": ["peft=lora", "peft.target_modules=[q_proj,v_proj]"], "full": [],
         "padded": ["peft=lora", "peft.target_modules=[q_proj,v_proj]", "data.packing=false"]}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from ppsplit.app.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def run_job(spec: dict, data: list[str], side: list[str]) -> dict:
    """One job's report."""
    import ppsplit.app.cli

    overrides = [*spec["model"], *data, *side, f"batch_size={spec['batch_size']}", f"seq_len={spec['seq_len']}",
                 f"microbatches={spec['microbatches']}", f"steps={spec['steps']}", "optimizer=adamw",
                 "verify=off", "eval.batches=0", "metrics.csv=false", "metrics.plot=false"]
    out = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-") as tmp:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = ppsplit.app.cli.run(compose(overrides), tmp)
        if code != 0:
            raise RuntimeError(out.getvalue()[-2000:])
        with open(os.path.join(tmp, "report.json")) as f:
            return json.load(f)


def scored_per_row(cache: str) -> float:
    """The mean count of scored tokens in a training row of a token store."""
    from ppsplit.data.store import open_store

    return float((open_store(cache)[0]["train_labels"] != -100).sum(1).mean())


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    with harness.torch_threads(1):  # as the ranks run
        return _main(quick, out_dir)


def _main(quick: bool, out_dir: str | None) -> dict:
    from ppsplit.data.toy_corpus import make

    spec = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="ppsplit-bench-chat-") as folder:
        _, tokenizer = make(folder, kb=40, vocab=spec["vocab"], chat=spec["chat"])
        data = ["data=sft", f"data.path={os.path.join(folder, 'chat.jsonl')}", f"data.tokenizer={tokenizer}",
                f"data.cache_dir={os.path.join(folder, 'cache')}", "data.truncate=true", "data.val_fraction=0.2",
                f"model.config.vocab_size={spec['vocab']}"]
        times = {k: [] for k in SIDES}
        reports = {}
        for r in range(spec["rounds"]):
            for side in (list(SIDES) if r % 2 == 0 else list(reversed(SIDES))):
                reports[side] = run_job(spec, data, SIDES[side])
                times[side] += reports[side]["run"]["step_times_s"][1:]
        scored = {side: scored_per_row(reports[side]["data"]["cache"]) for side in SIDES}
    return _report(spec, quick, times, reports, scored, out_dir)


def _report(spec, quick, times, reports, scored, out_dir) -> dict:
    tokens = spec["batch_size"] * spec["seq_len"]
    sides = {k: harness.summary(v) for k, v in times.items()}
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    scored_tps = {k: scored[k] * spec["batch_size"] / statistics.median(times[k]) for k in times}
    optim = {k: [r["optimizer_bytes"] for r in reports[k]["run"]["rank_layout"]] for k in times}
    data = {
        "quick": quick, "threads": 1, "model": spec["model"], "batch": [spec["batch_size"], spec["seq_len"]],
        "step_time_s": sides, "tokens_per_s": tps, "scored_tokens_per_s": scored_tps,
        "scored_tokens_per_row": scored, "optimizer_bytes_per_rank": optim,
        "trained_params": {k: (reports[k].get("peft") or {}).get("trained_params") for k in times},
        "ratio": tps["lora"] / tps["full"],  # the headline: LoRA's throughput over full fine-tuning's
        "lora_over_full_tokens_per_s": tps["lora"] / tps["full"],
        "lora_over_full_optimizer_bytes": sum(optim["lora"]) / max(1, sum(optim["full"])),
        "packing_over_padding_tokens_per_s": tps["lora"] / tps["padded"],
        "packing_over_padding_scored_tokens_per_s": scored_tps["lora"] / scored_tps["padded"],
        "warnings": harness.noise_warnings(NAME, sides),
    }
    print(harness.table(["side", "step (median [min, max])", "tokens/s", "scored tokens/s", "optimizer bytes/rank"],
                        [[k, harness.fmt_stats(sides[k]), f"{tps[k]:,.0f}", f"{scored_tps[k]:,.0f}",
                          ", ".join(f"{b:,}" for b in optim[k])] for k in times]))
    print(f"LoRA / full: {data['lora_over_full_tokens_per_s']:.2f}x tokens/s, "
          f"{data['lora_over_full_optimizer_bytes']:.4f}x optimizer bytes; packing / padding: "
          f"{data['packing_over_padding_tokens_per_s']:.2f}x tokens/s, "
          f"{data['packing_over_padding_scored_tokens_per_s']:.2f}x scored tokens/s")
    harness.write_json(NAME, data, out_dir)
    return data


if __name__ == "__main__":
    main()

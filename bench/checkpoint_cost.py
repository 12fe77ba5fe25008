"""What a periodic checkpoint costs, side by side in one run.

One process, one torch thread, the unsplit model with AdamW (its state: parameters plus two
moments). Interleaved samples of:

- ``step``: one training step (forward, backward, optimizer), the thing a checkpoint interrupts;
- ``save``: :func:`ppsplit.checkpoint.dcp.save` of the model and optimizer state (what each rank
  runs for its stages), into a fresh folder;
- ``seal``: the driver's part, :func:`ppsplit.checkpoint.folder.seal` (the manifest's SHA-256
  of every file), then the rename into place;
- ``async_blocking``: the part of ``torch.distributed.checkpoint.async_save`` the training loop
  would wait for (staging the state), its write then awaited outside the sample.

Figures: seconds per MB of state for save and seal, and the share of a step that a checkpoint
every N steps costs, ``(save + seal) / (N * step)``, at N = 10, 100 and 1000. ``ratio``: the
checkpoint's cost over one step's.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile

from bench import harness

NAME = "checkpoint_cost"
FULL = dict(model=["model=gpt2", "model.config.n_layer=8", "model.config.n_embd=256", "model.config.n_head=8",
                   "model.config.vocab_size=8000", "model.config.n_positions=256"],
            batch_size=16, seq_len=128, repeats=5)
QUICK = dict(model=["model=gpt2"], batch_size=4, seq_len=32, repeats=2)
EVERY = (10, 100, 1000)


def _setup(spec: dict):
    import torch

    from bench.training import compose
    from ppsplit.models import build
    from ppsplit.train.objective import Objective
    from ppsplit.data.corpus import BatchSource
    from ppsplit.config.spec import from_config

    job = from_config(compose([*spec["model"], f"batch_size={spec['batch_size']}", f"seq_len={spec['seq_len']}",
                               "optimizer=adamw"]))
    m = job.model
    model = build.build_model(m.class_name, m.config, None, job.seed, job.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = BatchSource(job, model.config).batch(0)
    loss_fn = Objective(m.loss)

    def step(_):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(*batch.args, **batch.kwargs), batch.labels).backward()
        optimizer.step()

    step(None)  # the optimizer's state exists from here on
    return model, optimizer, step


def _main(quick: bool, out_dir: str | None) -> dict:
    import torch.distributed.checkpoint as dcp

    from ppsplit.checkpoint import dcp as ckpt
    from ppsplit.checkpoint.folder import seal

    spec = QUICK if quick else FULL
    model, optimizer, step = _setup(spec)
    root = tempfile.mkdtemp(prefix="ppsplit-bench-ckpt-")
    counter = iter(range(10 ** 6))

    def fresh(_=None) -> str:
        return os.path.join(root, f"c{next(counter)}")

    def save(folder):
        ckpt.save(folder, {0: model}, {0: optimizer})
        return folder

    def saved():
        return save(fresh())

    def do_seal(folder):
        seal(folder, {"model": "bench", "step": 1})
        os.rename(folder, folder + ".sealed")

    def async_blocking(folder):
        quiet = ckpt._quiet()
        try:
            return dcp.async_save(ckpt.state_of({0: model}, {0: optimizer}), checkpoint_id=folder)
        finally:
            quiet.__exit__(None, None, None)

    pending = []
    cases = {
        "step": harness.Case(step),
        "save": harness.Case(save, setup=fresh),
        "seal": harness.Case(do_seal, setup=saved),
        "async_blocking": harness.Case(lambda f: pending.append(async_blocking(f)), setup=fresh),
    }
    try:
        samples = harness.interleaved(cases, spec["repeats"])
        for future in pending:
            future.result()
        state_mb = sum(os.path.getsize(os.path.join(d, f)) for d in [save(fresh())] for f in os.listdir(d)) / 2 ** 20
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sides = {k: harness.summary(v) for k, v in samples.items()}
    med = {k: statistics.median(v) for k, v in samples.items()}
    checkpoint_s = med["save"] + med["seal"]
    data = {
        "quick": quick, "threads": 1, "model": spec["model"], "batch": [spec["batch_size"], spec["seq_len"]],
        "state_mb": state_mb, "seconds": sides,
        "save_s_per_mb": med["save"] / state_mb, "seal_s_per_mb": med["seal"] / state_mb,
        "async_blocking_over_save": med["async_blocking"] / med["save"],
        "share_of_steps": {str(n): checkpoint_s / (n * med["step"]) for n in EVERY},
        "ratio": checkpoint_s / med["step"],
        "warnings": harness.noise_warnings(NAME, sides),
    }
    print(harness.table(["side", "seconds (median [min, max])"], [[k, harness.fmt_stats(sides[k])] for k in cases]))
    print(f"state {state_mb:.1f} MB: save {data['save_s_per_mb'] * 1e3:.2f} ms/MB, seal "
          f"{data['seal_s_per_mb'] * 1e3:.2f} ms/MB; a checkpoint = {data['ratio']:.1f} steps; every N: "
          + ", ".join(f"N={n} {v * 100:.2f}%" for n, v in data["share_of_steps"].items())
          + f"; async_save blocks for {data['async_blocking_over_save']:.2f}x of a save")
    harness.write_json(NAME, data, out_dir)
    return data


def main(quick: bool = False, out_dir: str | None = None) -> dict:
    with harness.torch_threads(1):
        return _main(quick, out_dir)


if __name__ == "__main__":
    main()

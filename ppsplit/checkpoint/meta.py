"""What ``ppsplit.json`` records beside a checkpoint: where training stands (the step, the data
stream's next batch and sample), the model's config, and how the run was laid out."""

from __future__ import annotations

from ppsplit.checkpoint.series import data_identity
from ppsplit.config.spec import JobSpec


def _json_config(config) -> dict:
    """The model's transformers config, as ``ppsplit.json`` keeps it (what differs from its defaults)."""
    import json

    out = {}
    for key, value in config.to_diff_dict().items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out


def checkpoint_meta(spec: JobSpec, split, resume: dict | None, source, config=None, step: int | None = None) -> dict:
    """What ``ppsplit.json`` records beside a checkpoint: where training stands (the step, the
    data stream's next batch and sample) and how it was laid out. ``step``: a periodic one's
    (default: the run's last)."""
    if step is None:
        step = (resume["step"] if resume else 0) + spec.steps
    next_index = step * spec.train.grad_accumulation
    return {
        "model": spec.model.name,
        "model_class": spec.model.class_name,
        "model_config": _json_config(config) if config is not None else None,
        "step": step,
        "resumed_from": resume,
        "data": {**data_identity(spec),
                 "microbatches": spec.microbatches, "next_step": step, "next_batch": next_index,
                 "next_sample": source.sample_of(next_index)},
        "optimizer": spec.optimizer,
        "layout": {"stages": len(split), "split_points": split.points, "schedule": spec.schedule,
                   "dp": spec.parallel.dp, "tp": spec.parallel.tp},
        **({"peft": peft_record(spec)} if spec.peft.on else {}),  # the checkpoint holds these adapters alone
    }


def peft_record(spec: JobSpec) -> dict:
    """The adapters, and the base they go with (``model.pretrained``; None: built from ``seed``)."""
    p = spec.peft

    def listed(value):
        return list(value) if isinstance(value, tuple) else value

    return {"name": p.name, "r": p.r, "alpha": p.alpha, "target_modules": listed(p.target_modules),
            "modules_to_save": listed(p.modules_to_save), "base": spec.model.pretrained, "seed": spec.seed}

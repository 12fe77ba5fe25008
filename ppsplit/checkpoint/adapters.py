"""What an adapted run (``peft=lora``) exports with ``checkpoint.hf=true``: the adapter folder
``PeftModel.from_pretrained(base, folder)`` loads (``adapter_config.json`` and
``adapter_model.safetensors``, written from the adapters the ranks saved), and with
``peft.merge=true`` the model with the adapters folded in, a folder ``from_pretrained`` loads on
its own. The base model's own folder is only read."""

from __future__ import annotations

import glob
import os


def finish_adapter(folder: str, adapted) -> None:
    """The ranks' safetensors of the adapters made a peft adapter folder."""
    import copy

    from safetensors.torch import load_file, save_file

    parts = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    state = {}
    for part in parts:
        state.update(load_file(part))
        os.unlink(part)
    save_file(state, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(adapted.peft_config["default"])
    config.save_pretrained(folder)
    for leftover in ("sharded", "model.safetensors.index.json"):
        path = os.path.join(folder, leftover)
        if os.path.isdir(path):
            import shutil

            shutil.rmtree(path, ignore_errors=True)  # inside our own staging folder
        elif os.path.exists(path):
            os.unlink(path)


def write_merged(spec, adapter_folder: str, out: str) -> None:
    """The base model with the trained adapters folded in (peft's ``merge_and_unload``), saved
    as a model folder of its own."""
    import peft
    from transformers.utils import logging

    from ppsplit.models import build

    logging.disable_progress_bar()  # the run's own lines stay the only ones
    m = spec.model
    base = build.build_model(m.class_name, m.config, m.pretrained, spec.seed)
    merged = peft.PeftModel.from_pretrained(base, adapter_folder).merge_and_unload()
    merged.save_pretrained(out)

"""Checkpoints keyed by the original FQNs: what the ranks save and load.

Every rank saves its stages' parameters, buffers and (flattened) optimizer state with
``torch.distributed.checkpoint``; the keys are the unsplit model's (``lm_head.weight``,
``state.lm_head.weight.exp_avg``), so the checkpoint loads at any layout. The folder side (staging,
the manifest, what may be replaced) is :mod:`ppsplit.checkpoint.folder`.
"""

from __future__ import annotations

from ppsplit.checkpoint.folder import check_loadable, read_meta
from ppsplit.errors import PpsplitError


def check_resumable(folder: str, model, peft: dict | None = None) -> dict:
    """Where a run resumes, refusing a checkpoint of another model before any rank starts: its
    keys must be the model's, both ways, each of the same shape (from DCP's metadata); the
    config fields that differ are named when ``ppsplit.json`` recorded the config. Adapters
    (``peft``: this run's record of them) resume only with their own scale and over their own
    base: the same ``peft.alpha`` and ``model.pretrained`` (or ``seed``, for a base built from it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # an adapted model's class is its base's
    meta = check_loadable(folder, type(base).__name__)
    from ppsplit.checkpoint.reader import read_metadata

    stored = read_metadata(folder).state_dict_metadata
    saved = {k: tuple(v.size) for k, v in stored.items() if not k.startswith("optim.") and hasattr(v, "size")}
    kept = trained_keys(model) if adapted({0: model}) else None  # an adapted model's: its adapters
    mine = {k: tuple(t.shape) for k, t in model.state_dict().items() if kept is None or k in kept}
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    shapes = [k for k in mine if k in saved and saved[k] != mine[k]]
    if missing or extra or shapes:
        if shapes:
            first = f"{shapes[0]} is {list(saved[shapes[0]])} there, {list(mine[shapes[0]])} here"
        elif missing:
            first = f"it lacks {missing[0]} ({len(missing)} of the model's keys)"
        else:
            first = f"it has {extra[0]}, which the model lacks ({len(extra)} such keys)"
        changed = _config_changes(meta.get("model_config"), getattr(model, "config", None))
        raise PpsplitError(f"checkpoint.load={folder!r} holds another model: {first}"
                           + (f"; saved with {changed}" if changed else "")
                           + "; allowed: a checkpoint of the same model config")
    if peft and meta.get("peft"):
        _check_adapters_match(folder, meta["peft"], peft)
    return {"checkpoint": folder, "step": int(meta["step"]),
            "next_sample": (meta.get("data") or {}).get("next_sample")}


def _check_adapters_match(folder: str, saved: dict, now: dict) -> None:
    keys = [("alpha", "peft.alpha"), ("base", "model.pretrained")]
    if saved.get("base") is None and now.get("base") is None:
        keys.append(("seed", "seed"))  # the base is the one built from seed
    changed = [f"{name}={saved.get(key)!r} there, {now.get(key)!r} here" for key, name in keys
               if saved.get(key) != now.get(key)]
    if changed:
        raise PpsplitError(f"checkpoint.load={folder!r} holds adapters trained with {'; '.join(changed)}; allowed: "
                           "the adapters' own peft.alpha and base (model.pretrained, or seed for a base built from it)")


def _config_changes(saved: dict | None, config) -> str:
    """The config fields the checkpoint was saved with that differ from this model's."""
    if not saved or config is None:
        return ""
    now = config.to_dict()
    diffs = [f"{k}={v!r} (here {now.get(k)!r})" for k, v in sorted(saved.items())
             if k in now and now.get(k) != v and not k.startswith("_") and k not in ("architectures",
                                                                                    "transformers_version")]
    return ", ".join(diffs[:4])


def state_of(modules, optimizers) -> dict:
    """Model and flattened optimizer state of this rank's stages, keyed by the original FQNs. Of
    an adapted model (``peft``), the trained tensors alone: its base is the model's own."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state: dict = {}
    for i, module in modules.items():
        model_sd, optim_sd = get_state_dict(module, optimizers[i], options=options)
        kept = trained_keys(module) if adapted(modules) else model_sd
        state.update({k: v.detach() if hasattr(v, "detach") else v for k, v in model_sd.items() if k in kept})
        state.update({f"optim.{k}": v for k, v in optim_sd.items()})
    return state


def adapted(modules) -> bool:
    """Whether these stages hold adapters over a frozen base (``peft``)."""
    return any(".lora_A." in k for m in modules.values() for k, _ in m.named_parameters(remove_duplicate=False))


def trained_keys(module) -> set[str]:
    return {k for k, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}


def _quiet():
    """DCP warns that it runs in one process when no process group exists (inline, the driver)."""
    import warnings

    quiet = warnings.catch_warnings()
    quiet.__enter__()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    return quiet


def save(folder: str, modules: dict, optimizers: dict, hf: str | None = None, tie_groups=()) -> None:
    """Save this rank's stages (all ranks call this together); with ``hf``, also their
    parameters and buffers as a safetensors folder there (whole tensors, original FQNs)."""
    import torch.distributed.checkpoint as dcp

    quiet = _quiet()
    try:
        dcp.save(state_of(modules, optimizers), checkpoint_id=folder)
        if hf:
            save_hf(hf, modules, tie_groups)
    finally:
        quiet.__exit__(None, None, None)


def save_hf(folder: str, modules: dict, tie_groups=()) -> None:
    """The stages' tensors as safetensors (sharded ones consolidated into whole tensors), each
    tied tensor once under its first name, as ``save_pretrained`` writes it. An adapted model's
    adapters alone, under the names peft's ``save_pretrained`` gives them
    (:mod:`ppsplit.checkpoint.adapters` makes the folder peft's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from ppsplit.models.adapters import saved_key

    dropped = {k for group in tie_groups for k in group[1:]}
    trained = {k for m in modules.values() for k, p in m.named_parameters(remove_duplicate=False) if p.requires_grad}
    adapted = any(".lora_A." in k for k in trained)
    state = {}
    for module in modules.values():
        state.update({saved_key(k) if adapted else k: v.detach() for k, v in module.state_dict().items()
                      if k not in dropped and (k in trained or not adapted)})
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True,
                                                            enable_consolidation=True))


def _alias(key: str, saved: set, aliases: dict[str, list[str]]) -> str | None:
    """``key`` under another name of its tied tensor, if the checkpoint has that one (optimizer
    state is keyed by one name per tensor, which depends on the layout it was saved from)."""
    for prefix in ("optim.state.", "optim.param_groups.", ""):
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix):]
        for name, others in aliases.items():
            if rest == name or rest.startswith(name + "."):
                for other in others:
                    candidate = prefix + other + rest[len(name):]
                    if candidate in saved:
                        return candidate
    return None


def saved_keys(folder: str) -> set[str]:
    from ppsplit.checkpoint.reader import read_metadata

    return set(read_metadata(folder).state_dict_metadata)


def load(folder: str, modules: dict, optimizers: dict, tie_groups=()) -> int:
    """Load a ppsplit checkpoint saved at any layout into this rank's stages and optimizers
    (all ranks call this together; each reads only its keys). Returns the step to go on from."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from ppsplit.checkpoint.reader import SafePlanner, SafeReader

    saved = saved_keys(folder)
    aliases = {k: [o for o in group if o != k] for group in tie_groups for k in group}
    state = state_of(modules, optimizers)
    source_of, request = {}, {}
    for key, value in state.items():
        source = key if key in saved else _alias(key, saved, aliases)
        if source is None:
            raise RuntimeError(f"checkpoint {folder} has no {key}")
        source_of[key] = source
        request.setdefault(source, value)
    quiet = _quiet()
    try:
        dcp.load(request, storage_reader=SafeReader(folder), planner=SafePlanner())
    finally:
        quiet.__exit__(None, None, None)
    loaded = {}
    with torch.no_grad():
        for key, value in state.items():
            got = request[source_of[key]]
            if isinstance(value, torch.Tensor) and got is not value:  # a second name of one entry
                _local(value).copy_(_local(got))
                got = value
            loaded[key] = got
    # An adapted model's checkpoint holds its adapters: the base stays as the model built it.
    options = StateDictOptions(flatten_optimizer_state_dict=True, strict=not adapted(modules))
    for i, module in modules.items():
        model_keys = set(module.state_dict())
        params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        model_sd = {k: v for k, v in loaded.items() if k in model_keys}
        optim_sd = {k[len("optim."):]: v for k, v in loaded.items()
                    if k.startswith("optim.") and k.split(".", 2)[2].rsplit(".", 1)[0] in params}
        set_state_dict(module, optimizers[i], model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=options)
    return int(read_meta(folder)["step"])


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t

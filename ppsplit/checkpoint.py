"""Checkpoints keyed by the original FQNs, written so that nothing is ever half-written or lost.

Every rank saves its stages' parameters, buffers and (flattened) optimizer state with
``torch.distributed.checkpoint``; the keys are the unsplit model's (``lm_head.weight``,
``state.lm_head.weight.exp_avg``), so the checkpoint loads at any layout.

The ranks write into a staging folder beside ``checkpoint.dir``. Only when the whole run has
passed does the driver add ``ppsplit.json`` (the step reached, the data stream, the layout it was
saved from) and move the staging folder into place; an older ppsplit checkpoint there is
replaced only with ``checkpoint.overwrite=true``, and is removed only once the new one stands.
A folder holding anything but a ppsplit checkpoint is never replaced.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time

from ppsplit.errors import PpsplitError

MARKER = "ppsplit.json"
FORMAT = 1


def is_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER)) and os.path.isfile(os.path.join(folder, ".metadata"))


class Target:
    """Where a run's checkpoint goes: checked before any rank starts, staged, then committed."""

    def __init__(self, folder: str, overwrite: bool):
        self.folder = os.path.abspath(folder)
        self.overwrite = overwrite
        self.staging = None
        self._made_parents: list[str] = []
        self.check()

    def check(self) -> None:
        f = self.folder
        key = f"checkpoint.dir={f!r}"
        if os.path.lexists(f) and not os.path.isdir(f):
            raise PpsplitError(f"{key} is a file, not a folder; allowed: a new or empty folder")
        if os.path.isdir(f) and os.listdir(f):
            if not self.overwrite:
                raise PpsplitError(f"{key} is not empty; allowed: a new or empty folder, or "
                                   "checkpoint.overwrite=true to replace the ppsplit checkpoint in it")
            if not is_checkpoint(f):
                raise PpsplitError(f"{key} holds files that are not a ppsplit checkpoint; "
                                   "checkpoint.overwrite=true replaces only a ppsplit checkpoint; "
                                   "allowed: another folder")
        parent = os.path.dirname(f)
        existing = parent
        while not os.path.isdir(existing):
            if os.path.lexists(existing):
                raise PpsplitError(f"{key}: {existing!r} is a file, not a folder")
            existing = os.path.dirname(existing)
        try:  # a real write: permissions, a read-only file system, root squash...
            os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".ppsplit-write-check-"))
        except OSError as err:
            raise PpsplitError(f"{key} is not writable ({existing!r}: {os.strerror(err.errno) if err.errno else err}); "
                               "allowed: a folder this user can write") from None

    def stage(self, token: str) -> str:
        """The staging folder the ranks write into (beside the target, so the move is atomic)."""
        parent = os.path.dirname(self.folder)
        missing = []
        p = parent
        while not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        for p in reversed(missing):
            os.mkdir(p)
            self._made_parents.append(p)
        self.staging = os.path.join(parent, f".{os.path.basename(self.folder)}.partial-{token}")
        return self.staging

    def commit(self, meta: dict, config=None, architecture: str | None = None) -> str:
        """Move the finished checkpoint into place; returns its folder. With ``config``, its
        ``hf/`` folder gets the model's ``config.json`` (``architecture``: the model class)."""
        self.check()  # nothing appeared there meanwhile that we must not replace
        if config is not None and os.path.isdir(os.path.join(self.staging, "hf")):
            finish_hf(os.path.join(self.staging, "hf"), config, architecture)
        with open(os.path.join(self.staging, MARKER), "w") as f:
            json.dump({"format": FORMAT, "saved_at": time.time(), **meta}, f, indent=2)
        old = None
        if os.path.isdir(self.folder):
            if os.listdir(self.folder):
                old = f"{self.staging}.old"
                os.rename(self.folder, old)
            else:
                os.rmdir(self.folder)
        os.rename(self.staging, self.folder)
        self.staging = None
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return self.folder

    def discard(self) -> None:
        """After a failed run: remove what this run wrote, and only that."""
        if self.staging and os.path.isdir(self.staging):
            shutil.rmtree(self.staging, ignore_errors=True)
        self.staging = None
        for p in reversed(self._made_parents):
            try:
                os.rmdir(p)  # only if still empty
            except OSError:
                break
        self._made_parents = []


def check_loadable(folder: str, class_name: str) -> dict:
    """Refuse ``checkpoint.load`` unless it is a ppsplit checkpoint of this model class."""
    key = f"checkpoint.load={folder!r}"
    if not os.path.isdir(folder):
        raise PpsplitError(f"{key} is not a folder; allowed: a checkpoint folder written by checkpoint.save=true")
    if not is_checkpoint(folder):
        raise PpsplitError(f"{key} is not a ppsplit checkpoint (no {MARKER} and .metadata); "
                           "allowed: a folder written by checkpoint.save=true")
    try:
        meta = read_meta(folder)
    except (OSError, ValueError) as err:
        raise PpsplitError(f"{key}: its {MARKER} cannot be read: {err}") from None
    if meta.get("model_class") != class_name:
        raise PpsplitError(f"{key} holds a {meta.get('model_class')}, not a {class_name}; "
                           "allowed: a checkpoint of the same model class")
    return meta


def check_resumable(folder: str, model) -> dict:
    """Where a run resumes: the checkpoint has every key of the model (driver side, before any rank)."""
    meta = check_loadable(folder, type(model).__name__)
    missing = sorted(set(model.state_dict()) - saved_keys(folder))
    if missing:
        raise PpsplitError(f"checkpoint.load={folder!r} lacks {len(missing)} of the model's keys "
                           f"({', '.join(missing[:3])}...); allowed: a checkpoint of the same model config")
    return {"checkpoint": folder, "step": int(meta["step"])}


def read_meta(folder: str) -> dict:
    with open(os.path.join(folder, MARKER)) as f:
        return json.load(f)


def state_of(modules, optimizers) -> dict:
    """Model and flattened optimizer state of this rank's stages, keyed by the original FQNs."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state: dict = {}
    for i, module in modules.items():
        model_sd, optim_sd = get_state_dict(module, optimizers[i], options=options)
        state.update({k: v.detach() if hasattr(v, "detach") else v for k, v in model_sd.items()})
        state.update({f"optim.{k}": v for k, v in optim_sd.items()})
    return state


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
    tied tensor once under its first name, as ``save_pretrained`` writes it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dropped = {k for group in tie_groups for k in group[1:]}
    state = {}
    for module in modules.values():
        state.update({k: v.detach() for k, v in module.state_dict().items() if k not in dropped})
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True,
                                                            enable_consolidation=True))


def finish_hf(folder: str, config, architecture: str | None = None) -> None:
    """Make the safetensors the ranks wrote a ``save_pretrained`` folder: add ``config.json``
    (naming ``architecture``, the model class, as ``save_pretrained`` does), drop the per-rank
    shards the consolidation read."""
    if architecture and not getattr(config, "architectures", None):
        config = copy.deepcopy(config)
        config.architectures = [architecture]
    config.save_pretrained(folder)
    shutil.rmtree(os.path.join(folder, "sharded"), ignore_errors=True)


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
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)


def load(folder: str, modules: dict, optimizers: dict, tie_groups=()) -> int:
    """Load a ppsplit checkpoint saved at any layout into this rank's stages and optimizers
    (all ranks call this together; each reads only its keys). Returns the step to go on from."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

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
        dcp.load(request, checkpoint_id=folder)
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
    options = StateDictOptions(flatten_optimizer_state_dict=True)
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

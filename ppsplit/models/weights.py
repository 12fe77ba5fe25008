"""Reads of a local safetensors checkpoint (one file or sharded), one tensor or one slice at a
time, tied aliases resolved: a rank reads only the keys of its stages."""

from __future__ import annotations

import os

import torch

from ppsplit.errors import PpsplitError


def checkpoint_weight_map(folder: str) -> dict[str, str]:
    """Which file of a transformers safetensors checkpoint (one file, or sharded with
    ``model.safetensors.index.json``) holds each tensor name."""
    import json

    from safetensors import safe_open

    folder = os.path.expanduser(str(folder))
    index_file = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_file):
        with open(index_file) as f:
            return json.load(f)["weight_map"]
    single = os.path.join(folder, "model.safetensors")
    if not os.path.exists(single):
        raise PpsplitError(f"model.pretrained={folder!r} holds no safetensors weights "
                           "(model.safetensors or model.safetensors.index.json)")
    with safe_open(single, "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def read_checkpoint_parts(folder: str, requests, tie_groups=(), weight_map: dict | None = None,
                          rename=None) -> list[torch.Tensor | None]:
    """For each ``(fqn, index)`` of ``requests``, that tensor of the checkpoint, or only
    ``tensor[index]`` (a tuple of slices: a rank's shard) read alone from the file; None where the
    checkpoint does not hold it (the model's initialisation stands). A tied name missing from the
    file (``save_pretrained`` writes one name per tied tensor) is read under another name of its
    group. ``weight_map``: :func:`checkpoint_weight_map`'s, when the caller reads it once.
    ``rename``: a name's key in the checkpoint, where they differ (an adapted model's base)."""
    from safetensors import safe_open

    folder = os.path.expanduser(str(folder))
    weight_map = checkpoint_weight_map(folder) if weight_map is None else weight_map
    alias = {k: g for g in tie_groups for k in g}
    by_file: dict[str, list[tuple[int, str, tuple | None]]] = {}
    key = rename or (lambda name: name)
    for n, (fqn, index) in enumerate(requests):
        source = next((key(k) for k in (fqn, *alias.get(fqn, ())) if key(k) in weight_map), None)
        if source is not None:
            by_file.setdefault(weight_map[source], []).append((n, source, index))
    out: list[torch.Tensor | None] = [None] * len(requests)
    for file, wanted in by_file.items():
        with safe_open(os.path.join(folder, file), "pt") as f:
            for n, source, index in wanted:
                out[n] = f.get_tensor(source) if index is None else f.get_slice(source)[index]
    return out

"""Counts, per rank and per training step, the calls that cost a kernel launch or a host sync on
a GPU: torch.distributed's collectives by kind, the functional collectives DTensor uses, the
pipeline's point-to-point operations, and the reads of a tensor's value on the host (``item``,
``bool``, ``tolist``, ``float``, ``int``). A step is what a rank does between two
``RankChannel.report("step", k)`` calls: the step itself and whatever the loop adds around it."""

from __future__ import annotations

import collections
import functools
import json
import os

KINDS = {
    "all_reduce": "ours", "barrier": "ours", "broadcast": "ours", "all_gather": "ours",
    "all_gather_object": "ours", "reduce": "ours",
    "all_gather_into_tensor": "fsdp", "reduce_scatter_tensor": "fsdp", "all_gather_single": "fsdp",
    "reduce_scatter_single": "fsdp",
    "send": "p2p", "recv": "p2p", "batch_isend_irecv": "p2p",  # (isend/irecv: P2POp checks them by identity)
}
FUNCTIONAL = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single",
              "all_reduce_coalesced", "all_gather_into_tensor_coalesced")
SYNCS = ("item", "__bool__", "tolist", "__float__", "__int__")
counts: collections.Counter = collections.Counter()


def _counted(key: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)

    return call


def install(folder: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    for name, kind in KINDS.items():
        if hasattr(dist, name):
            setattr(dist, name, _counted(f"{kind}:{name}", getattr(dist, name)))
    for name in FUNCTIONAL:
        if hasattr(funcol, name):
            setattr(funcol, name, _counted(f"dtensor:{name}", getattr(funcol, name)))
    for name in SYNCS:
        setattr(torch.Tensor, name, _counted(f"sync:{name}", getattr(torch.Tensor, name)))

    from ppsplit.launch import control

    report = control.RankChannel.report
    state = {"at": None, "before": None}

    def counting_report(self, phase, step=None):
        if phase == "step":
            if state["at"] is not None:
                made = counts - state["before"]
                with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
                    f.write(json.dumps({"rank": self.rank, "step": state["at"], "counts": dict(made)}) + "\n")
            state["at"], state["before"] = step, collections.Counter(counts)
        return report(self, phase, step)

    control.RankChannel.report = counting_report

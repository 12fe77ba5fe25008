"""Keep tied weights tied when their copies sit in different stages and ranks.

A tie group is the set of original FQNs that name one tensor (GPT2's ``transformer.wte.weight``
and ``lm_head.weight``). Each stage that uses the tensor holds one copy; after every backward the
copies' gradients are summed over every stage that holds the group (all-reduce across the ranks
involved, a local sum for stages on one rank), so each copy's gradient is the unsplit model's
and the copies stay equal under any optimizer. This is what DeepSpeed's tied layers and
Megatron's shared embedding do, found here from the traced model instead of declared.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class TieSync:
    def __init__(self, groups, stage_keys, modules, rank_of_stage, rank):
        """``modules`` are this rank's stages by index; every rank builds the same groups in the
        same order (``dist.new_group`` is collective over the whole world)."""
        self.rank = rank
        self.entries = []
        for group in groups:
            holders = [s for s, keys in enumerate(stage_keys) if set(keys) & set(group)]
            ranks = sorted({rank_of_stage[s] for s in holders})
            process_group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank not in ranks:
                continue
            local = []
            for s in holders:
                if s not in modules:
                    continue
                for key in group:
                    if key in stage_keys[s]:
                        tensor = modules[s].get_parameter(key)
                        if all(tensor is not t for t in local):
                            local.append(tensor)
            self.entries.append({"keys": list(group), "ranks": ranks, "local": local,
                                 "group": process_group})
        self._start_equal()

    def comm_groups(self) -> list[dict]:
        """The tie groups this rank communicates for, with the ranks involved."""
        return [{"keys": e["keys"], "ranks": e["ranks"]} for e in self.entries if e["group"] is not None]

    @torch.no_grad()
    def _start_equal(self) -> None:
        # Whatever initialised the copies (seed, checkpoint, a later init path), start from the
        # lowest rank's values.
        for e in self.entries:
            first = e["local"][0]
            if e["group"] is not None:
                dist.broadcast(first.data, src=e["ranks"][0], group=e["group"])
            for other in e["local"][1:]:
                other.data.copy_(first.data)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Make every copy's gradient the sum over all copies: the unsplit model's gradient."""
        for e in self.entries:
            if len(e["local"]) == 1 and e["group"] is None:
                continue  # one tensor in one stage: nothing to synchronise
            grads = [t.grad for t in e["local"] if t.grad is not None]
            total = torch.stack(grads).sum(0) if grads else torch.zeros_like(e["local"][0])
            if e["group"] is not None:
                dist.all_reduce(total, group=e["group"])
            for t in e["local"]:
                t.grad = total.clone()

    @torch.no_grad()
    def check_equal(self, step: int) -> None:
        """Fail loudly if any copy differs from another, in this rank or across ranks."""
        for e in self.entries:
            first = e["local"][0]
            for other in e["local"][1:]:
                if not torch.equal(first, other):
                    raise RuntimeError(f"tied tensor {e['keys'][0]} drifted between stages at step {step}")
            if e["group"] is not None:
                copies = [torch.empty_like(first) for _ in e["ranks"]]
                dist.all_gather(copies, first.contiguous(), group=e["group"])
                if not all(torch.equal(first, c) for c in copies):
                    raise RuntimeError(
                        f"tied tensor {e['keys'][0]} drifted across ranks {e['ranks']} at step {step}"
                    )

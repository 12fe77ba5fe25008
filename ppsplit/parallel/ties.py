"""Keep tied weights tied when their copies sit in different stages and ranks.

A tie group is the set of original FQNs that name one tensor (GPT2's ``transformer.wte.weight``
and ``lm_head.weight``). Each stage that uses the tensor holds one copy; after every backward the
copies' gradients are summed over every stage that holds the group (all-reduce across the
pipeline ranks involved, a local sum for stages on one rank), so each copy's gradient is the
unsplit model's and the copies stay equal under any optimizer. This is what DeepSpeed's tied
layers and Megatron's shared embedding do, found here from the traced model instead of declared.

With data or tensor parallelism the sum runs over the pipeline ranks of one (dp, tp) coordinate,
on the local shards, when every copy is laid out alike (FSDP shards them alike, and a plan
usually gives a tied embedding and head the same row sharding); copies laid out differently are
summed as whole tensors and each takes its own shard back.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ppsplit.stages.code import adopt_tensors, same_kind


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _layout(t: torch.Tensor) -> tuple:
    placements = tuple(str(p) for p in getattr(t, "placements", ()))
    return tuple(t.shape), placements, tuple(_local(t).shape)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s own part of ``full`` (the whole tensor for a plain one)."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements).to_local()


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``param`` is (a DTensor of its mesh and placements, or a plain copy)."""
    if not hasattr(param, "device_mesh"):
        return full.clone()
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements)


class TieSync:
    def __init__(self, groups, stage_keys, modules, rank_of_stage, rank, layout=None):
        """``modules`` are this rank's stages by index; ``rank_of_stage`` maps a stage to its
        pipeline rank; ``layout`` (a :class:`ppsplit.parallel.layout.Layout`) places the pipeline ranks in
        the world (None: pipeline ranks are the world's). Every rank builds the same groups in
        the same order (``dist.new_group`` is collective over the whole world)."""
        from ppsplit.parallel.layout import Layout

        layout = layout or Layout(pp=max(rank_of_stage.values()) + 1, dp=1, tp=1)
        pp, dp, tp = layout.coords(rank)
        self.rank = rank
        self.entries = []
        for group in groups:
            holders = [s for s, keys in enumerate(stage_keys) if set(keys) & set(group)]
            pipe_ranks = sorted({rank_of_stage[s] for s in holders})
            process_group = None
            if len(pipe_ranks) > 1:
                for d, t in itertools.product(range(layout.dp), range(layout.tp)):
                    ranks = [layout.rank_of(p, d, t) for p in pipe_ranks]
                    made = dist.new_group(ranks)
                    if (d, t) == (dp, tp):
                        process_group, my_ranks = made, ranks
            if pp not in pipe_ranks:
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
            self.entries.append({"keys": list(group), "ranks": pipe_ranks, "local": local,
                                 "group": process_group,
                                 "world_ranks": my_ranks if process_group is not None else [rank]})
        for e in self.entries:
            e["alike"] = self._alike(e)
        self._start_equal()

    def _alike(self, e, tensors=None) -> bool:
        """Whether every copy of the group (or ``tensors``: their gradients), on every rank, is
        laid out alike (shards line up). Collective over the group's ranks."""
        mine = {_layout(t) for t in (e["local"] if tensors is None else tensors)}
        if e["group"] is None:
            return len(mine) == 1
        seen = [None] * len(e["world_ranks"])
        dist.all_gather_object(seen, sorted(mine), group=e["group"])
        return len({x for s in seen for x in s}) == 1

    def comm_groups(self) -> list[dict]:
        """The tie groups this rank communicates for, with the pipeline ranks involved."""
        return [{"keys": e["keys"], "ranks": e["ranks"]} for e in self.entries if e["group"] is not None]

    @torch.no_grad()
    def _start_equal(self) -> None:
        # Whatever initialised the copies (seed, checkpoint, a later init path), start from the
        # lowest pipeline rank's values.
        for e in self.entries:
            first = e["local"][0]
            if e["alike"]:
                if e["group"] is not None:
                    dist.broadcast(_local(first), src=e["world_ranks"][0], group=e["group"])
                for other in e["local"][1:]:
                    _local(other).copy_(_local(first))
            else:
                full = _full(first).contiguous()
                if e["group"] is not None:
                    dist.broadcast(full, src=e["world_ranks"][0], group=e["group"])
                for t in e["local"]:
                    _local(t).copy_(_shard_of(full, t))

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Make every copy's gradient the sum over all copies: the unsplit model's gradient."""
        for e in self.entries:
            if len(e["local"]) == 1 and e["group"] is None:
                continue  # one tensor in one stage: nothing to synchronise
            if not e["local"][0].requires_grad:
                continue  # frozen (an adapted model's base): no gradient anywhere
            for t in e["local"]:
                if t.grad is None:
                    t.grad = torch.zeros_like(t)
            if "grads_alike" not in e:
                # The gradients may be laid out unlike their parameters (under tensor parallelism
                # a tied embedding's gradient comes back whole where the head's is a shard): decide
                # from the gradients themselves, once, together.
                e["grads_alike"] = e["alike"] and self._alike(e, [t.grad for t in e["local"]])
            if e["grads_alike"]:
                total = torch.stack([_local(t.grad) for t in e["local"]]).sum(0)
                if e["group"] is not None:
                    dist.all_reduce(total, group=e["group"])
                for t in e["local"]:
                    _local(t.grad).copy_(total)
            else:
                total = torch.stack([_full(t.grad) for t in e["local"]]).sum(0)
                if e["group"] is not None:
                    dist.all_reduce(total, group=e["group"])
                for t in e["local"]:  # each copy gets the sum laid out as its parameter is
                    t.grad = _like(total, t)

    @torch.no_grad()
    def check_equal(self, step: int) -> None:
        """Fail loudly if any copy differs from another, in this rank or across ranks."""
        for e in self.entries:
            first = _local(e["local"][0]) if e["alike"] else _full(e["local"][0])
            for other in e["local"][1:]:
                if not torch.equal(first, _local(other) if e["alike"] else _full(other)):
                    raise RuntimeError(f"tied tensor {e['keys'][0]} drifted between stages at step {step}")
            if e["group"] is not None:
                copies = [torch.empty_like(first) for _ in e["ranks"]]
                dist.all_gather(copies, first.contiguous(), group=e["group"])
                if not all(torch.equal(first, c) for c in copies):
                    raise RuntimeError(
                        f"tied tensor {e['keys'][0]} drifted across ranks {e['ranks']} at step {step}"
                    )


class TiedWeights:
    """Keep a split's tied weights tied on this rank's stages, for a training loop of your own.

    >>> ties = ppsplit.TiedWeights(split, {0: split.stages[0]}, mesh=mesh)  # every rank, after parallelize
    >>> schedule.step(...); ties.sync_grads(); optimizer.step()

    ``stages``: this rank's stages by index, laid out (``ppsplit.parallelize``) or not.
    ``stage_ranks``: the pipeline rank of each stage, in stage order (default: stage i on
    pipeline rank i; in one process without ``torch.distributed``, every stage on this one).
    ``mesh``: the ("pp", "dp", "tp") ``DeviceMesh`` the stages are laid out on (None: the
    world's ranks are the pipeline ranks). Building it is collective over the world, and starts
    every copy from the lowest pipeline rank's values. ``sync_grads()`` after the backward
    makes each copy's gradient the sum over all copies (the unsplit model's gradient), however
    the copies are laid out; ``check()`` fails if any copy differs from another."""

    def __init__(self, split, stages: dict, stage_ranks=None, mesh=None):
        from ppsplit.errors import PpsplitError
        from ppsplit.parallel.layout import Layout

        n = len(split.stages)
        distributed = dist.is_available() and dist.is_initialized()
        if stage_ranks is None:
            stage_ranks = list(range(n)) if distributed else [0] * n
        stage_ranks = list(stage_ranks)
        if len(stage_ranks) != n:
            raise PpsplitError(f"stage_ranks={stage_ranks}: the split has {n} stages; allowed: one pipeline rank a stage")
        unknown = sorted(set(stages) - set(range(n)))
        if unknown:
            raise PpsplitError(f"stages {unknown}: the split has stages 0..{n - 1}")
        sizes = {"pp": max(stage_ranks) + 1, "dp": 1, "tp": 1}
        if mesh is not None:
            names = tuple(mesh.mesh_dim_names or ())
            if not set(names) <= set(sizes):
                raise PpsplitError(f"mesh dimensions {names}: allowed: pp, dp, tp (in that order)")
            sizes.update({name: mesh.size(i) for i, name in enumerate(names)})
            order = torch.arange(mesh.mesh.numel()).reshape([sizes[k] for k in names if k in sizes])
            if list(names) != [k for k in ("pp", "dp", "tp") if k in names] or not torch.equal(mesh.mesh, order):
                raise PpsplitError(f"mesh {names} of ranks {mesh.mesh.tolist()}: allowed: init_device_mesh's "
                                   "row-major ranks over (pp, dp, tp)")
        layout = Layout(sizes["pp"], sizes["dp"], sizes["tp"])
        rank = dist.get_rank() if distributed else 0
        if distributed and dist.get_world_size() != layout.world:
            raise PpsplitError(f"a world of {dist.get_world_size()} ranks for pp={layout.pp} x dp={layout.dp} x "
                               f"tp={layout.tp}; allowed: a mesh (or stage_ranks) covering the world")
        mine = [s for s in range(n) if stage_ranks[s] == layout.coords(rank)[0]]
        if sorted(stages) != mine:
            raise PpsplitError(f"stages {sorted(stages)} on pipeline rank {layout.coords(rank)[0]}; "
                               f"stage_ranks={stage_ranks} puts {mine} there")
        self._sync = TieSync(split.tie_groups, split.stage_keys, dict(stages),
                             dict(enumerate(stage_ranks)), rank, layout)

    def sync_grads(self) -> None:
        self._sync.sum_grads()

    def check(self, step: int = 0) -> None:
        self._sync.check_equal(step)

    @property
    def groups(self) -> list[dict]:
        """The tie groups this rank communicates for, with the pipeline ranks involved."""
        return self._sync.comm_groups()


def separate_local_copies(modules: dict[int, torch.nn.Module]) -> None:
    """Give each stage on this rank its own tensor for a tie its stages share.

    Splitting hands every stage the caller's tensor, so the first and last stage of a V
    placement (both on rank 0) would hold one tensor; torch's schedules scale and write each
    stage's gradients on their own, which would count that tensor twice. TieSync then sums the
    copies' gradients like any other pair of copies."""
    owner: dict[int, int] = {}
    for i in sorted(modules):
        stage = modules[i]
        named = dict(stage.named_parameters(remove_duplicate=False))
        named.update(stage.named_buffers(remove_duplicate=False))
        copies: dict[int, torch.Tensor] = {}
        replace = {}
        for fqn, tensor in named.items():
            if owner.get(id(tensor), i) != i:
                if id(tensor) not in copies:
                    copies[id(tensor)] = same_kind(tensor, tensor.detach().clone())
                replace[fqn] = copies[id(tensor)]
        if replace:
            adopt_tensors(stage, replace, only_known=True)
        for tensor in list(stage.parameters()) + list(stage.buffers()):
            owner.setdefault(id(tensor), i)

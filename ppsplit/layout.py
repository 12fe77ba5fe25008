"""Lay stages out over data- and tensor-parallel ranks by FQN: FSDP2 on each block, tensor
parallelism from the model's own plan.

A rank's stages keep the original FQNs, so the plans that are keyed by them apply unchanged:

- **Tensor parallelism** (``tp > 1``) takes transformers' ``tp_plan`` (``model.layers.*.self_attn.q_proj:
  colwise``), or one given in the model config. Each planned leaf of the stage (an unflattened
  ``InterpreterModule`` running one ``aten.linear``) is replaced by a fresh module of the
  original's class holding the stage's own parameters, and torch's style is applied to it. The
  trace baked the global head counts into the graph (``expand(x, [2, 2, 2, 32, 16])``); which
  dimensions hold heads is found by following the sharded dimension from each column-wise
  output through the graph (views, transposes, broadcasts, attention), and those sizes are
  divided by ``tp`` (:mod:`ppsplit.shard_flow`). No model is special-cased; an op the flow cannot
  follow is refused with its name and module.
- **FSDP2** (``fully_shard``) over the "dp" mesh on each block of the stage (the split's blocks,
  by FQN), then on the stage root; ``fsdp=False`` keeps plain replicas whose gradients are
  averaged after each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppsplit.errors import PpsplitError
from ppsplit.shard_flow import StageFlow, TensorParallelRefused, apply_rewrites, plan_stage_flows


# --- the plan --------------------------------------------------------------------------------

def tp_plan_of(model: torch.nn.Module, override: dict | None = None) -> dict[str, str]:
    """The tensor-parallel plan of ``model`` keyed by full FQN patterns: ``override`` (from the
    model config) or transformers' own (``model.tp_plan``)."""
    if override:
        return dict(override)
    plan = getattr(model, "tp_plan", None)
    return dict(plan or {})


def torch_style(style: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    raise PpsplitError(f"tensor-parallel style {style!r} is not supported; allowed: colwise, rowwise, "
                       "colwise_gather_output, embedding_rowwise, replicate")


def _fresh_leaf(original: torch.nn.Module, unflattened: torch.nn.Module) -> torch.nn.Module:
    """A new module of the original leaf's class and settings, holding the unflattened leaf's
    (the stage's) parameters: parallelizing it leaves the caller's model untouched."""
    leaf = type(original).__new__(type(original))
    torch.nn.Module.__init__(leaf)
    for key, value in vars(original).items():
        if not key.startswith("_") and key != "training":
            setattr(leaf, key, value)
    leaf._parameters = {n: unflattened._parameters.get(n, p) for n, p in original._parameters.items()}
    leaf._buffers = {n: unflattened._buffers.get(n, b) for n, b in original._buffers.items()}
    leaf.train(unflattened.training)
    return leaf


def apply_tensor_parallel(stage: torch.nn.Module, model: torch.nn.Module, flow: StageFlow, tp_mesh) -> None:
    """Swap the stage's planned leaves for the original modules' kind and apply their styles,
    then divide the head counts the trace baked in."""
    from torch.distributed.tensor.parallel import parallelize_module

    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for prefix, module in stage.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, name))
    replaced: dict[int, torch.nn.Parameter] = {}
    for fqn, style in flow.leaves.items():
        unflattened = stage.get_submodule(fqn)
        original = model.get_submodule(fqn)
        if not isinstance(original, (torch.nn.Linear, torch.nn.Embedding)):
            raise PpsplitError(f"tensor-parallel plan: {fqn} is a {type(original).__name__}; "
                               "allowed: nn.Linear and nn.Embedding leaves")
        leaf = _fresh_leaf(original, unflattened)
        before = {name: p for name, p in leaf._parameters.items() if p is not None}
        parallelize_module(leaf, tp_mesh, torch_style(style))
        for name, p in before.items():
            replaced[id(p)] = leaf._parameters[name]
        parent_name, _, child = fqn.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        setattr(parent, child, leaf)
    # A tensor held under several names in this stage stays one tensor.
    for pid, new in replaced.items():
        for module, name in holders.get(pid, []):
            current = module._parameters.get(name)
            if current is not None and id(current) == pid:
                module._parameters[name] = new
    apply_rewrites(stage, flow.rewrites, tp_mesh)


def apply_fsdp(stage: torch.nn.Module, blocks: list[str], dp_mesh, bf16: bool = False) -> None:
    """``fully_shard`` each of the stage's blocks, then the stage root, over ``dp_mesh``; with
    ``bf16``, parameters are gathered in bfloat16 and gradients reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ppsplit.stage_code import drop_dtype_checks

    policy = MixedPrecisionPolicy()
    if bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        drop_dtype_checks(stage)  # the trace saw float32 where bfloat16 parameters now give bfloat16
    names = {n for n, _ in stage.named_modules()}
    for block in blocks:
        if block in names:
            fully_shard(stage.get_submodule(block), mesh=dp_mesh, mp_policy=policy)
    fully_shard(stage, mesh=dp_mesh, mp_policy=policy)


def reshard_every_microbatch(pipe_stage) -> None:
    """FSDP2 under a pipeline schedule with the memory of a shard: each microbatch's backward
    reduce-scatters its gradients block by block and reshards, as FSDP does outside a pipeline.

    torch's ``PipelineStage`` keeps an FSDP stage's parameters gathered and its gradients whole
    from the first microbatch's backward to the last, then reduce-scatters once: the least
    communication, but for the length of the backward a rank holds its whole stage twice over
    (parameters and gradients), whatever ``dp``. Here every microbatch's backward runs with
    FSDP's own settings for a last backward, and the stage's end-of-backward (the same call the
    schedule makes after the last one) follows it; the sharded gradients accumulate over the
    microbatches, and the schedule's own last call scales them as before. Only a full backward
    is changed (FSDP is refused under the zero-bubble schedules, which split it)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining._backward import stage_backward

    module = pipe_stage.submod
    if not isinstance(module, FSDPModule):
        return
    plain = pipe_stage.backward_maybe_with_nosync

    def backward(backward_type, bwd_kwargs, last_backward=False):
        if backward_type != "full":
            return plain(backward_type, bwd_kwargs, last_backward)
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        pipe_stage.perform_reduce_grad(1)  # the groups autograd did not reach, and FSDP's end of backward
        return grads, None

    pipe_stage.backward_maybe_with_nosync = backward


def local_shape(meta: torch.Tensor, shard: int | None, tp: int) -> torch.Tensor:
    if shard is None:
        return meta
    shape = list(meta.shape)
    shape[shard] //= tp
    return torch.empty(shape, dtype=meta.dtype, device="meta").requires_grad_(meta.requires_grad)


@dataclass
class Layout:
    """How one rank's stages are laid out."""
    pp: int
    dp: int
    tp: int
    fsdp: bool = True

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) of a global rank: "pp" outermost, "tp" innermost."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp


def device_mesh(layout: Layout, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))


def check_tensor_parallel(split, model: torch.nn.Module, plan: dict | None, tp: int) -> list[StageFlow]:
    """The flows of a tensor-parallel layout, or :class:`TensorParallelRefused` before any rank
    starts: a model without a plan, a plan naming what cannot be sharded, an op the shard cannot
    follow."""
    plan = tp_plan_of(model, plan)
    if not plan:
        raise TensorParallelRefused(
            f"parallel.tp={tp}: {type(model).__name__} has no tensor-parallel plan (transformers ships "
            "none for it); give one as model.tp_plan (FQN pattern: colwise|rowwise|colwise_gather_output|"
            "embedding_rowwise), or use tp=1")
    return plan_stage_flows(split, plan, tp, model)


def tp_flows(split, model: torch.nn.Module | None, plan: dict | None, tp: int) -> list[StageFlow]:
    """The split's tensor-parallel flows at ``tp``, computed once (before any stage is laid out:
    the flows follow the stages' unflattened graphs) and kept on the split."""
    cached = split._tp_flows
    if cached is not None and cached[0] == tp and (plan is None or dict(plan) == cached[1]):
        return cached[2]
    if model is None:
        raise PpsplitError(f"tp={tp}: the split has no tensor-parallel layout at tp={tp} yet; "
                           "allowed: pass model= (its plan, or plan=) or call ppsplit.parallelize first")
    flows = check_tensor_parallel(split, model, plan, tp)
    split._tp_flows = (tp, tp_plan_of(model, plan), flows)
    return flows


def parallelize(split, index: int, model: torch.nn.Module, mesh, plan: dict | None = None,
                fsdp: bool = True, flows: list[StageFlow] | None = None, bf16: bool = False) -> torch.nn.Module:
    """Apply a layout to stage ``index`` of ``split`` on this rank: tensor parallelism over
    ``mesh["tp"]`` with ``plan`` (default: the model's own), then FSDP2 over ``mesh["dp"]``.
    The stage keeps its FQNs. Every rank of the mesh calls this for its stages."""
    stage = split.stages[index]
    tp = mesh["tp"].size()
    if tp > 1:
        flows = flows or tp_flows(split, model, plan, tp)
        apply_tensor_parallel(stage, model, flows[index], mesh["tp"])
    if mesh["dp"].size() > 1 and fsdp:
        blocks = dict.fromkeys(b.partition("@")[0] for b in split.stage_blocks()[index])  # a shared layer once
        apply_fsdp(stage, list(blocks), mesh["dp"], bf16)
    return stage

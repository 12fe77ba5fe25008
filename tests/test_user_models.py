"""Models as users write them: blocks in a dict or as named attributes, pipe_split() markers,
points after a module, forward arguments named like builtins, positional calls."""

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import pipe_split

import ppsplit
from ppsplit import PpsplitError
from ppsplit.data.batch import Batch

WIDTH = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(x + torch.relu(self.lin(x)))


class DictBlocks(nn.Module):
    """torchtitan's layout: blocks in an nn.ModuleDict keyed by their number."""

    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n)})
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


class AttributeBlocks(nn.Module):
    """Blocks as named attributes, and a keyword input scaling the output."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.block0, self.block1, self.block2, self.block3 = Block(), Block(), Block(), Block()
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x, scale):
        x = self.embed(x)
        x = self.block3(self.block2(self.block1(self.block0(x))))
        return self.head(x) * scale


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, 3)


class BuiltinNames(Stack):
    """forward(input, type): fx renames such placeholders (input_1)."""

    def forward(self, input, type):
        x = input
        for layer in self.layers:
            x = layer(x)
        return self.head(x) * type


class Marked(Stack):
    """A forward with torch.distributed.pipelining.pipe_split() markers, as torch's users write."""

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i in (0, 2):
                pipe_split()
        return self.head(x)


def loss_fn(out, labels):
    return nn.functional.cross_entropy(out, labels)


def assert_exact(model, split, args, kwargs):
    """FQN partition, values, forward and every gradient against the unsplit model."""
    original = model.state_dict()
    keys = [set(s.state_dict()) for s in split.stages]
    assert set().union(*keys) == set(original) and sum(map(len, keys)) == len(original)
    report = ppsplit.verify_fqns(model, split)
    assert report.ok, report.problems()
    labels = torch.randint(0, 3, (args[0].shape[0] if args else next(iter(kwargs.values())).shape[0],))
    numerics = ppsplit.verify_numerics(model, split, [Batch(args, kwargs, labels)], loss_fn)
    assert numerics.forward_max_abs_diff == 0 and numerics.loss_abs_diff == 0
    assert numerics.grad_max_abs_diff <= 1e-7, numerics.worst_grad


def x():
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("cls,blocks", [
    (DictBlocks, ["layers.0", "layers.1", "layers.2", "layers.3"]),
    (AttributeBlocks, ["block0", "block1", "block2", "block3"]),
])
def test_blocks_that_are_not_a_module_list_are_found(cls, blocks):
    torch.manual_seed(0)
    model = cls()
    kwargs = {"scale": torch.tensor(2.0)} if cls is AttributeBlocks else {}
    assert ppsplit.find_blocks(model) == blocks
    split = ppsplit.split(model, (x(),), kwargs, stages=4)
    assert split.points == blocks[1:]
    assert_exact(model, split, (x(),), kwargs)


def test_a_model_without_blocks_is_told_what_to_give():
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 3))
    with pytest.raises(PpsplitError, match="shows no repeated blocks.*split.points"):
        ppsplit.split(model, (x(),), stages=2)
    split = ppsplit.split(model, (x(),), points=["2"])  # a manual point still works
    assert_exact(model, split, (x(),), {})


def test_pipe_split_markers_are_the_points():
    torch.manual_seed(0)
    model = Marked()
    split = ppsplit.split(model, (x(),))
    assert split.points == ["pipe_split:0", "pipe_split:1"] and split.strategy == "markers"
    assert [sorted({k.split(".")[1] for k in s.state_dict() if k.startswith("layers.")}) for s in split.stages] \
        == [["0"], ["1", "2"], ["3"]]
    assert_exact(model, split, (x(),), {})
    one = ppsplit.split(model, (x(),), points=["pipe_split:1"])  # one marker of two, by number
    assert len(one) == 2 and "layers.2.lin.weight" in one.stages[0].state_dict()
    with pytest.raises(PpsplitError, match="calls pipe_split\\(\\) 2 time.*allowed: pipe_split:0, pipe_split:1"):
        ppsplit.split(model, (x(),), points=["pipe_split:2"])


def test_a_stage_may_begin_after_a_module():
    torch.manual_seed(0)
    model = Marked()
    split = ppsplit.split(model, (x(),), points=["layers.1:end"])
    assert "layers.1.norm.weight" in split.stages[0].state_dict()
    assert "layers.2.lin.weight" in split.stages[1].state_dict()
    assert_exact(model, split, (x(),), {})
    with pytest.raises(PpsplitError, match="'head:end'.*stage 1.*holds no parameter"):
        ppsplit.split(model, (x(),), points=["head:end"])


def test_forward_arguments_named_like_builtins():
    torch.manual_seed(0)
    model = BuiltinNames()
    kwargs = {"input": x(), "type": torch.tensor(3.0)}
    split = ppsplit.split(model, (), kwargs, stages=2)
    assert_exact(model, split, (), kwargs)


def test_a_split_binds_arguments_by_the_model_signature():
    torch.manual_seed(0)
    model = AttributeBlocks()
    scale = torch.tensor(2.0)
    split = ppsplit.split(model, (x(),), {"scale": scale}, stages=2)
    expected = model(x(), scale)
    assert torch.equal(split(x(), scale), expected)  # traced by keyword, called by position
    assert torch.equal(split(x=x(), scale=scale), expected)  # traced by position, called by name
    with pytest.raises(PpsplitError, match="do not fit the model's forward"):
        split(x(), scale, torch.tensor(1.0))
    with pytest.raises(PpsplitError, match="missing a required argument: 'scale'"):
        split(x())

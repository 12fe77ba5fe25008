"""The example this project comes from: a TransformerLike of small MLP blocks."""

import copy

import pytest
import torch
from torch import nn

import ppsplit


class MLPBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.net1 = nn.Linear(d, 2 * d)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class TransformerLike(nn.Module):
    def __init__(self, d=16, n=8, container=nn.Sequential):
        super().__init__()
        blocks = [MLPBlock(d) for _ in range(n)]
        self.layers = container(*blocks) if container is nn.Sequential else container(blocks)

    def forward(self, x):
        if isinstance(self.layers, nn.Sequential):
            return self.layers(x)
        for layer in self.layers:
            x = layer(x)
        return x


def layers_of(stage):
    return sorted({k.split(".")[1] for k in stage.state_dict()}, key=int)


def test_sequential_split_in_two():
    torch.manual_seed(0)
    model = TransformerLike()
    x = torch.randn(4, 16)
    split = ppsplit.split(model, (x,), stages=2)
    assert split.points == ["layers.4"]
    assert layers_of(split.stages[0]) == ["0", "1", "2", "3"]
    assert layers_of(split.stages[1]) == ["4", "5", "6", "7"]
    assert "layers.4.net1.weight" in split.stages[1].state_dict()
    assert ppsplit.verify_fqns(model, split).ok
    assert torch.allclose(split(x), model(x), atol=1e-6)


def test_module_list_split_after_layer_0():
    torch.manual_seed(0)
    model = TransformerLike(container=nn.ModuleList)
    x = torch.randn(4, 16)
    split = ppsplit.split(model, (x,), points=["layers.1"])
    assert layers_of(split.stages[0]) == ["0"]
    assert layers_of(split.stages[1]) == [str(i) for i in range(1, 8)]
    assert "layers.1.net2.bias" in split.stages[1].state_dict()
    assert ppsplit.verify_fqns(model, split).ok
    reference = copy.deepcopy(model)
    split(x).sum().backward()
    reference(x).sum().backward()
    for s in split.stages:
        for k, p in s.named_parameters():
            assert torch.allclose(p.grad, reference.get_parameter(k).grad, atol=1e-6), k


@pytest.mark.parametrize("points,match", [
    (["layers.9"], "not a module"),
    (["layers.3", "layers.2"], "out of order"),
    (["layers.2", "layers.2"], "repeated"),
    (["layers.0"], "stage 0 empty"),
    (["layers.2", "layers.2.net1"], "empty"),
])
def test_bad_points_are_refused(points, match):
    model = TransformerLike()
    with pytest.raises(ppsplit.PpsplitError, match=match):
        ppsplit.split(model, (torch.randn(2, 16),), points=points)

"""Input/weight gradient split with plain layers: exact gradients, no second walk of the input path."""

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from moeinfra.pipeline.runtime.weight_grad import backward_input, backward_weight  # noqa: E402


def _split_vs_full(model: nn.Module):
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = model(x)
    g = torch.randn_like(y)
    input_grads, deferred = backward_input([y], [g], [x], list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # nothing before W
    backward_weight(deferred)
    ref(xr).backward(g)
    assert torch.allclose(input_grads[0], xr.grad)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    return deferred


def test_linear_stack_splits_at_boundaries_without_recomputing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.LayerNorm(4))
    calls = []
    x = torch.randn(3, 4, requires_grad=True)
    y = model(x)
    tanh_node, todo = None, [y.grad_fn]
    while todo:
        node = todo.pop()
        if node.name() == "TanhBackward0":
            tanh_node = node
        todo.extend(c for c, _ in node.next_functions if c is not None)
    tanh_node.register_prehook(lambda grads: calls.append(1))
    _, deferred = backward_input([y], [torch.ones_like(y)], [x], list(model.parameters()))
    assert len(calls) == 1
    backward_weight(deferred)
    assert len(calls) == 1  # W restarted below the input path: Tanh's backward ran once
    assert deferred.roots is None and len(deferred.groups) == 3
    _split_vs_full(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.LayerNorm(4)))


def test_shared_weight_falls_back_exactly():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    assert _split_vs_full(model).roots is not None


def test_inputs_without_grad_defer_everything():
    model = nn.Linear(4, 4)
    y = model(torch.randn(2, 4))
    grads, deferred = backward_input(
        [y], [torch.ones_like(y)], [torch.randn(2, 4)], list(model.parameters())
    )
    assert grads == [None] and model.weight.grad is None
    backward_weight(deferred)
    assert torch.allclose(model.bias.grad, torch.full((4,), 2.0))

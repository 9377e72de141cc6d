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


# --- custom autograd Functions and DeepSeek's WeightGradStore protocol ---------------------------

from moeinfra.pipeline.dualpipe import WeightGradStore  # noqa: E402


class StoreLinearFunc(torch.autograd.Function):
    """The structure of DeepSeek's example: weight gradient added by hand, deferred to the store."""

    calls = 0

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_output):
        StoreLinearFunc.calls += 1
        x, weight = ctx.saved_tensors
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)

        def grad_weight_fn():
            weight.grad += grad_output.flatten(0, -2).T @ x.flatten(0, -2)

        if WeightGradStore.enabled:
            WeightGradStore.put(grad_weight_fn)
        else:
            grad_weight_fn()
        return grad_output @ weight, None


class ReturnLinearFunc(torch.autograd.Function):
    """A custom Function that returns its weight gradient the ordinary way."""

    calls = 0

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_output):
        ReturnLinearFunc.calls += 1
        x, weight = ctx.saved_tensors
        return grad_output @ weight, grad_output.flatten(0, -2).T @ x.flatten(0, -2)


class CustomLinear(nn.Linear):
    def __init__(self, n_in: int, n_out: int, func) -> None:
        super().__init__(n_in, n_out, bias=False)
        self.func = func

    def forward(self, x):
        return self.func.apply(x, self.weight)


class Mixed(nn.Module):
    """Custom linears (store-aware and returning) beside a standard one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = CustomLinear(4, 8, StoreLinearFunc)
        self.b = nn.Linear(8, 8)
        self.c = CustomLinear(8, 4, ReturnLinearFunc)

    def forward(self, x):
        return self.c(torch.tanh(self.b(nn.functional.gelu(self.a(x)))))


def _reference_grads(model: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """Gradients by one ordinary backward of a copy, the store disabled (computed at once)."""
    ref = copy.deepcopy(model)
    xr = x.detach().clone().requires_grad_()
    ref(xr).backward(g)
    return xr.grad, [p.grad for p in ref.parameters()]


def _split(model: nn.Module, x: torch.Tensor, g: torch.Tensor):
    StoreLinearFunc.calls = ReturnLinearFunc.calls = 0
    y = model(x)
    grads, deferred = backward_input([y], [g], [x], list(model.parameters()))
    return grads, deferred


def test_deepseek_store_stage_defers_its_weight_and_runs_each_backward_once():
    torch.manual_seed(1)
    model = Mixed()
    x, g = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    ref_x, ref_p = _reference_grads(model, x, g)
    grads, deferred = _split(model, x, g)
    assert (StoreLinearFunc.calls, ReturnLinearFunc.calls) == (1, 1)
    assert torch.allclose(grads[0], ref_x, atol=1e-6)
    assert len(deferred.stored) == 1 and not WeightGradStore.cache and not WeightGradStore.enabled
    assert torch.count_nonzero(model.a.weight.grad) == 0  # the store holds it until W
    assert model.b.weight.grad is None  # the standard layer is split as before
    assert torch.allclose(model.c.weight.grad, ref_p[3], atol=1e-6)  # returned: taken in I
    backward_weight(deferred)
    assert (StoreLinearFunc.calls, ReturnLinearFunc.calls) == (1, 1)  # W ran no backward again
    for p, q in zip(model.parameters(), ref_p, strict=True):
        assert torch.allclose(p.grad, q, atol=1e-6)


def test_custom_function_with_a_shared_weight_is_done_in_one_pass():
    torch.manual_seed(2)
    model = Mixed()
    model.b = nn.Linear(8, 8, bias=False)
    shared = CustomLinear(8, 8, ReturnLinearFunc)
    shared.weight = model.b.weight
    model.c = nn.Sequential(shared, nn.Linear(8, 4))
    x, g = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    ref_x, ref_p = _reference_grads(model, x, g)
    grads, deferred = _split(model, x, g)
    assert deferred.roots is None and deferred.groups == []  # nothing restarted in W
    backward_weight(deferred)
    assert (StoreLinearFunc.calls, ReturnLinearFunc.calls) == (1, 1)
    assert torch.allclose(grads[0], ref_x, atol=1e-6)
    for p, q in zip(model.parameters(), ref_p, strict=True):
        assert torch.allclose(p.grad, q, atol=1e-6)


def test_custom_function_with_a_non_leaf_input_is_done_in_one_pass():
    torch.manual_seed(3)
    pre, model = nn.Linear(4, 4), Mixed()
    x0, g = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    x = pre(x0)  # the stage input has a node of its own
    ref = copy.deepcopy(model)
    xr = x.detach().clone().requires_grad_()
    ref(xr).backward(g)
    grads, deferred = _split(model, x, g)
    backward_weight(deferred)
    assert (StoreLinearFunc.calls, ReturnLinearFunc.calls) == (1, 1)
    assert torch.allclose(grads[0], xr.grad, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def test_store_keeps_deepseeks_fifo_semantics():
    WeightGradStore.clear()
    out = []
    WeightGradStore.put(lambda: out.append(1))
    WeightGradStore.flush()
    WeightGradStore.put(lambda: out.append(2))
    WeightGradStore.put(lambda: out.append(3))
    WeightGradStore.flush()
    WeightGradStore.pop()
    assert out == [1]
    WeightGradStore.pop()
    assert out == [1, 2, 3]
    with pytest.raises(RuntimeError, match="empty"):
        WeightGradStore.pop()

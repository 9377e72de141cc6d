"""Split a stage's backward into input gradients now (``I``) and weight gradients later (``W``).

Works on any autograd graph built from standard layers; no custom autograd function is needed.
During ``I`` the graph is walked once to find the *boundary* nodes: nodes on the path to the stage
inputs with a child that leads only to parameters (for ``nn.Linear``, its ``AddmmBackward``).
Pre-hooks on them capture the gradient that reaches them while the input gradients are computed.
``W`` then restarts autograd at each boundary node with the captured gradient and asks only for
the parameters behind it, so the input-gradient part is never computed twice.

When that split is not exact (a parameter behind several boundary nodes, e.g. a shared weight, or
an output that does not depend on the inputs), ``W`` falls back to asking autograd for the parameter
gradients from the stage outputs, which is correct but walks the graph again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class DeferredWeightGrad:
    """What ``W`` needs: captured gradients at boundary nodes, or the outputs for the fallback."""

    params: list[torch.nn.Parameter]
    groups: list[tuple[object, tuple, list[torch.nn.Parameter]]] = field(default_factory=list)
    roots: list[torch.Tensor] | None = None
    root_grads: list | None = None


def _children(node) -> list:
    return [c for c, _ in node.next_functions if c is not None]


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.nn.Parameter],
) -> tuple[list[torch.Tensor | None], DeferredWeightGrad]:
    """Gradients of ``inputs`` (None where not needed) from ``roots`` with ``grads``; the weight part
    is returned for :func:`backward_weight`."""
    params = [p for p in params if p.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    deferred = DeferredWeightGrad(params)
    if not roots:
        return [None] * len(inputs), deferred
    if not wanted:
        deferred.roots, deferred.root_grads = list(roots), list(grads)
        return [None] * len(inputs), deferred

    input_nodes = {get_gradient_edge(t).node for t in wanted}
    param_of = {get_gradient_edge(p).node: p for p in params}
    # Post-order walk: on_path[n] = n leads to an input; behind[n] = parameters reachable from n.
    on_path: dict = {}
    behind: dict = {}
    root_nodes = [r.grad_fn for r in roots if r.grad_fn is not None]
    stack = [(n, False) for n in root_nodes]
    while stack:
        node, expanded = stack.pop()
        if node in on_path:
            continue
        kids = _children(node)
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in kids if c not in on_path)
            continue
        on_path[node] = node in input_nodes or any(on_path[c] for c in kids)
        reach = {param_of[node]} if node in param_of else set()
        for c in kids:
            reach |= behind[c]
        behind[node] = frozenset(reach)

    exact = all(on_path[n] or not behind[n] for n in root_nodes)
    boundary: dict = {}
    for node, is_on in on_path.items():
        if not is_on:
            continue
        got = set()
        for c in _children(node):
            if not on_path[c]:
                got |= behind[c]
        if got:
            boundary[node] = got
    seen: set = set()
    for ps in boundary.values():
        if seen & ps:
            exact = False
        seen |= ps

    captured: dict = {}
    handles = []
    if exact:
        for node in boundary:
            handles.append(
                node.register_prehook(
                    lambda grad_outputs, node=node: captured.__setitem__(node, grad_outputs)
                )
            )
    try:
        got = torch.autograd.grad(
            list(roots), wanted, list(grads), retain_graph=True, allow_unused=True
        )
    finally:
        for h in handles:
            h.remove()
    if exact and set(captured) == set(boundary):
        by_param = {id(p): p for p in params}
        deferred.groups = [
            (node, captured[node], [by_param[id(p)] for p in ps]) for node, ps in boundary.items()
        ]
    else:
        deferred.roots, deferred.root_grads = list(roots), list(grads)
    by_id = {id(t): g for t, g in zip(wanted, got, strict=True)}
    return [by_id.get(id(t)) for t in inputs], deferred


def _accumulate(params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad.add_(g)


def backward_weight(deferred: DeferredWeightGrad) -> None:
    """Add the deferred weight gradients to the parameters' ``.grad``."""
    if deferred.roots is not None:
        if deferred.params:
            grads = torch.autograd.grad(
                deferred.roots, deferred.params, deferred.root_grads, allow_unused=True
            )
            _accumulate(deferred.params, grads)
        return
    for node, grad_outputs, params in deferred.groups:
        edges = [GradientEdge(node, i) for i, g in enumerate(grad_outputs) if g is not None]
        if not edges:
            continue
        given = [g for g in grad_outputs if g is not None]
        grads = torch.autograd.grad(edges, params, given, retain_graph=True, allow_unused=True)
        _accumulate(params, grads)

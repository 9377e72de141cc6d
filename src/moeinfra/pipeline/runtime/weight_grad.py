"""Split a stage's backward into input gradients now (``I``) and weight gradients later (``W``).

Works on any autograd graph built from standard layers; no custom autograd function is needed.
During ``I`` the graph is walked once to find the *boundary* nodes: nodes on the path to the stage
inputs with a child that leads only to parameters (for ``nn.Linear``, its ``AddmmBackward``).
Pre-hooks on them capture the gradient that reaches them while the input gradients are computed.
``W`` then restarts autograd at each boundary node with the captured gradient and asks only for
the parameters behind it, so the input-gradient part is never computed twice.

A custom ``torch.autograd.Function`` is never restarted: its backward computes every output each
time it runs and may have side effects (DeepSeek's zero-bubble stages add to ``weight.grad``
themselves, or defer that to :class:`WeightGradStore`). It runs once, in ``I``; the parameter
gradients it returns are taken there, and what it puts in the store runs at ``W``.

When that split is not exact (a parameter behind several boundary nodes, e.g. a shared weight, or
an output that does not depend on the inputs), ``W`` falls back to asking autograd for the parameter
gradients from the stage outputs, which is correct but walks the graph again; with a custom
``Function`` on the input path, everything but the store's work is done in ``I`` instead.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, get_gradient_edge


class WeightGradStore:
    """DeepSeek's zero-bubble protocol (``dualpipe.utils.WeightGradStore``), same semantics.

    A custom autograd backward that sees ``WeightGradStore.enabled`` puts a closure computing its
    weight gradient instead of computing it; the runtime enables the store during a split backward
    (``I``), keeps what was put per micro-batch and stage, and runs it at that ``W``. ``flush`` /
    ``pop`` / ``clear`` behave as DeepSeek's (one FIFO per process) for code that drives the store
    itself.
    """

    enabled: bool = False
    cache: list[Callable[[], None]] = []
    funcs_queue: queue.Queue = queue.Queue()

    @classmethod
    def put(cls, func: Callable[[], None]) -> None:
        cls.cache.append(func)

    @classmethod
    def flush(cls) -> None:
        cls.funcs_queue.put(cls.cache)
        cls.cache = []

    @classmethod
    def pop(cls) -> None:
        if cls.funcs_queue.empty():
            raise RuntimeError("WeightGradStore.pop: the queue is empty (pop without a flush)")
        for func in cls.funcs_queue.get():
            func()

    @classmethod
    def clear(cls) -> None:
        cls.cache = []
        cls.funcs_queue = queue.Queue()

    @classmethod
    def take(cls) -> list[Callable[[], None]]:
        """What was put since the last flush or take, removed from the store."""
        funcs, cls.cache = cls.cache, []
        return funcs


@dataclass
class DeferredWeightGrad:
    """What ``W`` needs: captured gradients at boundary nodes, or the outputs for the fallback."""

    params: list[torch.nn.Parameter]
    groups: list[tuple[object, tuple, list[torch.nn.Parameter]]] = field(default_factory=list)
    roots: list[torch.Tensor] | None = None
    root_grads: list | None = None
    stored: list[Callable[[], None]] = field(default_factory=list)


def _is_custom(node) -> bool:
    return isinstance(node, BackwardCFunction)


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
    eager: set = set()  # parameters behind a custom Function on the path: taken in I
    for node, is_on in on_path.items():
        if not is_on:
            continue
        got = set()
        for c in _children(node):
            if not on_path[c]:
                got |= behind[c]
        if got and _is_custom(node):
            eager |= got
        elif got:
            boundary[node] = got
    seen: set = set(eager)
    for ps in boundary.values():
        if seen & ps:
            exact = False
        seen |= ps
    custom = any(_is_custom(n) for n, is_on in on_path.items() if is_on)
    if custom and any(t.grad_fn is not None for t in wanted):
        exact = False  # a non-leaf input's own node may not run in I: no restart can be trusted
    if custom and not exact:
        eager = set(params)

    by_param = {id(p): p for p in params}
    eager_params = [p for p in params if p in eager]
    captured: dict = {}
    handles = []
    if exact:
        for node in boundary:
            handles.append(
                node.register_prehook(
                    lambda grad_outputs, node=node: captured.__setitem__(node, grad_outputs)
                )
            )
    WeightGradStore.enabled = True
    try:
        got = torch.autograd.grad(
            list(roots),
            wanted + eager_params,
            list(grads),
            retain_graph=exact or not custom,
            allow_unused=True,
        )
    finally:
        WeightGradStore.enabled = False
        deferred.stored = WeightGradStore.take()
        for h in handles:
            h.remove()
    _accumulate(eager_params, got[len(wanted) :])
    if custom and not exact:
        deferred.params = []
    elif exact and set(captured) == set(boundary):
        deferred.groups = [
            (node, captured[node], [by_param[id(p)] for p in ps]) for node, ps in boundary.items()
        ]
    elif custom:  # restarting from the roots would run a custom backward a second time
        raise RuntimeError(
            "zero-bubble split: a boundary node did not run during the input backward; "
            "use a full backward (B) for this stage"
        )
    else:
        deferred.roots, deferred.root_grads = list(roots), list(grads)
    by_id = {id(t): g for t, g in zip(wanted, got[: len(wanted)], strict=True)}
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
    """Add the deferred weight gradients to the parameters' ``.grad``, and run what the stage put
    in the :class:`WeightGradStore` during its ``I``."""
    for func in deferred.stored:
        func()
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

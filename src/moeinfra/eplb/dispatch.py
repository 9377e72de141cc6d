"""Which physical replica serves each routed token."""

from __future__ import annotations

from typing import Any

import numpy as np

from moeinfra.eplb.inputs import like_input
from moeinfra.eplb.plan import Plan
from moeinfra.errors import InputError


def _to_numpy_int(value: Any, name: str) -> np.ndarray:
    if type(value).__module__.startswith("torch"):
        value = value.detach().to("cpu").numpy()
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise InputError(f"{name} must hold integers; got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def replica_for_tokens(plan: Plan, layer: int, expert_ids: Any, token_ids: Any) -> Any:
    """Physical slot for every (token, expert) pair, spreading each expert's tokens over its replicas.

    Pairs routed to the same expert are ordered by token id; the ``k``-th goes to replica
    ``(k + first_token_id) mod logcnt[expert]``. Within one call the replicas of an expert get counts
    that differ by at most one; offsetting by the first token id keeps ranks that pass global token ids
    from all starting at replica 0. Deterministic.

    Args:
        plan: the placement. layer: layer index.
        expert_ids: ``[...]`` logical expert of each pair (e.g. ``[tokens, top_k]``).
        token_ids: token id of each pair, same shape as ``expert_ids`` or broadcastable to it
            (e.g. ``[tokens, 1]``).
    Returns:
        Physical slot ids, same shape as ``expert_ids``; a torch tensor on the same device if
        ``expert_ids`` is one. The GPU of a slot is ``slot // (num_replicas / num_gpus)``.
    """
    if not 0 <= layer < plan.num_layers:
        raise InputError(f"layer={layer} must be in 0..{plan.num_layers - 1}")
    experts = _to_numpy_int(expert_ids, "expert_ids")
    try:
        tokens = np.broadcast_to(_to_numpy_int(token_ids, "token_ids"), experts.shape)
    except ValueError:
        raise InputError(
            f"token_ids shape {np.shape(token_ids)} does not broadcast to expert_ids shape {experts.shape}"
        ) from None
    flat_experts = experts.ravel()
    num_experts = plan.layout.num_experts
    if flat_experts.size and (flat_experts.min() < 0 or flat_experts.max() >= num_experts):
        raise InputError(f"expert_ids must be in 0..{num_experts - 1}")
    flat_tokens = tokens.ravel()
    order = np.lexsort((flat_tokens, flat_experts))
    sorted_experts = flat_experts[order]
    positions = np.arange(order.size)
    is_start = np.ones(order.size, dtype=bool)
    is_start[1:] = sorted_experts[1:] != sorted_experts[:-1]
    start = np.maximum.accumulate(np.where(is_start, positions, 0)) if order.size else positions
    first_token = flat_tokens[order][start]
    counts = plan.logcnt[layer, sorted_experts]
    replica = (positions - start + first_token) % counts
    slots_sorted = plan.log2phy[layer, sorted_experts, replica]
    slots = np.empty_like(flat_experts)
    slots[order] = slots_sorted
    return like_input(slots.reshape(experts.shape), expert_ids)

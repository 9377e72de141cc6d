"""Input checks shared by every EPLB entry point, and the numpy <-> torch boundary.

The library computes in numpy. A torch tensor given in comes back out as a torch tensor on the same
device (torch is imported lazily, only when one is given).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moeinfra.errors import InputError


@dataclass(frozen=True)
class Layout:
    """How physical expert slots map onto hardware.

    Slot ``r`` of a layer lives on GPU ``r // slots_per_gpu``; GPU ``g`` on node ``g // gpus_per_node``.
    """

    num_experts: int
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_gpus: int

    @property
    def slots_per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_groups


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise InputError(f"{name}={value!r} must be a positive integer")
    return int(value)


def check_layout(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> Layout:
    """Validate the slot/hardware numbers against each other; raise :class:`InputError` naming the rule."""
    num_replicas = positive_int("num_replicas", num_replicas)
    num_groups = positive_int("num_groups", num_groups)
    num_nodes = positive_int("num_nodes", num_nodes)
    num_gpus = positive_int("num_gpus", num_gpus)
    if num_replicas < num_experts:
        raise InputError(
            f"num_replicas={num_replicas} must be >= the number of experts ({num_experts}): "
            "every expert needs at least one slot"
        )
    if num_replicas % num_gpus:
        raise InputError(f"num_replicas={num_replicas} must be a multiple of num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise InputError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    if num_experts % num_groups:
        raise InputError(
            f"num_groups={num_groups} must divide the number of experts ({num_experts})"
        )
    return Layout(num_experts, num_replicas, num_groups, num_nodes, num_gpus)


def to_numpy_load(weight: Any, name: str = "weight") -> np.ndarray:
    """Return ``weight`` as a float64 ``[layers, experts]`` array after checking shape and values.

    Accepts numpy arrays, torch tensors (any device) and nested sequences.
    """
    if _is_torch(weight):
        array = weight.detach().to("cpu").double().numpy()
    else:
        try:
            array = np.asarray(weight, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{name} must be a numeric [layers, experts] array: {exc}") from None
    if array.ndim != 2:
        raise InputError(
            f"{name} must have shape [layers, experts]; got shape {tuple(array.shape)}"
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise InputError(
            f"{name} must have at least one layer and one expert; got shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise InputError(f"{name} must be finite; it holds NaN or infinity")
    if (array < 0).any():
        raise InputError(
            f"{name} must be >= 0 (token counts or loads); its minimum is {array.min()}"
        )
    # placement runs in float32 as DeepSeek's does: a layer's sum must stay finite there
    limit = float(np.finfo(np.float32).max) / array.shape[1]
    if array.max() > limit:
        raise InputError(
            f"{name} must be <= {limit:.3g} (float32 range over {array.shape[1]} experts); "
            f"its maximum is {array.max():.3g}"
        )
    return array


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def like_input(array: np.ndarray, reference: Any) -> Any:
    """Return ``array`` as a torch tensor on ``reference``'s device if ``reference`` is one, else as is."""
    if _is_torch(reference):
        import torch

        return torch.from_numpy(np.ascontiguousarray(array)).to(reference.device)
    return array

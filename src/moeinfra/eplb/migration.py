"""Expert-weight transfers needed to go from one plan to another."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moeinfra.eplb.plan import Plan, gpu_presence
from moeinfra.errors import InputError


@dataclass(frozen=True)
class Migration:
    """Transfers between two plans.

    Attributes:
        transfers: ``[T, 4]`` int64 rows ``(layer, expert, source_gpu, destination_gpu)``; one per slot
            whose expert changed and whose GPU did not already hold that expert.
        slots_changed: physical slots whose expert differs between the plans (local copies included).
        bytes: ``T * bytes_per_expert``.
    """

    transfers: np.ndarray
    slots_changed: int
    bytes: int

    @property
    def num_transfers(self) -> int:
        return int(self.transfers.shape[0])

    def to_records(self) -> list[dict[str, Any]]:
        keys = ("layer", "expert", "source_gpu", "destination_gpu")
        return [dict(zip(keys, map(int, row), strict=True)) for row in self.transfers]


def migration(previous: Plan, plan: Plan, bytes_per_expert: int = 0) -> Migration:
    """List the transfers that turn ``previous`` into ``plan``.

    Each slot of ``plan`` whose expert is new to its GPU is fetched from a GPU that held the expert in
    ``previous``: one on the same node if there is one, else any; among those, the one that has sent
    the fewest weights so far in this layer (spreads the sending), then the lowest GPU id.

    Args:
        previous, plan: plans with the same layout and layer count.
        bytes_per_expert: size of one expert's weights (e.g. 3 * 7168 * 2048 bytes in FP8 for DeepSeek-V3).
    """
    if previous.layout != plan.layout or previous.phy2log.shape != plan.phy2log.shape:
        raise InputError(
            f"plans differ in layout or shape: {previous.layout}, {previous.phy2log.shape} vs "
            f"{plan.layout}, {plan.phy2log.shape}"
        )
    if bytes_per_expert < 0:
        raise InputError(f"bytes_per_expert={bytes_per_expert} must be >= 0")
    lay = plan.layout
    old_presence = gpu_presence(previous.phy2log, lay.num_gpus, lay.num_experts) > 0
    slot_gpu = plan.slot_gpu()
    changed = previous.phy2log != plan.phy2log
    rows: list[tuple[int, int, int, int]] = []
    for layer in np.flatnonzero(changed.any(axis=1)):
        sent = np.zeros(lay.num_gpus, dtype=np.int64)
        fetched: set[tuple[int, int]] = set()
        for slot in np.flatnonzero(changed[layer]):
            expert, gpu = int(plan.phy2log[layer, slot]), int(slot_gpu[slot])
            if old_presence[layer, gpu, expert] or (expert, gpu) in fetched:
                continue
            holders = np.flatnonzero(old_presence[layer, :, expert])
            same_node = holders[holders // lay.gpus_per_node == gpu // lay.gpus_per_node]
            pool = same_node if same_node.size else holders
            source = int(pool[np.argmin(sent[pool])])
            sent[source] += 1
            fetched.add((expert, gpu))
            rows.append((int(layer), expert, source, gpu))
    transfers = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return Migration(transfers, int(changed.sum()), int(transfers.shape[0]) * int(bytes_per_expert))

"""``Plan``: where every physical expert slot of every layer lives. The spine of the EPLB package.

Producers (:func:`moeinfra.eplb.rebalance`) make it; metrics, migration, dispatch, figures and the CLI
read it. Saved as ``.npz`` (arrays + layout) or ``.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moeinfra.atomicio import atomic_path
from moeinfra.eplb.inputs import Layout, check_layout
from moeinfra.eplb.jit import kernel
from moeinfra.errors import InputError


@dataclass(frozen=True)
class Plan:
    """Placement of physical expert replicas.

    Attributes:
        phy2log: ``[L, R]`` int64, logical expert held by each physical slot. Slot ``r`` is on GPU
            ``r // (R / num_gpus)``, GPU ``g`` on node ``g // (num_gpus / num_nodes)``.
        log2phy: ``[L, E, K]`` int64, the slots of each expert, padded with -1 (``K = R - E + 1``).
        logcnt: ``[L, E]`` int64, replicas per expert.
        gpu_load: ``[L, num_gpus]`` float64, load of each GPU under the load the plan was built for
            (an expert's load split evenly over its replicas).
        layout: slot/hardware numbers. policy: which policy produced the plan.
        expert_load: ``[L, E]`` float64, the load the plan was built for (``None`` if unknown).
        metrics: producer's notes (``layer_policy``, ``moves``); not saved.
    """

    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    gpu_load: np.ndarray
    layout: Layout
    policy: str
    expert_load: np.ndarray | None = None
    metrics: dict = field(default_factory=dict, compare=False)

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    def slot_gpu(self) -> np.ndarray:
        """``[R]`` GPU of each physical slot."""
        return np.arange(self.layout.num_replicas) // self.layout.slots_per_gpu

    def gpu_experts(self) -> np.ndarray:
        """``[L, num_gpus, slots_per_gpu]`` experts held by each GPU."""
        return self.phy2log.reshape(
            self.num_layers, self.layout.num_gpus, self.layout.slots_per_gpu
        )

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Everything :meth:`save` writes, as named arrays."""
        lay = self.layout
        arrays = {
            "phy2log": self.phy2log,
            "log2phy": self.log2phy,
            "logcnt": self.logcnt,
            "gpu_load": self.gpu_load,
            "layout": np.array(
                [lay.num_experts, lay.num_replicas, lay.num_groups, lay.num_nodes, lay.num_gpus],
                dtype=np.int64,
            ),
            "policy": np.array(self.policy),
        }
        if self.expert_load is not None:
            arrays["load"] = self.expert_load
        return arrays

    def save(self, path: str | Path) -> Path:
        """Write the plan to ``.npz`` or ``.json`` (by suffix) atomically; return the path."""
        path = Path(path)
        if path.suffix not in (".npz", ".json"):
            raise InputError(f"plan path {str(path)!r} must end in .npz or .json")
        with atomic_path(path) as tmp:
            if path.suffix == ".npz":
                np.savez_compressed(tmp, **self.to_arrays())
            else:
                payload = {k: v.tolist() for k, v in self.to_arrays().items()}
                tmp.write_text(json.dumps(payload))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`."""
        path = Path(path)
        if not path.exists():
            raise InputError(f"plan file {str(path)!r} does not exist")
        where = f"plan file {str(path)!r}"
        try:
            if path.suffix == ".json":
                raw = json.loads(path.read_text())
                if not isinstance(raw, dict):
                    raise ValueError(f"a JSON {type(raw).__name__}, not an object of arrays")
                arrays = {k: np.asarray(v) for k, v in raw.items()}
            else:
                with np.load(path, allow_pickle=False) as data:
                    if not hasattr(data, "files"):
                        raise ValueError("one array, not a plan's named arrays")
                    arrays = {k: data[k] for k in data.files}
            missing = {"phy2log", "log2phy", "logcnt", "gpu_load", "layout", "policy"} - set(arrays)
            if missing:
                raise ValueError(f"no {', '.join(sorted(missing))} (a load file?)")
            layout = check_layout(*(int(x) for x in np.asarray(arrays["layout"]).ravel()))
            plan = cls(
                phy2log=arrays["phy2log"].astype(np.int64),
                log2phy=arrays["log2phy"].astype(np.int64),
                logcnt=arrays["logcnt"].astype(np.int64),
                gpu_load=arrays["gpu_load"].astype(np.float64),
                layout=layout,
                policy=str(arrays["policy"]),
                expert_load=arrays["load"].astype(np.float64) if "load" in arrays else None,
            )
        except (KeyError, ValueError, TypeError, OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{where} is not a moeinfra plan: {exc}") from None
        plan.check(where)
        return plan

    def check(self, where: str = "plan") -> None:
        """Raise :class:`InputError` unless the arrays are a consistent plan for ``layout``:
        shapes, expert ids in range, every expert placed, ``logcnt`` and ``log2phy`` derived from
        ``phy2log``, finite loads."""
        lay, p = self.layout, self.phy2log

        def bad(what: str) -> InputError:
            return InputError(f"{where}: {what}")

        if p.ndim != 2 or p.shape[1] != lay.num_replicas or p.shape[0] < 1:
            raise bad(f"phy2log has shape {p.shape}, want [layers, {lay.num_replicas}]")
        if p.min() < 0 or p.max() >= lay.num_experts:
            raise bad(
                f"phy2log holds expert ids {p.min()}..{p.max()}, allowed 0..{lay.num_experts - 1}"
            )
        counts = count_replicas(p, lay.num_experts)
        if (counts == 0).any():
            layer, expert = np.argwhere(counts == 0)[0]
            raise bad(f"expert {expert} has no slot in layer {layer}")
        if self.logcnt.shape != counts.shape or (self.logcnt != counts).any():
            raise bad("logcnt does not count phy2log's replicas")
        width = self.log2phy.shape[-1] if self.log2phy.ndim == 3 else 0
        if self.log2phy.shape[:2] != counts.shape or width < counts.max():
            raise bad(
                f"log2phy has shape {self.log2phy.shape}, want [{p.shape[0]}, "
                f"{lay.num_experts}, >= {counts.max()}]"
            )
        used = int(counts.max())  # columns past the most replicas hold only padding
        head = self.log2phy[..., :used]
        listed = np.arange(used) < counts[..., None]
        slots = np.where(listed, head, 0)
        # each layer lists every slot exactly once, under the expert that slot holds
        # (logcnt sums to R per layer, so each layer lists R slots)
        per_layer = np.sort(slots[listed].reshape(p.shape[0], lay.num_replicas), axis=1)
        ok = (
            (self.log2phy[..., used:] == -1).all()
            and (head[~listed] == -1).all()
            and (per_layer == np.arange(lay.num_replicas)).all()
        )
        if ok:
            owner = np.take_along_axis(p, slots.reshape(p.shape[0], -1), 1).reshape(slots.shape)
            ok = bool((owner == np.arange(lay.num_experts)[None, :, None])[listed].all())
        if not ok:
            raise bad("log2phy does not list each expert's slots of phy2log (padded with -1)")
        if (
            self.gpu_load.shape != (p.shape[0], lay.num_gpus)
            or not np.isfinite(self.gpu_load).all()
        ):
            raise bad(f"gpu_load must be finite, shape [{p.shape[0]}, {lay.num_gpus}]")
        if self.expert_load is not None and (
            self.expert_load.shape != counts.shape or not np.isfinite(self.expert_load).all()
        ):
            raise bad(f"load must be finite, shape [{p.shape[0]}, {lay.num_experts}]")


def replica_load(load: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """``[L, R]`` load of each physical slot: its expert's load divided by the expert's replica count."""
    per_replica = load / np.maximum(logcnt, 1)
    return np.take_along_axis(per_replica, phy2log, axis=1)


def gpu_loads(
    load: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int
) -> np.ndarray:
    """``[L, num_gpus]`` summed slot loads per GPU."""
    slots = replica_load(load, phy2log, logcnt)
    return slots.reshape(slots.shape[0], num_gpus, -1).sum(axis=2)


@kernel()
def _plan_rows(phy2log, load, num_gpus, logcnt, log2phy, gpu_load):
    """Per layer: replica counts, each expert's slots in slot order (rest -1), GPU loads."""
    num_layers, num_replicas = phy2log.shape
    slots_per_gpu = num_replicas // num_gpus
    log2phy[:] = -1
    gpu_load[:] = 0.0
    for layer in range(num_layers):
        for slot in range(num_replicas):
            expert = phy2log[layer, slot]
            log2phy[layer, expert, logcnt[layer, expert]] = slot
            logcnt[layer, expert] += 1
        for slot in range(num_replicas):
            expert = phy2log[layer, slot]
            gpu_load[layer, slot // slots_per_gpu] += load[layer, expert] / logcnt[layer, expert]


def count_replicas(phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, E]`` number of slots holding each expert."""
    num_layers = phy2log.shape[0]
    flat = phy2log + np.arange(num_layers)[:, None] * num_experts
    return np.bincount(flat.ravel(), minlength=num_layers * num_experts).reshape(num_layers, -1)


def gpu_presence(phy2log: np.ndarray, num_gpus: int, num_experts: int) -> np.ndarray:
    """``[L, num_gpus, E]`` how many slots of each GPU hold each expert."""
    num_layers, num_replicas = phy2log.shape
    slot_gpu = np.arange(num_replicas) // (num_replicas // num_gpus)
    flat = (np.arange(num_layers)[:, None] * num_gpus + slot_gpu) * num_experts + phy2log
    counts = np.bincount(flat.ravel(), minlength=num_layers * num_gpus * num_experts)
    return counts.astype(np.int16).reshape(num_layers, num_gpus, num_experts)


def make_plan(
    phy2log: np.ndarray, load: np.ndarray, layout: Layout, policy: str, metrics: dict | None = None
) -> Plan:
    """Build a :class:`Plan` from ``phy2log [L, R]``, deriving ``logcnt``, ``log2phy`` and GPU loads.

    ``log2phy[l, e]`` lists expert ``e``'s slots in slot order, padded with -1 to ``R - E + 1``.
    """
    phy2log = np.ascontiguousarray(phy2log, dtype=np.int64)
    num_layers = phy2log.shape[0]
    max_replicas = layout.num_replicas - layout.num_experts + 1
    logcnt = np.zeros((num_layers, layout.num_experts), dtype=np.int64)
    log2phy = np.empty((num_layers, layout.num_experts, max_replicas), dtype=np.int64)
    gpu_load = np.empty((num_layers, layout.num_gpus))
    _plan_rows(
        phy2log,
        np.ascontiguousarray(load, dtype=np.float64),
        layout.num_gpus,
        logcnt,
        log2phy,
        gpu_load,
    )
    return Plan(
        phy2log=phy2log,
        log2phy=log2phy,
        logcnt=logcnt,
        gpu_load=gpu_load,
        layout=layout,
        policy=policy,
        expert_load=load,
        metrics=metrics or {},
    )

"""Kernel breakdown: count, total, mean, min, max and std of op durations per name and per class.

Statistics are over op durations (µs) exactly as recorded; ``std`` is the population standard
deviation (ddof=0, 0 for a single op), computed in two passes for accuracy. ``exposed_us`` is, for
communication ops, the part of their time not covered by any compute op of the same device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeinfra.trace import intervals
from moeinfra.trace.classify import CLASS_NAMES, COMM, COMPUTE, op_key
from moeinfra.trace.model import KIND_NAMES, Trace


@dataclass(frozen=True)
class KernelStats:
    """Duration statistics of one group of ops (µs)."""

    name: str
    op_class: str
    kind: str
    count: int
    total_us: float
    mean_us: float
    min_us: float
    max_us: float
    std_us: float
    exposed_us: float
    share: float  # of the summed duration of all GPU ops

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def display_name(name: str, width: int = 80) -> str:
    """Short form of a kernel name for tables: no return type, no parameter list, at most ``width`` chars."""
    key = op_key(name)
    depth = 0
    for i, ch in enumerate(key):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            key = key[:i].rstrip()
            break
    return key if len(key) <= width else key[: width - 3] + "..."


def exposed_per_op(trace: Trace, classes: np.ndarray) -> np.ndarray:
    """Per communication op, ns of it not covered by compute on its device (0 for other ops), int64 ``[n]``."""
    gpu = trace.gpu
    out = np.zeros(len(gpu), dtype=np.int64)
    for rows in trace.device_slices().values():
        c = classes[rows]
        compute = intervals.union(gpu.start_ns[rows][c == COMPUTE], gpu.end_ns[rows][c == COMPUTE])
        sel = np.flatnonzero(c == COMM) + rows.start
        covered = intervals.covered_length(compute, gpu.start_ns[sel], gpu.end_ns[sel])
        out[sel] = gpu.end_ns[sel] - gpu.start_ns[sel] - covered
    return out


def _group_stats(
    group: np.ndarray, n_groups: int, dur_us: np.ndarray, exposed_us: np.ndarray
) -> dict[str, np.ndarray]:
    count = np.bincount(group, minlength=n_groups)
    total = np.bincount(group, weights=dur_us, minlength=n_groups)
    mean = np.divide(total, count, out=np.zeros(n_groups), where=count > 0)
    dev = dur_us - mean[group]
    var = np.divide(
        np.bincount(group, weights=dev * dev, minlength=n_groups),
        count,
        out=np.zeros(n_groups),
        where=count > 0,
    )
    mins = np.full(n_groups, np.inf)
    maxs = np.full(n_groups, -np.inf)
    np.minimum.at(mins, group, dur_us)
    np.maximum.at(maxs, group, dur_us)
    return {
        "count": count,
        "total": total,
        "mean": mean,
        "min": mins,
        "max": maxs,
        "std": np.sqrt(var),
        "exposed": np.bincount(group, weights=exposed_us, minlength=n_groups),
    }


def kernel_breakdown(trace: Trace, classes: np.ndarray, by: str = "name") -> list[KernelStats]:
    """Statistics per op name (``by="name"``), per class (``"class"``: compute / communication / memory)
    or per Kineto category (``"kind"``: kernel / memcpy / memset), sorted by total time, descending."""
    gpu = trace.gpu
    if len(gpu) == 0:
        return []
    dur_us = gpu.dur_ns.astype(np.float64) * 1e-3
    exposed_us = exposed_per_op(trace, classes).astype(np.float64) * 1e-3
    grand = float(dur_us.sum())
    if by == "name":
        # A name can occur with more than one class only through user rules on kind; key on both.
        key = gpu.name_id.astype(np.int64) * 3 + classes
        uniq, group = np.unique(key, return_inverse=True)
        labels = [gpu.names[int(k // 3)] for k in uniq]
        cls = [CLASS_NAMES[int(k % 3)] for k in uniq]
        first = np.zeros(uniq.size, dtype=np.int64)
        first[group[::-1]] = np.arange(len(gpu))[::-1]
        kinds = [KIND_NAMES[int(gpu.kind[i])] for i in first]
    elif by == "class":
        uniq, group = np.unique(classes, return_inverse=True)
        labels = [CLASS_NAMES[int(k)] for k in uniq]
        cls = labels
        kinds = ["*"] * uniq.size
    elif by == "kind":
        uniq, group = np.unique(gpu.kind, return_inverse=True)
        labels = [KIND_NAMES[int(k)] for k in uniq]
        cls = ["*"] * uniq.size
        kinds = labels
    else:
        from moeinfra.errors import InputError

        raise InputError(f"by={by!r} is not allowed; use 'name', 'class' or 'kind'")
    st = _group_stats(group, uniq.size, dur_us, exposed_us)
    out = [
        KernelStats(
            name=labels[i],
            op_class=cls[i],
            kind=kinds[i],
            count=int(st["count"][i]),
            total_us=float(st["total"][i]),
            mean_us=float(st["mean"][i]),
            min_us=float(st["min"][i]),
            max_us=float(st["max"][i]),
            std_us=float(st["std"][i]),
            exposed_us=float(st["exposed"][i]),
            share=float(st["total"][i]) / grand if grand else 0.0,
        )
        for i in range(uniq.size)
    ]
    out.sort(key=lambda k: (-k.total_us, k.name))
    return out

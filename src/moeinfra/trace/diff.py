"""Compare two traces: decomposition side by side, kernels that got slower, communication that became exposed.

Devices are matched by ``(rank, device)``; a device present in only one trace is listed with the
other side ``None``. Kernels are matched by name; ``exposed_us`` is the part of a communication
kernel's time not covered by compute (see :mod:`moeinfra.trace.kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeinfra.trace.kernels import KernelStats, kernel_breakdown
from moeinfra.trace.summary import TraceReport

_METRICS = (
    "span_us",
    "busy_us",
    "idle_us",
    "compute_us",
    "comm_us",
    "memory_us",
    "overlap_us",
    "exposed_comm_us",
    "exposed_memory_us",
    "comm_hidden_fraction",
)


@dataclass(frozen=True)
class TraceDiff:
    """Result of :func:`diff_reports` (JSON-ready through :meth:`to_dict`)."""

    devices: list[dict]
    kernels: list[dict]

    def to_dict(self) -> dict:
        return {"devices": self.devices, "kernels": self.kernels}


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def diff_reports(a: TraceReport, b: TraceReport, top: int | None = None) -> TraceDiff:
    """Side-by-side metrics per device and per kernel name (``b - a``), kernels sorted by |Δ total|.

    ``top`` keeps only the first ``top`` kernels.
    """
    da = {(d.decomposition.rank, d.decomposition.device): d.to_dict() for d in a.devices}
    db = {(d.decomposition.rank, d.decomposition.device): d.to_dict() for d in b.devices}
    devices = []
    for key in sorted(set(da) | set(db)):
        left, right = da.get(key), db.get(key)
        metrics = {}
        for m in _METRICS:
            va = None if left is None else left[m]
            vb = None if right is None else right[m]
            metrics[m] = {"a": va, "b": vb, "delta": _delta(va, vb)}
        devices.append({"rank": key[0], "device": key[1], "metrics": metrics})

    ka = {k.name: k for k in kernel_breakdown(a.trace, a.classes)}
    kb = {k.name: k for k in kernel_breakdown(b.trace, b.classes)}
    kernels = []
    for name in set(ka) | set(kb):
        x, y = ka.get(name), kb.get(name)
        kernels.append(
            {
                "name": name,
                "op_class": (y or x).op_class,  # type: ignore[union-attr]
                "a_count": _get(x, "count", 0),
                "b_count": _get(y, "count", 0),
                "a_total_us": _get(x, "total_us", 0.0),
                "b_total_us": _get(y, "total_us", 0.0),
                "delta_total_us": _get(y, "total_us", 0.0) - _get(x, "total_us", 0.0),
                "a_mean_us": _get(x, "mean_us", None),
                "b_mean_us": _get(y, "mean_us", None),
                "a_exposed_us": _get(x, "exposed_us", 0.0),
                "b_exposed_us": _get(y, "exposed_us", 0.0),
                "delta_exposed_us": _get(y, "exposed_us", 0.0) - _get(x, "exposed_us", 0.0),
            }
        )
    kernels.sort(key=lambda k: (-abs(k["delta_total_us"]), -abs(k["delta_exposed_us"]), k["name"]))
    if top is not None:
        kernels = kernels[:top]
    return TraceDiff(devices=devices, kernels=kernels)


def _get(stats: KernelStats | None, field: str, default):
    return default if stats is None else getattr(stats, field)

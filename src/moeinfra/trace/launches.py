"""Kernel-launch statistics: how long launches take on the CPU and how long ops wait to start (as in HTA).

Each GPU op is joined to the runtime call that launched it (same rank, same correlation id; the
calls in :data:`LAUNCH_CALLS`). Per launch, in ns (Holistic Trace Analysis,
``get_cuda_kernel_launch_stats``):

- ``cpu_dur``  = duration of the launch call;
- ``gpu_dur``  = duration of the GPU op;
- ``launch_delay`` = op start − **end** of the launch call, clipped at 0 (a negative value means the
  CPU and GPU clocks disagree; such launches are counted in ``clipped``).

And per rank, with HTA's default thresholds: **short kernels** = ops that run for less time than
their launch call took, among calls not longer than ``runtime_cutoff`` (``gpu_dur < cpu_dur`` and
``cpu_dur <= 50 µs``): the GPU finishes them faster than the CPU can issue them; **runtime outliers**
= launch calls longer than ``runtime_cutoff`` (50 µs); **launch-delay outliers** = ops that start
more than ``launch_delay_cutoff`` (100 µs) after their launch call returned.

Where this differs from HTA: the launch calls are HTA's queue-length set (``cudaLaunchKernel``,
``cudaLaunchKernelExC``, ``cuLaunchKernel``, ``cuLaunchKernelEx``, ``cudaMemcpyAsync``,
``cudaMemsetAsync`` and the HIP equivalents), a superset of the four names HTA's launch statistics
use, so Triton's driver launches count too; times are exact ns (HTA rounds fractional µs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeinfra.errors import InputError
from moeinfra.trace.attribution import link_launches
from moeinfra.trace.model import Trace

#: Runtime/driver calls that enqueue exactly one GPU op (graph launches enqueue many: left out).
LAUNCH_CALLS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaMemcpyAsync",
        "cudaMemsetAsync",
        "hipLaunchKernel",
        "hipExtModuleLaunchKernel",
        "hipMemcpyAsync",
        "hipMemsetAsync",
        "hipMemcpyWithStream",
    }
)
#: HTA's defaults (``runtime_cutoff=50``, ``launch_delay_cutoff=100``, µs).
DEFAULT_RUNTIME_CUTOFF_NS = 50_000
DEFAULT_LAUNCH_DELAY_CUTOFF_NS = 100_000


@dataclass(frozen=True)
class Launches:
    """One row per GPU op launched by a :data:`LAUNCH_CALLS` call, shape ``[m]`` each, times ns.

    ``op`` indexes ``trace.gpu``, ``call`` indexes ``trace.cpu``; ``raw_delay_ns`` is the unclipped
    op start − call end.
    """

    op: np.ndarray  # int64
    call: np.ndarray  # int64
    cpu_dur_ns: np.ndarray  # int64
    gpu_dur_ns: np.ndarray  # int64
    raw_delay_ns: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.op.shape[0])

    @property
    def launch_delay_ns(self) -> np.ndarray:
        """HTA's launch delay: op start − call end, clipped at 0 (int64 ``[m]``)."""
        return np.maximum(self.raw_delay_ns, 0)


def launch_calls_mask(trace: Trace) -> np.ndarray:
    """Which CPU events are :data:`LAUNCH_CALLS` calls (bool ``[n_cpu]``)."""
    cpu = trace.cpu
    is_launch = np.asarray([name in LAUNCH_CALLS for name in cpu.names], dtype=bool)
    return is_launch[cpu.name_id] if len(cpu.names) else np.zeros(len(cpu), dtype=bool)


def launch_table(trace: Trace, launch: np.ndarray | None = None) -> Launches:
    """Every GPU op joined to its launch call (``launch`` from ``link_launches``, computed if None)."""
    launch = link_launches(trace) if launch is None else launch
    cpu, gpu = trace.cpu, trace.gpu
    ok = launch >= 0
    if ok.any():
        ok[ok] = launch_calls_mask(trace)[launch[ok]]
    op = np.flatnonzero(ok)
    call = launch[op]
    return Launches(
        op=op,
        call=call,
        cpu_dur_ns=cpu.end_ns[call] - cpu.start_ns[call],
        gpu_dur_ns=gpu.end_ns[op] - gpu.start_ns[op],
        raw_delay_ns=gpu.start_ns[op] - cpu.end_ns[call],
    )


@dataclass(frozen=True)
class LaunchSummary:
    """Launch statistics of one rank (times ns). Distributions give mean, p50, p95, max."""

    rank: int
    gpu_ops: int  # all GPU ops of the rank
    launches: int  # of them joined to a launch call
    cpu_dur_ns: dict[str, float]
    gpu_dur_ns: dict[str, float]
    launch_delay_ns: dict[str, float]
    total_launch_delay_ns: int
    short_kernels: int
    short_kernel_gpu_ns: int
    runtime_outliers: int
    launch_delay_outliers: int
    clipped: int
    runtime_cutoff_ns: int
    launch_delay_cutoff_ns: int
    short_by_name: list[tuple[str, int, int]]  # (name, count, total gpu ns), most frequent first
    worst: list[dict]  # the launches with the longest delay (op_start_us: from the first GPU op)

    def to_dict(self) -> dict:
        """JSON-ready dict, times in µs."""
        us = 1e-3

        def dist(d: dict[str, float]) -> dict[str, float]:
            return {f"{k}_us": v * us for k, v in d.items()}

        return {
            "rank": self.rank,
            "gpu_ops": self.gpu_ops,
            "launches": self.launches,
            "cpu_duration": dist(self.cpu_dur_ns),
            "gpu_duration": dist(self.gpu_dur_ns),
            "launch_delay": dist(self.launch_delay_ns),
            "total_launch_delay_us": self.total_launch_delay_ns * us,
            "short_kernels": self.short_kernels,
            "short_kernel_gpu_us": self.short_kernel_gpu_ns * us,
            "runtime_outliers": self.runtime_outliers,
            "launch_delay_outliers": self.launch_delay_outliers,
            "clipped_negative_delays": self.clipped,
            "runtime_cutoff_us": self.runtime_cutoff_ns * us,
            "launch_delay_cutoff_us": self.launch_delay_cutoff_ns * us,
            "short_by_name": [
                {"name": n, "count": c, "gpu_us": g * us} for n, c, g in self.short_by_name
            ],
            "worst": self.worst,
        }


def _dist(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
    p50, p95 = np.percentile(values, [50, 95])
    return {
        "mean": float(values.mean()),
        "p50": float(p50),
        "p95": float(p95),
        "max": float(values.max()),
    }


def launch_stats(
    trace: Trace,
    runtime_cutoff_ns: int = DEFAULT_RUNTIME_CUTOFF_NS,
    launch_delay_cutoff_ns: int = DEFAULT_LAUNCH_DELAY_CUTOFF_NS,
    top: int = 10,
) -> list[LaunchSummary]:
    """Launch statistics per rank (see the module docstring); ``top`` bounds the name and worst lists."""
    if runtime_cutoff_ns < 0 or launch_delay_cutoff_ns < 0:
        raise InputError(
            f"runtime_cutoff_ns={runtime_cutoff_ns} and launch_delay_cutoff_ns="
            f"{launch_delay_cutoff_ns} must be >= 0"
        )
    if top < 0:
        raise InputError(f"top={top} must be >= 0")
    gpu = trace.gpu
    origin = trace.start_ns or 0
    table = launch_table(trace)
    delay = table.launch_delay_ns
    op_rank = gpu.rank[table.op]
    out = []
    for rank in np.unique(gpu.rank):
        sel = op_rank == rank
        c, g, d = table.cpu_dur_ns[sel], table.gpu_dur_ns[sel], delay[sel]
        ops = table.op[sel]
        short = (c <= runtime_cutoff_ns) & (g < c)
        names = gpu.name_id[ops[short]]
        uniq, counts = np.unique(names, return_counts=True)
        gpu_ns = np.asarray([int(g[short][names == u].sum()) for u in uniq], dtype=np.int64)
        by_name = sorted(
            zip((gpu.names[int(u)] for u in uniq), counts.tolist(), gpu_ns.tolist(), strict=True),
            key=lambda t: (-t[1], t[0]),
        )[:top]
        worst_rows = np.argsort(-d, kind="stable")[:top]
        worst = [
            {
                "name": gpu.names[int(gpu.name_id[ops[i]])],
                "correlation": int(gpu.correlation[ops[i]]),
                "device": int(gpu.device[ops[i]]),
                "stream": int(gpu.stream[ops[i]]),
                "op_start_us": int(gpu.start_ns[ops[i]] - origin) * 1e-3,
                "cpu_duration_us": int(c[i]) * 1e-3,
                "gpu_duration_us": int(g[i]) * 1e-3,
                "launch_delay_us": int(d[i]) * 1e-3,
            }
            for i in worst_rows
        ]
        out.append(
            LaunchSummary(
                rank=int(rank),
                gpu_ops=int((gpu.rank == rank).sum()),
                launches=int(sel.sum()),
                cpu_dur_ns=_dist(c),
                gpu_dur_ns=_dist(g),
                launch_delay_ns=_dist(d),
                total_launch_delay_ns=int(d.sum()),
                short_kernels=int(short.sum()),
                short_kernel_gpu_ns=int(g[short].sum()),
                runtime_outliers=int((c > runtime_cutoff_ns).sum()),
                launch_delay_outliers=int((d > launch_delay_cutoff_ns).sum()),
                clipped=int((table.raw_delay_ns[sel] < 0).sum()),
                runtime_cutoff_ns=runtime_cutoff_ns,
                launch_delay_cutoff_ns=launch_delay_cutoff_ns,
                short_by_name=by_name,
                worst=worst,
            )
        )
    return out

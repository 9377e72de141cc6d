"""The shared trace model every analyzer reads: GPU ops, CPU events, annotations, flows, devices.

Everything is stored as column arrays (one row per event), times as int64 **nanoseconds** on the
trace's own clock, so interval arithmetic is exact. Producers: :mod:`moeinfra.trace.reader`.
Consumers: the analyzers (:mod:`~moeinfra.trace.overlap`, :mod:`~moeinfra.trace.attribution`,
:mod:`~moeinfra.trace.kernels`, :mod:`~moeinfra.trace.diff`, :mod:`~moeinfra.trace.timeline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# GPU op kinds (values of GpuOps.kind).
KERNEL, MEMCPY, MEMSET = 0, 1, 2
KIND_NAMES = ("kernel", "memcpy", "memset")

# CPU event kinds (values of CpuEvents.kind).
CPU_OP, RUNTIME, PYTHON, OTHER_CPU = 0, 1, 2, 3
CPU_KIND_NAMES = ("cpu_op", "runtime", "python_function", "other")


@dataclass(frozen=True)
class GpuOps:
    """GPU ops (kernels, memcpy, memset), one row per op, sorted by (rank, device, stream, start).

    ``names[name_id[i]]`` is the name of op ``i``. ``correlation`` links an op to the CPU runtime
    call that launched it (-1 when the trace has none); ``blocks`` is the product of ``args.grid``
    (0 when unknown, e.g. memcpy). All arrays have shape ``[n]``.
    """

    names: list[str]
    name_id: np.ndarray  # int32
    kind: np.ndarray  # int8: KERNEL / MEMCPY / MEMSET
    rank: np.ndarray  # int32
    device: np.ndarray  # int32
    stream: np.ndarray  # int64
    start_ns: np.ndarray  # int64
    end_ns: np.ndarray  # int64
    correlation: np.ndarray  # int64
    blocks: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.start_ns.shape[0])

    @property
    def dur_ns(self) -> np.ndarray:
        """Durations, int64 ns, shape ``[n]``."""
        return self.end_ns - self.start_ns

    def op_names(self) -> np.ndarray:
        """Name of every op as an object array ``[n]`` (allocates; analyzers use ``name_id``)."""
        return np.asarray(self.names, dtype=object)[self.name_id]


@dataclass(frozen=True)
class CpuEvents:
    """Complete ('X') CPU-side events: operators, runtime/driver calls, python functions.

    ``thread`` indexes ``threads`` (``(rank, pid, tid)`` as strings), ``correlation`` is -1 when
    absent (only runtime launches carry one). Arrays have shape ``[n]``; sorted by start.
    """

    names: list[str]
    name_id: np.ndarray  # int32
    kind: np.ndarray  # int8: CPU_OP / RUNTIME / PYTHON / OTHER_CPU
    rank: np.ndarray  # int32
    thread: np.ndarray  # int32
    start_ns: np.ndarray  # int64
    end_ns: np.ndarray  # int64
    correlation: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.start_ns.shape[0])


@dataclass(frozen=True)
class Annotations:
    """User annotations (``record_function`` ranges, cat ``user_annotation``), shape ``[n]`` each.

    ``on_gpu`` marks the GPU-timeline copies Kineto writes (cat ``gpu_user_annotation``); the
    attribution uses the CPU ones, the timeline can draw either.
    """

    names: list[str]
    name_id: np.ndarray  # int32
    rank: np.ndarray  # int32
    thread: np.ndarray  # int32
    start_ns: np.ndarray  # int64
    end_ns: np.ndarray  # int64
    on_gpu: np.ndarray  # bool

    def __len__(self) -> int:
        return int(self.start_ns.shape[0])


@dataclass(frozen=True)
class Flows:
    """Flow events (``ph`` 's' / 'f'): e.g. Kineto's ``ac2g`` launch->kernel arrows. Shape ``[n]``."""

    flow_id: np.ndarray  # int64 (hash of the id for string ids)
    is_start: np.ndarray  # bool
    rank: np.ndarray  # int32
    ts_ns: np.ndarray  # int64
    category: list[str]
    category_id: np.ndarray  # int32

    def __len__(self) -> int:
        return int(self.ts_ns.shape[0])


@dataclass(frozen=True)
class DeviceProps:
    """What a trace says about one GPU (Kineto ``deviceProperties``)."""

    device: int
    name: str
    num_sms: int | None


@dataclass(frozen=True)
class Trace:
    """One trace (a file, or a folder of per-rank files merged, each rank's events tagged with it).

    ``devices[(rank, device)]`` holds device properties when the trace has them; ``sources`` lists
    the files read (index = position in ``ranks``); ``skipped`` counts events that could not be used
    (e.g. a GPU op without ``dur``) by reason — nothing is dropped silently.
    """

    gpu: GpuOps
    cpu: CpuEvents
    annotations: Annotations
    flows: Flows
    threads: list[tuple[int, str, str]]
    devices: dict[tuple[int, int], DeviceProps]
    ranks: list[int]
    sources: list[str]
    skipped: dict[str, int] = field(default_factory=dict)

    def device_keys(self) -> list[tuple[int, int]]:
        """Sorted ``(rank, device)`` pairs that have at least one GPU op."""
        if len(self.gpu) == 0:
            return []
        pairs = np.unique(np.stack([self.gpu.rank, self.gpu.device], axis=1), axis=0)
        return [(int(r), int(d)) for r, d in pairs]

    def device_slices(self) -> dict[tuple[int, int], slice]:
        """``(rank, device) -> slice`` of the GPU op rows (ops are sorted by rank, device first)."""
        n = len(self.gpu)
        if n == 0:
            return {}
        key = self.gpu.rank.astype(np.int64) << 32 | (self.gpu.device.astype(np.int64) & 0xFFFFFFFF)
        cuts = np.flatnonzero(np.diff(key)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [n]])
        return {
            (int(self.gpu.rank[s]), int(self.gpu.device[s])): slice(int(s), int(e))
            for s, e in zip(starts, ends, strict=True)
        }

    @property
    def start_ns(self) -> int | None:
        """Earliest GPU op start (ns), or None for a trace without GPU ops."""
        return int(self.gpu.start_ns.min()) if len(self.gpu) else None

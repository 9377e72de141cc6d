"""Iterations: the ``ProfilerStep#N`` windows of each rank, which events belong to step N, one step as a Trace.

``torch.profiler``'s ``prof.step()`` writes one CPU range ``ProfilerStep#N`` per training step
(category ``user_annotation``, or ``cpu_op`` in older Kineto). Membership follows Holistic Trace
Analysis (HTA, ``hta/common/trace.py: add_iteration``):

- a CPU event (operator, runtime call, annotation) belongs to step N of its rank when its start lies
  in the step's window ``[start, end)``;
- a GPU op belongs to the step of the runtime call that launched it (same rank and correlation id),
  so kernels that run after the CPU window closed still count for the step that issued them;
- a GPU op without a launching call belongs to no step (HTA: iteration -1) — except on a rank whose
  trace links no GPU op at all (no correlation ids, e.g. a synthetic trace), where a GPU op belongs
  to the step whose window holds its start.

Unlike HTA, nothing is dropped by default: HTA leaves out the last step of a trace with more than
one (often cut short when the profiler stops); here every step is listed, the last one of each rank
marked ``last``, and :func:`select_step` picks any of them. Times are int64 ns as in the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

import numpy as np

from moeinfra.errors import InputError
from moeinfra.trace.attribution import link_launches
from moeinfra.trace.model import CPU_OP, Trace

STEP_PATTERN = re.compile(r"^\s*ProfilerStep\s*#\s*(\d+)\s*$")


@dataclass(frozen=True)
class StepWindows:
    """The ``ProfilerStep#N`` CPU windows of a trace, one row per (rank, step), shape ``[k]`` each.

    Sorted by (rank, start). A step number that occurs more than once on a rank gets the window
    from its first start to its last end.
    """

    rank: np.ndarray  # int32
    step: np.ndarray  # int64: N of ProfilerStep#N
    start_ns: np.ndarray  # int64
    end_ns: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.step.shape[0])

    def numbers(self) -> list[int]:
        """Sorted distinct step numbers over all ranks."""
        return sorted({int(s) for s in self.step})


@dataclass(frozen=True)
class Step:
    """One step of one rank: its CPU window and the GPU ops it launched (times ns)."""

    rank: int
    step: int
    start_ns: int
    end_ns: int
    gpu_ops: int
    gpu_start_ns: int | None  # first start of the step's GPU ops (None without any)
    gpu_end_ns: int | None  # last end of the step's GPU ops
    last: bool  # the last step of its rank (HTA leaves it out by default when there are several)

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


def find_steps(trace: Trace) -> StepWindows:
    """The ``ProfilerStep#N`` windows of every rank (CPU annotations and, for old Kineto, CPU ops)."""
    ann, cpu = trace.annotations, trace.cpu
    ranks, steps, starts, ends = [], [], [], []
    for names, name_id, rows, rank, start, end in (
        (ann.names, ann.name_id, ~ann.on_gpu, ann.rank, ann.start_ns, ann.end_ns),
        (cpu.names, cpu.name_id, cpu.kind == CPU_OP, cpu.rank, cpu.start_ns, cpu.end_ns),
    ):
        number = np.full(len(names), -1, dtype=np.int64)
        for i, name in enumerate(names):
            match = STEP_PATTERN.match(name)
            if match:
                number[i] = int(match.group(1))
        if not (number >= 0).any():
            continue
        sel = rows & (number[name_id] >= 0)
        ranks.append(rank[sel])
        steps.append(number[name_id[sel]])
        starts.append(start[sel])
        ends.append(end[sel])
    if not ranks:
        empty = np.zeros(0, dtype=np.int64)
        return StepWindows(np.zeros(0, dtype=np.int32), empty, empty.copy(), empty.copy())
    rank = np.concatenate(ranks).astype(np.int32)
    step = np.concatenate(steps)
    start = np.concatenate(starts)
    end = np.concatenate(ends)
    # one window per (rank, step): first start, last end
    key = (rank.astype(np.int64) << 40) | step
    uniq, inverse = np.unique(key, return_inverse=True)
    w_start = np.full(uniq.size, np.iinfo(np.int64).max, dtype=np.int64)
    w_end = np.full(uniq.size, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(w_start, inverse, start)
    np.maximum.at(w_end, inverse, end)
    w_rank = (uniq >> 40).astype(np.int32)
    w_step = uniq & ((1 << 40) - 1)
    order = np.lexsort((w_start, w_rank))
    return StepWindows(w_rank[order], w_step[order], w_start[order], w_end[order])


def step_at(windows: StepWindows, ranks: np.ndarray, times_ns: np.ndarray) -> np.ndarray:
    """Step number whose window on the same rank holds each time (int64 ``[n]``, -1 if none).

    Windows of one rank are taken as disjoint (as ``prof.step()`` writes them); where two overlap,
    the later-starting one wins.
    """
    times_ns = np.asarray(times_ns, dtype=np.int64)
    ranks = np.asarray(ranks)
    out = np.full(times_ns.shape, -1, dtype=np.int64)
    for rank in np.unique(windows.rank):
        w = np.flatnonzero(windows.rank == rank)
        sel = np.flatnonzero(ranks == rank)
        if sel.size == 0:
            continue
        i = np.searchsorted(windows.start_ns[w], times_ns[sel], side="right") - 1
        ok = i >= 0
        j = w[np.maximum(i, 0)]
        ok &= times_ns[sel] < windows.end_ns[j]
        out[sel[ok]] = windows.step[j[ok]]
    return out


def gpu_op_steps(
    trace: Trace, windows: StepWindows | None = None, launch: np.ndarray | None = None
) -> np.ndarray:
    """Step number of every GPU op (int64 ``[n_ops]``, -1 for none); see the module docstring.

    ``launch`` (from :func:`~moeinfra.trace.attribution.link_launches`) is computed when not given.
    """
    windows = find_steps(trace) if windows is None else windows
    gpu = trace.gpu
    out = np.full(len(gpu), -1, dtype=np.int64)
    if len(windows) == 0 or len(gpu) == 0:
        return out
    launch = link_launches(trace) if launch is None else launch
    linked = launch >= 0
    out[linked] = step_at(windows, gpu.rank[linked], trace.cpu.start_ns[launch[linked]])
    # A rank without any launch link (no correlation ids): fall back to the op's own start.
    unlinked_ranks = np.setdiff1d(np.unique(gpu.rank), np.unique(gpu.rank[linked]))
    if unlinked_ranks.size:
        sel = np.isin(gpu.rank, unlinked_ranks)
        out[sel] = step_at(windows, gpu.rank[sel], gpu.start_ns[sel])
    return out


def list_steps(trace: Trace) -> list[Step]:
    """Every (rank, step) of the trace, sorted by rank then start, with its GPU op extent."""
    windows = find_steps(trace)
    if len(windows) == 0:
        return []
    op_step = gpu_op_steps(trace, windows)
    gpu = trace.gpu
    out = []
    for i in range(len(windows)):
        rank, number = int(windows.rank[i]), int(windows.step[i])
        sel = (op_step == number) & (gpu.rank == rank)
        count = int(sel.sum())
        out.append(
            Step(
                rank=rank,
                step=number,
                start_ns=int(windows.start_ns[i]),
                end_ns=int(windows.end_ns[i]),
                gpu_ops=count,
                gpu_start_ns=int(gpu.start_ns[sel].min()) if count else None,
                gpu_end_ns=int(gpu.end_ns[sel].max()) if count else None,
                last=bool(i + 1 == len(windows) or windows.rank[i + 1] != rank),
            )
        )
    return out


def _no_step_error(step: int, windows: StepWindows) -> InputError:
    if len(windows) == 0:
        return InputError(
            f"step={step}: the trace has no ProfilerStep#N annotations "
            "(torch.profiler writes them at each prof.step())"
        )
    names = ", ".join(str(n) for n in windows.numbers())
    return InputError(f"step={step} is not in the trace; its steps are {names}")


def _take(table, mask: np.ndarray):
    """A copy of a column table (GpuOps, CpuEvents, ...) with the rows where ``mask`` is True."""
    changes = {
        f.name: getattr(table, f.name)[mask]
        for f in fields(table)
        if isinstance(getattr(table, f.name), np.ndarray)
    }
    return replace(table, **changes)


def select_step(trace: Trace, step: int) -> Trace:
    """The part of ``trace`` that belongs to step ``step`` on every rank that has it.

    Keeps the step's GPU ops (see the module docstring), the CPU events that start in the step's
    window, the annotations that overlap the window (so enclosing ranges still attribute the ops),
    GPU-side annotations and flows within the step's CPU or GPU extent. Every analyzer can then run
    on the result unchanged.

    Raises:
        InputError: the trace has no ``ProfilerStep#N`` annotations, or none numbered ``step``
            (the message lists the steps it has).
    """
    windows = find_steps(trace)
    return select_step_with(trace, step, windows, gpu_op_steps(trace, windows))


def select_step_with(trace: Trace, step: int, windows: StepWindows, op_step: np.ndarray) -> Trace:
    """:func:`select_step` with the windows and the GPU ops' steps already computed (for loops
    over many steps: ``op_step`` from :func:`gpu_op_steps`)."""
    if len(windows) == 0 or not (windows.step == step).any():
        raise _no_step_error(step, windows)
    mine = StepWindows(
        rank=windows.rank[windows.step == step],
        step=windows.step[windows.step == step],
        start_ns=windows.start_ns[windows.step == step],
        end_ns=windows.end_ns[windows.step == step],
    )
    gpu, cpu, ann, flows = trace.gpu, trace.cpu, trace.annotations, trace.flows
    gpu_mask = op_step == step
    cpu_mask = step_at(mine, cpu.rank, cpu.start_ns) == step
    # The extent of the step per rank: its CPU window joined with its GPU ops' extent.
    lo = {int(r): int(s) for r, s in zip(mine.rank, mine.start_ns, strict=True)}
    hi = {int(r): int(e) for r, e in zip(mine.rank, mine.end_ns, strict=True)}
    for rank in lo:
        sel = gpu_mask & (gpu.rank == rank)
        if sel.any():
            lo[rank] = min(lo[rank], int(gpu.start_ns[sel].min()))
            hi[rank] = max(hi[rank], int(gpu.end_ns[sel].max()))
    ann_mask = np.zeros(len(ann), dtype=bool)
    flow_mask = np.zeros(len(flows), dtype=bool)
    for i, rank in enumerate(mine.rank.tolist()):
        on_rank = ann.rank == rank
        cpu_window = (ann.start_ns < mine.end_ns[i]) & (ann.end_ns > mine.start_ns[i])
        extent = (ann.start_ns < hi[rank]) & (ann.end_ns > lo[rank])
        ann_mask |= on_rank & np.where(ann.on_gpu, extent, cpu_window)
        flow_mask |= (flows.rank == rank) & (flows.ts_ns >= lo[rank]) & (flows.ts_ns < hi[rank])
    return replace(
        trace,
        gpu=_take(gpu, gpu_mask),
        cpu=_take(cpu, cpu_mask),
        annotations=_take(ann, ann_mask),
        flows=_take(flows, flow_mask),
    )

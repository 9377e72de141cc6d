"""Attribute GPU ops to user annotations and phases (F / B / W for DualPipe traces).

Each GPU op is linked to the CPU runtime call that launched it (same rank, same correlation id);
the op's *region* is the innermost user annotation (``record_function`` range, CPU side, any
thread of the rank) that encloses the launch time ``[start, end)``, innermost = shortest. Its
*phase* is taken from the innermost enclosing annotation whose name matches the phase pattern
(default: a ``(F)``, ``(B)`` or ``(W)`` suffix, as in DeepSeek's ``attn(F)``, ``mlp(B)``).

Per device and phase, :func:`phase_breakdown` gives compute / comm / memory time (unions) and the
cross-phase matrix ``phase_overlap[X][Y] = |comm of phase X ∩ compute of phase Y|``: how much of
X's communication is hidden by Y's computation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from moeinfra.errors import InputError
from moeinfra.trace import intervals
from moeinfra.trace.classify import COMM, COMPUTE, MEMORY
from moeinfra.trace.model import RUNTIME, Trace

DEFAULT_PHASE_PATTERN = r"\((?P<phase>[FBW])\)\s*$"
UNATTRIBUTED = "(unattributed)"


@dataclass(frozen=True)
class Attribution:
    """Per GPU op (shape ``[n_ops]``): launching CPU row, innermost annotation row, phase index.

    ``launch`` indexes ``trace.cpu`` rows, ``region`` indexes ``trace.annotations`` rows, ``phase``
    indexes ``phases``; -1 means none found.
    """

    launch: np.ndarray
    region: np.ndarray
    phase: np.ndarray
    phases: list[str]

    def region_names(self, trace: Trace) -> np.ndarray:
        """Innermost annotation name per op (object ``[n_ops]``; UNATTRIBUTED where none)."""
        names = np.asarray([*trace.annotations.names, UNATTRIBUTED], dtype=object)
        return names[_take(trace.annotations.name_id, self.region, len(names) - 1)]


def _take(values: np.ndarray, index: np.ndarray, fill: int) -> np.ndarray:
    """``values[index]`` where ``index >= 0``, ``fill`` elsewhere (works for empty ``values``)."""
    out = np.full(index.shape, fill, dtype=np.int64)
    ok = index >= 0
    out[ok] = values[index[ok]]
    return out


def link_launches(trace: Trace) -> np.ndarray:
    """Row in ``trace.cpu`` of the runtime call that launched each GPU op (int64 ``[n_ops]``, -1 if none)."""
    gpu, cpu = trace.gpu, trace.cpu
    runtime = np.flatnonzero((cpu.kind == RUNTIME) & (cpu.correlation >= 0))
    out = np.full(len(gpu), -1, dtype=np.int64)
    if runtime.size == 0 or len(gpu) == 0:
        return out
    run_corr, gpu_corr = cpu.correlation[runtime], gpu.correlation
    if max(int(run_corr.max()), int(gpu_corr.max())) >= 1 << 40:
        # ids this large would spill into the rank bits of the key: use their ranks instead
        _, dense = np.unique(np.concatenate([run_corr, gpu_corr]), return_inverse=True)
        run_corr, gpu_corr = dense[: runtime.size], dense[runtime.size :]
    keys = (cpu.rank[runtime].astype(np.int64) << 40) | run_corr
    order = np.argsort(keys, kind="stable")
    keys, runtime = keys[order], runtime[order]
    want = (gpu.rank.astype(np.int64) << 40) | gpu_corr
    pos = np.minimum(np.searchsorted(keys, want), keys.size - 1)
    found = (keys[pos] == want) & (gpu.correlation >= 0)
    out[found] = runtime[pos[found]]
    return out


def _paint_innermost(
    times: np.ndarray, valid: np.ndarray, ranks: np.ndarray, trace: Trace, rows: np.ndarray
) -> np.ndarray:
    """For each valid time point, the innermost (shortest) annotation among ``rows`` enclosing it (-1 if none)."""
    ann = trace.annotations
    out = np.full(times.size, -1, dtype=np.int64)
    if rows.size == 0 or times.size == 0:
        return out
    for rank in np.unique(ranks[valid]):
        sel = np.flatnonzero(valid & (ranks == rank))
        order = np.argsort(times[sel], kind="stable")
        idx, t = sel[order], times[sel][order]
        mine = rows[ann.rank[rows] == rank]
        # Longest first so that shorter (inner) annotations overwrite the outer ones.
        dur = ann.end_ns[mine] - ann.start_ns[mine]
        mine = mine[np.lexsort((ann.start_ns[mine], -dur))]
        lo = np.searchsorted(t, ann.start_ns[mine], side="left")
        hi = np.searchsorted(t, ann.end_ns[mine], side="left")
        for row, a, b in zip(mine, lo, hi, strict=True):
            if b > a:
                out[idx[a:b]] = row
    return out


def attribute(trace: Trace, phase_pattern: str = DEFAULT_PHASE_PATTERN) -> Attribution:
    """Attribute every GPU op to its launch, innermost annotation and phase.

    ``phase_pattern`` is a regex searched in annotation names; its group ``phase`` (or group 1,
    or the whole match) names the phase.
    """
    try:
        compiled = re.compile(phase_pattern)
    except re.error as exc:
        raise InputError(
            f"phase_pattern={phase_pattern!r} is not a valid regular expression: {exc}"
        ) from None
    ann = trace.annotations
    launch = link_launches(trace)
    launch_ts = _take(trace.cpu.start_ns, launch, -1)
    cpu_rows = np.flatnonzero(~ann.on_gpu)
    region = _paint_innermost(launch_ts, launch >= 0, trace.gpu.rank, trace, cpu_rows)

    phase_of_name: list[str | None] = []
    for name in ann.names:
        match = compiled.search(name)
        if match is None:
            phase_of_name.append(None)
        elif "phase" in compiled.groupindex:
            phase_of_name.append(match.group("phase"))
        else:
            phase_of_name.append(match.group(1) if compiled.groups else match.group(0))
    phases = sorted({p for p in phase_of_name if p is not None}, key=_phase_order)
    phase_index = np.asarray(
        [phases.index(p) if p is not None else -1 for p in phase_of_name], dtype=np.int64
    )
    phase_rows = cpu_rows[phase_index[ann.name_id[cpu_rows]] >= 0] if len(ann) else cpu_rows
    phase_region = _paint_innermost(launch_ts, launch >= 0, trace.gpu.rank, trace, phase_rows)
    phase = _take(phase_index, _take(ann.name_id, phase_region, -1), -1)
    return Attribution(launch=launch, region=region, phase=phase, phases=phases)


def _phase_order(name: str) -> tuple[int, str]:
    known = {"F": 0, "B": 1, "W": 2}
    return (known.get(name, 3), name)


@dataclass(frozen=True)
class PhaseBreakdown:
    """Per phase of one device: union times (ns) and the cross-phase overlap matrix (ns)."""

    phases: dict[str, dict[str, int]]
    phase_overlap: dict[str, dict[str, int]]

    def to_dict(self) -> dict:
        us = 1e-3
        return {
            "phases": {
                p: {
                    (k[:-3] + "_us" if k.endswith("_ns") else k): (
                        v * us if k.endswith("_ns") else v
                    )
                    for k, v in d.items()
                }
                for p, d in self.phases.items()
            },
            "phase_overlap": {
                x: {y: v * us for y, v in row.items()} for x, row in self.phase_overlap.items()
            },
        }


def phase_breakdown(
    trace: Trace, classes: np.ndarray, attribution: Attribution, rows: slice
) -> PhaseBreakdown | None:
    """Phase times and overlap matrix for the GPU op rows ``rows`` (one device); None without phases."""
    if not attribution.phases:
        return None
    gpu = trace.gpu
    s, e, c, p = gpu.start_ns[rows], gpu.end_ns[rows], classes[rows], attribution.phase[rows]
    labels = list(attribution.phases)
    if (p < 0).any():
        labels.append(UNATTRIBUTED)
    p = np.where(p < 0, len(attribution.phases), p)
    sets: dict[str, dict[int, intervals.IntervalSet]] = {}
    phases: dict[str, dict[str, int]] = {}
    for i, label in enumerate(labels):
        sel = p == i
        sets[label] = {
            code: intervals.union(s[sel & (c == code)], e[sel & (c == code)])
            for code in (COMPUTE, COMM, MEMORY)
        }
        phases[label] = {
            "compute_ns": intervals.length(sets[label][COMPUTE]),
            "comm_ns": intervals.length(sets[label][COMM]),
            "memory_ns": intervals.length(sets[label][MEMORY]),
            "ops": int(sel.sum()),
        }
    overlap = {
        x: {
            y: intervals.length(intervals.intersect(sets[x][COMM], sets[y][COMPUTE]))
            for y in labels
        }
        for x in labels
    }
    return PhaseBreakdown(phases=phases, phase_overlap=overlap)


def region_breakdown(
    trace: Trace, classes: np.ndarray, attribution: Attribution, rows: slice
) -> dict[str, dict[str, float]]:
    """Per innermost-annotation name on one device: compute, comm and *exposed* comm time in µs.

    Exposed comm of a region = the part of its communication not covered by any compute of the
    device, so the regions where communication is not hidden stand out.
    """
    gpu = trace.gpu
    s, e, c = gpu.start_ns[rows], gpu.end_ns[rows], classes[rows]
    names = attribution.region_names(trace)[rows]
    compute_all = intervals.union(s[c == COMPUTE], e[c == COMPUTE])
    out: dict[str, dict[str, float]] = {}
    for name in sorted(set(names.tolist())):
        sel = names == name
        comm = intervals.union(s[sel & (c == COMM)], e[sel & (c == COMM)])
        out[name] = {
            "compute_us": intervals.length(
                intervals.union(s[sel & (c == COMPUTE)], e[sel & (c == COMPUTE)])
            )
            * 1e-3,
            "comm_us": intervals.length(comm) * 1e-3,
            "exposed_comm_us": intervals.length(intervals.subtract(comm, compute_all)) * 1e-3,
            "ops": int(sel.sum()),
        }
    return out

"""The ``report`` question end to end: read, classify, decompose, attribute; one JSON-ready result.

:func:`analyze` is what ``moeinfra trace report`` prints (optionally for one ``ProfilerStep#N``);
:func:`step_breakdown` is the per-step table of ``moeinfra trace steps``. Library users can call the
analyzers (:mod:`overlap`, :mod:`attribution`, :mod:`kernels`, :mod:`idle`, ...) directly on a
:class:`Trace` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeinfra.errors import InputError
from moeinfra.trace.attribution import (
    DEFAULT_PHASE_PATTERN,
    Attribution,
    PhaseBreakdown,
    attribute,
    phase_breakdown,
    region_breakdown,
)
from moeinfra.trace.classify import CLASS_NAMES, DEFAULT_RULES, Classifier, Rule, comm_rules
from moeinfra.trace.idle import DEFAULT_KERNEL_WAIT_NS, IDLE_CATEGORIES, IdleBreakdown, device_idle
from moeinfra.trace.iterations import (
    Step,
    find_steps,
    gpu_op_steps,
    list_steps,
    select_step,
    select_step_with,
)
from moeinfra.trace.model import Trace
from moeinfra.trace.overlap import Decomposition, decompose_device
from moeinfra.trace.reader import TimeUnit, read_trace


@dataclass(frozen=True)
class DeviceReport:
    """Everything ``report`` says about one device."""

    decomposition: Decomposition
    phases: PhaseBreakdown | None
    regions: dict[str, dict[str, float]]
    idle: IdleBreakdown | None = None

    def to_dict(self) -> dict:
        out = self.decomposition.to_dict()
        if self.idle is not None:
            out["idle_breakdown"] = idle_parts(self.idle)
        if self.phases is not None:
            out.update(self.phases.to_dict())
        out["regions"] = self.regions
        return out


@dataclass(frozen=True)
class TraceReport:
    """Result of :func:`analyze`: the trace, op classes, attribution and one report per device.

    ``trace`` is the part analysed (one step's when ``step`` is set); ``steps`` lists the
    ``ProfilerStep#N`` windows of the whole trace.
    """

    trace: Trace
    classes: np.ndarray
    attribution: Attribution
    devices: list[DeviceReport]
    rules: tuple[Rule, ...]
    step: int | None = None
    steps: tuple[Step, ...] = ()
    kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS

    def to_dict(self) -> dict:
        """JSON-ready dict (times in µs)."""
        counts = (
            np.bincount(self.classes, minlength=3)
            if self.classes.size
            else np.zeros(3, dtype=np.int64)
        )
        return {
            "sources": self.trace.sources,
            "ranks": self.trace.ranks,
            "gpu_ops": len(self.trace.gpu),
            "ops_per_class": {CLASS_NAMES[i]: int(counts[i]) for i in range(3)},
            "phase_names": self.attribution.phases,
            "skipped": self.trace.skipped,
            "step": self.step,
            "steps": [
                {"rank": s.rank, "step": s.step, "dur_us": s.dur_ns * 1e-3, "gpu_ops": s.gpu_ops}
                for s in self.steps
            ],
            "kernel_wait_threshold_us": self.kernel_wait_ns * 1e-3,
            "devices": [d.to_dict() for d in self.devices],
        }


def idle_parts(idle: IdleBreakdown) -> dict[str, float]:
    """``{host_wait_us, kernel_wait_us, other_us}`` of a device's idle time."""
    return {f"{name}_us": idle.idle_ns[i] * 1e-3 for i, name in enumerate(IDLE_CATEGORIES)}


def build_rules(
    comm_patterns: Sequence[str] = (), rules: Sequence[Rule] = DEFAULT_RULES
) -> tuple[Rule, ...]:
    """User communication patterns first (they win), then ``rules``."""
    return (*comm_rules(comm_patterns), *rules)


def analyze(
    source: str | Path | Trace,
    *,
    comm_patterns: Sequence[str] = (),
    rules: Sequence[Rule] = DEFAULT_RULES,
    phase_pattern: str = DEFAULT_PHASE_PATTERN,
    time_unit: TimeUnit = "auto",
    progress: bool = False,
    step: int | None = None,
    kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS,
) -> TraceReport:
    """Read (if given a path) and analyse a trace: per-device decomposition, idle breakdown,
    phases, regions.

    ``comm_patterns`` are extra communication regexes (anchored at the start of the op key, see
    :mod:`moeinfra.trace.classify`) tried before ``rules``. ``step`` restricts everything to the
    ``ProfilerStep#step`` iteration (see :func:`~moeinfra.trace.iterations.select_step`; an
    InputError names the steps there are); ``kernel_wait_ns`` is the idle breakdown's
    kernel-wait threshold (:mod:`~moeinfra.trace.idle`).
    """
    if kernel_wait_ns < 0:
        raise InputError(f"kernel_wait_ns={kernel_wait_ns} must be >= 0")
    whole = (
        source
        if isinstance(source, Trace)
        else read_trace(source, time_unit=time_unit, progress=progress)
    )
    trace = whole if step is None else select_step(whole, step)
    all_rules = build_rules(comm_patterns, rules)
    classes = Classifier(all_rules).classify(trace.gpu)
    attribution = attribute(trace, phase_pattern)
    devices = []
    for (rank, device), rows in trace.device_slices().items():
        devices.append(
            DeviceReport(
                decomposition=decompose_device(trace, classes, rank, device, rows),
                phases=phase_breakdown(trace, classes, attribution, rows),
                regions=region_breakdown(trace, classes, attribution, rows),
                idle=device_idle(trace, rows, kernel_wait_ns, attribution.launch),
            )
        )
    return TraceReport(
        trace=trace,
        classes=classes,
        attribution=attribution,
        devices=devices,
        rules=all_rules,
        step=step,
        steps=tuple(list_steps(whole)),
        kernel_wait_ns=kernel_wait_ns,
    )


def step_breakdown(
    trace: Trace,
    *,
    comm_patterns: Sequence[str] = (),
    rules: Sequence[Rule] = DEFAULT_RULES,
    kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS,
) -> list[dict]:
    """One row per (rank, step, device): the step's CPU window and its GPU ops' decomposition.

    Rows (JSON-ready, times µs, ``start_us`` from the first GPU op of the whole trace): ``rank,
    step, last, start_us, dur_us`` (the CPU window), ``device, gpu_ops`` and, over the step's own
    ops, ``span_us, busy_us, idle_us, compute_us, exposed_comm_us, exposed_memory_us,
    comm_hidden_fraction`` and the idle breakdown ``host_wait_us, kernel_wait_us, other_us``. A step
    that launched no GPU op has one row with ``device`` None.
    """
    steps = list_steps(trace)
    origin = trace.start_ns or 0
    classifier = Classifier(build_rules(comm_patterns, rules))
    windows = find_steps(trace)
    op_step = gpu_op_steps(trace, windows)
    per_number: dict[int, Trace] = {}
    out = []
    for s in steps:
        sub = per_number.get(s.step)
        if sub is None:
            sub = per_number[s.step] = select_step_with(trace, s.step, windows, op_step)
        base = {
            "rank": s.rank,
            "step": s.step,
            "last": s.last,
            "start_us": (s.start_ns - origin) * 1e-3,
            "dur_us": s.dur_ns * 1e-3,
        }
        classes = classifier.classify(sub.gpu)
        slices = [(key, rows) for key, rows in sub.device_slices().items() if key[0] == s.rank]
        if not slices:
            out.append({**base, "device": None, "gpu_ops": 0})
        for (rank, device), rows in slices:
            d = decompose_device(sub, classes, rank, device, rows).to_dict()
            idle = device_idle(sub, rows, kernel_wait_ns)
            out.append(
                {
                    **base,
                    "device": device,
                    "gpu_ops": rows.stop - rows.start,
                    **{
                        k: d[k]
                        for k in (
                            "span_us",
                            "busy_us",
                            "idle_us",
                            "compute_us",
                            "exposed_comm_us",
                            "exposed_memory_us",
                            "comm_hidden_fraction",
                        )
                    },
                    **idle_parts(idle),
                }
            )
    return out

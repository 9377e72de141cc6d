"""The ``report`` question end to end: read, classify, decompose, attribute; one JSON-ready result.

:func:`analyze` is what ``moeinfra trace report`` prints. Library users can call the analyzers
(:mod:`overlap`, :mod:`attribution`, :mod:`kernels`) directly on a :class:`Trace` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeinfra.trace.attribution import (
    DEFAULT_PHASE_PATTERN,
    Attribution,
    PhaseBreakdown,
    attribute,
    phase_breakdown,
    region_breakdown,
)
from moeinfra.trace.classify import CLASS_NAMES, DEFAULT_RULES, Classifier, Rule, comm_rules
from moeinfra.trace.model import Trace
from moeinfra.trace.overlap import Decomposition, decompose_device
from moeinfra.trace.reader import TimeUnit, read_trace


@dataclass(frozen=True)
class DeviceReport:
    """Everything ``report`` says about one device."""

    decomposition: Decomposition
    phases: PhaseBreakdown | None
    regions: dict[str, dict[str, float]]

    def to_dict(self) -> dict:
        out = self.decomposition.to_dict()
        if self.phases is not None:
            out.update(self.phases.to_dict())
        out["regions"] = self.regions
        return out


@dataclass(frozen=True)
class TraceReport:
    """Result of :func:`analyze`: the trace, op classes, attribution and one report per device."""

    trace: Trace
    classes: np.ndarray
    attribution: Attribution
    devices: list[DeviceReport]
    rules: tuple[Rule, ...]

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
            "devices": [d.to_dict() for d in self.devices],
        }


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
) -> TraceReport:
    """Read (if given a path) and analyse a trace: per-device decomposition, phases, regions.

    ``comm_patterns`` are extra communication regexes (anchored at the start of the op key, see
    :mod:`moeinfra.trace.classify`) tried before ``rules``.
    """
    trace = (
        source
        if isinstance(source, Trace)
        else read_trace(source, time_unit=time_unit, progress=progress)
    )
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
            )
        )
    return TraceReport(
        trace=trace, classes=classes, attribution=attribution, devices=devices, rules=all_rules
    )

"""Trace analysis: how much communication is hidden behind computation, and where it is not.

Reads PyTorch Profiler (Kineto) Chrome traces without torch. One shared model
(:mod:`~moeinfra.trace.model`, filled by :mod:`~moeinfra.trace.reader`), one analyzer per question:

- :mod:`~moeinfra.trace.classify`  — compute / communication / memory, ordered anchored rules
- :mod:`~moeinfra.trace.overlap`   — per-device decomposition (compute + exposed comm + exposed memory + idle = span), SM share
- :mod:`~moeinfra.trace.attribution` — op -> launch -> innermost annotation; F/B/W phases and phase_overlap
- :mod:`~moeinfra.trace.kernels`   — kernel statistics
- :mod:`~moeinfra.trace.iterations` — ProfilerStep#N windows; one step as a Trace (``select_step``)
- :mod:`~moeinfra.trace.idle`      — idle time: host wait / kernel wait / other, per device and stream
- :mod:`~moeinfra.trace.launches`  — kernel-launch statistics: launch delay, short kernels, outliers
- :mod:`~moeinfra.trace.queue`     — queue length per stream over time
- :mod:`~moeinfra.trace.diff`      — two traces side by side
- :mod:`~moeinfra.trace.timeline`  — timeline PNG

Typical use::

    from moeinfra.trace import analyze
    result = analyze("trace.json", comm_patterns=[r"my_alltoall"])
    print(result.to_dict()["devices"][0]["comm_hidden_fraction"])
"""

from typing import TYPE_CHECKING

from moeinfra.lazy import lazy_attributes
from moeinfra.trace.attribution import Attribution, attribute, phase_breakdown, region_breakdown
from moeinfra.trace.classify import (
    CLASS_NAMES,
    COMM,
    COMPUTE,
    DEFAULT_RULES,
    MEMORY,
    Classifier,
    Rule,
    classify,
)
from moeinfra.trace.idle import IdleBreakdown, idle_breakdown
from moeinfra.trace.iterations import Step, list_steps, select_step
from moeinfra.trace.model import Trace
from moeinfra.trace.overlap import Decomposition, decompose
from moeinfra.trace.reader import read_trace
from moeinfra.trace.summary import TraceReport, analyze, step_breakdown

if TYPE_CHECKING:
    from moeinfra.trace.diff import TraceDiff, diff_reports
    from moeinfra.trace.kernels import KernelStats, kernel_breakdown
    from moeinfra.trace.launches import LaunchSummary, launch_stats
    from moeinfra.trace.queue import QueueSummary, queue_series, queue_summary

# Imported on first use: `moeinfra trace report` does not need them (start-up time).
_LAZY = {
    "TraceDiff": "diff",
    "diff_reports": "diff",
    "KernelStats": "kernels",
    "kernel_breakdown": "kernels",
    "LaunchSummary": "launches",
    "launch_stats": "launches",
    "QueueSummary": "queue",
    "queue_series": "queue",
    "queue_summary": "queue",
}

__getattr__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "CLASS_NAMES",
    "COMM",
    "COMPUTE",
    "DEFAULT_RULES",
    "MEMORY",
    "Attribution",
    "Classifier",
    "Decomposition",
    "IdleBreakdown",
    "KernelStats",
    "LaunchSummary",
    "QueueSummary",
    "Rule",
    "Step",
    "Trace",
    "TraceDiff",
    "TraceReport",
    "analyze",
    "attribute",
    "classify",
    "decompose",
    "diff_reports",
    "idle_breakdown",
    "kernel_breakdown",
    "launch_stats",
    "list_steps",
    "phase_breakdown",
    "queue_series",
    "queue_summary",
    "read_trace",
    "region_breakdown",
    "select_step",
    "step_breakdown",
]

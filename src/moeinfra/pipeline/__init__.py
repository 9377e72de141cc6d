"""Pipeline-parallel schedules as data, a simulator, figures and a torch.distributed runtime.

``Schedule`` is the shared type: generators (:func:`gpipe`, :func:`one_f_one_b`, :func:`zb1p`,
:func:`dualpipe`, :func:`dualpipev`) make it, :func:`validate` checks it, :func:`simulate` times it,
:mod:`moeinfra.pipeline.timeline` draws it and :mod:`moeinfra.pipeline.runtime` (the only part that
needs torch) executes it.
"""

from moeinfra.pipeline.actions import Action, parse_action
from moeinfra.pipeline.compare import Candidate, compare
from moeinfra.pipeline.generators import (
    GENERATORS,
    dualpipe,
    dualpipev,
    generate,
    gpipe,
    one_f_one_b,
    zb1p,
)
from moeinfra.pipeline.schedule import Schedule
from moeinfra.pipeline.simulate import (
    COMM_MODELS,
    Costs,
    DeadlockError,
    RankResult,
    SimResult,
    simulate,
)
from moeinfra.pipeline.validate import ScheduleError, validate

__all__ = [
    "COMM_MODELS",
    "GENERATORS",
    "Action",
    "Candidate",
    "Costs",
    "DeadlockError",
    "RankResult",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "compare",
    "dualpipe",
    "dualpipev",
    "generate",
    "gpipe",
    "one_f_one_b",
    "parse_action",
    "simulate",
    "validate",
    "zb1p",
]

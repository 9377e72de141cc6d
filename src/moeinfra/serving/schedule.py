"""How many prefill and decode units run when: a step schedule (DeepSeek's day is a preset) or one
derived from the workload by a target-utilisation policy."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moeinfra.errors import InputError

# DeepSeek's day-6 node curve (deepseek_day6_node_schedule.csv): start hour since 12:00 UTC+8, nodes,
# and the hypothesised split into 18-node decode and 4-node prefill units (REFERENCE.md).
DEEPSEEK_DAY_STEPS = (
    (0.0, 278, 9, 29),
    (12.0, 218, 7, 23),
    (13.25, 188, 6, 20),
    (14.0, 158, 5, 17),
    (14.75, 128, 4, 14),
    (15.0, 98, 3, 11),
    (15.5, 68, 2, 8),
    (18.5, 98, 3, 11),
    (19.0, 128, 4, 14),
    (19.5, 188, 6, 20),
    (20.0, 218, 7, 23),
    (20.5, 278, 9, 29),
)


@dataclass(frozen=True)
class FleetSchedule:
    """Units per phase as a step function of time.

    Attributes:
        start_s: ``[k]`` ascending step starts (the first is 0). prefill_units, decode_units: ``[k]``.
        prefill_nodes, decode_nodes: nodes per unit. duration_s: end of the last step.
        colocated: each unit does both phases (aggregated serving): ``prefill_units`` and
            ``decode_units`` are the same units, so they and their node counts must be equal,
            and their nodes are counted once (as decode nodes).
    """

    start_s: np.ndarray
    prefill_units: np.ndarray
    decode_units: np.ndarray
    prefill_nodes: int = 4
    decode_nodes: int = 18
    duration_s: float = 86_400.0
    colocated: bool = False

    def __post_init__(self) -> None:
        k = self.start_s.size
        if k == 0 or self.start_s[0] != 0 or np.any(np.diff(self.start_s) <= 0):
            raise InputError("FleetSchedule.start_s must start at 0 and increase")
        if self.prefill_units.shape != (k,) or self.decode_units.shape != (k,):
            raise InputError(f"FleetSchedule unit arrays must have shape ({k},)")
        if np.any(self.prefill_units < 1) or np.any(self.decode_units < 1):
            raise InputError("FleetSchedule needs >= 1 prefill and >= 1 decode unit at all times")
        if self.duration_s <= self.start_s[-1]:
            raise InputError(
                f"FleetSchedule.duration_s={self.duration_s} must exceed the last start"
            )
        if self.colocated and (
            self.prefill_nodes != self.decode_nodes
            or not np.array_equal(self.prefill_units, self.decode_units)
        ):
            raise InputError(
                "a colocated FleetSchedule runs both phases on the same units: prefill and decode "
                "units and nodes per unit must be equal"
            )

    def at(self, t_s: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(prefill_units, decode_units)`` running at time(s) ``t_s``."""
        i = np.searchsorted(self.start_s, t_s, side="right") - 1
        return self.prefill_units[i], self.decode_units[i]

    def nodes_at(self, t_s: float | np.ndarray) -> np.ndarray:
        p, d = self.at(t_s)
        return (0 if self.colocated else p * self.prefill_nodes) + d * self.decode_nodes

    @property
    def max_units(self) -> tuple[int, int]:
        return int(self.prefill_units.max()), int(self.decode_units.max())

    def node_seconds(self, start_s: float = 0.0, end_s: float | None = None) -> tuple[float, float]:
        """``(prefill, decode)`` node-seconds in ``[start_s, end_s)`` (colocated: all decode)."""
        end_s = self.duration_s if end_s is None else end_s
        edges = np.append(self.start_s, self.duration_s)
        lo = np.clip(edges[:-1], start_s, end_s)
        hi = np.clip(edges[1:], start_s, end_s)
        span = hi - lo
        prefill = 0.0 if self.colocated else (span * self.prefill_units).sum() * self.prefill_nodes
        return float(prefill), float((span * self.decode_units).sum() * self.decode_nodes)

    def summary(self) -> dict[str, float]:
        p, d = self.node_seconds()
        return {
            "peak_nodes": int(self.nodes_at(self.start_s).max()),
            "avg_nodes": (p + d) / self.duration_s,
            "avg_prefill_nodes": p / self.duration_s,
            "avg_decode_nodes": d / self.duration_s,
            "node_hours": (p + d) / 3600.0,
        }


def deepseek_day_schedule(hours: float = 24.0) -> FleetSchedule:
    """DeepSeek's published node curve with the 18-node decode / 4-node prefill unit split."""
    steps = np.array(DEEPSEEK_DAY_STEPS, dtype=np.float64)
    keep = steps[:, 0] < hours
    return FleetSchedule(
        steps[keep, 0] * 3600.0,
        steps[keep, 3].astype(np.int64),
        steps[keep, 2].astype(np.int64),
        4,
        18,
        hours * 3600.0,
    )


def constant_schedule(
    prefill_units: int,
    decode_units: int,
    duration_s: float,
    prefill_nodes: int = 4,
    decode_nodes: int = 18,
    colocated: bool = False,
) -> FleetSchedule:
    """A fixed fleet for the whole window."""
    return FleetSchedule(
        np.zeros(1),
        np.array([prefill_units]),
        np.array([decode_units]),
        prefill_nodes,
        decode_nodes,
        duration_s,
        colocated,
    )


def interval_spans(duration_s: float, interval_s: float) -> np.ndarray:
    """Seconds of each autoscaling interval (the last one may be cut short by the duration)."""
    k = max(1, math.ceil(duration_s / interval_s))
    return np.maximum(np.minimum(interval_s, duration_s - np.arange(k) * interval_s), 1e-9)


#: Busy share the target-utilisation autoscaler sizes units for unless told otherwise.
DEFAULT_TARGET = 0.7


def units_for_work(work_s, span_s, target: float = DEFAULT_TARGET, min_units: int = 1):
    """The target-utilisation rule: whole units whose busy share would be ``target`` for
    ``work_s`` unit-seconds of work over ``span_s`` seconds (at least ``min_units``); broadcasts.
    The simulator's autoscaler applies it to the work arriving per interval, the live server's
    (``moeinfra.server.autoscale``) to the work its units did in the last interval."""
    if not 0 < target <= 1:
        raise InputError(f"target={target} must be in (0, 1]")
    units = np.ceil(np.asarray(work_s, dtype=np.float64) / (np.asarray(span_s) * target))
    return np.maximum(units, min_units).astype(np.int64)


def utilisation_schedule(
    arrival_s: np.ndarray,
    prefill_work_s: np.ndarray,
    decode_work_s: np.ndarray,
    duration_s: float,
    *,
    target: float = DEFAULT_TARGET,
    interval_s: float = 900.0,
    prefill_nodes: int = 4,
    decode_nodes: int = 18,
    min_units: int = 1,
    block: tuple[int, int] | None = None,
    prefill_floor: np.ndarray | None = None,
) -> FleetSchedule:
    """Autoscaling by a target-utilisation policy: per ``interval_s``, the whole units whose busy
    share would be ``target`` for the work arriving in it.

    ``prefill_work_s`` / ``decode_work_s``: ``[n]`` unit-seconds each request needs (real scale).
    ``block``: ``(prefill units, decode units)`` added or removed together, as many blocks as the
    more demanding phase needs (DeepSeek's node curve moves in 30-node steps: ``(3, 1)``).
    ``prefill_floor``: ``[intervals]`` prefill units needed regardless of utilisation (e.g. for a
    TTFT SLO, :func:`moeinfra.serving.scenario.ttft_prefill_units`).
    """
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise InputError(f"block={block!r} must be (prefill units, decode units), both >= 1")
    if interval_s <= 0:
        raise InputError(f"interval_s={interval_s} must be > 0")
    span = interval_spans(duration_s, interval_s)
    k = span.size
    slot = np.minimum((arrival_s // interval_s).astype(np.int64), k - 1)
    prefill = np.bincount(slot, weights=prefill_work_s, minlength=k)
    decode = np.bincount(slot, weights=decode_work_s, minlength=k)
    p = units_for_work(prefill, span, target, min_units)
    if prefill_floor is not None:
        if np.shape(prefill_floor) != (k,):
            raise InputError(
                f"prefill_floor has shape {np.shape(prefill_floor)}; one value per interval ({k},)"
            )
        p = np.maximum(p, np.asarray(prefill_floor, dtype=np.int64))
    d = units_for_work(decode, span, target, min_units)
    if block is not None:
        blocks = np.maximum(-(-p // block[0]), -(-d // block[1]))
        p, d = blocks * block[0], blocks * block[1]
    change = np.ones(k, dtype=bool)
    change[1:] = (p[1:] != p[:-1]) | (d[1:] != d[:-1])
    starts = np.arange(k)[change] * interval_s
    return FleetSchedule(starts, p[change], d[change], prefill_nodes, decode_nodes, duration_s)

"""Ranges beside the point figures of a calibrated simulation or plan.

A calibration's own points say how far the model's step times stray from measured ones: per
phase, measured / predicted over the points it was fitted on and held out spans ``[lo, hi]``.
The simulation (or the plan) runs again with every prefill step time x ``lo`` of prefill and every
decode step x ``lo`` of decode (the *fast* bound), and again with the ``hi`` ratios (the *slow*
bound); a figure's range is the smallest and the largest of its three values. Both phases move
together, so the range is the widest the residuals allow, not a confidence interval.

A calibration fitted on as many points as it has free factors (``deepseek-h800``: two profiles,
two factors) has no residual spread: its range is the point. How far such a calibration carries to
other systems is measured separately (docs/serving-model.md, "Shipped calibrations").
"""

from __future__ import annotations

import math

from moeinfra.serving.calibration import Calibration

PHASES = ("prefill", "decode")
#: Figures of ``serve simulate`` that get a range: (payload key, percentile key or None).
SIMULATE_FIGURES = {
    "mean_output_tokens_per_s": ("mean_output_tokens_per_s", None),
    "ttft_p95_s": ("ttft_s", "p95"),
    "tpot_p95_s": ("tpot_s", "p95"),
    "avg_nodes": ("avg_nodes", None),
    "cost_usd": ("cost_usd", None),
}
METHOD = (
    "every prefill / decode step time x the smallest (fast) and largest (slow) measured/predicted "
    "ratio of the calibration's points of that phase; range = min and max over the three runs"
)


def range_method(calibrated: bool, spread: bool) -> str:
    """What a payload's ``range_method`` says: the method, or why there is no range."""
    if not calibrated:
        return "none: the first-principles model has no residuals (pass --calibration)"
    return METHOD + ("" if spread else "; this calibration fits its points exactly: no spread")


def step_time_bounds(calibration: Calibration) -> dict[str, tuple[float, float]]:
    """``{"fast": (prefill, decode), "slow": (prefill, decode)}`` step-time multipliers."""
    spans = [calibration.measured_over_predicted(phase) for phase in PHASES]
    return {
        "fast": (spans[0][0], spans[1][0]),
        "slow": (spans[0][1], spans[1][1]),
    }


def has_spread(bounds: dict[str, tuple[float, float]], tol: float = 1e-9) -> bool:
    """Whether any bound moves a step time (a calibration that fits its points exactly does not)."""
    return any(abs(k - 1.0) > tol for ks in bounds.values() for k in ks)


def simulate_figures(payload: dict) -> dict[str, float | None]:
    """The ranged figures of a ``serve simulate`` payload (None where a run has none)."""
    out = {}
    for name, (key, sub) in SIMULATE_FIGURES.items():
        value = payload.get(key)
        out[name] = value.get(sub) if sub is not None else value
    return out


def plan_figures(plan) -> dict[str, float]:
    """The ranged figures of a :class:`~moeinfra.serving.planner.CapacityPlan`."""
    return {
        "nodes": float(plan.nodes),
        "cost_usd": plan.cost_usd,
        "ttft_p95_s": plan.ttft_p95_s,
        "tpot_p95_s": plan.tpot_p95_s,
    }


def ranges(point: dict, *others: dict) -> dict[str, list[float | None]]:
    """``{figure: [smallest, largest]}`` over ``point`` and the bound runs' figures; an end is
    None when a run has no value for that figure (e.g. no request completed)."""
    out = {}
    for name, value in point.items():
        values = [value, *(o.get(name) for o in others)]
        known = [v for v in values if v is not None and math.isfinite(v)]
        if len(known) < len(values):
            out[name] = [None, None]
        else:
            out[name] = [min(known), max(known)]
    return out

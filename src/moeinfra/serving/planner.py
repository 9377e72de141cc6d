"""Capacity planner: the cheapest fixed fleet of prefill and decode units that meets the SLOs.

TTFT depends only on the prefill side (the first token comes out of prefill) and the time per output
token only on the decode side, so each side is searched on its own: for every candidate deployment
(nodes per unit, redundant experts) the fewest units that meet its SLO is found by bisection over
simulations of the workload, and the cheapest candidate of each side is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from moeinfra.errors import InputError
from moeinfra.serving.calibration import Calibration
from moeinfra.serving.perfmodel import DEFAULT_EFFICIENCY, PerfModel
from moeinfra.serving.scenario import decode_seconds_per_token
from moeinfra.serving.schedule import constant_schedule
from moeinfra.serving.simulate import REJECTED, SimConfig, json_ready, simulate
from moeinfra.serving.specs import DEEPSEEK_V3, Deployment, HardwareSpec, ModelSpec, hardware
from moeinfra.serving.workload import Workload

#: (nodes per unit, redundant experts) candidates; each must spread 256 + R slots evenly on its GPUs.
PREFILL_CANDIDATES = ((4, 32), (4, 0), (2, 0))
DECODE_CANDIDATES = ((18, 32), (16, 0), (8, 64), (4, 32))


@dataclass(frozen=True)
class SideOption:
    """One candidate of one side: ``units`` units of ``nodes`` nodes, and what it achieved."""

    phase: str
    nodes: int
    redundant_experts: int
    units: int
    metric_s: float
    meets_slo: bool
    cost_usd: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class CapacityPlan:
    """The cheapest prefill and decode options and every candidate tried."""

    prefill: SideOption
    decode: SideOption
    options: list[SideOption]
    hours: float
    unfit: tuple[str, ...] = ()  # candidates left out: they do not fit in HBM (why)

    @property
    def cost_usd(self) -> float:
        return self.prefill.cost_usd + self.decode.cost_usd

    @property
    def nodes(self) -> int:
        return self.prefill.units * self.prefill.nodes + self.decode.units * self.decode.nodes

    def to_dict(self) -> dict:
        return json_ready(
            {
                "hours": self.hours,
                "nodes": self.nodes,
                "cost_usd": self.cost_usd,
                "prefill": self.prefill.to_dict(),
                "decode": self.decode.to_dict(),
                "options": [o.to_dict() for o in self.options],
                "unfit": list(self.unfit),
            }
        )


def _side_metric(phase, units, model_p, model_d, workload, big, config) -> tuple[float, bool]:
    p_units, d_units = (units, big) if phase == "prefill" else (big, units)
    schedule = constant_schedule(
        p_units, d_units, workload.duration_s, model_p.dep.nodes, model_d.dep.nodes
    )
    result = simulate(workload, schedule, model_p, model_d, config)
    rejected = bool(np.any(result.status == REJECTED))
    if phase == "prefill":
        ttft = result.ttft_s[np.isfinite(result.ttft_s)]
        value = float(np.percentile(ttft, 95)) if ttft.size else math.inf
    else:
        tpot = result.tpot_s[np.isfinite(result.tpot_s)]
        value = float(np.percentile(tpot, 95)) if tpot.size else math.inf
    return (math.inf if rejected else value), rejected


def plan_capacity(
    workload: Workload,
    *,
    slo_ttft_p95_s: float,
    slo_tpot_p95_s: float,
    hw: HardwareSpec | str = "h800",
    model: ModelSpec = DEEPSEEK_V3,
    prefill_candidates=PREFILL_CANDIDATES,
    decode_candidates=DECODE_CANDIDATES,
    max_units: int = 256,
    config: SimConfig | None = None,
    calibration: Calibration | None = None,
    time_scale: tuple[float, float] = (1.0, 1.0),
) -> CapacityPlan:
    """Cheapest fleet meeting TTFT p95 <= ``slo_ttft_p95_s`` and per-request TPOT p95 <=
    ``slo_tpot_p95_s`` with no rejection, for the whole ``workload`` window on a fixed fleet.
    ``time_scale``: (prefill, decode) multipliers on every step time."""
    if slo_ttft_p95_s <= 0 or slo_tpot_p95_s <= 0:
        raise InputError(
            f"slo_ttft_p95_s={slo_ttft_p95_s} and slo_tpot_p95_s={slo_tpot_p95_s} must be > 0"
        )
    if workload.size == 0:
        raise InputError("workload holds no request")
    hw = hardware(hw) if isinstance(hw, str) else hw
    eff, kv = DEFAULT_EFFICIENCY, None
    if calibration is not None:
        hw = replace(calibration.hardware, gpu_hour_usd=hw.gpu_hour_usd)
        model, eff, kv = calibration.model, calibration.efficiency(), calibration.kv_tokens_per_gpu
    config = config or SimConfig()
    hours = workload.duration_s / 3600.0
    inputs = workload.input_tokens.astype(np.float64)
    outputs = workload.output_tokens.astype(np.float64)
    hit = float(workload.cached_tokens.sum() / inputs.sum())
    mean_kv = float((inputs * outputs + outputs**2 / 2).sum() / outputs.sum())
    models, unfit = {}, []
    effs = {
        phase: eff.scaled(k) for phase, k in zip(("prefill", "decode"), time_scale, strict=True)
    }
    for phase, cands in (("prefill", prefill_candidates), ("decode", decode_candidates)):
        for nodes, red in cands:
            try:
                models[(phase, nodes, red)] = PerfModel(
                    Deployment(phase, nodes, red),
                    hw,
                    model,
                    effs[phase],
                    kv_tokens_per_gpu=kv,
                )
                models[(phase, nodes, red)].check_fits()
            except InputError as err:
                models.pop((phase, nodes, red), None)
                unfit.append(str(err))
                continue
    if not any(k[0] == "prefill" for k in models) or not any(k[0] == "decode" for k in models):
        raise InputError(
            "no valid prefill or decode candidate (slots must divide over GPUs and fit in HBM): "
            + "; ".join(unfit)
        )
    ref_p = next(m for k, m in models.items() if k[0] == "prefill")
    ref_d = next(m for k, m in models.items() if k[0] == "decode")
    options: list[SideOption] = []
    best: dict[str, SideOption] = {}
    for (phase, nodes, red), perf in models.items():
        slo = slo_ttft_p95_s if phase == "prefill" else slo_tpot_p95_s
        peak = _peak_rate_work(workload, perf, phase, hit, mean_kv)
        lo = max(1, math.floor(peak))
        pm, dm = (perf, ref_d) if phase == "prefill" else (ref_p, perf)
        big = max_units

        def ok(units: int, phase=phase, pm=pm, dm=dm, slo=slo, big=big) -> tuple[bool, float]:
            value, _ = _side_metric(phase, units, pm, dm, workload, big, config)
            return value <= slo, value

        hi = lo
        good, value = ok(hi)
        while not good and hi < max_units:
            lo, hi = hi, min(hi * 2, max_units)
            good, value = ok(hi)
        if good:
            best_units, best_value = hi, value
            while hi - lo > 1:
                mid = (lo + hi) // 2
                g, v = ok(mid)
                if g:
                    hi, best_units, best_value = mid, mid, v
                else:
                    lo = mid
        else:
            best_units, best_value = hi, value
        cost = best_units * nodes * hw.node_hour_usd * hours
        option = SideOption(phase, nodes, red, best_units, best_value, good, cost)
        options.append(option)
        if good and (phase not in best or cost < best[phase].cost_usd):
            best[phase] = option
    for phase in ("prefill", "decode"):
        if phase not in best:
            raise InputError(
                f"no {phase} candidate meets the SLO with up to max_units={max_units} units"
            )
    return CapacityPlan(best["prefill"], best["decode"], options, hours, tuple(unfit))


def _peak_rate_work(workload, perf: PerfModel, phase: str, hit: float, mean_kv: float) -> float:
    """Units needed at 100% utilisation in the busiest 5 minutes (a lower bound for the search)."""
    slot = (workload.arrival_s // 300).astype(np.int64)
    if phase == "prefill":
        per_req = (workload.input_tokens - workload.cached_tokens) * perf.prefill_seconds_per_token(
            hit, float(workload.input_tokens.mean())
        )
    else:
        per_req = workload.output_tokens * decode_seconds_per_token(perf, 128.0, mean_kv)
    work = np.bincount(slot, weights=per_req * workload.scale)
    return float(work.max() / 300.0)

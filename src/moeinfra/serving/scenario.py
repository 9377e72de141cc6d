"""Named scenarios: a workload, a fleet schedule and the two deployment units, ready to simulate.

``deepseek-v3-day``: DeepSeek's published day — the hourly demand curve, the published length and
cache-hit statistics, the node curve with 18-node decode and 4-node prefill units, H800 nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from moeinfra.errors import InputError
from moeinfra.serving.calibration import Calibration
from moeinfra.serving.kernels import KernelTables
from moeinfra.serving.perfmodel import DEFAULT_EFFICIENCY, PerfModel
from moeinfra.serving.prefill_ticks import PrefillShare
from moeinfra.serving.schedule import (
    DEFAULT_TARGET,
    FleetSchedule,
    constant_schedule,
    deepseek_day_schedule,
    interval_spans,
    utilisation_schedule,
)
from moeinfra.serving.simulate import SimConfig, SimulationResult, simulate
from moeinfra.serving.specs import (
    DEEPSEEK_V3,
    Deployment,
    ModelSpec,
    deepseek_decode_unit,
    deepseek_prefill_unit,
    fitting_redundant_experts,
    priced_hardware,
)
from moeinfra.serving.unit_cost import BALANCERS, PrefillCost, prefill_cost
from moeinfra.serving.workload import Workload, deepseek_day

SCENARIOS = ("deepseek-v3-day",)

#: Real requests per sampled request in the default day (~1.55M sampled of ~155M).
DEFAULT_SCALE = 100.0


@dataclass(frozen=True)
class Scenario:
    """Everything :func:`simulate` needs."""

    name: str
    workload: Workload
    schedule: FleetSchedule
    prefill: PerfModel
    decode: PerfModel

    def run(
        self,
        config: SimConfig | None = None,
        progress: Callable[[float], None] | None = None,
        prefill_share: PrefillShare | None = None,
    ) -> SimulationResult:
        """:func:`simulate` this scenario (``prefill_share``: as there)."""
        return simulate(
            self.workload,
            self.schedule,
            self.prefill,
            self.decode,
            config,
            progress=progress,
            prefill_share=prefill_share,
        )


def decode_seconds_per_token(decode: PerfModel, batch_per_gpu: float, mean_kv: float) -> float:
    """Unit-seconds per output token of a decode unit running ``batch_per_gpu`` requests per GPU
    (with MTP, a step yields ``1 + acceptance`` tokens per request)."""
    step = float(decode.decode_step_s(batch_per_gpu, mean_kv))
    return step / (batch_per_gpu * decode.gpus * decode.dep.tokens_per_step)


def batch_at_step(decode: PerfModel, step_s: float, mean_kv: float) -> float:
    """Largest requests per GPU whose decode step is at most ``step_s`` (at most what the KV cache
    holds at ``mean_kv``); the step grows with the batch, so bisection finds it."""
    full = decode.kv_requests_per_gpu(max(mean_kv, 1.0))
    smallest = float(decode.decode_step_s(1e-3, mean_kv))
    if step_s < smallest:
        raise InputError(
            f"slo_tpot_s={step_s:g} is below the decode step of an almost empty unit "
            f"({smallest * 1e3:.1f} ms at mean KV {mean_kv:,.0f}); allowed: >= {smallest:.4f}"
        )
    if float(decode.decode_step_s(full, mean_kv)) <= step_s:
        return full
    low, high = 1e-3, full
    for _ in range(60):
        mid = 0.5 * (low + high)
        low, high = (
            (mid, high) if float(decode.decode_step_s(mid, mean_kv)) <= step_s else (low, mid)
        )
    return low


def auto_schedule(
    workload: Workload,
    prefill: PerfModel,
    decode: PerfModel,
    *,
    target: float = DEFAULT_TARGET,
    interval_s: float = 900.0,
    decode_batch_per_gpu: float = 64.0,
    slo_tpot_s: float | None = None,
    slo_ttft_s: float | None = None,
    ttft_quantile: float = 0.95,
    block: tuple[int, int] | None = None,
    balancer: str = "deepseek",
) -> FleetSchedule:
    """Autoscaling for ``workload`` (whole units per ``interval_s``) to a target utilisation.

    A decode unit's capacity is its output rate at ``decode_batch_per_gpu`` requests per GPU or,
    with ``slo_tpot_s``, at the largest batch whose step still meets that time per output token.
    With ``slo_ttft_s`` each interval gets at least the prefill units with which its arrivals, run
    through the simulator's prefill queue, keep the ``ttft_quantile`` of the time to first token
    within it (:func:`ttft_prefill_units`). Units are sized so the work arriving would keep them ``target`` busy, in blocks of
    ``block = (prefill units, decode units)`` if given. ``balancer``: the DP-rank balancer inside
    units (as in :class:`SimConfig`), which sets the prefill work per request.
    """
    inputs = workload.input_tokens.astype(np.float64)
    outputs = workload.output_tokens.astype(np.float64)
    service = prefill_cost(prefill, decode, workload, balancer)
    mean_kv = float((inputs * outputs + outputs**2 / 2).sum() / max(outputs.sum(), 1.0))
    if slo_tpot_s is not None:
        # a step may take the SLO times the tokens it yields per request (MTP)
        step_s = slo_tpot_s * decode.dep.tokens_per_step
        decode_batch_per_gpu = batch_at_step(decode, step_s, mean_kv)
    s_decode = decode_seconds_per_token(decode, decode_batch_per_gpu, mean_kv)
    floor = None
    if slo_ttft_s is not None:
        floor = ttft_prefill_units(
            workload,
            service,
            slo_ttft_s,
            interval_s=interval_s,
            quantile=ttft_quantile,
            target=target,
        )
    return utilisation_schedule(
        workload.arrival_s,
        service.work_s * workload.scale,
        outputs * s_decode * workload.scale,
        workload.duration_s,
        target=target,
        interval_s=interval_s,
        prefill_nodes=prefill.dep.nodes,
        decode_nodes=decode.dep.nodes,
        block=block,
        prefill_floor=floor,
    )


def ttft_prefill_units(
    workload: Workload,
    service: PrefillCost,
    slo_ttft_s: float,
    *,
    interval_s: float = 900.0,
    quantile: float = 0.95,
    target: float = 1.0,
) -> np.ndarray:
    """``[intervals]`` fewest prefill units that are at most ``target`` busy and keep the
    interval's TTFT ``quantile`` within ``slo_ttft_s``: the interval's arrivals are run through the
    simulator's prefill queue (:class:`~moeinfra.serving.prefill_queue.PrefillQueue`, starting empty), doubling the units from the
    fewest that are at most ``target`` busy, then bisecting. Like the utilisation policy, it sizes
    for the work that arrives (a perfect forecast). An interval whose requests miss the SLO even
    without queueing gets a unit per sampled request (nothing waits).
    """
    first_token = np.maximum(service.work_s, service.min_latency_s)
    own = float(np.quantile(first_token, quantile)) if first_token.size else 0.0
    if not slo_ttft_s > own:
        raise InputError(
            f"slo_ttft_s={slo_ttft_s:g} is not above the p{quantile * 100:g} prefill time of an "
            f"idle unit ({own:.3f} s); allowed: > {own:.3f}"
        )
    span = interval_spans(workload.duration_s, interval_s)
    arrival, work = workload.arrival_s, service.work_s * workload.scale
    bounds = np.searchsorted(arrival, np.arange(span.size + 1) * interval_s)
    bounds[-1] = arrival.size
    cumulative = np.concatenate([[0.0], np.cumsum(work)])
    interval_work = cumulative[bounds[1:]] - cumulative[bounds[:-1]]
    starts = np.maximum(1, np.ceil(interval_work / (span * target)))
    most = int(max(np.diff(bounds).max(), starts.max()))
    queue = service.queue(workload, most)
    units = np.ones(span.size, dtype=np.int64)
    for i in np.flatnonzero(np.diff(bounds)):
        lo, hi = int(bounds[i]), int(bounds[i + 1])

        def meets(count: int, lo=lo, hi=hi) -> bool:
            queue.reset()
            idx, _, first, _, _ = queue.admit(lo, hi, count, last=True)
            return float(np.quantile(first - arrival[idx], quantile)) <= slo_ttft_s

        start = int(starts[i])
        if meets(start):
            units[i] = start
            continue
        cap = max(hi - lo, start)  # a unit per sampled request: nothing waits
        fails, enough = start, min(2 * start, cap)
        while enough < cap and not meets(enough):
            fails, enough = enough, min(2 * enough, cap)
        while enough - fails > 1:
            mid = (fails + enough) // 2
            fails, enough = (fails, mid) if meets(mid) else (mid, enough)
        units[i] = enough
    return units


def build_scenario(
    name: str = "deepseek-v3-day",
    *,
    workload: Workload | None = None,
    hardware_name: str = "h800",
    hours: float | None = None,
    scale: float = DEFAULT_SCALE,
    demand_scale: float = 1.0,
    seed: int = 0,
    fleet: str | tuple[int, int] | None = None,
    prefill_dep: Deployment | None = None,
    decode_dep: Deployment | None = None,
    target: float | None = None,
    slo_tpot_s: float | None = None,
    slo_ttft_s: float | None = None,
    block: tuple[int, int] | None = None,
    balancer: str = "deepseek",
    gpu_hour_usd: float | None = None,
    calibration: Calibration | None = None,
    kernels: KernelTables | None = None,
    time_scale: tuple[float, float] = (1.0, 1.0),
    model: ModelSpec | None = None,
) -> Scenario:
    """Assemble a scenario. ``workload`` replaces the generated one (e.g. a replayed trace); then
    ``fleet`` defaults to ``"auto"`` (autoscaling, :func:`auto_schedule` with ``target`` (default
    ``DEFAULT_TARGET``), ``slo_tpot_s``, ``slo_ttft_s`` and ``block``) instead of ``"deepseek"``
    (the published node curve); ``fleet=(P, D)`` runs P prefill and D decode units throughout.
    ``demand_scale`` multiplies the generated day's arrival rate (a given ``workload`` is scaled
    by the caller: :meth:`Workload.with_demand_scale`).
    ``balancer`` (``"deepseek"`` or ``"baseline"``, as in :class:`SimConfig`) is the in-unit
    balancer the autoscaler sizes prefill work for. ``gpu_hour_usd`` replaces the hardware
    preset's price. With a ``calibration``, its hardware, model and fitted factors replace
    ``hardware_name`` and the first-principles figures, and its measured unit shapes are the
    default units. ``kernels``: measured kernel tables in place of the first-principles
    all-to-all and expert GEMMs where they cover a unit (not with a calibration). ``time_scale``:
    (prefill, decode) multipliers on every step time (the bounds of
    :mod:`moeinfra.serving.uncertainty`). ``model``: the architecture served (default
    DeepSeek-V3, or the calibration's; with a calibration, its factors on this model:
    :meth:`Calibration.with_model`)."""
    if balancer not in BALANCERS:
        raise InputError(f"balancer={balancer!r} must be 'deepseek' or 'baseline'")
    if name not in SCENARIOS:
        raise InputError(f"scenario={name!r} is not one of {', '.join(SCENARIOS)}")
    if workload is None:
        if hours is not None and not 0 < hours <= 24:
            raise InputError(f"hours={hours} must be in (0, 24]")
        workload = deepseek_day(scale=scale, seed=seed, hours=hours, demand_scale=demand_scale)
    k_prefill, k_decode = time_scale
    if calibration is None:
        hw = priced_hardware(hardware_name, gpu_hour_usd)
        served = model or DEEPSEEK_V3

        def spread(dep):
            """DeepSeek's unit with the fewest redundant experts, at least its 32, that spread
            this model's experts evenly (32 for V3's 256 on 4 or 18 nodes; 48 for V4-Pro's 384
            on 18)."""
            redundant = fitting_redundant_experts(
                dep.nodes, hw.gpus_per_node, served.num_routed_experts
            )
            return dep.with_(redundant_experts=redundant)

        prefill = PerfModel(
            prefill_dep or spread(deepseek_prefill_unit()),
            hw,
            served,
            DEFAULT_EFFICIENCY.scaled(k_prefill),
            kernels=kernels,
        )
        decode = PerfModel(
            decode_dep or spread(deepseek_decode_unit()),
            hw,
            served,
            DEFAULT_EFFICIENCY.scaled(k_decode),
            kernels=kernels,
        )
    else:
        if kernels is not None:
            raise InputError(
                "measured kernels replace the first-principles times a calibration scales: "
                "use one or the other"
            )
        if gpu_hour_usd is not None:
            calibration = replace(
                calibration, hardware=replace(calibration.hardware, gpu_hour_usd=gpu_hour_usd)
            )
        if model is not None:
            calibration = calibration.with_model(model)
        calibration = calibration.at_load(workload.output_tokens_per_s)
        units = calibration.units
        prefill = calibration.perf_model(
            prefill_dep or units.get("prefill") or deepseek_prefill_unit(), k_prefill
        )
        decode = calibration.perf_model(
            decode_dep or units.get("decode") or deepseek_decode_unit(), k_decode
        )
    for unit in (prefill, decode):
        unit.check_fits()
    fleet = fleet or ("deepseek" if workload.name == "deepseek-v3-day" else "auto")
    sizing = {"target": target, "slo_tpot_s": slo_tpot_s, "slo_ttft_s": slo_ttft_s, "block": block}
    given = ", ".join(f"{k}={v!r}" for k, v in sizing.items() if v is not None)
    if fleet != "auto" and given:
        raise InputError(f"{given}: only with fleet='auto' (got fleet={fleet!r})")
    if isinstance(fleet, tuple):
        if len(fleet) != 2 or min(fleet) < 1:
            raise InputError(f"fleet={fleet!r} must be (prefill units, decode units), both >= 1")
        schedule = constant_schedule(
            int(fleet[0]), int(fleet[1]), workload.duration_s, prefill.dep.nodes, decode.dep.nodes
        )
    elif fleet == "deepseek":
        if prefill.dep.nodes != 4 or decode.dep.nodes != 18:
            raise InputError("fleet='deepseek' needs the 4-node prefill and 18-node decode units")
        schedule = deepseek_day_schedule(min(workload.duration_s, 86_400.0) / 3600.0)
    elif fleet == "auto":
        schedule = auto_schedule(
            workload,
            prefill,
            decode,
            target=DEFAULT_TARGET if target is None else target,
            slo_tpot_s=slo_tpot_s,
            slo_ttft_s=slo_ttft_s,
            block=block,
            balancer=balancer,
        )
    else:
        raise InputError(f"fleet={fleet!r} must be 'deepseek', 'auto' or (prefill, decode) units")
    return Scenario(name, workload, schedule, prefill, decode)


#: DeepSeek's published day (REFERENCE.md), for "published vs simulated" tables.
PUBLISHED = {
    "cost_usd": 87_072.0,
    "avg_nodes": 226.75,
    "peak_nodes": 278,
    "input_tokens": 608e9,
    "cache_hit_input_tokens": 342e9,
    "output_tokens": 168e9,
    "revenue_usd": 562_027.0,
    "margin": 5.45,
    "prefill_tokens_per_s_per_node": 73.7e3,
    "decode_tokens_per_s_per_node": 14.8e3,
    "mean_output_tokens_per_s": 21.0,
    "mean_kv_len_per_output_token": 4_989.0,
}

PUBLISHED_LABELS = {
    "cost_usd": "cost (USD)",
    "avg_nodes": "average nodes",
    "peak_nodes": "peak nodes",
    "input_tokens": "input tokens",
    "cache_hit_input_tokens": "cache-hit input tokens",
    "output_tokens": "output tokens",
    "revenue_usd": "theoretical revenue (USD)",
    "margin": "cost profit margin",
    "prefill_tokens_per_s_per_node": "prefill input tokens/s per node",
    "decode_tokens_per_s_per_node": "decode output tokens/s per node",
    "mean_output_tokens_per_s": "mean output speed, tokens/s (20-22)",
    "mean_kv_len_per_output_token": "mean KV length per output token",
}


#: Theoretical income per hour from 12:00 UTC+8 read off DeepSeek's chart (deepseek_day6_hourly.csv,
#: ``income_usd_scaled``: the digitised bars scaled to sum to the published $562,027).
PUBLISHED_HOURLY_INCOME = (
    27022.7, 28514.1, 30464.7, 30924.0, 30464.7, 27826.3, 26793.0, 29547.3, 30694.4, 30809.2,
    31038.8, 29776.9, 21744.7, 17958.2, 13138.5, 7975.3, 6368.1, 6368.1, 7975.3, 13712.5,
    23121.3, 29432.5, 30464.7, 29891.7,
)  # fmt: skip


def published_vs_simulated(totals: dict) -> list[tuple[str, float, float, float]]:
    """Rows ``(label, published, simulated, simulated/published - 1)``."""
    return [
        (PUBLISHED_LABELS[k], float(v), float(totals[k]), float(totals[k]) / float(v) - 1.0)
        for k, v in PUBLISHED.items()
    ]

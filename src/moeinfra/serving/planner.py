"""Capacity planner: the cheapest fixed fleet meeting TTFT and TPOT SLOs, searched over unit shapes,
disaggregated (prefill units and decode units) or aggregated (units doing both phases).

Disaggregated, TTFT depends only on the prefill side (the first token comes out of prefill) and the
time per output token only on the decode side, so each side is searched on its own; an aggregated
(colocated) unit must meet both at once. For every candidate shape the fewest units meeting its
SLO(s), with every request served (none rejected, all finished within ``DRAIN_S`` of the window's
end), is found by bisection between a lower bound and a first guess (doubled until it meets them),
each probe a simulation of the workload. Work is counted at the unit's fastest rate per token
(prefill at its nominal step, decode at the largest batch its KV cache or batch limit allows); the
first guess carries the busiest five minutes' work in those five minutes; the lower bound carries
the work arriving from any five-minute mark on by the end of the drain, which no fewer units can.
Candidates are searched cheapest lower bound first, and one whose lower bound already costs more
than the best found (for its side; for an aggregated unit, the best fleet of either kind) is not
simulated: it is pruned. Between shapes of equal cost the one with more headroom under its SLOs
wins; between a disaggregated and an aggregated fleet of equal cost, the disaggregated one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from moeinfra.errors import InputError
from moeinfra.numfmt import format_number
from moeinfra.serving.calibration import Calibration
from moeinfra.serving.kernels import KernelTables
from moeinfra.serving.perfmodel import DEFAULT_EFFICIENCY, PerfModel
from moeinfra.serving.scenario import decode_seconds_per_token
from moeinfra.serving.schedule import constant_schedule
from moeinfra.serving.simulate import COMPLETED, SimConfig, json_ready, simulate
from moeinfra.serving.specs import (
    DEEPSEEK_V3,
    Deployment,
    HardwareSpec,
    ModelSpec,
    fitting_redundant_experts,
    hardware,
)
from moeinfra.serving.workload import Workload

MODES = ("disaggregated", "aggregated")
#: Seconds after the window a plan's simulations run on: every request must finish by then.
DRAIN_S = 900.0
#: nodes per unit searched by default, per phase (which hold the model depends on the GPU's HBM)
DEFAULT_NODES = {
    "prefill": (1, 2, 4, 8),
    "decode": (1, 2, 4, 8, 16, 18, 32),
    "colocated": (1, 2, 4, 8, 16, 18),
}


@dataclass(frozen=True)
class Shape:
    """One candidate unit: ``phase`` prefill, decode or colocated (both phases on the same GPUs)."""

    phase: str
    nodes: int
    redundant_experts: int
    micro_batches: int = 2
    mtp_acceptance: float = 0.0
    max_batch_per_gpu: float | None = None

    def deployments(self) -> tuple[Deployment | None, Deployment | None]:
        """(prefill, decode) deployments of this shape (None for the phase it does not run)."""
        prefill = Deployment("prefill", self.nodes, self.redundant_experts, self.micro_batches)
        decode = Deployment(
            "decode",
            self.nodes,
            self.redundant_experts,
            self.micro_batches,
            mtp_acceptance=self.mtp_acceptance,
            max_batch_per_gpu=self.max_batch_per_gpu,
        )
        return (
            prefill if self.phase != "decode" else None,
            decode if self.phase != "prefill" else None,
        )

    def describe(self) -> str:
        n = format_number
        extras = [f"{n(self.micro_batches)} micro-batch{'es' if self.micro_batches > 1 else ''}"]
        if self.mtp_acceptance:
            extras.append(f"MTP {n(self.mtp_acceptance)}")
        if self.max_batch_per_gpu is not None:
            extras.append(f"at most {n(self.max_batch_per_gpu)} requests per GPU")
        return (
            f"{n(self.nodes)}-node {self.phase} unit, {n(self.redundant_experts)} redundant experts, "
            + ", ".join(extras)
        )


def candidate_shapes(
    *,
    modes: tuple[str, ...] = MODES,
    nodes: dict[str, tuple[int, ...]] | None = None,
    micro_batches: tuple[int, ...] = (1, 2),
    mtp_acceptance: float = 0.0,
    max_batch_per_gpu: tuple[float, ...] = (),
    gpus_per_node: int = 8,
    routed_experts: int = 256,
) -> list[Shape]:
    """Every shape to search: per phase of ``modes`` and nodes per unit, the redundant experts that
    spread evenly (none, where the routed experts divide over the GPUs, and the fewest >= 32), each
    micro-batch count; decoding shapes also with MTP at ``mtp_acceptance`` (when > 0) and each
    batch limit of ``max_batch_per_gpu`` (beside no limit)."""
    unknown = set(modes) - set(MODES)
    if not modes or unknown:
        raise InputError(f"modes={modes!r} must be a non-empty subset of {MODES}")
    if not 0.0 <= mtp_acceptance < 1.0:
        raise InputError(f"mtp_acceptance={mtp_acceptance} must be in [0, 1) (0: no MTP)")
    nodes = DEFAULT_NODES | (nodes or {})
    phases = (("prefill", "decode") if "disaggregated" in modes else ()) + (
        ("colocated",) if "aggregated" in modes else ()
    )
    shapes = []
    for phase in phases:
        for n in nodes[phase]:
            if n < 1:
                raise InputError(f"nodes per {phase} unit = {n} must be >= 1")
            fitting = fitting_redundant_experts(n, gpus_per_node, routed_experts)
            none_fits = routed_experts % (n * gpus_per_node) == 0
            for red in ((0,) if none_fits else ()) + (fitting,):
                for mb in micro_batches:
                    decodes = phase != "prefill"
                    for mtp in (0.0, mtp_acceptance) if decodes and mtp_acceptance else (0.0,):
                        for limit in (None, *max_batch_per_gpu) if decodes else (None,):
                            shapes.append(Shape(phase, n, red, mb, mtp, limit))
    return shapes


@dataclass(frozen=True)
class Option:
    """One searched (or pruned) shape: the fewest ``units`` meeting its SLO(s), what they achieved
    (``ttft_p95_s`` for shapes that prefill, ``tpot_p95_s`` for shapes that decode) and cost."""

    shape: Shape
    units: int
    lower_bound_units: int
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    meets_slo: bool
    cost_usd: float
    searched: bool = True

    @property
    def phase(self) -> str:
        return self.shape.phase

    @property
    def nodes(self) -> int:
        return self.units * self.shape.nodes

    def to_dict(self) -> dict:
        out = asdict(self.shape)
        out.update(
            units=self.units,
            total_nodes=self.nodes,
            lower_bound_units=self.lower_bound_units,
            ttft_p95_s=self.ttft_p95_s,
            tpot_p95_s=self.tpot_p95_s,
            meets_slo=self.meets_slo,
            cost_usd=self.cost_usd,
            searched=self.searched,
        )
        return out


@dataclass(frozen=True)
class CapacityPlan:
    """The cheapest fleet of each kind found, the cheaper one chosen, and every shape tried.

    ``prefill`` / ``decode``: the cheapest disaggregated sides (None if a side met no SLO or
    disaggregated serving was not searched); ``colocated``: the cheapest aggregated units."""

    prefill: Option | None
    decode: Option | None
    colocated: Option | None
    options: list[Option]
    hours: float
    unfit: tuple[str, ...] = ()  # shapes left out: they do not fit in HBM (why)

    @property
    def disaggregated_cost_usd(self) -> float:
        if self.prefill is None or self.decode is None:
            return math.inf
        return self.prefill.cost_usd + self.decode.cost_usd

    @property
    def mode(self) -> str:
        """The cheaper kind of fleet (disaggregated on a tie)."""
        if self.colocated is not None and self.colocated.cost_usd < self.disaggregated_cost_usd:
            return "aggregated"
        return "disaggregated"

    @property
    def cost_usd(self) -> float:
        if self.mode == "aggregated":
            return self.colocated.cost_usd
        return self.disaggregated_cost_usd

    @property
    def nodes(self) -> int:
        if self.mode == "aggregated":
            return self.colocated.nodes
        return self.prefill.nodes + self.decode.nodes

    @property
    def ttft_p95_s(self) -> float:
        return (self.colocated if self.mode == "aggregated" else self.prefill).ttft_p95_s

    @property
    def tpot_p95_s(self) -> float:
        return (self.colocated if self.mode == "aggregated" else self.decode).tpot_p95_s

    def to_dict(self) -> dict:
        def one(option):
            return None if option is None else option.to_dict()

        return json_ready(
            {
                "hours": self.hours,
                "mode": self.mode,
                "nodes": self.nodes,
                "cost_usd": self.cost_usd,
                "ttft_p95_s": self.ttft_p95_s,
                "tpot_p95_s": self.tpot_p95_s,
                "prefill": one(self.prefill),
                "decode": one(self.decode),
                "colocated": one(self.colocated),
                "disaggregated_cost_usd": self.disaggregated_cost_usd,
                "options": [o.to_dict() for o in self.options],
                "unfit": list(self.unfit),
            }
        )


@dataclass
class _Search:
    """What every probe of one plan shares."""

    workload: Workload
    config: SimConfig
    slo_ttft_s: float
    slo_tpot_s: float
    max_units: int
    ref_prefill: PerfModel | None
    ref_decode: PerfModel | None
    ample: dict[str, int]  # per phase: how many units of its reference run beside a probe

    def probe(
        self, shape: Shape, models, units: int
    ) -> tuple[bool, float | None, float | None, int]:
        """Simulate ``units`` units of ``shape`` (the other side, if any, ample): (meets its
        SLOs with every request served, TTFT p95, TPOT p95 — None for a phase the shape does not
        run, inf when a request was rejected or left unfinished —, how many were)."""
        prefill, decode = models
        nodes = shape.nodes
        if shape.phase == "colocated":
            schedule = constant_schedule(units, units, self.workload.duration_s, nodes, nodes, True)
        elif shape.phase == "prefill":
            decode = self.ref_decode
            schedule = constant_schedule(
                units, self.ample["decode"], self.workload.duration_s, nodes, decode.dep.nodes
            )
        else:
            prefill = self.ref_prefill
            schedule = constant_schedule(
                self.ample["prefill"], units, self.workload.duration_s, prefill.dep.nodes, nodes
            )
        result = simulate(self.workload, schedule, prefill, decode, self.config)
        unserved = int(np.count_nonzero(result.status != COMPLETED))
        if unserved:  # too few units: the latencies say nothing
            return (
                False,
                None if shape.phase == "decode" else math.inf,
                None if shape.phase == "prefill" else math.inf,
                unserved,
            )
        ttft = tpot = None
        good = True
        if shape.phase != "decode":
            ttft = _p95(result.ttft_s)
            good &= ttft <= self.slo_ttft_s
        if shape.phase != "prefill":
            tpot = _p95(result.tpot_s)
            good &= tpot <= self.slo_tpot_s
        return good, ttft, tpot, 0

    def fewest_units(self, shape, models, lower: int, guess: int):
        """Bisection between ``lower`` and ``guess`` (doubled until it meets the SLOs): (units,
        meets, TTFT p95, TPOT p95). Doubling stops early when more units cannot help: they no
        longer shorten the missed latency by 1% (the shape's latency at an almost idle unit is
        over the SLO) or, while requests go unserved, no longer serve 1% more of them (e.g. a
        request whose KV cache outgrows the unit)."""
        lo, hi = lower - 1, max(guess, lower)
        good, *figures, unserved = self.probe(shape, models, hi)
        while not good and hi < self.max_units:
            lo, hi = hi, min(hi * 2, self.max_units)
            before, unserved_before = self.missed(figures), unserved
            good, *figures, unserved = self.probe(shape, models, hi)
            if good:
                break
            if unserved_before and unserved > 0.99 * unserved_before:
                break
            if math.isfinite(before) and self.missed(figures) > 0.99 * before:
                break
        if not good:
            return hi, False, *figures
        while hi - lo > 1:
            mid = (lo + hi) // 2
            g, *f, _ = self.probe(shape, models, mid)
            if g:
                hi, figures = mid, f
            else:
                lo = mid
        return hi, True, *figures

    def missed(self, figures) -> float:
        """The larger of TTFT p95 / its SLO and TPOT p95 / its SLO (inf after a rejection)."""
        ttft, tpot = figures
        return max((ttft or 0.0) / self.slo_ttft_s, (tpot or 0.0) / self.slo_tpot_s)


def _rank(option: Option, search: _Search) -> tuple[float, float]:
    """Cheaper first; at equal cost, the larger share of its SLOs left unused."""
    return option.cost_usd, search.missed((option.ttft_p95_s, option.tpot_p95_s))


def _p95(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(np.percentile(finite, 95)) if finite.size else math.inf


def plan_capacity(
    workload: Workload,
    *,
    slo_ttft_p95_s: float,
    slo_tpot_p95_s: float,
    hw: HardwareSpec | str = "h800",
    model: ModelSpec | None = None,
    shapes: list[Shape] | None = None,
    max_units: int = 256,
    config: SimConfig | None = None,
    calibration: Calibration | None = None,
    kernels: KernelTables | None = None,
    time_scale: tuple[float, float] = (1.0, 1.0),
) -> CapacityPlan:
    """Cheapest fleet meeting TTFT p95 <= ``slo_ttft_p95_s`` and per-request TPOT p95 <=
    ``slo_tpot_p95_s`` with no rejection, for the whole ``workload`` window on a fixed fleet,
    over ``shapes`` (default :func:`candidate_shapes`). ``kernels``: measured kernel tables in
    place of first-principles times where they cover a unit (not with a calibration).
    ``time_scale``: (prefill, decode) multipliers on every step time. ``model``: the architecture
    served (default DeepSeek-V3, or the calibration's; with a calibration, its factors on this
    model: :meth:`Calibration.with_model`)."""
    if not (slo_ttft_p95_s > 0 and slo_tpot_p95_s > 0):
        raise InputError(
            f"slo_ttft_p95_s={slo_ttft_p95_s} and slo_tpot_p95_s={slo_tpot_p95_s} must be > 0"
        )
    if workload.size == 0:
        raise InputError("workload holds no request")
    hw = hardware(hw) if isinstance(hw, str) else hw
    eff, kv = DEFAULT_EFFICIENCY, None
    if calibration is not None:
        if kernels is not None:
            raise InputError(
                "measured kernels replace the first-principles times a calibration scales: "
                "use one or the other"
            )
        hw = replace(calibration.hardware, gpu_hour_usd=hw.gpu_hour_usd)
        if model is not None:
            calibration = calibration.with_model(model)
        calibration = calibration.at_load(workload.output_tokens_per_s)
        model, eff, kv = calibration.model, calibration.efficiency(), calibration.kv_tokens_per_gpu
    model = model or DEEPSEEK_V3
    shapes = candidate_shapes(gpus_per_node=hw.gpus_per_node) if shapes is None else shapes
    effs = dict(zip(("prefill", "decode"), (eff.scaled(k) for k in time_scale), strict=True))
    hours = workload.duration_s / 3600.0
    models, unfit = {}, []
    for shape in shapes:
        try:
            models[shape] = tuple(
                None
                if dep is None
                else PerfModel(
                    dep, hw, model, effs[dep.phase], kv_tokens_per_gpu=kv, kernels=kernels
                )
                for dep in shape.deployments()
            )
            for perf in models[shape]:
                if perf is not None:
                    perf.check_fits()
        except InputError as err:
            models.pop(shape, None)
            unfit.append(f"{shape.describe()}: {err}")
    for shape, pair in list(models.items()):
        decode = pair[1]
        limit = shape.max_batch_per_gpu
        if decode is not None and limit is not None and limit * decode.gpus < workload.scale:
            del models[shape]
            unfit.append(
                f"{shape.describe()}: {limit:g} x {decode.gpus} GPUs is less than one sampled "
                f"request (each stands for {workload.scale:g})"
            )
    phases = {s.phase for s in models}
    for alone, other in (("prefill", "decode"), ("decode", "prefill")):
        if alone in phases and other not in phases:
            for shape in [s for s in models if s.phase == alone]:
                del models[shape]
                unfit.append(f"{shape.describe()}: no {other} unit fits to pair it with")
    if not models:
        raise InputError("no candidate unit fits (slots over GPUs, HBM): " + "; ".join(unfit))

    config = config or SimConfig()
    config = replace(config, drain_s=max(config.drain_s, DRAIN_S))
    bounds, guesses = _unit_bounds(workload, models, config.drain_s)

    def partner(phase, index):
        """The other side of a disaggregated probe, run ample: the largest unit of that phase
        (the most KV cache per unit: a sampled request brings ``scale`` requests' KV to one),
        four times as many as carry the busiest 5 minutes at full load (at least twice as many
        as finish the work in time). Not ``max_units``: every idle unit costs simulation time."""
        fitting = [s for s in models if s.phase == phase]
        if not fitting:
            return None, 0

        def biggest(shape):
            return shape.nodes, shape.max_batch_per_gpu is None, shape.micro_batches

        shape = max(fitting, key=biggest)
        ample = min(max_units, max(2 * bounds[shape], 4 * guesses[shape]))
        return models[shape][index], ample

    (ref_prefill, ample_prefill), (ref_decode, ample_decode) = (
        partner("prefill", 0),
        partner("decode", 1),
    )
    search = _Search(
        workload,
        config,
        slo_ttft_p95_s,
        slo_tpot_p95_s,
        max_units,
        ref_prefill,
        ref_decode,
        {"prefill": ample_prefill, "decode": ample_decode},
    )
    best: dict[str, Option] = {}
    options: list[Option] = []
    # disaggregated sides first: their best fleet prunes aggregated shapes
    for shape in sorted(models, key=lambda s: (s.phase == "colocated", bounds[s] * s.nodes)):
        lower = bounds[shape]
        lower_cost = lower * shape.nodes * hw.node_hour_usd * hours
        if shape.phase == "colocated":
            sides = [best.get(p) for p in ("prefill", "decode")]
            ceiling = min(
                best["colocated"].cost_usd if "colocated" in best else math.inf,
                math.inf if None in sides else sides[0].cost_usd + sides[1].cost_usd,
            )
        else:
            ceiling = best[shape.phase].cost_usd if shape.phase in best else math.inf
        if lower_cost > ceiling:
            options.append(Option(shape, lower, lower, None, None, False, lower_cost, False))
            continue
        units, good, ttft, tpot = search.fewest_units(shape, models[shape], lower, guesses[shape])
        cost = units * shape.nodes * hw.node_hour_usd * hours
        option = Option(shape, units, lower, ttft, tpot, good, cost)
        options.append(option)
        if good and (
            shape.phase not in best or _rank(option, search) < _rank(best[shape.phase], search)
        ):
            best[shape.phase] = option
    plan = CapacityPlan(
        best.get("prefill"), best.get("decode"), best.get("colocated"), options, hours, tuple(unfit)
    )
    if plan.colocated is None and math.isinf(plan.disaggregated_cost_usd):
        raise InputError(
            f"no fleet meets the SLOs with up to max_units={max_units} units of any candidate"
            + _closest(options, search)
        )
    return plan


def _closest(options: list[Option], search: _Search) -> str:
    """For a refusal: per phase whose every searched shape missed, the one that came nearest its
    SLO(s), its units and what they reached (more units no longer helped, or ``max_units``)."""
    n = format_number
    parts = []
    for phase in ("prefill", "decode", "colocated"):
        tried = [o for o in options if o.phase == phase and o.searched]
        if not tried or any(o.meets_slo for o in tried):
            continue
        best = min(tried, key=lambda o: search.missed((o.ttft_p95_s, o.tpot_p95_s)))
        reached = []
        for name, value, slo, unit, k in (
            ("TTFT", best.ttft_p95_s, search.slo_ttft_s, "s", 1.0),
            ("TPOT", best.tpot_p95_s, search.slo_tpot_s, "ms", 1e3),
        ):
            if value is None:
                continue
            reached.append(
                f"{name} p95 {n(value * k)} {unit} against {n(slo * k)} {unit}"
                if math.isfinite(value)
                else "requests left unserved"
            )
        parts.append(
            f"{phase}: at best {n(best.units)} x {n(best.shape.nodes)}-node units, "
            + " and ".join(dict.fromkeys(reached))
        )
    return " (" + "; ".join(parts) + ")" if parts else ""


def _unit_bounds(workload: Workload, models: dict, drain_s: float):
    """Per shape, at the unit's fastest rate per token and 100% utilisation: (the units that
    finish the work arriving from any 5-minute mark on by the end of the drain — fewer cannot
    serve every request —, the units that carry the busiest 5 minutes' work in those 5 minutes:
    the search's first guess), each at least 1."""
    inputs = workload.input_tokens.astype(np.float64)
    outputs = workload.output_tokens.astype(np.float64)
    hit = float(workload.cached_tokens.sum() / inputs.sum())
    mean_kv = float((inputs * outputs + outputs**2 / 2).sum() / outputs.sum())
    slot = (workload.arrival_s // 300).astype(np.int64)
    computed = (workload.input_tokens - workload.cached_tokens) * workload.scale
    generated = workload.output_tokens * workload.scale
    lower, guess = {}, {}
    for shape, (prefill, decode) in models.items():
        per_request = np.zeros(workload.size)
        if prefill is not None:
            per_request += computed * prefill.prefill_seconds_per_token(hit, float(inputs.mean()))
        if decode is not None:
            fullest = decode.kv_requests_per_gpu(mean_kv)
            limit = decode.dep.max_batch_per_gpu
            batch = fullest if limit is None else min(fullest, limit)
            per_request += generated * decode_seconds_per_token(decode, batch, mean_kv)
        work = np.bincount(slot, weights=per_request)
        after = np.cumsum(work[::-1])[::-1]  # work arriving from each 5-minute mark on
        left = workload.duration_s + drain_s - 300.0 * np.arange(work.size)
        lower[shape] = max(1, math.ceil(float((after / left).max()) * (1 - 1e-9)))
        guess[shape] = max(lower[shape], math.floor(work.max() / 300.0))
    return lower, guess

"""Calibrations: the performance model's terms fitted to measured step times, kept as data.

The first-principles model (:mod:`moeinfra.serving.perfmodel`) stays as it is; a calibration is a
separate, named input — a JSON file holding the hardware and model it was measured on, the measured
steps it was fitted on, the steps held out to validate it, the fitted factors and both residuals.
Factors (:data:`FACTORS`): multipliers on the modelled GEMM, core-attention (prefill and decode
apart) and all-to-all times,
the fixed seconds of one all-to-all call and of one step (host scheduling, launches, sampling),
how much a step slows while another unit computes on the same host, and the seconds a decode step
loses each time a prefill step starts or ends during it (units sharing one CPU host; each fitted
only when some measured steps overlapped another unit's).

Fit: least squares on ``log(predicted / measured)`` (a 10% miss weighs the same on a 1 ms and a
1 s step), multipliers in log space, every factor bounded, one residual per binned measurement
weighted by its bin's share of its phase's steps (prefill and decode weigh the same)
(``scipy.optimize.least_squares``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from moeinfra.errors import InputError
from moeinfra.serving.perfmodel import DEFAULT_EFFICIENCY, H800_FP8_TFLOPS, Efficiency, PerfModel
from moeinfra.serving.specs import Deployment, HardwareSpec, ModelSpec

FORMAT_VERSION = 1
MULTIPLIERS = ("gemm_time", "attention_time", "decode_attention_time", "comm_time")
CONTENTION = {"prefill": "prefill_contention", "decode": "decode_contention"}
INTERRUPT = "decode_interrupt_s"
FACTORS = (
    *MULTIPLIERS,
    "comm_launch_s",
    "ll_wait_s",
    "step_overhead_s",
    "prompt_overhead_s",
    *CONTENTION.values(),
    INTERRUPT,
)
#: Fitted when a measurements file or caller names no factors: all but the per-call low-latency
#: wait, which a fit tells apart from the all-to-all multiplier only across unit shapes and batches
#: that few measurement sets have (a measurements file frees it by naming it).
DEFAULT_FREE = tuple(f for f in FACTORS if f != "ll_wait_s")
#: Measured directly rather than fitted: a live server's time outside its units per request, on
#: prompts sent alone (``request_overhead_s``) and under its own steady traffic
#: (``request_overhead_loaded_s``, while the workload offered ``overhead_load_tokens_per_s``
#: output tokens a second: the API server streams each as an event, on the cores the units use).
LOADED_OVERHEAD = ("request_overhead_loaded_s", "overhead_load_tokens_per_s")
MEASURED = ("request_overhead_s", *LOADED_OVERHEAD)
BOUNDS = {
    "gemm_time": (1e-3, 1e5),
    "attention_time": (1e-3, 1e5),
    "decode_attention_time": (1e-3, 1e5),
    "comm_time": (1e-3, 1e5),
    "comm_launch_s": (0.0, 1.0),
    "ll_wait_s": (0.0, 1.0),
    "step_overhead_s": (0.0, 10.0),
    "prompt_overhead_s": (0.0, 1.0),
    "prefill_contention": (0.0, 4.0),
    "decode_contention": (0.0, 4.0),
    INTERRUPT: (0.0, 1.0),
}
#: Optional in a file (0 when absent: files written before these factors existed; for host
#: sharing, calibrations of units with their own GPUs).
OPTIONAL = frozenset({*CONTENTION.values(), INTERRUPT, "prompt_overhead_s", "ll_wait_s"})
#: Split from ``attention_time`` later: a file without it had one factor for both phases.
SPLIT_FROM = {"decode_attention_time": "attention_time"}
#: ``gemm_table``: DeepGEMM's published H800 throughput by rows (GPUs), or one figure at every row
#: count (a CPU host: no tensor-core tile effects).
GEMM_TABLES = ("deepgemm-h800", "flat")


@dataclass(frozen=True)
class StepPoint:
    """One measured step time (or the median of a bin of similar steps).

    ``phase``: ``prefill`` or ``decode``; ``nodes``/``redundant_experts``/``micro_batches``: the
    unit it ran on (GPUs = nodes x the hardware's GPUs per node). Prefill: ``tokens`` computed on
    the busiest GPU, ``keys`` attended per token, ``sampled`` prompts finishing (rows through the LM
    head). Decode: ``tokens`` requests on the busiest GPU, ``keys`` their mean KV length.
    ``steps``: how many steps the point stands for (its weight in the fit). ``contended``: the
    share of the step during which another unit on the same host computed (0..1);
    ``interrupts``: how many times a prefill step of another unit on the same host started or
    ended during this decode step.
    """

    phase: str
    tokens: float
    keys: float
    sampled: float
    seconds: float
    nodes: int = 1
    redundant_experts: int = 0
    micro_batches: int = 2
    steps: int = 1
    contended: float = 0.0
    interrupts: float = 0.0

    def __post_init__(self) -> None:
        if self.phase not in ("prefill", "decode"):
            raise InputError(f"StepPoint.phase={self.phase!r} must be 'prefill' or 'decode'")
        for name in ("tokens", "seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InputError(f"StepPoint.{name}={value!r} must be a finite number > 0")
        for name in ("keys", "sampled"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InputError(f"StepPoint.{name}={value!r} must be a finite number >= 0")
        if not 0.0 <= self.contended <= 1.0:
            raise InputError(f"StepPoint.contended={self.contended!r} must be in [0, 1]")
        if not (math.isfinite(self.interrupts) and self.interrupts >= 0):
            raise InputError(
                f"StepPoint.interrupts={self.interrupts!r} must be a finite number >= 0"
            )
        if self.interrupts and self.phase != "decode":
            raise InputError("StepPoint.interrupts: counted for decode steps only")

    def deployment(self) -> Deployment:
        return Deployment(
            self.phase,
            self.nodes,
            redundant_experts=self.redundant_experts,
            micro_batches=self.micro_batches,
        )


@dataclass(frozen=True)
class Calibration:
    """A fitted calibration (see the module docstring); ``units``: the unit shapes it was measured
    on by phase (``serve simulate`` defaults to them); ``kv_tokens_per_gpu``: the engine's KV
    capacity (None: from HBM)."""

    name: str
    source: str
    hardware: HardwareSpec
    model: ModelSpec
    factors: dict[str, float]
    fitted: tuple[str, ...]
    fit_points: tuple[StepPoint, ...]
    validation_points: tuple[StepPoint, ...] = ()
    gemm_table: str = "deepgemm-h800"
    units: dict[str, Deployment] = field(default_factory=dict)
    kv_tokens_per_gpu: float | None = None
    created: str = ""
    version: int = FORMAT_VERSION
    prefill_step_jitter: tuple[float, ...] = ()

    def with_model(self, model: ModelSpec) -> Calibration:
        """This calibration's factors on ``model``: an architecture of the same MLA and MoE shape
        as the one it was measured on, differing only in its sparse-attention indexer, its cache
        format or its name (DeepSeek-V3.2 on a DeepSeek-V3 calibration); InputError otherwise."""
        same = {"name", "index_n_heads", "index_head_dim", "index_topk", "kv_cache_dtype"}
        if model.v4 != self.model.v4:
            raise InputError(
                f"calibration {self.name!r} was fitted on {self.model.name} (MLA) and "
                f"{model.name} is DeepSeek-V4 (window and compressed attention, FP4 experts): "
                "no calibration carries to it; give --calibration none (first principles)"
            )
        mine, theirs = asdict(self.model), asdict(model)
        differ = sorted(k for k in mine if k not in same and mine[k] != theirs[k])
        if differ:
            raise InputError(
                f"calibration {self.name!r} was measured on {self.model.name} and "
                f"{model.name} differs from it in {', '.join(differ)}: its factors apply to "
                "models of the same MLA and MoE shape only"
            )
        return replace(self, model=model)

    def at_load(self, output_tokens_per_s: float) -> Calibration:
        """This calibration with its request overhead at a workload offering
        ``output_tokens_per_s`` to one API server: the overhead measured on prompts sent alone
        plus the extra measured under the calibration's traffic, in proportion to the output
        tokens a second streamed (the API server's work grows with them), never more than
        measured (a calibration without the loaded figure: its one overhead)."""
        loaded, load = (self.factors.get(k) for k in LOADED_OVERHEAD)
        if not loaded or not load:
            return self
        share = min(max(output_tokens_per_s, 0.0) / load, 1.0)
        alone = self.factors.get("request_overhead_s", 0.0)
        return replace(
            self, factors=self.factors | {"request_overhead_s": alone + (loaded - alone) * share}
        )

    def efficiency(self) -> Efficiency:
        factors = {k: v for k, v in self.factors.items() if k not in LOADED_OVERHEAD}
        return replace(
            efficiency_with(factors, self.gemm_table),
            prefill_step_jitter=self.prefill_step_jitter,
        )

    def perf_model(self, dep: Deployment, time_scale: float = 1.0) -> PerfModel:
        """The performance model of ``dep`` on this calibration's hardware and model, every step
        time x ``time_scale``."""
        return PerfModel(
            dep,
            self.hardware,
            self.model,
            self.efficiency().scaled(time_scale),
            kv_tokens_per_gpu=self.kv_tokens_per_gpu,
        )

    def measured_over_predicted(self, phase: str) -> tuple[float, float]:
        """Smallest and largest measured / predicted step time over this calibration's points of
        ``phase`` (fitted and held out); ``(1, 1)`` when it has none."""
        points = [p for p in (*self.fit_points, *self.validation_points) if p.phase == phase]
        if not points:
            return 1.0, 1.0
        ratio = np.array([p.seconds for p in points]) / self.predict(points)
        return float(ratio.min()), float(ratio.max())

    def predict(self, points) -> np.ndarray:
        return predict_seconds(
            points, self.hardware, self.model, self.efficiency(), self.kv_tokens_per_gpu
        )

    def errors(self) -> dict[str, dict[str, float]]:
        """Relative errors (predicted / measured - 1) on the fit and the held-out points."""
        return {
            "fit": relative_errors(self.fit_points, self.predict(self.fit_points)),
            "validation": relative_errors(
                self.validation_points, self.predict(self.validation_points)
            ),
        }

    def errors_on(self, other: Calibration) -> dict[str, float]:
        """Relative errors of this calibration's factors on another's measured points, computed on
        that one's hardware and model: how a calibration carries across systems."""
        points = (*other.fit_points, *other.validation_points)
        predicted = predict_seconds(
            points, other.hardware, other.model, self.efficiency(), other.kv_tokens_per_gpu
        )
        return relative_errors(points, predicted)

    def summary(self) -> dict:
        """What every JSON output names: the calibration, its factors and its errors."""
        return {
            "name": self.name,
            "source": self.source,
            "hardware": self.hardware.name,
            "model": self.model.name,
            "factors": dict(self.factors),
            "errors": self.errors(),
        }

    def to_dict(self) -> dict:
        fit, held = self.predict(self.fit_points), self.predict(self.validation_points)
        return {
            "format": "moeinfra-calibration",
            "version": self.version,
            "name": self.name,
            "source": self.source,
            "created": self.created,
            "method": "least squares on log(predicted/measured), multipliers in log space, "
            "bounded; residuals weighted by each point's share of its phase's steps",
            "hardware": asdict(self.hardware),
            "model": asdict(self.model),
            "gemm_table": self.gemm_table,
            "kv_tokens_per_gpu": self.kv_tokens_per_gpu,
            "units": {phase: asdict(dep) for phase, dep in self.units.items()},
            "factors": dict(self.factors),
            "fitted": list(self.fitted),
            "prefill_step_jitter": list(self.prefill_step_jitter),
            "errors": self.errors(),
            "fit_points": [
                asdict(p) | {"predicted": float(s)}
                for p, s in zip(self.fit_points, fit, strict=True)
            ],
            "validation_points": [
                asdict(p) | {"predicted": float(s)}
                for p, s in zip(self.validation_points, held, strict=True)
            ],
        }

    def save(self, path: Path) -> None:
        from moeinfra.atomicio import write_text_atomic

        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: dict, where: str = "calibration") -> Calibration:
        try:
            if data.get("format") != "moeinfra-calibration":
                raise InputError(
                    f"{where}: not a moeinfra calibration (format={data.get('format')!r})"
                )
            if data.get("version") != FORMAT_VERSION:
                raise InputError(
                    f"{where}: version={data.get('version')!r}, this moeinfra reads {FORMAT_VERSION}"
                )
            point_keys = StepPoint.__dataclass_fields__
            given = dict(data["factors"])
            for split, before in SPLIT_FROM.items():
                if split not in given and before in given:
                    given[split] = given[before]
            factors = {k: float(given[k]) for k in FACTORS if k not in OPTIONAL}
            factors |= {k: float(given.get(k, 0.0)) for k in sorted(OPTIONAL)}
            factors |= {k: float(given[k]) for k in MEASURED if k in given}
            gemm_table = data.get("gemm_table", "deepgemm-h800")
            if gemm_table not in GEMM_TABLES:
                raise InputError(f"{where}: gemm_table={gemm_table!r} is not one of {GEMM_TABLES}")
            return cls(
                name=str(data["name"]),
                source=str(data["source"]),
                hardware=HardwareSpec(**data["hardware"]),
                model=ModelSpec(**data["model"]),
                factors=factors,
                fitted=tuple(data.get("fitted", ())),
                fit_points=tuple(
                    StepPoint(**{k: v for k, v in p.items() if k in point_keys})
                    for p in data["fit_points"]
                ),
                validation_points=tuple(
                    StepPoint(**{k: v for k, v in p.items() if k in point_keys})
                    for p in data.get("validation_points", ())
                ),
                gemm_table=gemm_table,
                units={k: Deployment(**v) for k, v in data.get("units", {}).items()},
                kv_tokens_per_gpu=data.get("kv_tokens_per_gpu"),
                created=str(data.get("created", "")),
                prefill_step_jitter=_jitter(data.get("prefill_step_jitter", ()), where),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(f"{where}: malformed calibration ({err!r})") from None


#: Calibrations shipped with moeinfra: ``data/calibrations/<name>.json``, fitted by ``moeinfra serve
#: calibrate --measurements`` on the published figures in ``data/measurements/<name>.json`` (each
#: names its source).
BUILTIN = ("deepseek-h800", "sglang-h100", "rtp-llm-h800")

#: The calibration ``moeinfra serve`` uses on a hardware preset unless told otherwise
#: (``--calibration none``: the first-principles model): ``rtp-llm-h800``, fitted on an independent
#: measurement of DeepSeek's decode unit (RTP-LLM's EP144 curve on H800), never on DeepSeek's day,
#: which it reproduces best (docs/serving-model.md, "Shipped calibrations").
DEFAULT_CALIBRATION = {"h800": "rtp-llm-h800"}


def default_calibration(hardware_name: str) -> str:
    """The calibration name ``moeinfra serve`` uses on ``hardware_name`` by default
    (:data:`DEFAULT_CALIBRATION`), ``"none"`` where none is shipped for it."""
    return DEFAULT_CALIBRATION.get(hardware_name, "none")


#: Quantiles a calibration keeps of its step-time spread (percentiles: the slowest step measured
#: stands for the slowest 1% drawn, not 5% as with 21 quantiles, where one outlier among ~100
#: probe steps lengthened every twentieth simulated step).
JITTER_QUANTILES = 101
#: Fewer like steps than this tell nothing of their spread.
JITTER_MIN_STEPS = 21


def jitter_quantiles(ratios) -> tuple[float, ...]:
    """The spread of step times as :data:`JITTER_QUANTILES` quantiles of ``ratios`` (each step's
    time over the median of its like steps), at evenly spaced probabilities from 0 to 1; empty
    when fewer than :data:`JITTER_MIN_STEPS` steps were measured."""
    ratios = np.asarray(ratios, dtype=np.float64)
    if ratios.size < JITTER_MIN_STEPS:
        return ()
    return tuple(float(q) for q in np.quantile(ratios, np.linspace(0, 1, JITTER_QUANTILES)))


def _jitter(values, where: str) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if out and (
        len(out) < 2
        or not all(math.isfinite(v) and v > 0 for v in out)
        or any(b < a for a, b in zip(out, out[1:], strict=False))
    ):
        raise InputError(
            f"{where}: prefill_step_jitter={list(out)!r} must be at least two increasing "
            "positive quantiles (or empty)"
        )
    return out


def builtin_file(name: str, kind: str = "calibrations"):
    """A shipped calibration (``kind="calibrations"``) or the measurements it was fitted on."""
    from importlib import resources

    return resources.files("moeinfra.serving").joinpath("data", kind, f"{name}.json")


def load_calibration(name_or_path: str | Path | None) -> Calibration | None:
    """``none``/None (the first-principles model), a shipped calibration's name
    (:data:`BUILTIN`) or a calibration file's path."""
    if name_or_path is None or str(name_or_path) == "none":
        return None
    path = builtin_file(str(name_or_path)) if str(name_or_path) in BUILTIN else Path(name_or_path)
    if not path.is_file():
        raise InputError(
            f"--calibration={str(name_or_path)!r}: no such file; allowed: none, "
            f"{', '.join(BUILTIN)} or the path of a file written by moeinfra serve calibrate"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"--calibration={str(path)!r}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise InputError(f"--calibration={str(path)!r}: not a moeinfra calibration")
    return Calibration.from_dict(data, f"--calibration={str(path)!r}")


def efficiency_with(factors: dict[str, float], gemm_table: str = "deepgemm-h800") -> Efficiency:
    """:data:`DEFAULT_EFFICIENCY` with ``factors`` applied (a ``flat`` GEMM table: the plain GEMM
    efficiency at every row count and role)."""
    eff = replace(DEFAULT_EFFICIENCY, **factors)
    if gemm_table == "flat":
        flat = {1: H800_FP8_TFLOPS * eff.gemm}
        eff = replace(eff, gemm_tflops={role: dict(flat) for role in eff.gemm_tflops})
    return eff


def predict_seconds(
    points, hw: HardwareSpec, model: ModelSpec, eff: Efficiency, kv_tokens_per_gpu=None
) -> np.ndarray:
    """Modelled seconds of each of ``points``."""
    out = np.empty(len(points))
    models: dict[Deployment, PerfModel] = {}
    for i, p in enumerate(points):
        dep = p.deployment()
        perf = models.get(dep)
        if perf is None:
            perf = models[dep] = PerfModel(dep, hw, model, eff, kv_tokens_per_gpu=kv_tokens_per_gpu)
        if p.phase == "prefill":
            out[i] = perf.prefill_breakdown(
                tokens_per_gpu=p.tokens,
                attn_keys_per_token=p.keys,
                prompt_len=p.tokens / max(p.sampled, 1e-9),
            ).step_s
        else:
            out[i] = float(perf.decode_step_s(p.tokens, p.keys))
    slowdown = np.array([getattr(eff, CONTENTION[p.phase]) * p.contended for p in points])
    interrupted = np.array([p.interrupts for p in points]) * eff.decode_interrupt_s
    return out * (1.0 + slowdown) + interrupted


def relative_errors(points, predicted: np.ndarray) -> dict[str, float]:
    """Median, mean absolute and worst relative error, weighted by steps (empty: no points)."""
    if not len(points):
        return {}
    measured = np.array([p.seconds for p in points])
    weight = np.array([p.steps for p in points], dtype=np.float64)
    err = predicted / measured - 1.0
    order = np.argsort(np.abs(err))
    cumulative = np.cumsum(weight[order]) / weight.sum()
    return {
        "points": len(points),
        "steps": int(weight.sum()),
        "median_abs": float(np.abs(err)[order][np.searchsorted(cumulative, 0.5)]),
        "mean_abs": float((np.abs(err) * weight).sum() / weight.sum()),
        "max_abs": float(np.abs(err).max()),
        "bias": float(np.exp((np.log1p(err) * weight).sum() / weight.sum()) - 1.0),
    }


def fit_calibration(
    name: str,
    source: str,
    points,
    hw: HardwareSpec,
    model: ModelSpec,
    *,
    free: tuple[str, ...] = DEFAULT_FREE,
    hold_out_every: int = 3,
    gemm_table: str = "deepgemm-h800",
    units: dict[str, Deployment] | None = None,
    kv_tokens_per_gpu: float | None = None,
    fixed: dict[str, float] | None = None,
) -> Calibration:
    """Fit ``free`` factors to ``points`` (every ``hold_out_every``-th point, ordered by phase and
    size, is held out for validation; 0 holds none out); the others keep their defaults.
    A phase's contention factor is fitted only when some of its points are contended, the decode
    interrupt only when some decode points were interrupted, the prompt overhead only when the
    prefill points' prompts per token vary by 1.5x or more (else 0). ``fixed``: factors set to
    given values (measured elsewhere) instead of their defaults; not fitted."""
    from scipy.optimize import least_squares

    unknown = [f for f in free if f not in FACTORS]
    if unknown or not free:
        raise InputError(f"free={free!r} must be a non-empty subset of {FACTORS}")
    fixed = dict(fixed or {})
    for f, v in fixed.items():
        lo_, hi_ = BOUNDS.get(f, (None, None))
        if f in free or lo_ is None or not (math.isfinite(v) and lo_ <= v <= hi_):
            raise InputError(
                f"fixed[{f!r}]={v!r} must be a factor of {FACTORS} that is not free, "
                f"within its bounds"
            )
    for phase, factor in CONTENTION.items():
        if not any(p.contended > 0 for p in points if p.phase == phase):
            free = tuple(f for f in free if f != factor)
    if not any(p.interrupts > 0 for p in points):
        free = tuple(f for f in free if f != INTERRUPT)
    # a cost per prompt is told apart from a cost per token only if prompts per token vary
    per_token = [p.sampled / p.tokens for p in points if p.phase == "prefill" and p.sampled > 0]
    if not per_token or max(per_token) < 1.5 * min(per_token):
        free = tuple(f for f in free if f != "prompt_overhead_s")
    # decode attention is told apart from the rest of a decode step only if KV lengths vary
    kv = [p.keys for p in points if p.phase == "decode"]
    if not kv or max(kv) < 1.5 * max(min(kv), 1e-9):
        free = tuple(f for f in free if f != "decode_attention_time")
    ordered = sorted(points, key=lambda p: (p.phase, p.tokens, p.keys, p.contended, p.interrupts))
    k = hold_out_every
    held = ordered[k - 1 :: k] if k else []
    fit = [p for i, p in enumerate(ordered) if (i + 1) % k] if k else ordered
    if len(fit) < len(free):
        raise InputError(
            f"{len(fit)} measured points to fit {len(free)} factors: measure more step sizes"
        )
    measured = np.log(np.array([p.seconds for p in fit]))
    # a point weighs by its steps' share of its phase: prefill and decode count the same however
    # many steps of each were measured
    steps = np.array([p.steps for p in fit], dtype=np.float64)
    phase_steps = {ph: sum(p.steps for p in fit if p.phase == ph) for ph in ("prefill", "decode")}
    weight = np.sqrt(steps / np.array([phase_steps[p.phase] for p in fit]))
    base = {k: getattr(DEFAULT_EFFICIENCY, k) for k in FACTORS} | fixed
    logged = [f in MULTIPLIERS for f in free]

    def factors_of(x) -> dict[str, float]:
        values = dict(base)
        for f, v, log in zip(free, x, logged, strict=True):
            values[f] = float(np.exp(v)) if log else float(v)
        return values

    def residuals(x):
        eff = efficiency_with(factors_of(x), gemm_table)
        predicted = predict_seconds(fit, hw, model, eff, kv_tokens_per_gpu)
        return weight * (np.log(np.maximum(predicted, 1e-300)) - measured)

    lo = [
        math.log(BOUNDS[f][0]) if log else BOUNDS[f][0] for f, log in zip(free, logged, strict=True)
    ]
    hi = [
        math.log(BOUNDS[f][1]) if log else BOUNDS[f][1] for f, log in zip(free, logged, strict=True)
    ]
    x0 = [
        0.0 if log else min(max(base[f], lo_), hi_)
        for f, log, lo_, hi_ in zip(free, logged, lo, hi, strict=True)
    ]
    result = least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac")
    return Calibration(
        name=name,
        source=source,
        hardware=hw,
        model=model,
        factors=factors_of(result.x),
        fitted=tuple(free),
        fit_points=tuple(fit),
        validation_points=tuple(held),
        gemm_table=gemm_table,
        units=dict(units or {}),
        kv_tokens_per_gpu=kv_tokens_per_gpu,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def model_spec(config: dict, name: str = "model") -> ModelSpec:
    """The :class:`ModelSpec` of a DeepSeek-V3-style ``config.json`` (Hugging Face keys; a V3.2
    config's indexer keys make it sparse): :meth:`ModelSpec.from_config`."""
    return ModelSpec.from_config(config, name)


def fit_measurements(path: Path, name: str | None = None) -> Calibration:
    """Fit a calibration to a measurements file: JSON with ``source`` (where the figures come
    from), ``hardware`` (a preset name), optional ``model`` (a ``config.json``-style dict;
    default DeepSeek-V3), ``points`` (:class:`StepPoint` fields) and optional ``free`` factors and
    ``hold_out_every``."""
    from moeinfra.serving.specs import DEEPSEEK_V3, hardware

    where = f"--measurements={str(path)!r}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{where}: not readable JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise InputError(f"{where}: must be an object with a 'points' list")
    keys = StepPoint.__dataclass_fields__
    points = []
    for i, p in enumerate(data["points"]):
        if not isinstance(p, dict) or not {"phase", "tokens", "keys", "seconds"} <= set(p):
            raise InputError(f"{where}: points[{i}] needs phase, tokens, keys and seconds")
        try:
            points.append(
                StepPoint(**({"sampled": 0.0} | {k: v for k, v in p.items() if k in keys}))
            )
        except (InputError, TypeError) as err:
            raise InputError(f"{where}: points[{i}]: {err}") from None
    model = data.get("model")
    return fit_calibration(
        name or str(data.get("name") or Path(path).stem),
        str(data.get("source") or where),
        points,
        hardware(str(data.get("hardware", "h800"))),
        DEEPSEEK_V3 if model is None else model_spec(model, str(model.get("name", "model"))),
        free=tuple(data.get("free", DEFAULT_FREE)),
        hold_out_every=int(data.get("hold_out_every", 3)),
        fixed=_fixed_factors(data.get("fixed", {}), where),
    )


def _fixed_factors(given, where: str) -> dict[str, float]:
    if not isinstance(given, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in given.values()
    ):
        raise InputError(f"{where}: 'fixed' must map factor names to numbers, got {given!r}")
    return {str(k): float(v) for k, v in given.items()}

"""Serving a DeepSeek-V3-style MoE model: prefill/decode-disaggregated fleet, from kernels to dollars.

* :mod:`~moeinfra.serving.arch` — the arithmetic of an architecture from its ``config.json``
  (DeepSeek-V3, V3.2, V4-Flash, V4-Pro): parameters, KV bytes and FLOPs per token by context.
* :mod:`~moeinfra.serving.specs` — :class:`ModelSpec` (DeepSeek-V3 and V3.2 from their published
  configs: :data:`MODELS`), :class:`HardwareSpec`, :class:`Deployment` and their presets; the
  expert imbalance of a unit from an EPLB plan.
* :mod:`~moeinfra.serving.perfmodel` — per-layer, per-step time of a unit (:class:`PerfModel`):
  the step model every architecture shares, and each architecture's cost terms in a module of
  its own.
* :mod:`~moeinfra.serving.workload` — :class:`Workload`, the day generator and trace replay.
* :mod:`~moeinfra.serving.balancers` — prefill/decode load balancers and their baselines.
* :mod:`~moeinfra.serving.schedule` — units over time (DeepSeek's node curve, target utilisation).
* :mod:`~moeinfra.serving.simulate` — the fleet simulator; :mod:`~moeinfra.serving.scenario` — presets.
* :mod:`~moeinfra.serving.cost` — cost, theoretical revenue, margin; :mod:`~moeinfra.serving.planner`.
* :mod:`~moeinfra.serving.position_cost` — cost per million tokens by token position, against
  DeepSeek's published V3.1-Terminus / V3.2 curve.
* :mod:`~moeinfra.serving.calibration` — fitted calibrations; :mod:`~moeinfra.serving.uncertainty`
  — ranges from a calibration's residuals.

No torch anywhere in this package. Formulas and method: docs/serving-model.md.
"""

from moeinfra.serving.balancers import (
    DecodeLoadBalancer,
    LeastRequests,
    PrefillLoadBalancer,
    RoundRobin,
)
from moeinfra.serving.cost import R1_PRICES, Prices, fleet_cost_usd, margin, revenue_usd
from moeinfra.serving.perfmodel import DEFAULT_EFFICIENCY, Efficiency, PerfModel
from moeinfra.serving.planner import CapacityPlan, plan_capacity
from moeinfra.serving.scenario import SCENARIOS, Scenario, auto_schedule, build_scenario
from moeinfra.serving.schedule import FleetSchedule, deepseek_day_schedule, utilisation_schedule
from moeinfra.serving.simulate import SimConfig, SimulationResult, simulate
from moeinfra.serving.specs import (
    DEEPSEEK_V3,
    DEEPSEEK_V32,
    HARDWARE,
    MODELS,
    Deployment,
    HardwareSpec,
    ModelSpec,
    deepseek_decode_unit,
    deepseek_prefill_unit,
    hardware,
    priced_hardware,
)
from moeinfra.serving.uncertainty import step_time_bounds
from moeinfra.serving.workload import LengthModel, Workload, deepseek_day, generate, read_trace

__all__ = [
    "DEEPSEEK_V3",
    "DEEPSEEK_V32",
    "DEFAULT_EFFICIENCY",
    "HARDWARE",
    "MODELS",
    "R1_PRICES",
    "SCENARIOS",
    "CapacityPlan",
    "DecodeLoadBalancer",
    "Deployment",
    "Efficiency",
    "FleetSchedule",
    "HardwareSpec",
    "LeastRequests",
    "LengthModel",
    "ModelSpec",
    "PerfModel",
    "PrefillLoadBalancer",
    "Prices",
    "RoundRobin",
    "Scenario",
    "SimConfig",
    "SimulationResult",
    "Workload",
    "auto_schedule",
    "build_scenario",
    "deepseek_day",
    "deepseek_day_schedule",
    "deepseek_decode_unit",
    "deepseek_prefill_unit",
    "fleet_cost_usd",
    "generate",
    "hardware",
    "margin",
    "plan_capacity",
    "priced_hardware",
    "read_trace",
    "revenue_usd",
    "simulate",
    "step_time_bounds",
    "utilisation_schedule",
]

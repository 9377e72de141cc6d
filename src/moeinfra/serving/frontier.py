"""Decode's throughput frontier: output tokens/s per GPU against tokens/s per user, over unit shapes
and batch sizes.

A decode unit trades per-user speed for per-GPU throughput with its batch: every request in the
batch advances one token per step, so a unit at ``b`` requests per GPU with step time ``t`` gives
each user ``1 / t`` tokens/s and each GPU ``b / t``. Each unit shape (nodes, redundant experts,
micro-batches) draws a curve as its batch grows, up to what its KV cache holds at the given mean
KV length; the frontier is the set of (shape, batch) points no other point beats on both axes.
Shapes whose GPUs cannot hold the model (:meth:`PerfModel.check_fits`) are left out, with why.

With multi-token prediction (DeepSeek-V3's MTP module drafting one more token, accepted with
probability ``a``; the V3 report measures 85-90%), every step verifies two tokens per request and
yields ``1 + a`` on average: the step is modelled with two query tokens per request over the same
KV (GEMMs, attention FLOPs, all-to-all and LM head double; the KV read does not) plus the MTP
module as one more MoE layer, its weights and its KV cache included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeinfra.errors import InputError
from moeinfra.numfmt import format_number
from moeinfra.serving.perfmodel import DEFAULT_EFFICIENCY, Efficiency, PerfModel
from moeinfra.serving.specs import (
    DEEPSEEK_V3,
    Deployment,
    HardwareSpec,
    ModelSpec,
    fitting_redundant_experts,
)

#: Nodes per decode unit searched by default (DeepSeek's 18 among them).
DEFAULT_NODES = (1, 2, 4, 8, 16, 18, 32)
#: DeepSeek's decode operating point (day 6): 14.8K output tokens/s per H800 node of 8 GPUs at
#: 20-22 tokens/s per user on 18-node units (REFERENCE.md).
DEEPSEEK_DECODE_POINT = {"tokens_per_s_per_gpu": 14_800 / 8, "tokens_per_s_per_user": 21.0}


@dataclass(frozen=True)
class FrontierPoint:
    """One unit shape at one batch: its step and the two throughputs."""

    nodes: int
    redundant_experts: int
    micro_batches: int
    batch_per_gpu: float
    step_s: float
    tokens_per_s_per_gpu: float
    tokens_per_s_per_user: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Frontier:
    """Every point tried, the Pareto-optimal ones (sorted by per-user speed), the shapes left out."""

    points: tuple[FrontierPoint, ...]
    pareto: tuple[FrontierPoint, ...]
    unfit: tuple[str, ...]
    mean_kv: float
    mtp_acceptance: float = 0.0

    def best_at(self, tokens_per_s_per_user: float) -> FrontierPoint | None:
        """The frontier point with the most tokens/s per GPU at or above that per-user speed."""
        fast = [p for p in self.pareto if p.tokens_per_s_per_user >= tokens_per_s_per_user]
        return max(fast, key=lambda p: p.tokens_per_s_per_gpu, default=None)

    def to_dict(self) -> dict:
        return {
            "mean_kv": self.mean_kv,
            "mtp_acceptance": self.mtp_acceptance,
            "pareto": [p.to_dict() for p in self.pareto],
            "points": [p.to_dict() for p in self.points],
            "unfit": list(self.unfit),
        }


def pareto(points) -> list:
    """Points no other point beats on both tokens/s per GPU and tokens/s per user (ties kept
    once), sorted by per-user speed."""
    best: list = []
    for p in sorted(points, key=lambda p: (-p.tokens_per_s_per_user, -p.tokens_per_s_per_gpu)):
        if not best or p.tokens_per_s_per_gpu > best[-1].tokens_per_s_per_gpu:
            best.append(p)
    return best[::-1]


def decode_frontier(
    hw: HardwareSpec,
    model: ModelSpec = DEEPSEEK_V3,
    eff: Efficiency = DEFAULT_EFFICIENCY,
    *,
    mean_kv: float = 4_989.0,
    nodes: tuple[int, ...] = DEFAULT_NODES,
    micro_batches: tuple[int, ...] = (1, 2),
    batches: int = 48,
    kv_tokens_per_gpu: float | None = None,
    mtp_acceptance: float = 0.0,
) -> Frontier:
    """The decode frontier at mean KV length ``mean_kv`` (DeepSeek's day: 4,989 tokens per output
    token) over ``nodes`` per unit (each with its fitting redundant experts) and ``micro_batches``,
    each shape at ``batches`` batch sizes from 1 request per GPU to what its KV cache holds;
    ``mtp_acceptance`` > 0: with multi-token prediction accepting that share of drafts."""
    if not (np.isfinite(mean_kv) and mean_kv > 0):
        raise InputError(f"mean_kv={mean_kv} must be a finite number > 0")
    if batches < 2:
        raise InputError(f"batches={batches} must be >= 2")
    if not 0.0 <= mtp_acceptance < 1.0:
        raise InputError(f"mtp_acceptance={mtp_acceptance} must be in [0, 1) (0: no MTP)")
    points, unfit = [], []
    for n in nodes:
        redundant = fitting_redundant_experts(n, hw.gpus_per_node, model.num_routed_experts)
        for mb in micro_batches:
            dep = Deployment(
                "decode", n, redundant, micro_batches=mb, mtp_acceptance=mtp_acceptance
            )
            perf = PerfModel(dep, hw, model, eff, kv_tokens_per_gpu=kv_tokens_per_gpu)
            try:
                perf.check_fits()
            except InputError as err:
                if mb == micro_batches[0]:
                    unfit.append(str(err))
                continue
            most = perf.kv_requests_per_gpu(mean_kv)
            if most < 1.0:
                unfit.append(
                    f"{n}-node decode unit: its KV cache holds {format_number(most)} requests per GPU"
                )
                continue
            batch = np.geomspace(1.0, most, batches)
            step = np.asarray(perf.decode_step_s(batch, np.full(batches, mean_kv)))
            per_step = dep.tokens_per_step
            points += [
                FrontierPoint(
                    n,
                    redundant,
                    mb,
                    float(b),
                    float(s),
                    float(b * per_step / s),
                    float(per_step / s),
                )
                for b, s in zip(batch, step, strict=True)
            ]
    if not points:
        raise InputError("no decode unit shape fits: " + "; ".join(unfit))
    return Frontier(
        tuple(points), tuple(pareto(points)), tuple(unfit), float(mean_kv), mtp_acceptance
    )

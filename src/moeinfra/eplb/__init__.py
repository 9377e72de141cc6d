"""Expert-parallelism load balancer (EPLB).

* :func:`rebalance_experts` — DeepSeek's published policy, same contract; same plan up to the order
  of equal-load slots (DeepSeek's torch sort is not stable).
* :func:`rebalance` — moeinfra's policies (``auto``/``hierarchical``/``global``/``deepseek``), never
  worse than DeepSeek's on any layer, duplicate-free, migration-aware; returns a :class:`Plan`.
* :func:`evaluate` — balance, gap to a lower bound, duplicates, traffic.
* :func:`migration` — the expert-weight transfers between two plans.
* :class:`LoadEstimator` — per-step expert counts to the load to balance (window or EMA).
* :func:`replica_for_tokens` — which replica serves each routed token.

Depends on numpy and numba (the per-layer greedy and local-search loops are compiled, or run
interpreted while numba's cache is cold: see :mod:`moeinfra.eplb.jit`); torch tensors are accepted
and returned where the DeepSeek contract has them.
"""

from moeinfra.eplb.deepseek import rebalance_experts
from moeinfra.eplb.dispatch import replica_for_tokens
from moeinfra.eplb.estimator import LoadEstimator
from moeinfra.eplb.metrics import Evaluation, evaluate, lower_bound
from moeinfra.eplb.migration import Migration, migration
from moeinfra.eplb.plan import Plan
from moeinfra.eplb.policy import POLICIES, rebalance

__all__ = [
    "POLICIES",
    "Evaluation",
    "LoadEstimator",
    "Migration",
    "Plan",
    "evaluate",
    "lower_bound",
    "migration",
    "rebalance",
    "rebalance_experts",
    "replica_for_tokens",
]

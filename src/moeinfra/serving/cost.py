"""Cost of a fleet and theoretical revenue of the tokens it served (DeepSeek-R1 list prices)."""

from __future__ import annotations

from dataclasses import dataclass

from moeinfra.errors import InputError


@dataclass(frozen=True)
class Prices:
    """USD per million tokens (defaults: DeepSeek-R1 API prices DeepSeek used for its estimate)."""

    cache_hit_input: float = 0.14
    cache_miss_input: float = 0.55
    output: float = 2.19

    def __post_init__(self) -> None:
        for name in ("cache_hit_input", "cache_miss_input", "output"):
            if getattr(self, name) < 0:
                raise InputError(f"Prices.{name}={getattr(self, name)} must be >= 0")


R1_PRICES = Prices()


def revenue_usd(
    cache_hit_tokens: float,
    cache_miss_tokens: float,
    output_tokens: float,
    prices: Prices = R1_PRICES,
) -> float:
    """Theoretical revenue: every token billed at list price (no free tier, no discounts)."""
    return (
        cache_hit_tokens * prices.cache_hit_input
        + cache_miss_tokens * prices.cache_miss_input
        + output_tokens * prices.output
    ) / 1e6


def fleet_cost_usd(node_hours: float, gpus_per_node: int = 8, gpu_hour_usd: float = 2.0) -> float:
    """Rental cost: node-hours x GPUs per node x price per GPU-hour."""
    if node_hours < 0 or gpus_per_node < 1 or gpu_hour_usd < 0:
        raise InputError(
            f"node_hours={node_hours}, gpus_per_node={gpus_per_node}, gpu_hour_usd={gpu_hour_usd} "
            "must be >= 0, >= 1, >= 0"
        )
    return node_hours * gpus_per_node * gpu_hour_usd


def margin(revenue: float, cost: float) -> float:
    """Cost profit margin = (revenue - cost) / cost (DeepSeek's 545% is 5.45)."""
    if cost <= 0:
        raise InputError(f"cost={cost} must be > 0 for a margin")
    return (revenue - cost) / cost

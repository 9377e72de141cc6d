"""Benchmark of the EPLB policies at DeepSeek-V3 scale (``moeinfra eplb bench``, ``make bench``).

For each deployment and load kind: median time per call of the default policy and of DeepSeek's,
their balance (mean over layers of max/mean GPU load) and gap to the lower bound, and the
migration-aware mode under 2% multiplicative load noise (slots moved and balance vs a fresh plan).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

from moeinfra.eplb.metrics import evaluate
from moeinfra.eplb.policy import rebalance
from moeinfra.eplb.synthetic import perturb, synthetic_load

# DeepSeek-V3 (58 MoE layers x 256 routed experts, 32 redundant) on the units of DeepSeek's inference system.
DEPLOYMENTS = {
    "prefill": {"num_replicas": 288, "num_groups": 8, "num_nodes": 4, "num_gpus": 32},
    "decode": {"num_replicas": 288, "num_groups": 8, "num_nodes": 18, "num_gpus": 144},
}


def median_time(call: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls after one untimed call (which loads the compiled kernels)."""
    times, result = [], call()
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), result


def run_benchmark(
    *,
    repeats: int = 5,
    kinds: Iterable[str] = ("lognormal", "zipf"),
    layers: int = 58,
    experts: int = 256,
    noise: float = 0.02,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """One row per (deployment, load kind); times in ms, balance as max/mean GPU load."""
    rows = []
    for deployment, shape in DEPLOYMENTS.items():
        for kind in kinds:
            if progress:
                progress(f"{deployment} / {kind}")
            load = synthetic_load(kind, layers, experts, seed=seed)
            ours_s, ours = median_time(
                lambda load=load, shape=shape: rebalance(load, **shape), repeats
            )
            ds_s, ds = median_time(
                lambda load=load, shape=shape: rebalance(load, **shape, policy="deepseek"), repeats
            )
            ours_eval, ds_eval = evaluate(ours, load), evaluate(ds, load)
            noisy = perturb(load, noise, seed=seed + 1)
            fresh = rebalance(noisy, **shape)
            migrated_s, migrated = median_time(
                lambda noisy=noisy, shape=shape, ours=ours: rebalance(
                    noisy, **shape, previous=ours
                ),
                repeats,
            )
            ds_after = rebalance(noisy, **shape, policy="deepseek")
            fresh_balance = float(evaluate(fresh, noisy).max_over_mean.mean())
            migrated_balance = float(evaluate(migrated, noisy).max_over_mean.mean())
            rows.append(
                {
                    "deployment": deployment,
                    "load": kind,
                    "default_ms": ours_s * 1e3,
                    "deepseek_ms": ds_s * 1e3,
                    "default_max_over_mean": float(ours_eval.max_over_mean.mean()),
                    "deepseek_max_over_mean": float(ds_eval.max_over_mean.mean()),
                    "default_gap_to_bound": float(ours_eval.gap.mean()),
                    "deepseek_gap_to_bound": float(ds_eval.gap.mean()),
                    "default_duplicates": int(ours_eval.duplicates.sum()),
                    "deepseek_duplicates": int(ds_eval.duplicates.sum()),
                    "layers_global": int(sum(p == "global" for p in ours.metrics["layer_policy"])),
                    "migrate_ms": migrated_s * 1e3,
                    "migrate_moved_fraction": float((migrated.phy2log != ours.phy2log).mean()),
                    "migrate_worse_than_fresh": migrated_balance / fresh_balance - 1.0,
                    "deepseek_moved_fraction": float((ds_after.phy2log != ds.phy2log).mean()),
                }
            )
    return rows


COLUMNS = [
    ("deployment", "deployment", "{}"),
    ("load", "load", "{}"),
    ("default_ms", "default ms", "{:.1f}"),
    ("deepseek_ms", "deepseek ms", "{:.1f}"),
    ("default_max_over_mean", "default max/mean", "{:.4f}"),
    ("deepseek_max_over_mean", "deepseek max/mean", "{:.4f}"),
    ("default_gap_to_bound", "default gap to bound", "{:.2%}"),
    ("deepseek_gap_to_bound", "deepseek gap to bound", "{:.2%}"),
    ("default_duplicates", "default dup.", "{}"),
    ("deepseek_duplicates", "deepseek dup.", "{}"),
    ("migrate_ms", "migrate ms", "{:.1f}"),
    ("migrate_moved_fraction", "migrate: slots moved", "{:.1%}"),
    ("migrate_worse_than_fresh", "migrate: worse than fresh", "{:+.2%}"),
    ("deepseek_moved_fraction", "deepseek: slots moved", "{:.1%}"),
]


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (the format of ``docs/benchmarks.md``)."""
    header = "| " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    rule = "|" + "---|" * len(COLUMNS)
    lines = [header, rule]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)

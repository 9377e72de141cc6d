"""Benchmark of ``moeinfra.serving``: the DeepSeek-scale day (time, requests/s and events/s of the
simulator), SLO autoscaling of that day, the vectorised decode step model, and the load balancers
against their baselines.

Run: ``.venv/bin/python -m benchmarks.bench_serving [--reps 5]``. Prints Markdown tables of medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from moeinfra.serving.balancers import (
    DecodeLoadBalancer,
    LeastRequests,
    PrefillLoadBalancer,
    RoundRobin,
    decode_imbalance,
)
from moeinfra.serving.perfmodel import PerfModel
from moeinfra.serving.scenario import build_scenario
from moeinfra.serving.simulate import SimConfig
from moeinfra.serving.specs import deepseek_decode_unit, hardware
from moeinfra.serving.workload import LengthModel, cached_prefix


def timed(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    reps = max(args.reps, 1)

    print("### DeepSeek-scale day (default scenario, 24 h, 1 simulated request per 100 real)\n")
    print("| what | median s | sampled requests/s | real requests/s | events/s |")
    print("|---|---:|---:|---:|---:|")
    build_s, scenario = timed(lambda: build_scenario(), reps)
    sim_s, result = timed(lambda: scenario.run(), reps)
    req = result.requests()
    ticks = scenario.schedule.duration_s / SimConfig().tick_s
    # events: arrival, prefill done, decode admission, completion per sampled request, plus one
    # batched decode step per unit and tick
    unit_steps = float(np.sum(np.isfinite(result.decode_step_s))) * (60.0 / SimConfig().tick_s)
    events = 4 * req["sampled"] + unit_steps
    print(f"| build workload + units | {build_s:.2f} | | | |")
    print(
        f"| simulate | {sim_s:.2f} | {req['sampled'] / sim_s:,.0f} | {req['arrived'] / sim_s:,.0f} "
        f"| {events / sim_s:,.0f} |"
    )
    print(f"| total | {build_s + sim_s:.2f} | | | |")
    print(f"\n({req['arrived']:,.0f} requests, {ticks:,.0f} ticks)\n")

    print("### SLO autoscaling of the same day (no blocks)\n")
    print(
        "| policy | build + size fleet (median s) | simulate (median s) | avg nodes | TTFT p95 (s) |"
    )
    print("|---|---:|---:|---:|---:|")
    sizings = {
        "target 0.9, TPOT 47.6 ms": {"target": 0.9, "slo_tpot_s": 1 / 21},
        "+ TTFT p95 1 s": {"target": 0.9, "slo_tpot_s": 1 / 21, "slo_ttft_s": 1.0},
    }
    for name, sizing in sizings.items():
        size_s, sized = timed(lambda sizing=sizing: build_scenario(fleet="auto", **sizing), reps)
        run_s, out = timed(lambda sized=sized: sized.run(), reps)
        ttft = np.percentile(out.ttft_s[np.isfinite(out.ttft_s)], 95)
        print(
            f"| {name} | {size_s:.2f} | {run_s:.2f} | {out.totals['avg_nodes']:.1f} | {ttft:.3f} |"
        )
    print()

    print("### Decode step model, vectorised over units\n")
    print("| calls | units per call | median µs per call | µs per unit |")
    print("|---:|---:|---:|---:|")
    decode = PerfModel(deepseek_decode_unit(), hardware("h800"))
    for units in (1, 9, 64):
        b = np.linspace(10, 120, units)
        kv = np.full(units, 4989.0)
        t, _ = timed(lambda b=b, kv=kv: [decode.decode_step_s(b, kv) for _ in range(1000)], reps)
        print(f"| 1000 | {units} | {t * 1e3:.1f} | {t * 1e3 / units:.2f} |")

    print(
        "\n### Load balancers vs baselines (one prefill step of 32 ranks x 16K tokens; "
        "144 decode ranks x 64 requests)\n"
    )
    rng = np.random.default_rng(0)
    lengths = LengthModel.from_published()
    inputs, outputs = lengths.sample(144 * 64, rng)
    cached = cached_prefix(inputs, 0.563, rng)
    k = int(np.searchsorted(np.cumsum(inputs - cached), 32 * 16_384))
    print("| policy | median ms | max/mean attention (or KV) | max/mean tokens (or requests) |")
    print("|---|---:|---:|---:|")
    for name, lb in (
        ("PrefillLoadBalancer", PrefillLoadBalancer(32)),
        ("RoundRobin", RoundRobin(32)),
    ):
        t, placed = timed(lambda lb=lb: lb.assign(inputs[:k], cached[:k]), reps)
        imb = placed.imbalance()
        print(
            f"| {name} (prefill) | {t * 1e3:.2f} | {imb['attention']:.3f} | {imb['tokens']:.3f} |"
        )
    kv = inputs + outputs / 2
    for name, lb in (
        ("DecodeLoadBalancer", DecodeLoadBalancer(144)),
        ("LeastRequests", LeastRequests(144)),
        ("RoundRobin", RoundRobin(144)),
    ):
        t, rank = timed(lambda lb=lb: lb.assign_decode(kv), reps)
        imb = decode_imbalance(rank, kv, 144)
        print(f"| {name} (decode) | {t * 1e3:.2f} | {imb['kv']:.3f} | {imb['requests']:.3f} |")


if __name__ == "__main__":
    main()

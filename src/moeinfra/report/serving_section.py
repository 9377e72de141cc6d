"""Serving section of the demo report: DeepSeek's published day simulated from first principles."""

from __future__ import annotations

import html
import time
from pathlib import Path

from moeinfra.numfmt import format_number as n
from moeinfra.numfmt import signed_percent
from moeinfra.report.page import Section, figure_html, table_html
from moeinfra.serving.figures import plot_cost_income, plot_latency, plot_nodes, plot_throughput
from moeinfra.serving.scenario import (
    PUBLISHED_HOURLY_INCOME,
    build_scenario,
    published_vs_simulated,
)


def _in_units(label: str, published: float, simulated: float) -> tuple[str, float, float]:
    """Token totals in billions and the margin in %, the unit named in the label; the numbers
    themselves are printed by the report's one rule (``table_html``)."""
    if label.endswith("tokens"):
        return f"{label} (billions)", published / 1e9, simulated / 1e9
    if label == "cost profit margin":
        return f"{label} (%)", published * 100, simulated * 100
    return label, published, simulated


def build(out_dir: Path) -> Section:
    """Simulate the default day, write the serving figures into ``out_dir``, return the section."""
    start = time.perf_counter()
    scenario = build_scenario()
    result = scenario.run()
    elapsed = time.perf_counter() - start
    totals = result.totals
    req = result.requests()
    plot_nodes(scenario.schedule, out_dir / "serving_nodes.png")
    plot_cost_income(result, out_dir / "serving_cost_income.png", PUBLISHED_HOURLY_INCOME)
    plot_throughput(result, out_dir / "serving_throughput.png")
    plot_latency(result, out_dir / "serving_latency.png")
    rows = [
        [*_in_units(label, published, simulated), signed_percent(diff)]
        for label, published, simulated, diff in published_vs_simulated(totals)
    ]
    d = result.to_dict(hourly=False)
    parts = [
        "<p>DeepSeek-V3/R1 online service for one day (<code>moeinfra serve simulate --scenario "
        "deepseek-v3-day</code>): the published node curve with 18-node decode (EP144) and 4-node "
        "prefill (EP32) units on H800, the published demand curve and length statistics, and a "
        "per-layer performance model built from published kernel figures. "
        f"{n(round(req['arrived']))} requests, simulated in {n(elapsed)} s "
        f"({n(req['sampled'])} sampled, 1 per {n(result.scale)}).</p>",
        "<h3>Published vs simulated</h3>",
        table_html(["figure", "published", "simulated", "difference"], rows),
        "<p>Cost, nodes and token totals follow from the node curve and the demand (inputs); "
        "throughput per node, margin and output speed come out of the simulation. The output "
        "speed is where the model and DeepSeek's figure differ: the model gives a decode step of "
        f"about {n(d['tpot_s'].get('p50', float('nan')) * 1e3)} ms at the batch the published "
        f"throughput implies, so {n(d['mean_output_tokens_per_s'])} tokens/s against the "
        "published 20-22; against independent measurements of such deployments it is 8-30% "
        "optimistic too (see docs/serving-model.md).</p>",
        f"<p>Requests: {n(round(req['completed']))} completed, {n(round(req['running']))} still "
        f"running at the end, {n(round(req['rejected']))} rejected. TTFT p50/p95 "
        f"{n(d['ttft_s']['p50'])}/{n(d['ttft_s']['p95'])} s; time per output token p50/p95 "
        f"{n(d['tpot_s']['p50'] * 1e3)}/{n(d['tpot_s']['p95'] * 1e3)} ms. Expert imbalance "
        f"(EPLB, max/mean GPU load): prefill {n(d['model']['prefill_expert_imbalance'])}, "
        f"decode {n(d['model']['decode_expert_imbalance'])}.</p>",
        figure_html("serving_nodes.png", "Nodes in service over the day"),
        figure_html("serving_cost_income.png", "Cost vs theoretical income per hour"),
        figure_html("serving_throughput.png", "Throughput per node"),
        figure_html("serving_latency.png", "Latency distributions"),
        f"<p>{html.escape('Library: moeinfra.serving (specs, perfmodel, workload, balancers, ')}"
        f"{html.escape('schedule, simulate, cost, planner).')}</p>",
    ]
    return Section("serving", "Serving: DeepSeek's published day", "".join(parts))

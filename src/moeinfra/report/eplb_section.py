"""EPLB section of the demo report: DeepSeek's published example reproduced, and the policies compared
at DeepSeek-V3 scale on skewed synthetic loads."""

from __future__ import annotations

import html
from pathlib import Path

from moeinfra.eplb import evaluate, rebalance, rebalance_experts
from moeinfra.eplb.bench import DEPLOYMENTS, median_time
from moeinfra.eplb.figures import plot_plan, plot_policy_comparison
from moeinfra.eplb.published import EXAMPLE_PHY2LOG, EXAMPLE_WEIGHT
from moeinfra.eplb.synthetic import synthetic_load
from moeinfra.numfmt import percent
from moeinfra.report.page import Section, figure_html, table_html


def build(out_dir: Path) -> Section:
    """Write the EPLB figures into ``out_dir`` and return the section."""
    parts = [
        "<p>Expert placement for DeepSeek-V3 style expert parallelism (<code>moeinfra.eplb</code>).</p>"
    ]

    phy2log, _, _ = rebalance_experts(EXAMPLE_WEIGHT, 16, 4, 2, 8)
    match = bool((phy2log == EXAMPLE_PHY2LOG).all())
    parts.append("<h3>DeepSeek's published example</h3>")
    parts.append(
        table_html(
            ["layer", "published phy2log", "moeinfra rebalance_experts", "equal"],
            [
                [
                    layer,
                    " ".join(map(str, EXAMPLE_PHY2LOG[layer])),
                    " ".join(map(str, phy2log[layer])),
                    match,
                ]
                for layer in range(2)
            ],
        )
    )
    example_plan = rebalance(EXAMPLE_WEIGHT, 16, 4, 2, 8, policy="deepseek")
    plot_plan(example_plan, EXAMPLE_WEIGHT, out_dir / "eplb_example_deepseek.png", layer=0)
    default_example = rebalance(EXAMPLE_WEIGHT, 16, 4, 2, 8)
    plot_plan(default_example, EXAMPLE_WEIGHT, out_dir / "eplb_example_default.png", layer=0)
    parts.append(figure_html("eplb_example_deepseek.png", "Example, layer 0, DeepSeek's policy"))
    parts.append(
        figure_html("eplb_example_default.png", "Example, layer 0, moeinfra's default policy")
    )

    parts.append("<h3>DeepSeek-V3 scale: 58 MoE layers x 256 experts, 288 slots</h3>")
    rows = []
    for deployment, shape in DEPLOYMENTS.items():
        for kind in ("lognormal", "zipf"):
            load = synthetic_load(kind, 58, 256)
            seconds, ours = median_time(lambda load=load, shape=shape: rebalance(load, **shape), 5)
            ours_ms = seconds * 1e3
            theirs = rebalance(load, **shape, policy="deepseek")
            ours_eval, theirs_eval = evaluate(ours, load), evaluate(theirs, load)
            rows.append(
                [
                    f"{deployment} ({shape['num_nodes']} nodes, {shape['num_gpus']} GPUs)",
                    kind,
                    float(theirs_eval.max_over_mean.mean()),
                    float(ours_eval.max_over_mean.mean()),
                    percent(theirs_eval.gap.mean()),
                    percent(ours_eval.gap.mean()),
                    int(theirs_eval.duplicates.sum()),
                    int(ours_eval.duplicates.sum()),
                    ours_ms,  # a number: the table prints it by the one rule, as every cell
                ]
            )
            if deployment == "prefill" and kind == "zipf":
                plot_plan(ours, load, out_dir / "eplb_prefill_default.png")
                plot_policy_comparison(
                    {
                        "deepseek": theirs_eval.max_over_mean,
                        "moeinfra default": ours_eval.max_over_mean,
                    },
                    out_dir / "eplb_prefill_layers.png",
                    title="Prefill unit (EP32), Zipf loads: max / mean GPU load per layer",
                )
    parts.append(
        table_html(
            [
                "deployment",
                "load",
                "deepseek max/mean",
                "default max/mean",
                "deepseek gap to bound",
                "default gap to bound",
                "deepseek duplicates",
                "default duplicates",
                "default ms (median of 5)",
            ],
            rows,
        )
    )
    parts.append(
        "<p>"
        + html.escape(
            "max/mean: mean over layers of the heaviest GPU's load over the average GPU load (1 = perfect). "
            "Gap: heaviest GPU over the lower bound (see moeinfra.eplb.metrics). Duplicates: slots holding a "
            "second copy of an expert on the same GPU."
        )
        + "</p>"
    )
    parts.append(
        figure_html(
            "eplb_prefill_layers.png", "Per-layer balance, DeepSeek's policy vs the default"
        )
    )
    parts.append(
        figure_html(
            "eplb_prefill_default.png", "Least balanced prefill layer under the default policy"
        )
    )
    return Section("eplb", "Expert-parallelism load balancer (EPLB)", "".join(parts))

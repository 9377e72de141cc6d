"""Report section: the expert-parallel MoE on 2 local gloo ranks, with and without overlap."""

from __future__ import annotations

import html
from pathlib import Path

from moeinfra.report.page import Section, figure_html, table_html

_TITLE = "Expert-parallel MoE: dispatch/combine, redundant experts, dual micro-batch overlap"


def build(out_dir: Path) -> Section:
    """Run the tiny DeepSeek-V3 decoder on 2 gloo ranks (no overlap and prefill-style overlap, 3 ms injected delay
    per exchange); write ``moe_timeline.png`` and ``moe_prefill_trace.json`` into ``out_dir``."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return Section(
            "moe", _TITLE, "<p>This section needs torch (pip install moeinfra[torch]).</p>"
        )
    from moeinfra.moe.run import RunConfig, run
    from moeinfra.trace import analyze
    from moeinfra.trace.timeline import plot_timeline

    out_dir.mkdir(parents=True, exist_ok=True)
    rows, trace_path = [], out_dir / "moe_prefill_trace.json"
    for mode in ("none", "prefill"):
        result = run(
            RunConfig(
                world_size=2, tokens=512, seq_len=128, redundant=2, overlap=mode, delay_s=0.003
            ),
            trace_path=trace_path if mode == "prefill" else None,
        )
        hidden = result["comm_hidden_fraction"]
        rows.append(
            [
                mode,
                max(result["per_rank_time_s"]) * 1e3,
                "-" if hidden is None else f"{hidden:.0%}",
                result["max_abs_error_vs_reference"],
                f"{result['balancedness_before']:.3f} -> {result['balancedness_after']:.3f}",
            ]
        )
    figure = plot_timeline(
        analyze(trace_path),
        out_dir / "moe_timeline.png",
        title="prefill-style overlap, 2 gloo ranks: compute vs dispatch/combine",
    )
    body = (
        "<p>Tiny DeepSeek-V3 decoder (MLA + MoE, 2 layers, 16 routed experts in 4 groups, top-4 from 2 "
        "groups, 1 shared expert) on 2 local gloo ranks, 512 tokens per rank, 2 redundant expert slots "
        "placed by EPLB, 3 ms injected delay per dispatch/combine exchange.</p>"
        + table_html(
            [
                "overlap",
                "step time, slowest rank (ms)",
                "communication hidden",
                "max abs error vs 1-process reference",
                "balancedness before -> after EPLB",
            ],
            rows,
        )
        + figure_html(figure.name, "Prefill-style dual micro-batch timeline (per rank)")
        + f"<p>Chrome trace: <code>{html.escape(trace_path.name)}</code> (opens in Perfetto).</p>"
    )
    return Section("moe", _TITLE, body)

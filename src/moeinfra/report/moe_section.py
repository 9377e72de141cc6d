"""Report section: the expert-parallel MoE on 2 local gloo ranks, with and without overlap."""

from __future__ import annotations

import html
import statistics
from pathlib import Path

from moeinfra.numfmt import format_number, percent
from moeinfra.report.page import Section, figure_html, table_html

_TITLE = "Expert-parallel MoE: dispatch/combine, redundant experts, dual micro-batch overlap"
_DELAY_S = 0.004
_REPS = 7


def build(out_dir: Path) -> Section:
    """Run ``moeinfra moe run``'s default decoder on 2 gloo ranks: step times of no overlap and
    prefill-style overlap without and with a 4 ms injected delay per exchange (interleaved, median
    and quartiles of 7 steps), then one traced prefill-overlap run checked against the 1-process
    reference; write ``moe_timeline.png`` and ``moe_prefill_trace.json`` into ``out_dir``."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return Section(
            "moe", _TITLE, "<p>This section needs torch (pip install moeinfra[torch]).</p>"
        )
    from moeinfra.moe.launch import launch
    from moeinfra.moe.run import RunConfig, measure_rank, run
    from moeinfra.moe.schedules import schedule
    from moeinfra.trace import analyze
    from moeinfra.trace.timeline import plot_timeline

    out_dir.mkdir(parents=True, exist_ok=True)
    config = RunConfig(redundant=2)
    layers = config.model_config().num_layers
    modes, delays = ("none", "prefill"), (0.0, _DELAY_S)
    times = launch(2, measure_rank, (config, modes, delays, _REPS), timeout_s=600)[0]
    injected = sum(op.kind in ("DISPATCH", "COMBINE") for op in schedule("none", layers)) * _DELAY_S
    rows = []
    for delay in delays:
        none_s = statistics.median(times[f"none/{delay}"]["times_s"])
        for mode in modes:
            steps = times[f"{mode}/{delay}"]["times_s"]
            q1, q2, q3 = statistics.quantiles(steps, n=4, method="inclusive")
            saved = "-" if mode == "none" or not delay else percent((none_s - q2) / injected)
            rows.append(
                [
                    delay * 1e3,
                    mode,
                    q2 * 1e3,
                    f"{format_number(q1 * 1e3)}-{format_number(q3 * 1e3)}",
                    saved,
                ]
            )

    trace_path = out_dir / "moe_prefill_trace.json"
    result = run(RunConfig(redundant=2, overlap="prefill", delay_s=_DELAY_S), trace_path=trace_path)
    figure = plot_timeline(
        analyze(trace_path),
        out_dir / "moe_timeline.png",
        title="prefill-style overlap, 2 gloo ranks: compute vs dispatch/combine",
    )
    body = (
        f"<p><code>moeinfra moe run</code>'s default decoder (the <code>small</code> preset: MLA + "
        f"MoE, {layers} layers, 16 routed experts 512 wide in 4 groups, top-4 from 2 groups, 1 "
        f"shared expert) on 2 local gloo ranks, {config.tokens} tokens per rank, 2 redundant expert "
        f"slots placed by EPLB. Step time = the slowest rank's; the two modes and two delays are "
        f"interleaved over {_REPS} repetitions. 'Saved' = (no overlap - overlap) / the delay "
        f"injected into the no-overlap step ({injected * 1e3:g} ms).</p>"
        + table_html(
            [
                "injected delay per exchange (ms)",
                "overlap",
                "step time, median (ms)",
                "quartiles (ms)",
                "saved / injected",
            ],
            rows,
        )
        + table_html(
            [
                "traced run",
                "communication hidden",
                "max abs error vs 1-process reference",
                "balancedness before -> after EPLB",
            ],
            [
                [
                    f"prefill overlap, {_DELAY_S * 1e3:g} ms delay",
                    percent(result["comm_hidden_fraction"]),
                    result["max_abs_error_vs_reference"],
                    f"{format_number(result['balancedness_before'])} -> "
                    f"{format_number(result['balancedness_after'])}",
                ]
            ],
        )
        + figure_html(figure.name, "Prefill-style dual micro-batch timeline (per rank)")
        + f"<p>Chrome trace: <code>{html.escape(trace_path.name)}</code> (opens in Perfetto).</p>"
    )
    return Section("moe", _TITLE, body)
